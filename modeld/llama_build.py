"""Which llama.cpp build ``make`` installs here: CUDA, Metal, Vulkan or CPU, and its CMake arguments.

``make setup`` / ``make run`` run this file (``python modeld/llama_build.py kind`` and
``… cmake-args``) before the venv exists, so it needs the standard library only and
imports nothing from modeld. The decision is ``choose`` over injected facts (which
tools are on PATH, the platform, what ``nvidia-smi`` reports), so it is tested
without any of them:

* ``MODELD_LLAMA_BUILD=cpu|cuda|metal|vulkan`` wins (anything else is an error);
* macOS on Apple silicon: Metal (llama.cpp's default there; the CMake flag says so);
* ``nvcc`` on PATH *and* an NVIDIA GPU that ``nvidia-smi`` reports: CUDA, for that
  GPU's compute capability only (``CMAKE_CUDA_ARCHITECTURES``), so the build takes
  minutes, not the tens of minutes of every architecture. A CUDA toolkit without a
  GPU (a build container, a CI image) stays on the CPU: the build could not be
  checked there and a CPU wheel is what runs;
* ``vulkaninfo`` or ``glslc`` (the Vulkan SDK) on PATH: Vulkan;
* else CPU: the same install as always (the Makefile adds nothing).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import NamedTuple

__all__ = ["BUILDS", "ENV", "Build", "choose", "compute_capabilities", "main"]

ENV = "MODELD_LLAMA_BUILD"
BUILDS = ("cpu", "cuda", "metal", "vulkan")


class Build(NamedTuple):
    """The build, its CMake arguments (beyond the Makefile's own), and why."""

    kind: str
    cmake_args: tuple[str, ...]
    reason: str


def compute_capabilities(run: Callable[[list[str]], str]) -> list[str]:
    """The GPUs' compute capabilities as CMake spells them ("8.9" → "89"), from ``nvidia-smi``; [] when none."""
    try:
        out = run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"])
    except (OSError, subprocess.SubprocessError):
        return []
    caps: list[str] = []
    for line in out.splitlines():
        cap = line.strip().replace(".", "")
        if cap.isdigit() and cap not in caps:
            caps.append(cap)
    return caps


def _cuda(caps: list[str], why: str) -> Build:
    # without a detected GPU (an override on a machine without one) llama.cpp's own list of architectures is built
    archs = (f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(caps)}",) if caps else ()
    return Build("cuda", ("-DGGML_CUDA=on", *archs), why)


def choose(
    env: Mapping[str, str],
    which: Callable[[str], str | None],
    system: str,
    machine: str,
    run: Callable[[list[str]], str],
) -> Build:
    """The build for a machine described by ``env``, ``which`` (a tool's path or None), ``platform.system()``,
    ``platform.machine()`` and ``run`` (a command's stdout). Raises ValueError on an unknown override."""
    forced = env.get(ENV, "").strip().lower()
    if forced and forced not in BUILDS:
        raise ValueError(f"{ENV}={env[ENV]!r}: choose one of {', '.join(BUILDS)}")
    apple = system == "Darwin" and machine in ("arm64", "aarch64")
    if forced == "cpu":
        # llama.cpp turns Metal on by default on macOS: a CPU build there has to say so
        return Build("cpu", ("-DGGML_METAL=off",) if system == "Darwin" else (), f"{ENV}=cpu")
    if forced == "metal" or (not forced and apple):
        return Build("metal", ("-DGGML_METAL=on",), f"{ENV}=metal" if forced else "Apple silicon")
    if forced == "vulkan":
        return Build("vulkan", ("-DGGML_VULKAN=on",), f"{ENV}=vulkan")
    caps = compute_capabilities(run) if which("nvidia-smi") else []
    if forced == "cuda":
        return _cuda(caps, f"{ENV}=cuda")
    if which("nvcc") and caps:
        return _cuda(caps, f"nvcc and an NVIDIA GPU of compute capability {', '.join(caps)}")
    if which("vulkaninfo") or which("glslc"):
        return Build("vulkan", ("-DGGML_VULKAN=on",), "the Vulkan SDK (vulkaninfo or glslc) is on PATH")
    why = "nvcc but no NVIDIA GPU (nvidia-smi)" if which("nvcc") else "no GPU toolchain found"
    return Build("cpu", (), why)


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout


def main(argv: list[str]) -> int:
    """``kind``: the build's name; ``cmake-args``: its CMake arguments (empty for CPU); ``why``: the reason."""
    what = argv[0] if argv else "kind"
    if what not in ("kind", "cmake-args", "why"):
        print(f"usage: {sys.argv[0]} kind|cmake-args|why", file=sys.stderr)
        return 2
    try:
        build = choose(os.environ, shutil.which, platform.system(), platform.machine(), _run)
    except ValueError as exc:
        print(f"modeld: {exc}", file=sys.stderr)
        return 2
    print({"kind": build.kind, "cmake-args": " ".join(build.cmake_args), "why": build.reason}[what])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
