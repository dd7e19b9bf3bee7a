"""The daemon as a real OS process: slot rules over the wire, bad input, leases, shutdown."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from contract import wire
from contract.errors import (
    REGISTRY,
    BackendMismatch,
    BadFrame,
    FrameTooLarge,
    InvalidArgument,
    ModelBusy,
    ModelNotActive,
    ModelSwitchRequired,
    SessionClosed,
    SlotGenerationStale,
    StaleFence,
    Unavailable,
    UnknownOperation,
    UnsupportedProtocolVersion,
    from_wire,
)
from contract.messages import HeartbeatReply, HeartbeatRequest
from contract.types import (
    Config,
    DecodeConfig,
    LoadModelRequest,
    OpenSessionRequest,
    PrefixInput,
    SlotState,
    StreamChunk,
    SuffixInput,
    UnloadModelRequest,
    owner_fingerprint,
)
from contract.wire import Kind, Op
from harness.daemon import ROOT, DaemonProcess, streaming_client, wait_until
from runtime import Client

from .conformance import manifest_for

OWNER = "owner-A"
#: the test daemon's session lease (``--lease``)
LEASE_S = 2.0
MODEL_A = OpenSessionRequest(owner_instance_id=OWNER, model_name="a", type="memory", path="/models/a")
MODEL_B = OpenSessionRequest(owner_instance_id=OWNER, model_name="b", type="memory", path="/models/b")


def load_req(src: OpenSessionRequest, expected_generation: int = 0) -> LoadModelRequest:
    return LoadModelRequest(**src.model_dump(exclude={"queue_timeout_s", "switch", "client"}), expected_generation=expected_generation)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(
        tmp_path_factory.mktemp("slot"), "memory", None,
        "--no-preload", "--owner", OWNER, "--lease", str(LEASE_S), "--memory-token-delay-ms", "5",
    ).start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Client]:
    with daemon.client(timeout_s=20.0, owner=OWNER) as c:
        # Each test starts from an empty slot.
        for _ in range(50):
            st = c.status()
            if not st.session_open:
                break
            time.sleep(0.1)
        c.unload_model(UnloadModelRequest())
        yield c


# --- slot rules -------------------------------------------------------------------------------------
def test_open_auto_loads_and_bumps_generation(client: Client) -> None:
    g0 = client.status().generation
    sess = client.open_session(MODEL_A)
    st = client.status()
    assert st.state is SlotState.BUSY and st.session_open
    assert st.generation == g0 + 1 and st.active is not None and st.active.model_name == "a"
    sess.close()
    assert client.status().state is SlotState.READY


def test_one_holder_at_a_time(client: Client, daemon: DaemonProcess) -> None:
    sess = client.open_session(MODEL_A)
    with daemon.client(timeout_s=20.0, owner=OWNER) as other:
        with pytest.raises(ModelBusy):
            other.open_session(MODEL_A)
    sess.close()
    with daemon.client(timeout_s=20.0, owner=OWNER) as other:
        other.open_session(MODEL_A).close()


def test_switch_requires_released_session_and_invalidates_old_handle(client: Client) -> None:
    sess = client.open_session(MODEL_A)
    with pytest.raises(ModelSwitchRequired):
        client.open_session(MODEL_B)  # also busy, but a different model is named
    with pytest.raises(ModelBusy):
        client.load_model(load_req(MODEL_B))
    m = manifest_for(sess, "p")
    sess.ensure_prefix(PrefixInput(text="hello", manifest=m))
    stale_id = sess.session_id
    sess.close()
    gen = client.status().generation
    active = client.load_model(load_req(MODEL_B))
    assert active.model_name == "b" and active.generation == gen + 1
    # The old handle (even re-used by id) no longer works.
    with pytest.raises(SessionClosed):
        client.call(Op.ENSURE_PREFIX, {"session_id": stale_id, "text": "x"})
    with pytest.raises(ModelSwitchRequired):
        client.open_session(MODEL_A)


def test_session_survives_only_its_generation(client: Client, daemon: DaemonProcess) -> None:
    """A lease-expired holder whose slot was then switched sees a closed session."""
    sess = client.open_session(MODEL_A)
    sess.abandon()  # stop renewing the lease, as a client that hung would
    with daemon.client(timeout_s=20.0, owner=OWNER) as other:
        wait_until(lambda: not other.status().session_open, "the holder's lease reaped")
        other.load_model(load_req(MODEL_B))
    with pytest.raises((SessionClosed, SlotGenerationStale)):
        sess.ensure_prefix(PrefixInput(text="x"))


def test_expected_generation(client: Client) -> None:
    active = client.load_model(load_req(MODEL_A))
    with pytest.raises(SlotGenerationStale):
        client.load_model(load_req(MODEL_B, expected_generation=active.generation + 7))
    with pytest.raises(SlotGenerationStale):
        client.unload_model(UnloadModelRequest(expected_generation=active.generation - 1))
    assert client.status().active.model_name == "a"  # type: ignore[union-attr]
    b = client.load_model(load_req(MODEL_B, expected_generation=active.generation))
    assert b.generation == active.generation + 1
    client.unload_model(UnloadModelRequest(expected_generation=b.generation))
    st = client.status()
    assert st.state is SlotState.EMPTY and st.generation == b.generation + 1


def test_load_same_model_is_idempotent(client: Client) -> None:
    a1 = client.load_model(load_req(MODEL_A))
    a2 = client.load_model(load_req(MODEL_A))
    assert a1.generation == a2.generation


def test_unload_idempotent_on_empty_slot(client: Client) -> None:
    g = client.status().generation
    client.unload_model(UnloadModelRequest())
    client.unload_model(UnloadModelRequest())
    st = client.status()
    assert st.state is SlotState.EMPTY and st.generation == g


def test_stale_fence(daemon: DaemonProcess, client: Client) -> None:
    with daemon.client(timeout_s=20.0, owner="owner-B") as intruder:
        with pytest.raises(StaleFence):
            intruder.open_session(MODEL_A.model_copy(update={"owner_instance_id": "owner-B"}))
        with pytest.raises(StaleFence):
            intruder.load_model(load_req(MODEL_A).model_copy(update={"owner_instance_id": "owner-B"}))
        with pytest.raises(StaleFence):
            intruder.unload_model(UnloadModelRequest(owner_instance_id="owner-B"))
        with pytest.raises(StaleFence):
            intruder.describe(MODEL_A.model_copy(update={"owner_instance_id": "owner-B"}))
        assert intruder.status().owner_instance_id == owner_fingerprint(OWNER)  # status shows a fingerprint, never the id


def test_a_session_belongs_to_the_client_that_opened_it(daemon: DaemonProcess, client: Client) -> None:
    sess = client.open_session(MODEL_A)
    m = manifest_for(sess, "owned")
    sess.ensure_prefix(PrefixInput(text="mine", manifest=m))
    with daemon.client(timeout_s=20.0, owner=OWNER) as other:
        # the same owner, another client: the id is as unknown to it as a made-up one
        for op, body in ((Op.ENSURE_PREFIX, {"text": "x", "manifest": m.model_dump()}), (Op.EXPLAIN, {}),
                         (Op.SNAPSHOT, {}), (Op.DECODE, {"max_tokens": 2})):
            with pytest.raises(SessionClosed, match="unknown or closed session"):
                other.call(op, {"session_id": sess.session_id, **body})
        assert other.call(Op.CLOSE, {"session_id": sess.session_id}).body == {"closed": False}
        hb = other.request(Op.HEARTBEAT, HeartbeatRequest(session_ids=[sess.session_id]), HeartbeatReply)
        assert hb.alive == []
        with pytest.raises(ModelBusy) as busy:
            other.open_session(MODEL_A)
        # no reply names the holder's session or the owner
        assert sess.session_id not in str(busy.value.to_wire()) and OWNER not in str(busy.value.to_wire())
    with daemon.client(timeout_s=20.0, owner="intruder") as stranger, pytest.raises(StaleFence) as fence:
        stranger.open_session(MODEL_A.model_copy(update={"owner_instance_id": "intruder"}))
    assert OWNER not in str(fence.value.to_wire())
    assert client.status().owner_instance_id == owner_fingerprint(OWNER) != OWNER
    assert sess.explain_context().resident_tokens > 0  # the owner's session is untouched
    sess.close()


def test_backend_mismatch_and_not_active(client: Client) -> None:
    with pytest.raises(BackendMismatch):
        client.open_session(MODEL_A.model_copy(update={"type": "llama"}))
    with pytest.raises(ModelNotActive):
        client.open_session(MODEL_A.model_copy(update={"path": "", "model_name": ""}))


def test_status_answered_while_a_decode_streams(client: Client, daemon: DaemonProcess) -> None:
    sess = client.open_session(MODEL_A)
    m = manifest_for(sess, "status")
    sess.ensure_prefix(PrefixInput(text="system", manifest=m))
    sess.prefill_suffix(SuffixInput(text="user", manifest=m))
    latencies: list[float] = []
    states: list[str] = []

    def poll() -> None:
        with daemon.client(timeout_s=5.0, owner=OWNER) as c:
            for _ in range(20):
                t0 = time.perf_counter()
                st = c.status()
                latencies.append((time.perf_counter() - t0) * 1000)
                states.append(st.busy_operation)
                time.sleep(0.02)

    stream = sess.decode(DecodeConfig(max_tokens=400))  # 5 ms a token: ~2 s of streaming
    next(stream)
    t = threading.Thread(target=poll)
    t.start()
    n = sum(len(chunk.text) for chunk in stream)  # (one character is one token of this backend)
    t.join()
    sess.close()
    assert n > 100
    assert "decode" in states, "status was answered while the decode was running"
    assert statistics.median(latencies) < 50.0, latencies


def _frames(d: DaemonProcess, max_tokens: int) -> tuple[list[str], int]:
    """The text of each frame of one greedy decode, and the completion tokens its usage reports."""
    with d.client(timeout_s=20.0, owner=OWNER) as c:
        sess = c.open_session(MODEL_A)
        m = manifest_for(sess, "frames")
        sess.ensure_prefix(PrefixInput(text="system", manifest=m))
        sess.prefill_suffix(SuffixInput(text="user", manifest=m))
        chunks = list(sess.decode(DecodeConfig(max_tokens=max_tokens, temperature=0.0)))
        sess.close()
    assert chunks[-1].done and chunks[-1].usage is not None
    return [ch.text for ch in chunks[:-1]], chunks[-1].usage.completion_tokens


def test_decode_frames_are_coalesced_to_the_stream_interval(daemon: DaemonProcess, tmp_path: Path) -> None:
    """At 5 ms a token, the default 50 ms interval sends several tokens a frame, none lost or reordered;
    with an interval of 0 each token is its own frame."""
    frames, produced = _frames(daemon, 200)
    per_token = DaemonProcess(
        tmp_path, "memory", None, "--no-preload", "--owner", OWNER, "--memory-token-delay-ms", "5",
        "--stream-interval-ms", "0",
    ).start()
    try:
        single, produced_single = _frames(per_token, 200)
    finally:
        per_token.stop()
    assert produced == produced_single == 200
    assert all(len(f) == 1 for f in single) and len(single) == 200
    assert "".join(frames) == "".join(single)
    assert len(frames[0]) == 1, "the first token is never held"
    assert len(frames) < 200 / 2, f"{len(frames)} frames for 200 tokens at 5 ms a token"


def test_a_stream_sending_data_gets_no_heartbeats_between_its_frames(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data frame already tells the client the daemon is alive: while frames flow (every 50 ms here),
    a heartbeat is due only a whole interval after the last frame, so none arrives beside them."""
    heard: list[tuple[float, Kind | None]] = []
    decode_reply = wire.decode_reply

    def recording(frames: list[bytes]) -> wire.Message:
        msg = decode_reply(frames)
        heard.append((time.monotonic(), msg.kind))
        return msg

    sess = client.open_session(MODEL_A)
    m = manifest_for(sess, "heartbeats")
    sess.ensure_prefix(PrefixInput(text="system", manifest=m))
    sess.prefill_suffix(SuffixInput(text="user", manifest=m))
    monkeypatch.setattr(wire, "decode_reply", recording)
    n = sum(len(chunk.text) for chunk in sess.decode(DecodeConfig(max_tokens=500)))  # 5 ms a token: ~2.5 s
    monkeypatch.undo()
    sess.close()
    assert n == 500
    data = [t for t, kind in heard if kind is Kind.DATA]
    assert data[-1] - data[0] > 2 * wire.HEARTBEAT_INTERVAL_S, "the stream must outlast two heartbeat intervals"
    for i, (t, kind) in enumerate(heard):
        if kind is Kind.HEARTBEAT and i > 0:
            # (only a stall of the daemon longer than the interval may leave room for one)
            assert t - heard[i - 1][0] > wire.HEARTBEAT_INTERVAL_S / 2, f"a heartbeat between data frames: {heard}"


