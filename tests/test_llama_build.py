"""Which llama.cpp build ``make`` installs (modeld/llama_build.py), on injected machines, and the Makefile's CPU path."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from harness.daemon import ROOT
from modeld.llama_build import Build, choose, compute_capabilities


def machine(tools: set[str], smi: str = "", *, smi_fails: bool = False) -> tuple[Callable[[str], str | None],
                                                                                  Callable[[list[str]], str]]:
    def which(name: str) -> str | None:
        return f"/usr/bin/{name}" if name in tools else None

    def run(cmd: list[str]) -> str:
        assert cmd[0] == "nvidia-smi" and "--query-gpu=compute_cap" in cmd
        if smi_fails:
            raise subprocess.CalledProcessError(9, cmd, "", "NVIDIA-SMI has failed: no driver")
        return smi

    return which, run


def pick(tools: set[str], smi: str = "", env: dict[str, str] | None = None, system: str = "Linux",
         arch: str = "x86_64", smi_fails: bool = False) -> Build:
    which, run = machine(tools, smi, smi_fails=smi_fails)
    return choose(env or {}, which, system, arch, run)


def test_cuda_for_the_detected_gpu_only() -> None:
    got = pick({"nvcc", "nvidia-smi"}, "9.0\n")
    assert got.kind == "cuda"
    assert got.cmake_args == ("-DGGML_CUDA=on", "-DCMAKE_CUDA_ARCHITECTURES=90")
    assert "compute capability 90" in got.reason


def test_two_kinds_of_gpu_build_both_architectures_once() -> None:
    assert pick({"nvcc", "nvidia-smi"}, "8.9\n8.6\n8.9\n").cmake_args[1] == "-DCMAKE_CUDA_ARCHITECTURES=89;86"


def test_nvcc_without_a_gpu_stays_on_the_cpu() -> None:
    # a CUDA toolkit in a container with no GPU (this project's CI machines have one): the CPU build, as always
    assert pick({"nvcc"}) == Build("cpu", (), "nvcc but no NVIDIA GPU (nvidia-smi)")
    assert pick({"nvcc", "nvidia-smi"}, smi_fails=True).kind == "cpu"
    assert pick({"nvcc", "nvidia-smi"}, "").kind == "cpu"


def test_a_gpu_without_nvcc_cannot_build_cuda() -> None:
    assert pick({"nvidia-smi"}, "8.9\n").kind == "cpu"


def test_metal_on_apple_silicon() -> None:
    assert pick(set(), system="Darwin", arch="arm64") == Build("metal", ("-DGGML_METAL=on",), "Apple silicon")
    assert pick(set(), system="Darwin", arch="x86_64").kind == "cpu"  # an Intel Mac


def test_vulkan_where_its_sdk_is() -> None:
    assert pick({"vulkaninfo"}).kind == "vulkan"
    assert pick({"glslc"}).cmake_args == ("-DGGML_VULKAN=on",)
    assert pick({"nvcc", "nvidia-smi", "vulkaninfo"}, "8.9").kind == "cuda"  # CUDA first where both are


def test_nothing_is_cpu_with_no_extra_arguments() -> None:
    assert pick(set()) == Build("cpu", (), "no GPU toolchain found")


@pytest.mark.parametrize(
    ("forced", "kind", "args"),
    [
        ("cpu", "cpu", ()),
        ("CUDA", "cuda", ("-DGGML_CUDA=on", "-DCMAKE_CUDA_ARCHITECTURES=89")),
        ("metal", "metal", ("-DGGML_METAL=on",)),
        ("vulkan", "vulkan", ("-DGGML_VULKAN=on",)),
    ],
)
def test_the_override_wins(forced: str, kind: str, args: tuple[str, ...]) -> None:
    got = pick({"nvcc", "nvidia-smi", "vulkaninfo"}, "8.9", env={"MODELD_LLAMA_BUILD": forced})
    assert (got.kind, got.cmake_args) == (kind, args)
    assert got.reason == f"MODELD_LLAMA_BUILD={kind}"


def test_cuda_forced_without_a_gpu_builds_llama_cpps_own_architectures() -> None:
    assert pick({"nvcc"}, env={"MODELD_LLAMA_BUILD": "cuda"}).cmake_args == ("-DGGML_CUDA=on",)


def test_cpu_forced_on_a_mac_turns_metal_off() -> None:
    got = pick(set(), env={"MODELD_LLAMA_BUILD": "cpu"}, system="Darwin", arch="arm64")
    assert got == Build("cpu", ("-DGGML_METAL=off",), "MODELD_LLAMA_BUILD=cpu")


def test_an_unknown_override_is_refused() -> None:
    with pytest.raises(ValueError, match="MODELD_LLAMA_BUILD='rocm': choose one of cpu, cuda, metal, vulkan"):
        pick(set(), env={"MODELD_LLAMA_BUILD": "rocm"})


def test_compute_capabilities_skip_what_is_not_one() -> None:
    assert compute_capabilities(lambda cmd: "8.9\n[N/A]\n\n12.0\n") == ["89", "120"]

    def missing(cmd: list[str]) -> str:
        raise FileNotFoundError(cmd[0])

    assert compute_capabilities(missing) == []


def test_the_script_runs_on_the_standard_library_alone() -> None:
    """make runs it with the system python before the venv exists: -I -S, no site-packages, from its path."""
    out = subprocess.run([sys.executable, "-I", "-S", str(ROOT / "modeld" / "llama_build.py"), "kind"],
                         capture_output=True, text=True, timeout=60, env={"PATH": "/nonexistent"})
    assert (out.returncode, out.stdout.strip()) == (0, "cpu")
    bad = subprocess.run([sys.executable, "-I", "-S", str(ROOT / "modeld" / "llama_build.py"), "kind"],
                         capture_output=True, text=True, timeout=60,
                         env={"PATH": "/nonexistent", "MODELD_LLAMA_BUILD": "x"})
    assert bad.returncode == 2 and "choose one of" in bad.stderr


def test_the_makefile_cpu_path_adds_no_step() -> None:
    """On a machine the script calls CPU, ``make -n serving`` plans no llama.cpp rebuild."""
    out = subprocess.run(["make", "-n", "-C", str(ROOT), "serving", "MODELD_LLAMA_BUILD=cpu"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--force-reinstall" not in out.stdout and ".modeld-llama-" not in out.stdout
    forced = subprocess.run(["make", "-n", "-C", str(ROOT), "serving", "MODELD_LLAMA_BUILD=vulkan"],
                            capture_output=True, text=True, timeout=60)
    assert "--no-cache-dir --force-reinstall --no-deps llama-cpp-python" in forced.stdout
    assert "touch .venv/.modeld-llama-vulkan" in forced.stdout
    from_env = subprocess.run(["make", "-n", "-C", str(ROOT), "serving"], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "MODELD_LLAMA_BUILD": "vulkan"})
    assert "touch .venv/.modeld-llama-vulkan" in from_env.stdout
