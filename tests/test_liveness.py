"""Liveness in tiers, against real daemon processes on the memory backend.

The memory backend's simulated token delay stands in for an engine that hangs:
a 20 s "token" is a worker making no progress. The daemon's IO thread keeps
answering; past ``--wedge-timeout`` it says the worker is wedged (status), every
request waiting on it gets EngineUnresponsive, and SIGTERM still ends the
process within seconds. A client waiting on a daemon that was SIGKILLed fails
after a few seconds of missed heartbeats, not at its full timeout.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from contract.errors import DaemonTimeout, EngineUnresponsive
from contract.types import DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from runtime import Client
from tests.daemon_proc import DaemonProcess

MODEL = OpenSessionRequest(model_name="m", type="memory", path="/models/m")
WEDGE_S = 2.0


def _hung_daemon(tmp_path: Path, *extra: str) -> DaemonProcess:
    return DaemonProcess(
        tmp_path, "memory", None, "--model", "/models/m", "--model-name", "m",
        "--memory-token-delay-ms", "20000", "--wedge-timeout", str(WEDGE_S), *extra,
    ).start(wait_state=("Ready",))


def _start_decode(c: Client) -> object:
    sess = c.open_session(MODEL)
    sess.ensure_prefix(PrefixInput(text="system"))
    sess.prefill_suffix(SuffixInput(text="go"))
    return sess.decode(DecodeConfig(max_tokens=4))


def test_a_wedged_worker_is_reported_and_its_waiters_are_told(tmp_path: Path) -> None:
    d = _hung_daemon(tmp_path)
    try:
        with d.client(timeout_s=60.0) as c, d.client(timeout_s=60.0) as other:
            stream = _start_decode(c)
            t0 = time.monotonic()
            with pytest.raises(EngineUnresponsive, match="no progress") as stuck:
                list(stream)  # type: ignore[call-overload]
            assert time.monotonic() - t0 < WEDGE_S + 5
            assert stuck.value.details["operation"] == "decode"
            st = other.status()  # the IO thread answers throughout
            assert st.wedged and st.worker_stalled_s is not None and st.worker_stalled_s >= WEDGE_S
            t0 = time.monotonic()
            with pytest.raises(EngineUnresponsive):
                other.describe(MODEL)  # queued behind the stuck worker: told, not left waiting
            assert time.monotonic() - t0 < 5
        t0 = time.monotonic()
        code = d.stop(signal.SIGTERM, timeout_s=60.0)
        assert time.monotonic() - t0 < 15, "SIGTERM waited out the wedged worker"
        assert code == 1  # it could not release the model: a supervisor should know
    finally:
        d.stop(signal.SIGKILL)


def test_exit_when_wedged_hands_the_daemon_to_its_supervisor(tmp_path: Path) -> None:
    d = _hung_daemon(tmp_path, "--exit-when-wedged")
    try:
        with d.client(timeout_s=60.0) as c:
            with pytest.raises(EngineUnresponsive):
                list(_start_decode(c))  # type: ignore[call-overload]
        assert d.proc is not None
        d.proc.wait(timeout=WEDGE_S + 20)
        assert d.proc.returncode == 3
        assert "wedged" in d.log()
    finally:
        d.stop(signal.SIGKILL)


def test_a_client_waiting_on_a_killed_daemon_fails_within_seconds(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, "memory", None, "--model", "/models/m", "--model-name", "m",
                      "--memory-token-delay-ms", "200").start(wait_state=("Ready",))
    try:
        with d.client(timeout_s=120.0) as c:
            stream = iter(_start_decode(c))  # type: ignore[call-overload]
            next(stream)
            assert d.proc is not None
            d.proc.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(DaemonTimeout, match="stopped answering") as gone:
                for _ in stream:
                    pass
            assert time.monotonic() - t0 < 15  # heartbeats stopped; not the 120 s timeout
            assert d.endpoint in str(gone.value)
    finally:
        d.stop(signal.SIGKILL)