def test_a_call_queued_behind_a_stopped_client_gives_up_at_its_own_timeout(tmp_path: Path) -> None:
    """A client that stopped answering (SIGSTOP) holds the slot until its lease runs out (10 s here); a call
    queued behind it with a 2 s timeout of its own gives up at 2 s (ModelBusy), not when that lease runs out,
    whether it asked to wait longer (``queue_timeout_s``) or not."""
    d = DaemonProcess(tmp_path, "memory", None, "--no-preload", "--lease", "10",
                      "--memory-token-delay-ms", "5").start()
    proc = streaming_client(d.endpoint, MODEL_A.model_copy(update={"owner_instance_id": ""}))
    try:
        proc.send_signal(signal.SIGSTOP)
        for queue_timeout_s in (2.0, 120.0):
            with d.client(timeout_s=2.0) as c:
                t0 = time.monotonic()
                with pytest.raises(ModelBusy):
                    c.open_session(OpenSessionRequest(queue_timeout_s=queue_timeout_s))
                waited = time.monotonic() - t0
            assert 1.9 <= waited < 6.0, waited  # its own 2 s (a ceiling well short of the 10 s lease)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        d.stop()


def _decoding(client: Client, tag: str, max_tokens: int) -> tuple[Any, Iterator[StreamChunk]]:
    sess = client.open_session(MODEL_A)
    m = manifest_for(sess, tag)
    sess.ensure_prefix(PrefixInput(text="system", manifest=m))
    sess.prefill_suffix(SuffixInput(text="user", manifest=m))
    return sess, sess.decode(DecodeConfig(max_tokens=max_tokens))


