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
from collections.abc import Iterator
from pathlib import Path

import pytest

from contract.errors import DaemonTimeout, EngineUnresponsive
from contract.types import DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from harness.daemon import DaemonProcess, wait_until
from runtime import Client

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
        # (a worker found wedged gets 1 s to see the cancel, not the 10 s a busy one gets)
        assert time.monotonic() - t0 < 8, "SIGTERM waited out the wedged worker"
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
        d.proc.wait(timeout=WEDGE_S + 8)  # found wedged, then 1 s for the worker to see the cancel
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


def test_a_request_queued_when_the_daemon_dies_fails_within_seconds(tmp_path: Path) -> None:
    """An open waiting for the slot (60 s) when the daemon is SIGKILLed, before any heartbeat for it came."""
    d = DaemonProcess(tmp_path, "memory", None, "--model", "/models/m", "--model-name", "m",
                      "--memory-token-delay-ms", "200").start(wait_state=("Ready",))
    try:
        with d.client(timeout_s=120.0) as holder, d.client(timeout_s=120.0) as waiter:
            stream = iter(_start_decode(holder))  # type: ignore[call-overload]
            next(stream)
            assert waiter.status().session_open  # (this client has heard the daemon)
            done: list[BaseException] = []

            def wait_for_the_slot() -> None:
                try:
                    waiter.open_session(MODEL.model_copy(update={"queue_timeout_s": 60.0}))
                except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                    done.append(exc)

            import threading

            t = threading.Thread(target=wait_for_the_slot)
            t.start()
            wait_until(lambda: holder.status().waiting == 1, "the open queued")  # (and no heartbeat for it yet)
            assert d.proc is not None
            d.proc.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            t.join(timeout=60)
            assert done and isinstance(done[0], DaemonTimeout), done
            assert time.monotonic() - t0 < 12  # not the 60 s it was willing to queue, nor the 120 s timeout
    finally:
        d.stop(signal.SIGKILL)


#: a client that opens a session and then holds it idle (``streaming_client`` holds one while decoding)
IDLE_HOLDER = """
import sys
from runtime import Client
from contract.types import *
c = Client(sys.argv[1], timeout_s=60)
s = c.open_session(OpenSessionRequest(model_name="m", type="memory", path="/models/m"))
s.ensure_prefix(PrefixInput(text="system"))
print("holding", flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def leased_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon under the default lease, shared by the killed-client cases: each ends with the slot free."""
    with DaemonProcess(tmp_path_factory.mktemp("lease"), "memory", None, "--model", "/models/m", "--model-name", "m",
                       "--memory-token-delay-ms", "20").start(wait_state=("Ready",)) as d:
        yield d


@pytest.mark.parametrize("doing", ["idle", "decoding"])
def test_a_killed_client_frees_the_slot_within_seconds_under_the_default_lease(leased_daemon: DaemonProcess, doing: str) -> None:
    """The default 30 s lease, and a client SIGKILLed while it holds the slot: its closed connections are seen and
    the slot is free long before the lease runs out (the ceiling is a third of it). A client that keeps its connection (this test's own) keeps its session while
    others connect and go."""
    import os
    import subprocess
    import sys

    from harness.daemon import ROOT, streaming_client

    d = leased_daemon
    with d.client() as c:
        assert not c.status().session_open  # (a case before this one left the slot free)
        if doing == "decoding":
            proc = streaming_client(d.endpoint, MODEL)
        else:
            proc = subprocess.Popen([sys.executable, "-c", IDLE_HOLDER, d.endpoint], cwd=ROOT, text=True,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    env={**os.environ, "PYTHONPATH": str(ROOT)})
            assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
        try:
            assert c.status().session_open
            proc.kill()
            proc.wait()
            t0 = time.monotonic()
            while c.status().session_open:
                assert time.monotonic() - t0 < 10.0, "a killed client kept the slot"
                time.sleep(0.05)
        finally:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        sess = c.open_session(MODEL)
        # Settled first: the killed client's connections all seen closed and decided, and both of this client's
        # connections (its requests' and its lease thread's, which connects on its own thread after the open)
        # seen accepted. A count taken before the lease socket's accept lands would never balance the closes.
        wait_until(lambda: _open_and_closing(c) == (2, 0), "this client's two connections the only ones open", 60.0,
                   seen=lambda: f"(open, closing) = {_open_and_closing(c)}")
        before = _connections(c.metrics())
        for _ in range(30):  # short-lived clients: their descriptors are reused, and none is taken for this one
            with d.client() as passing:
                passing.status()

        def all_closed_and_decided() -> bool:
            # every connection the passing clients opened is seen closed, and every peer that closed is past the
            # grace (reported gone, or kept for its lease where its descriptor was reused at once): the daemon's
            # counts, whatever the machine's speed
            accepted, closed, closing = _connections(c.metrics())
            return accepted - before[0] >= 30 and closed - before[1] == accepted - before[0] and closing == 0

        wait_until(all_closed_and_decided, "the 30 passing clients' connections closed and decided", 60.0,
                   seen=lambda: f"(accepted, closed, closing) = {_connections(c.metrics())}, before {before}")
        sess.ensure_prefix(PrefixInput(text="still mine"))
        assert c.status().session_open
        sess.close()


def _open_and_closing(c: Client) -> tuple[int, int]:
    """Connections open (accepted less closed) and peers closing, by the daemon's counts."""
    accepted, closed, closing = _connections(c.metrics())
    return accepted - closed, closing


def _connections(metrics: str) -> tuple[int, int, int]:
    """The daemon's counts: connections accepted, connections closed, peers closing (within the grace)."""
    values = {}
    for line in metrics.splitlines():
        for name in ('modeld_connections_total{event="accepted"}', 'modeld_connections_total{event="closed"}',
                     "modeld_peers_closing"):
            if line.startswith(name + " "):
                values[name] = int(float(line.split()[-1]))
    assert len(values) == 3, f"the daemon's metrics lack its connection counts: {values}"
    return (values['modeld_connections_total{event="accepted"}'], values['modeld_connections_total{event="closed"}'],
            values["modeld_peers_closing"])


def test_peer_watch_reports_a_peer_whose_connections_all_closed() -> None:
    import zmq

    from modeld.peers import PeerWatch

    closed, accepted = zmq.EVENT_DISCONNECTED, zmq.EVENT_ACCEPTED
    w = PeerWatch(grace_s=1.0)
    w.seen(b"rt-a/1", 10)
    w.seen(b"rt-a/2", 11)  # the same client's second socket
    w.seen(b"other", 12)
    w.events([(closed, 10)], now=0.0)
    assert w.gone(5.0) == []  # one of its connections is still open
    w.events([(closed, 11)], now=5.0)
    assert w.gone(5.5) == [] and w.next_due() == 6.0  # within the grace it may reconnect
    assert w.closing == 1 and w.gone_total == 0
    assert w.gone(6.0) == [b"rt-a"] and w.gone(7.0) == []  # reported once
    assert w.closing == 0 and w.gone_total == 1
    # a peer that reconnects within the grace is not gone
    w.events([(closed, 12)], now=10.0)
    w.seen(b"other", 13)
    assert w.gone(20.0) == []
    # a descriptor closed and accepted again in one batch: the peers seen on it are left to their leases
    w.seen(b"late", 14)
    w.events([(closed, 14), (accepted, 14)], now=30.0)
    assert w.gone(40.0) == [] and len(w) == 1  # ("other" on 13)
    # what the metrics report: the monitor's events, counted as they came
    assert (w.accepted, w.closed, w.closing, w.gone_total) == (1, 4, 0, 1)
