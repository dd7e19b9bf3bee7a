"""The runtime client (runtime/client.py): how it builds requests and reads every kind of reply.

Against a real daemon process on the memory backend, plus a scripted peer for
replies the memory backend never sends (embeddings, protocol violations).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from contract import wire
from contract.errors import (
    BadFrame,
    InvalidArgument,
    ManifestMismatch,
    SessionClosed,
    SnapshotRejected,
    UnsupportedFeature,
)
from contract.manifest import ContextManifest
from contract.messages import CloseReply, EmbedReply, OpenReply, SessionRef
from contract.types import (
    Config,
    ContextReport,
    DecodeConfig,
    EmbedRequest,
    OpenSessionRequest,
    PrefixInput,
    PrefixStatus,
    StreamChunk,
    StructuredOutputConfig,
    SuffixInput,
    SuffixStatus,
    Usage,
)
from contract.wire import Kind, Message, Op
from harness.daemon import DaemonProcess
from runtime import Client, RemoteSession

from .conformance import SYSTEM, TURN_1, fresh_profile

REQUEST = OpenSessionRequest(model_name="ref", type="memory", path="/models/ref", config=Config(num_ctx=1024))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("client"), "memory", None, "--no-preload", "--memory-token-delay-ms", "1")
    d.start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Client]:
    with daemon.client(timeout_s=20.0) as c:
        yield c


@pytest.fixture
def sess(client: Client) -> Iterator[RemoteSession]:
    s = client.open_session(REQUEST)
    try:
        yield s
    finally:
        s.close()


def _turn(sess: RemoteSession, system: str = SYSTEM) -> ContextManifest:
    m = sess.manifest(profile=fresh_profile())
    sess.ensure_prefix(PrefixInput(text=system, manifest=m))
    sess.prefill_suffix(SuffixInput(text=TURN_1, manifest=m))
    return m


# --- against the daemon ---------------------------------------------------------------------------------
def test_open_reply_fills_the_session(client: Client, sess: RemoteSession) -> None:
    st = client.status()
    assert sess.session_id
    assert st.session_open and sess.generation == st.generation > 0
    assert sess.active is not None and sess.active == st.active
    assert sess.num_ctx == sess.active.effective_context == 1024
    assert set(sess.manifest_defaults) == set(ContextManifest().identity())
    assert sess.manifest_defaults["backend"] == "memory"
    m = sess.manifest(profile="mine")
    assert m.profile == "mine" and m.model_digest == sess.manifest_defaults["model_digest"] != ""


def test_a_turn_reads_every_reply(sess: RemoteSession) -> None:
    m = sess.manifest(profile=fresh_profile())
    pre = sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
    assert type(pre) is PrefixStatus and pre.manifest_digest == m.digest() and pre.prefilled_tokens > 0
    suf = sess.prefill_suffix(SuffixInput(text=TURN_1, manifest=m))
    assert type(suf) is SuffixStatus and suf.resident_tokens == pre.prefix_tokens + suf.suffix_tokens
    chunks = list(sess.decode(DecodeConfig(max_tokens=5, temperature=0.0, return_token_ids=True)))
    assert all(type(c) is StreamChunk for c in chunks)
    *data, final = chunks
    # (a frame carries the tokens decoded within the daemon's stream interval: one or more)
    assert sum(len(c.token_ids) for c in data) == 5 and all(not c.done and c.usage is None and c.token_ids for c in data)
    assert "".join(c.text for c in data) == "".join(chr(t) for c in data for t in c.token_ids)
    assert final.done and final.finish_reason == "length"
    assert isinstance(final.usage, Usage) and final.usage.completion_tokens == 5
    rep = sess.explain_context()
    assert type(rep) is ContextReport and rep.resident_tokens == suf.resident_tokens + 5 and not rep.closed


def test_an_error_inside_a_stream_is_raised_as_the_daemon_class(sess: RemoteSession) -> None:
    _turn(sess)
    with pytest.raises(UnsupportedFeature):
        list(sess.decode(DecodeConfig(structured_output=StructuredOutputConfig(regex="[a-z]+"))))
    assert list(sess.decode(DecodeConfig(max_tokens=2)))[-1].done  # the session serves on


def test_snapshot_with_and_without_state(sess: RemoteSession) -> None:
    _turn(sess)
    full = sess.snapshot()
    bare = sess.snapshot(include_state=False)
    assert full.state and full.state_id == "sha256:" + hashlib.sha256(full.state).hexdigest()
    assert bare.state == b"" and bare == full.model_copy(update={"state": b""})
    assert "state_bytes" not in bare.model_dump()  # wire bookkeeping, not part of the snapshot


def test_restore_from_state_id_and_from_the_payload(sess: RemoteSession) -> None:
    _turn(sess)
    full = sess.snapshot()
    bare = sess.snapshot(include_state=False)
    for snap in (bare, full.model_copy(update={"state_id": ""})):  # the blob the daemon kept; the bytes sent
        _turn(sess, "An unrelated system prompt about cooking.")
        assert sess.explain_context().resident_tokens != full.resident_tokens
        sess.restore(snap)
        rep = sess.explain_context()
        assert (rep.resident_tokens, rep.prefix_tokens) == (full.resident_tokens, full.prefix_tokens)
    with pytest.raises(SnapshotRejected, match="no snapshot blob"):
        sess.restore(bare.model_copy(update={"state_id": "sha256:" + "0" * 64}))
    with pytest.raises(InvalidArgument, match="payload frame or a state_id"):
        sess.restore(bare.model_copy(update={"state_id": ""}))


def test_close(client: Client) -> None:
    sess = client.open_session(REQUEST)
    sid = sess.session_id
    sess.close()
    sess.close()  # idempotent, and nothing is sent
    assert not client.status().session_open
    assert client.request(Op.CLOSE, SessionRef(session_id=sid), CloseReply).closed is False
    m = ContextManifest()
    for call in (
        lambda: sess.ensure_prefix(PrefixInput(text="x", manifest=m)),
        lambda: sess.prefill_suffix(SuffixInput(text="x", manifest=m)),
        lambda: sess.decode(),
        lambda: sess.explain_context(),
        lambda: sess.snapshot(),
        lambda: sess.restore(sess.snapshot()),
    ):
        with pytest.raises(SessionClosed, match="session is closed"):
            call()


def test_error_replies_are_raised_as_the_daemon_class(client: Client, sess: RemoteSession) -> None:
    with pytest.raises(SessionClosed) as closed:
        client.request(Op.EXPLAIN, SessionRef(session_id="nope"), ContextReport)
    assert closed.value.details == {"session_id": "nope"}
    m = _turn(sess)
    other = m.model_copy(update={"model_digest": "sha256:" + "1" * 64})
    with pytest.raises(ManifestMismatch):
        sess.prefill_suffix(SuffixInput(text=TURN_1, manifest=other))
    with pytest.raises(InvalidArgument) as bad:
        client.call(Op.DECODE, {"session_id": sess.session_id, "max_tokens": -1})
    assert bad.value.details["problems"][0].startswith("max_tokens:")


def test_one_client_serves_several_threads(client: Client, sess: RemoteSession) -> None:
    """While one thread streams a decode, others call through the same client; every reply reaches its caller."""
    _turn(sess)
    stream = sess.decode(DecodeConfig(max_tokens=600, temperature=0.0))
    first = next(stream)
    failures: list[BaseException] = []
    answered: list[int] = []

    def calls() -> None:
        try:
            for _ in range(10):
                assert client.status().busy_operation in ("decode", "")
                assert sess.explain_context().resident_tokens > 0
                answered.append(1)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=calls) for _ in range(3)]
    for t in threads:
        t.start()
    *data, final = [first, *stream]
    for t in threads:
        t.join(30)
    assert not failures, failures
    assert len(answered) == 30
    assert final.done and final.finish_reason == "length" and sum(len(c.text) for c in data) == 600


def test_cancel_from_another_thread_ends_the_stream_as_cancelled(sess: RemoteSession) -> None:
    """``cancel`` stops the decode, and the reader still gets its end: a final chunk that says "cancelled"."""
    _turn(sess)
    assert not sess.cancel()  # no decode in flight
    stream = sess.decode(DecodeConfig(max_tokens=800, temperature=0.0))
    first = next(stream)
    canceller = threading.Thread(target=sess.cancel)
    canceller.start()
    *data, final = [first, *stream]
    canceller.join(10)
    assert final.done and final.finish_reason == "cancelled"
    assert 0 < sum(len(c.text) for c in data) < 800
    assert not sess.cancel()  # nothing in flight any more
    assert list(sess.decode(DecodeConfig(max_tokens=3)))[-1].finish_reason == "length"  # the session serves on


# --- against a scripted peer ----------------------------------------------------------------------------------
Answer = Callable[[Message], list[list[bytes]]]


class ScriptedDaemon:
    """A ROUTER that answers each request with the reply frames ``answer`` gives (none: no reply)."""

    def __init__(self, endpoint: str, answer: Answer) -> None:
        self.answer = answer
        self.requests: list[Message] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            identity, *frames = self._sock.recv_multipart()
            msg = wire.decode_request(frames)
            self.requests.append(msg)
            for reply in self.answer(msg):
                self._sock.send_multipart([identity, *reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


def _defaults(msg: Message) -> list[list[bytes]]:
    if msg.op is Op.OPEN:
        return [wire.encode_reply(Kind.OK, msg.request_id, OpenReply(session_id="s1", generation=1, num_ctx=64))]
    if msg.op is Op.CLOSE:
        return [wire.encode_reply(Kind.OK, msg.request_id, CloseReply(closed=True))]
    return []


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[Callable[[Answer], tuple[ScriptedDaemon, Client]]]:
    made: list[tuple[ScriptedDaemon, Client]] = []

    def make(answer: Answer) -> tuple[ScriptedDaemon, Client]:
        endpoint = f"ipc://{tmp_path / 'peer.sock'}"
        peer = ScriptedDaemon(endpoint, lambda m: answer(m) or _defaults(m))
        made.append((peer, Client(endpoint, timeout_s=5.0)))
        return made[-1]

    yield make
    for peer, c in made:
        c.close()
        peer.close()


def test_embed_reply_is_read_from_its_float32_frame(scripted: Callable[[Answer], tuple[ScriptedDaemon, Client]]) -> None:
    vectors = [[0.5, -1.5, 2.0], [0.25, 0.0, -4.0]]

    def answer(msg: Message) -> list[list[bytes]]:
        req = wire.decode_body(EmbedRequest, msg)
        rows = vectors[: len(req.inputs())]
        reply = EmbedReply(vectors=rows, dims=3, count=len(rows), model_name="e", tokens=[2] * len(rows))
        return [wire.encode_reply(Kind.OK, msg.request_id, reply)]

    peer, c = scripted(answer)
    one = c.embed(EmbedRequest(text="a"))
    assert (one.vector, one.vectors, one.dims, one.model_name, one.tokens) == (vectors[0], vectors[:1], 3, "e", [2])
    many = c.embed(EmbedRequest(texts=["a", "b"]))
    assert (many.vector, many.vectors) == ([], vectors)
    assert len(peer.requests[0].payloads) == 0 and peer.requests[1].body["texts"] == ["a", "b"]


def test_embed_frame_of_the_wrong_size_is_a_bad_frame(scripted: Callable[[Answer], tuple[ScriptedDaemon, Client]]) -> None:
    def answer(msg: Message) -> list[list[bytes]]:
        body = msgpack.packb({"dims": 3, "count": 2, "model_name": "e"})
        return [[wire.PROTOCOL, b"ok", msg.request_id, body, b"\x00" * 20]]

    _, c = scripted(answer)
    with pytest.raises(BadFrame, match="does not hold 2x3"):
        c.embed(EmbedRequest(texts=["a", "b"]))


def test_a_unary_reply_inside_a_stream_is_a_bad_frame(scripted: Callable[[Answer], tuple[ScriptedDaemon, Client]]) -> None:
    def answer(msg: Message) -> list[list[bytes]]:
        if msg.op is Op.DECODE:
            return [
                wire.encode_chunk(msg.request_id, StreamChunk(text="a")),
                wire.encode_reply(Kind.OK, msg.request_id, StreamChunk(text="b")),
            ]
        return []

    peer, c = scripted(answer)
    stream = c.open_session(REQUEST).decode()
    assert next(stream).text == "a"
    with pytest.raises(BadFrame, match="inside a decode stream"):
        next(stream)
    assert [m.op for m in peer.requests if m.op is Op.CANCEL] == []  # the stream had ended: nothing to cancel


def test_a_reset_ends_the_calls_of_other_threads(scripted: Callable[[Answer], tuple[ScriptedDaemon, Client]]) -> None:
    """A call that times out resets the shared socket: a call another thread waits on ends at once, not at its
    own deadline (its reply could no longer reach it)."""
    import time

    from contract.errors import Unavailable

    peer, c = scripted(lambda m: [])  # a peer that never answers a status
    ended: list[tuple[BaseException, float]] = []

    def patient() -> None:
        t0 = time.monotonic()
        try:
            c.status(timeout_s=20.0)
        except Unavailable as exc:
            ended.append((exc, time.monotonic() - t0))

    waiter = threading.Thread(target=patient)
    waiter.start()
    deadline = time.monotonic() + 10
    while not any(m.op is Op.STATUS for m in peer.requests):  # the waiter's call is out
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(Unavailable):
        c.status(timeout_s=0.5)
    waiter.join(10)
    assert ended and "was reset" in ended[0][0].message and ended[0][1] < 5.0, ended


def test_a_stale_socket_file_fails_at_once(tmp_path: Path) -> None:
    import socket
    import time

    from contract.errors import Unavailable
    from runtime import Client

    path = tmp_path / "modeld.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # the file stays, nobody listens: what a killed daemon leaves
    assert path.exists()
    t0 = time.monotonic()
    with Client(f"ipc://{path}", timeout_s=30.0) as c, pytest.raises(Unavailable, match="stale socket file"):
        c.status()
    assert time.monotonic() - t0 < 15.0  # not the 30 s call timeout


def test_silence_is_what_the_client_listened_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that did not listen for a while (its progress callback took its time; on a loaded machine, a thread
    that was not scheduled) has not heard a silence: the daemon is called gone only after the liveness time spent
    in empty polls, and one that then stops answering altogether still is."""
    import time

    from contract.errors import DaemonTimeout
    from contract.types import Heartbeat, Progress
    from runtime import client as client_module

    monkeypatch.setattr(client_module, "LIVENESS_S", 2.0)
    endpoint = f"ipc://{tmp_path / 'peer.sock'}"
    listening_again = threading.Event()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)

    done = threading.Event()

    def peer() -> None:
        for answer in (True, False):  # the first status is answered late, the second never (heartbeats stop)
            while not router.poll(20):
                if done.is_set():
                    return
            identity, *frames = router.recv_multipart()
            rid = wire.decode_request(frames).request_id
            progress = Heartbeat(progress=Progress(stage="prefill", fraction=0.5, done=1, total=2))
            router.send_multipart([identity, *wire.encode_reply(Kind.HEARTBEAT, rid, progress)])
            if answer:
                listening_again.wait(10)
                time.sleep(0.5)  # (the daemon was stalled as long as the client, and comes back a little later)
                router.send_multipart([identity, *wire.encode_reply(Kind.OK, rid, CloseReply(closed=True))])

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()

    def slow_redraw(_: Progress) -> None:
        time.sleep(3.0)  # longer than the liveness time, with nothing queued for the client when it returns
        listening_again.set()

    c = Client(endpoint, timeout_s=30.0)
    try:
        assert c.call(Op.STATUS, {}, on_progress=slow_redraw).kind is Kind.OK
        t0 = time.monotonic()
        with pytest.raises(DaemonTimeout, match="stopped answering"):
            c.call(Op.STATUS, {})
        assert 2.0 <= time.monotonic() - t0 < 10.0  # the liveness time, not the call's 30 s
    finally:
        c.close()
        done.set()
        thread.join(5)
        router.close(0)
        ctx.term()