def test_a_decode_nobody_reads_is_cancelled_by_the_daemon(client: Client, daemon: DaemonProcess) -> None:
    """A reader that stops reading without a word (its route went away and its cancel was lost) leaves frames
    unread: the daemon cancels the decode once none were taken for ``UNREAD_STREAM_S``, not at its limit (500 s)."""
    sess, stream = _decoding(client, "unread", 100_000)  # 5 ms a token
    first = next(stream)
    assert first.text
    t0 = time.monotonic()
    with daemon.client(timeout_s=20.0) as watcher:
        wait_until(lambda: watcher.status().busy_operation != "decode", "the decode stopped", 60.0)
    assert time.monotonic() - t0 < 60.0
    rest = list(stream)  # what it wrote before it stopped, then the final chunk
    assert rest[-1].done and rest[-1].finish_reason == "cancelled", rest[-1]
    assert rest[-1].usage is not None and rest[-1].usage.completion_tokens < 100_000
    assert "nobody reads it" in daemon.log()
    sess.close()


def test_a_slow_reader_keeps_its_decode(client: Client) -> None:
    """A reader that takes a frame every 0.7 s is slow, not gone: the decode runs to its own end."""
    sess, stream = _decoding(client, "slow", 800)  # 5 ms a token: ~4 s, while the reader takes 7 s for ten frames
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) <= 10:
            time.sleep(0.7)
    assert chunks[-1].done and chunks[-1].finish_reason == "length", chunks[-1]
    assert sum(len(c.text) for c in chunks) == 800
    sess.close()


