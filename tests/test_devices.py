"""The GPU inventory (backends/devices.py) over a fake NVML: readings, no driver, CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

from backends import devices
from backends.devices import Nvml, read_gpus, visible_indices
from contract.sizing import MemoryPool

GiB = 2**30


class NVMLError(Exception):
    pass


class FakeNvml:
    """pynvml's functions over given readings: (name, total, free, uuid) per device."""

    NVMLError = NVMLError

    def __init__(self, gpus: list[tuple[str, int, int, str]], *, init_error: bool = False,
                 broken: frozenset[int] = frozenset(), name_as_bytes: bool = False) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.broken = broken
        self.name_as_bytes = name_as_bytes
        self.inits = 0

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.init_error:
            raise NVMLError("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> Any:
        if h in self.broken:
            raise NVMLError("GPU is lost")
        name = self.gpus[h][0]
        return name.encode() if self.name_as_bytes else name

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(total=self.gpus[h][1], free=self.gpus[h][2], used=self.gpus[h][1] - self.gpus[h][2])

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self.gpus[h][3]


H100 = ("NVIDIA H100 80GB HBM3", 80 * GiB, 79 * GiB, "GPU-aaaa-1111")
L4 = ("NVIDIA L4", 24 * GiB, 20 * GiB, "GPU-bbbb-2222")


def test_reads_each_device_name_total_and_free() -> None:
    got = Nvml(FakeNvml([H100, L4])).read()
    assert got == [
        MemoryPool(kind="gpu", id="0", total_bytes=80 * GiB, free_bytes=79 * GiB, name="NVIDIA H100 80GB HBM3"),
        MemoryPool(kind="gpu", id="1", total_bytes=24 * GiB, free_bytes=20 * GiB, name="NVIDIA L4"),
    ]


def test_old_pynvml_bytes_names_are_decoded() -> None:
    assert Nvml(FakeNvml([L4], name_as_bytes=True)).read()[0].name == "NVIDIA L4"


def test_no_driver_is_an_empty_inventory_and_is_not_retried() -> None:
    fake = FakeNvml([H100], init_error=True)
    nvml = Nvml(fake)
    assert nvml.read() == [] and nvml.read() == []
    assert fake.inits == 1
    assert "NVML" in nvml.unavailable


def test_missing_pynvml_is_an_empty_inventory(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_module(name: str) -> Any:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(devices.importlib, "import_module", no_module)
    nvml = Nvml()
    assert nvml.read() == []
    assert nvml.unavailable == "nvidia-ml-py is not installed"


def test_a_device_that_fails_alone_is_left_out() -> None:
    got = Nvml(FakeNvml([H100, L4], broken=frozenset({0}))).read()
    assert [(g.id, g.name) for g in got] == [("1", "NVIDIA L4")]  # still CUDA's device 1


def test_no_devices() -> None:
    assert Nvml(FakeNvml([])).read() == []


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, [0, 1, 2]),
        ("", []),
        ("-1", []),
        ("2,0", [2, 0]),
        ("1,7,0", [1]),  # CUDA stops at the first entry naming no device
        ("GPU-bbbb", [1]),
        ("GPU-", []),  # a prefix of more than one device names none
        ("0,0", [0]),
    ],
)
def test_cuda_visible_devices(visible: str | None, expected: list[int]) -> None:
    assert visible_indices(3, ["GPU-aaaa-1", "GPU-bbbb-2", "GPU-cccc-3"], visible) == expected


def test_visible_devices_are_numbered_as_cuda_numbers_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    got = read_gpus(Nvml(FakeNvml([H100, L4])))
    assert [(g.id, g.name) for g in got] == [("0", "NVIDIA L4")]


def test_this_machine_reads_without_raising() -> None:
    # whatever this machine has (a CI runner: nothing), reading it never raises
    for g in read_gpus():
        assert g.kind == "gpu" and 0 <= g.free_bytes <= g.total_bytes


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_the_engines_default_threads_are_the_cpus_this_process_may_run_on() -> None:
    """Under a narrower affinity mask (taskset, a cpuset, a test worker's share) the default thread count is the
    mask's CPUs, not the machine's: more threads than CPUs spin against one another at every step."""
    import subprocess
    import sys

    from harness.daemon import ROOT

    pytest.importorskip("llama_cpp")
    script = """
import os
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
from backends.devices import usable_cpus
from backends.llama.options import LoadOptions
from contract.sizing import ModelShape
from contract.types import Config
shape = ModelShape(n_layer=4, n_ctx_train=1024, n_embd=64, n_head=4, n_head_kv=4, head_dim_k=16, head_dim_v=16,
                   weights_bytes=1)
from backends.llama.embedder import LlamaEmbedder
embedder = LlamaEmbedder.default_path()
print(usable_cpus(), LoadOptions.resolve(Config(num_ctx=512), shape).num_threads,
      LoadOptions.resolve(Config(num_ctx=512, num_threads=3), shape).num_threads,
      LlamaEmbedder.plan_for(embedder, Config()).num_threads, LlamaEmbedder.plan_for(embedder, Config(num_threads=3)).num_threads)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    assert out.stdout.split() == ["1", "1", "3", "1", "3"]  # the chat model's, the embedder's; a number asked for kept
    assert devices.usable_cpus() == len(os.sched_getaffinity(0))
