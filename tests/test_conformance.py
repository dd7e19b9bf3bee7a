"""The conformance suite against MemoryService in process and through a real daemon (ipc and tcp)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.memory import MemoryService
from contract.types import Config, OpenSessionRequest
from harness.daemon import DaemonProcess, free_tcp_endpoint

from .conformance import SCENARIOS, Target

MEM_REQUEST = OpenSessionRequest(model_name="ref", type="memory", path="/models/ref", config=Config(num_ctx=1024))


@pytest.fixture(scope="module")
def memory_daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, DaemonProcess]]:
    ipc = DaemonProcess(tmp_path_factory.mktemp("ipc"), "memory", None, "--no-preload", "--memory-token-delay-ms", "2").start()
    tcp = DaemonProcess(tmp_path_factory.mktemp("tcp"), "memory", free_tcp_endpoint(), "--no-preload", "--memory-token-delay-ms", "2").start()
    try:
        yield {"ipc": ipc, "tcp": tcp}
    finally:
        ipc.stop()
        tcp.stop()


@pytest.fixture(params=["in-process", "ipc", "tcp"])
def target(request: pytest.FixtureRequest, memory_daemons: dict[str, DaemonProcess]) -> Iterator[Target]:
    if request.param == "in-process":
        yield Target("in-process", MemoryService(), MEM_REQUEST, partial_reuse=False)
        return
    with memory_daemons[request.param].client(timeout_s=20.0) as client:
        yield Target(request.param, client, MEM_REQUEST, partial_reuse=False)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_scenario(target: Target, scenario: str) -> None:
    SCENARIOS[scenario](target)


def _run_all(t: Target) -> dict[str, Any]:
    return {name: fn(t) for name, fn in sorted(SCENARIOS.items())}


def test_identical_results_in_process_and_over_the_wire(memory_daemons: dict[str, DaemonProcess], tmp_path: Path) -> None:
    """Every scenario observes exactly the same numbers and text in process and over ipc and tcp."""
    results = {"in-process": _run_all(Target("in-process", MemoryService(), MEM_REQUEST, partial_reuse=False))}
    for name in ("ipc", "tcp"):
        # A fresh daemon per transport so resident state starts equal to the fresh MemoryService.
        ep = None if name == "ipc" else free_tcp_endpoint()
        with DaemonProcess(tmp_path / name, "memory", ep, "--no-preload", "--memory-token-delay-ms", "2") as d, d.client(timeout_s=20.0) as c:
            results[name] = _run_all(Target(name, c, MEM_REQUEST, partial_reuse=False))

    def strip(r: dict[str, Any]) -> dict[str, Any]:
        # Manifest digests include the per-run random profile; compare everything else.
        out = {}
        for k, v in r.items():
            out[k] = {kk: _drop_digests(vv) for kk, vv in v.items()}
        return out

    assert strip(results["in-process"]) == strip(results["ipc"]) == strip(results["tcp"])


def _drop_digests(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _drop_digests(x) for k, x in v.items() if k != "manifest_digest"}
    return v