def test_status_shows_the_turn_and_cancel_turn_ends_it(client: Client, daemon: DaemonProcess) -> None:
    """The turn that holds the slot is in status (who opened it, its phase, how far it came); ``cancel_turn``
    (``modeld cancel``) ends it: its decode stops, its session is released and its next call is refused."""
    sess = client.open_session(MODEL_A.model_copy(update={"client": "tests from here"}))
    st = client.status()
    assert st.turn is not None and st.turn.session_id == sess.session_id and st.turn.client == "tests from here"
    assert st.turn.phase == "idle" and st.turn.operation == ""
    m = manifest_for(sess, "turn")
    sess.ensure_prefix(PrefixInput(text="system", manifest=m))
    sess.prefill_suffix(SuffixInput(text="user", manifest=m))
    stream = sess.decode(DecodeConfig(max_tokens=100_000))
    next(stream)
    with daemon.client(timeout_s=20.0) as other:
        wait_until(lambda: (t := other.status().turn) is not None and t.phase == "decode" and t.done > 20,
                   "the turn decoding", 30.0)
        with pytest.raises(StaleFence):
            other.cancel_turn()  # the daemon has an owner: a cancel is fenced
    with daemon.client(timeout_s=20.0, owner=OWNER) as other:
        ended = other.cancel_turn()
        assert ended.session_id == sess.session_id and ended.client == "tests from here"
        chunks = list(stream)
        assert chunks[-1].done and chunks[-1].finish_reason == "cancelled"
        wait_until(lambda: not other.status().session_open, "the session released", 30.0)
        assert other.status().turn is None and other.cancel_turn().session_id == ""
    with pytest.raises(SessionClosed):
        sess.ensure_prefix(PrefixInput(text="system", manifest=m))
    sess.close()


