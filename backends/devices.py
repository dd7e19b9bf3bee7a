"""The machine's GPUs, read through NVML (``nvidia-ml-py``, module ``pynvml``): name, total and free memory; and
the CPUs this process may run on.

``read_gpus`` is the inventory: one ``MemoryPool`` (kind "gpu") per NVIDIA device
the CUDA runtime will show, in that order, with its memory free now. It never
raises for a machine without GPUs: no ``pynvml`` installed, no driver (NVML's
library missing), no device or a device NVML cannot read all give an empty
list (a device that fails alone is left out, the others stay), so a CPU-only
machine reports "none" and nothing else changes.

The seam is the ``nvml`` argument: anything with pynvml's functions
(``nvmlInit``, ``nvmlDeviceGetCount``, ``nvmlDeviceGetHandleByIndex``,
``nvmlDeviceGetName``, ``nvmlDeviceGetMemoryInfo``, ``nvmlDeviceGetUUID``) and
its ``NVMLError``; tests pass a fake one with the readings they need.

Only NVIDIA devices are read: Metal's working set and Vulkan's heaps (which
llama.cpp's own device list would give) are not, so a Metal or Vulkan build
plans on the host alone. This module lives in ``backends`` (it is what the
llama.cpp backend's ``memory_pools`` reads); the daemon takes it from the
composition root, as every other engine-side reader.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Sequence
from typing import Any

from contract.sizing import MemoryPool

__all__ = ["Nvml", "read_gpus", "usable_cpus", "visible_indices"]

#: the CUDA runtime's device filter: the devices a CUDA build of llama.cpp will see, in its order
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (``taskset``, a cgroup's cpuset, a service unit's
    ``CPUAffinity=``), where ``os.cpu_count()`` counts the whole machine's. The engines' default thread count: more
    threads than CPUs would spin against one another at every barrier (OpenVINO reads the mask itself)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _text(value: Any) -> str:
    # pynvml returned bytes before 11.5 and str since
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def visible_indices(count: int, uuids: Sequence[str], visible: str | None) -> list[int]:
    """The NVML indices the CUDA runtime shows under ``CUDA_VISIBLE_DEVICES=visible``, in its order.

    Unset: every device. The variable lists indices or UUIDs (``GPU-…``, a unique
    prefix is enough); as in CUDA, the list stops at the first entry that names no
    device, and "" or "-1" hides them all. (CUDA orders the rest fastest first
    unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; NVML's order is the PCI bus's. Only the
    first device is planned on, so on a machine of mixed GPUs set the order.)
    """
    if visible is None:
        return list(range(count))
    shown: list[int] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.isdigit() and int(entry) < count:
            index = int(entry)
        else:
            matches = [i for i, u in enumerate(uuids) if entry and u.startswith(entry)] if entry.startswith(("GPU-", "MIG-")) else []
            if len(matches) != 1:
                break
            index = matches[0]
        if index in shown:
            break
        shown.append(index)
    return shown


class Nvml:
    """NVML, initialised once on first use and kept (each reading after that is a few calls, well under a ms).

    ``module`` is pynvml or a fake; None imports pynvml when first read. A failed
    import or ``nvmlInit`` is remembered: the machine has no NVIDIA driver, and
    asking again on every ``status`` would only repeat the failure.
    """

    def __init__(self, module: Any = None) -> None:
        self._module = module
        self._ready: bool | None = None
        self._lock = threading.Lock()
        #: why the inventory is empty when NVML could not start ("" while it could)
        self.unavailable = ""

    def _start(self) -> Any:
        with self._lock:
            if self._ready is None:
                try:
                    if self._module is None:
                        self._module = importlib.import_module("pynvml")
                    self._module.nvmlInit()
                    self._ready = True
                except ImportError:
                    self._ready, self.unavailable = False, "nvidia-ml-py is not installed"
                except Exception as exc:  # noqa: BLE001 - pynvml.NVMLError and its many subclasses: no driver
                    self._ready, self.unavailable = False, f"NVML: {exc}"
            return self._module if self._ready else None

    def read(self, visible: str | None = None) -> list[MemoryPool]:
        """The GPUs now (see ``read_gpus``); ``visible`` stands for ``$CUDA_VISIBLE_DEVICES``."""
        nvml = self._start()
        if nvml is None:
            return []
        error: type[BaseException] = getattr(nvml, "NVMLError", Exception)
        try:
            count = int(nvml.nvmlDeviceGetCount())
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except error:
            return []
        uuids: list[str] = []
        for handle in handles:
            try:
                uuids.append(_text(nvml.nvmlDeviceGetUUID(handle)))
            except error:
                uuids.append("")
        pools: list[MemoryPool] = []
        # ids are CUDA's device numbers as llama.cpp names them (CUDA0, CUDA1, …): the position among the visible
        for cuda_index, index in enumerate(visible_indices(count, uuids, visible)):
            try:
                name = _text(nvml.nvmlDeviceGetName(handles[index]))
                memory = nvml.nvmlDeviceGetMemoryInfo(handles[index])
                pools.append(MemoryPool(kind="gpu", id=str(cuda_index), total_bytes=int(memory.total),
                                        free_bytes=int(memory.free), name=name))
            except error:
                continue  # a device NVML cannot read (lost, reset) is left out; the others stay
        return pools


_NVML = Nvml()


def read_gpus(nvml: Nvml | None = None) -> list[MemoryPool]:
    """The NVIDIA GPUs the CUDA runtime will show (``$CUDA_VISIBLE_DEVICES``), each with its memory now; [] when none."""
    return (nvml or _NVML).read(os.environ.get(CUDA_VISIBLE_DEVICES))