def test_an_idle_daemon_sleeps_until_its_next_timer(tmp_path: Path) -> None:
    """With nothing to do, the IO thread (the main thread of ``modeld serve``) wakes for its timers only
    (the lease reaper, every half second), not on a short poll."""
    from modeld.server import REAP_INTERVAL_S

    d = DaemonProcess(tmp_path, "memory", None, "--no-preload").start()
    try:
        with d.client(timeout_s=10.0) as c:
            # the daemon's own count of the wake-ups its timers caused (a poll that timed out), which neither another
            # program's load nor these metrics requests (socket events, counted apart) can raise
            before, t0 = _wakeups(c.metrics(), "timer"), time.monotonic()
            wait_until(lambda: _wakeups(c.metrics(), "timer") - before >= 6, "six timer wake-ups", 60.0, 0.1)
            woke, slept = _wakeups(c.metrics(), "timer") - before, time.monotonic() - t0
    finally:
        d.stop()
    # the reap timer alone: one wake-up per interval (a 50 ms poll was 20 a second); a busy machine only makes the
    # wake-ups later, so fewer; the worker the timer wakes is woken through a queue, not on a timer of its own
    expected = slept / REAP_INTERVAL_S
    assert woke <= expected + 2, f"{woke} timer wake-ups in {slept:.1f} s idle (the reap timer alone: {expected:.0f})"


def _wakeups(metrics: str, cause: str) -> int:
    line = f'modeld_io_wakeups_total{{cause="{cause}"}} '
    found = [text.split()[-1] for text in metrics.splitlines() if text.startswith(line)]
    return int(float(found[0])) if found else 0


def test_client_killed_mid_decode_releases_the_slot(daemon: DaemonProcess, client: Client) -> None:
    proc = streaming_client(daemon.endpoint, MODEL_A, owner=OWNER, then="os._exit(0)  # die without closing anything")
    proc.wait(60)
    assert proc.stdout is not None
    proc.stdout.close()
    assert client.status().session_open
    deadline = time.monotonic() + 10.0
    while client.status().session_open:
        assert time.monotonic() < deadline, "the dead client's session was never released"
        time.sleep(0.1)
    st = client.status()
    assert st.busy_operation == ""
    client.open_session(MODEL_A).close()


def test_lease_is_renewed_while_client_lives(daemon: DaemonProcess, client: Client) -> None:
    """An idle session outlives its lease while its client's lease thread renews it, and is released once the
    renewals stop: the renewals, not the clock, are what keeps it."""
    sess = client.open_session(MODEL_A)
    opened = time.monotonic()
    # another client watches: its calls renew no lease of this one
    with daemon.client(timeout_s=20.0, owner=OWNER) as watcher:
        while time.monotonic() - opened < 2 * LEASE_S:
            assert watcher.status().session_open, "the session was released while its client renewed the lease"
            time.sleep(0.1)
        sess.ensure_prefix(PrefixInput(text="still mine", manifest=manifest_for(sess, "lease")))
        sess.abandon()  # the lease thread stops renewing it, as a client that hung would
        stopped = time.monotonic()
        while watcher.status().session_open:
            assert time.monotonic() - stopped < 5 * LEASE_S, "the session was kept with no renewal"
            time.sleep(0.1)
    assert time.monotonic() - stopped > LEASE_S / 2
    with pytest.raises(SessionClosed):
        sess.ensure_prefix(PrefixInput(text="gone", manifest=manifest_for(sess, "lease")))


# --- bad input ------------------------------------------------------------------------------------------
def _raw(daemon: DaemonProcess) -> zmq.Socket[bytes]:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(daemon.endpoint)
    return s


def _reply(sock: zmq.Socket[bytes], timeout_ms: int = 5000) -> wire.Message:
    assert sock.poll(timeout_ms), "the daemon did not answer"
    return wire.decode_reply(sock.recv_multipart())


@pytest.mark.parametrize(
    ("frames", "error"),
    [
        ([b"MDP9", b"status", b"r1", msgpack.packb({})], UnsupportedProtocolVersion),
        ([wire.PROTOCOL, b"nonsense", b"r1", msgpack.packb({})], UnknownOperation),
        ([wire.PROTOCOL, b"status"], BadFrame),
        ([wire.PROTOCOL, b"load", b"r1", b"\xc1\xc1not msgpack"], BadFrame),
        ([wire.PROTOCOL, b"load", b"r1", msgpack.packb([1, 2, 3])], BadFrame),
        ([wire.PROTOCOL, b"load", b"r1", msgpack.packb({"path": 12, "type": "memory"})], InvalidArgument),
        ([wire.PROTOCOL, b"load", b"r1", msgpack.packb({"bogus_field": 1})], InvalidArgument),
        ([wire.PROTOCOL, b"decode", b"r1", msgpack.packb({"session_id": "x", "max_tokens": -5})], InvalidArgument),
        (
            [wire.PROTOCOL, b"decode", b"r1", msgpack.packb({"session_id": "x", "structured_output": {"regex": "a", "grammar": "b"}})],
            InvalidArgument,
        ),
        ([wire.PROTOCOL, b"load", b"r1", msgpack.packb({"path": msgpack.ExtType(1, b"x")})], BadFrame),
        ([wire.PROTOCOL, b"ensure_prefix", b"r1", msgpack.packb({"session_id": "nope"})], SessionClosed),
        ([wire.PROTOCOL, b"status", b"r" * 100, msgpack.packb({})], BadFrame),
    ],
)
def test_bad_frames_get_typed_errors(daemon: DaemonProcess, frames: list[bytes], error: type) -> None:
    sock = _raw(daemon)
    try:
        sock.send_multipart(frames)
        msg = _reply(sock)
        assert msg.kind is Kind.ERROR
        assert type(from_wire(msg.body)) is error, msg.body
        sock.send_multipart(wire.encode_request(Op.STATUS, b"ok?", {}))
        assert _reply(sock).kind is Kind.OK  # still serving
    finally:
        sock.close(0)


def test_oversize_frames(daemon: DaemonProcess) -> None:
    sock = _raw(daemon)
    try:
        big = msgpack.packb({"text": "x" * (wire.MAX_BODY_BYTES + 10)})
        sock.send_multipart([wire.PROTOCOL, b"ensure_prefix", b"big", big])
        assert type(from_wire(_reply(sock, 20000).body)) is FrameTooLarge
        sock.send_multipart([wire.PROTOCOL, b"status", b"many", msgpack.packb({}), *([b"p"] * 9)])
        assert type(from_wire(_reply(sock).body)) is BadFrame
        # per operation: a status takes a small body and no payload frame at all
        sock.send_multipart([wire.PROTOCOL, b"status", b"fat", msgpack.packb({"x": "y" * wire.MAX_SMALL_BODY_BYTES})])
        err = from_wire(_reply(sock, 20000).body)
        assert type(err) is FrameTooLarge and err.details["op"] == "status"
        sock.send_multipart([wire.PROTOCOL, b"status", b"extra", msgpack.packb({}), b"\0" * 2**20])
        assert "status takes 0 payload frame" in from_wire(_reply(sock).body).message
        sock.send_multipart(wire.encode_request(Op.STATUS, b"ok?", {}))
        assert _reply(sock).kind is Kind.OK  # still serving
    finally:
        sock.close(0)


_frame = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([wire.PROTOCOL, b"status", b"load", b"decode", b"open", b"cancel", b"restore", b"embed"]),
    st.builds(lambda d: msgpack.packb(d), st.dictionaries(st.text(max_size=12), st.one_of(
        st.none(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=20), st.binary(max_size=20), st.booleans(),
        st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3)), max_size=5)),
)


def test_random_frames_never_kill_the_daemon(daemon: DaemonProcess, client: Client) -> None:
    """600 generated messages on one raw socket, each followed by a status probe; then a normal session."""
    sock = _raw(daemon)

    @settings(max_examples=600, deadline=None)
    @given(frames=st.lists(_frame, min_size=1, max_size=6))
    def one(frames: list[bytes]) -> None:
        # A message that happens to be a legal request may run; anything else must get a typed error.
        sock.send_multipart(frames)
        sock.send_multipart(wire.encode_request(Op.STATUS, b"alive", {}))
        while True:
            assert sock.poll(5000), "daemon stopped answering"
            msg = wire.decode_reply(sock.recv_multipart())
            if msg.kind is Kind.ERROR:
                assert msg.body["code"] in REGISTRY, msg.body
            if msg.request_id == b"alive":
                assert msg.kind is Kind.OK
                break

    try:
        one()
    finally:
        sock.close(0)
    client.open_session(MODEL_A).close()  # and the daemon serves a normal session afterwards


# --- lifecycle ----------------------------------------------------------------------------------------------
def test_sigterm_ends_streams_and_removes_socket(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, "memory", None, "--no-preload", "--memory-token-delay-ms", "20").start()
    sock_path = Path(d.endpoint[len("ipc://"):])
    assert sock_path.exists() and oct(sock_path.stat().st_mode & 0o777) == "0o600"
    with d.client(timeout_s=20.0) as c:
        s = c.open_session(MODEL_A.model_copy(update={"owner_instance_id": ""}))
        s.ensure_prefix(PrefixInput(text="sys"))
        s.prefill_suffix(SuffixInput(text="go"))
        stream = s.decode(DecodeConfig(max_tokens=1000))
        next(stream)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        with pytest.raises(Exception) as exc:
            for _ in stream:
                pass
        assert type(exc.value).__name__ in ("ShuttingDown", "Cancelled"), exc.value
        assert d.proc.wait(20) == 0
        d.stop()
    assert not sock_path.exists()
    assert "modeld stopped" in d.log()
    with Client(d.endpoint, timeout_s=2.0) as c, pytest.raises(Unavailable, match="no daemon at"):
        c.status()


def test_second_daemon_on_same_endpoint_refuses(daemon: DaemonProcess, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "modeld", "serve", "--backend", "memory", "--no-preload",
         "--endpoint", daemon.endpoint, "--data-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=60, cwd=ROOT,
    )
    assert out.returncode == 1 and "already serving" in out.stderr
    with daemon.client() as c:
        assert c.status().owner_instance_id == owner_fingerprint(OWNER)  # the first one is unharmed


def test_cli_status_json_and_errors(daemon: DaemonProcess) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MODELD_OWNER": OWNER}
    out = subprocess.run([sys.executable, "-m", "modeld", "status", "--json", "--endpoint", daemon.endpoint],
                         capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    import json

    body = json.loads(out.stdout)
    for key in ("owner_instance_id", "backend", "state", "active", "busy_operation", "last_error"):
        assert key in body
    bad = subprocess.run([sys.executable, "-m", "modeld", "load", "x", "--path", "/p", "--type", "llama",
                          "--endpoint", daemon.endpoint], capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
    assert bad.returncode == 1 and "BackendMismatch" in bad.stderr
    gone = subprocess.run([sys.executable, "-m", "modeld", "status", "--endpoint", "ipc:///nonexistent/x.sock"],
                          capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
    assert gone.returncode == 1 and "no daemon at ipc:///nonexistent/x.sock" in gone.stderr


def test_oversize_context_request_is_clamped_not_failed(client: Client) -> None:
    sess = client.open_session(MODEL_A.model_copy(update={"config": Config(num_ctx=1 << 30)}))
    try:
        active = client.status().active
        assert active is not None and active.effective_context == 1 << 20  # the memory backend's ceiling
        assert sess.explain_context().num_ctx == 1 << 20
    finally:
        sess.close()


def test_memory_backend_has_no_embeddings(client: Client) -> None:
    from contract.errors import UnsupportedFeature
    from contract.types import EmbedRequest

    with pytest.raises(UnsupportedFeature):
        client.embed(EmbedRequest(text="hello"))
    assert client.status().embedding is None


def test_client_close_does_not_wait_out_a_dead_daemon(tmp_path: Path) -> None:
    """Closing a client whose daemon died gives up on its sessions quickly (their leases release them)."""
    d = DaemonProcess(tmp_path, "memory", None, "--no-preload").start()
    c = d.client(timeout_s=60.0)
    c.open_session(MODEL_A.model_copy(update={"owner_instance_id": ""}))
    d.stop(signal.SIGKILL)
    t0 = time.monotonic()
    c.close()
    assert time.monotonic() - t0 < 20.0  # not the 60 s call timeout


def test_a_stopped_client_loses_the_slot_after_its_lease(daemon: DaemonProcess, client: Client) -> None:
    """SIGSTOP mid-decode (a debugger, a suspended laptop): the chunks it no longer reads do not renew its lease."""
    proc = streaming_client(daemon.endpoint, MODEL_A, owner=OWNER)
    try:
        proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        while client.status().session_open:
            assert time.monotonic() - t0 < 10 * LEASE_S, "a stopped client kept the slot past its lease"
            time.sleep(0.05)
        client.open_session(MODEL_A).close()  # the slot serves the next client
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
