"""The runtime client: the contract's Service, Session and ModelController over ZeroMQ.

A coding agent imports this (``runtime.Client``); it needs only pyzmq, msgpack
and pydantic. Every call has a timeout: a receive waits behind ``poll``, a
heartbeat frame from a daemon that is still working pushes the deadline out,
and silence past it raises ``DaemonTimeout`` (or ``Unavailable`` when nothing
has ever answered). A heartbeat may carry the running request's progress (a
model load, a prefill): an ``on_progress`` callback, given to the client or to
one call, receives it. After a timeout the socket is closed with LINGER=0 and a
fresh one is connected; nothing is resent automatically, since a decode or a
prefill must never run twice behind the caller's back.

A background thread renews the lease of open sessions, so an agent that thinks
for a while between turns keeps its slot, while a client that dies loses it
after the daemon's lease time.

Over ~400 lines on purpose: the connection (timeouts, reconnects, the lease thread) and the
remote session's streaming share one socket and its lock; the operations are one short method each.
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import zmq
from pydantic import BaseModel
from zmq.utils.monitor import recv_monitor_message

from contract import wire
from contract.endpoint import default_endpoint, ipc_path
from contract.errors import BadFrame, DaemonTimeout, InvalidArgument, ModeldError, SessionClosed, Unavailable
from contract.manifest import ContextManifest
from contract.messages import (
    CacheClearReply,
    CacheClearRequest,
    CacheListReply,
    CacheListRequest,
    CancelRequest,
    CancelTurnReply,
    CancelTurnRequest,
    CloseReply,
    CountTokensRequest,
    DecodeRequest,
    DetokenizeReply,
    DetokenizeRequest,
    EmbedReply,
    EnsurePrefixRequest,
    ForkRequest,
    HeartbeatRequest,
    MetricsReply,
    MetricsRequest,
    OpenReply,
    PrefillSuffixRequest,
    ReadRequest,
    RestoreRequest,
    SessionRef,
    SnapshotReply,
    SnapshotRequest,
    StatusRequest,
    TakeoverReply,
    TakeoverRequest,
    TokenizeReply,
    TokenizeRequest,
    UnloadReply,
    WhyReply,
    WhyRequest,
)
from contract.types import (
    ActiveModel,
    ContextReport,
    DaemonStatus,
    DecodeConfig,
    EmbedRequest,
    EmbedResult,
    ImageInput,
    LoadModelRequest,
    ModelInfo,
    OpenSessionRequest,
    PrefixInput,
    PrefixStatus,
    Progress,
    ReuseRecord,
    SamplingParams,
    SessionSnapshot,
    StreamChunk,
    SuffixInput,
    SuffixStatus,
    TokenCount,
    UnloadModelRequest,
)
from contract.wire import Kind, Message, Op

from .fairlock import FairLock
from .wakeups import prompt_zmq_wakeups

#: what the CURVE client's monitor reports: the handshake's outcome
_HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)

if TYPE_CHECKING:
    from contract.types import ChatMessage

    from .chat import ChatEvent, ChatResult

DEFAULT_TIMEOUT_S = 60.0
LEASE_RENEW_INTERVAL_S = 5.0
#: a stream's reader reports what it took at least this often while frames wait for it (and always before it waits
#: for more), well inside the daemon's ``wire.UNREAD_STREAM_S``
READ_REPORT_S = 0.5
#: how long Client.close() waits for each still-open session to close (then the lease does it)
CLOSE_ON_EXIT_TIMEOUT_S = 2.0

_R = TypeVar("_R", bound=BaseModel)
#: receives the progress a daemon's heartbeat carries (about once a second while a load or a prefill runs)
ProgressCallback = Callable[[Progress], None]
_Fenced = TypeVar("_Fenced", LoadModelRequest, UnloadModelRequest, OpenSessionRequest, EmbedRequest, CacheClearRequest)


def _listening(path: Path) -> bool:
    """Whether something accepts connections on the unix socket at ``path`` (False: a stale file)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True  # not ours to judge (permissions, a full backlog): ZeroMQ will tell
    return True


#: a request the daemon holds gets a heartbeat every second; this much silence means the daemon is gone. Silence is
#: what the waiting thread itself sat through in empty polls, not the clock's time since the last message: a client
#: that was not scheduled (a loaded machine, another thread holding the interpreter lock) heard nothing because it
#: did not listen, and the daemon's heartbeats wait on the socket for it
LIVENESS_S = 8 * wire.HEARTBEAT_INTERVAL_S
#: how long a send may wait for ZeroMQ to take a request (it queues it at once wherever a connection is made or
#: being made)
SEND_TIMEOUT_MS = 1000

#: the daemon's CURVE public key for ``--curve`` tcp endpoints (``modeld keys`` prints it)
SERVER_KEY_ENV = "MODELD_SERVER_KEY"


class Client:
    """Service + ModelController over ZeroMQ.

    Safe to share between threads: every use of the request socket is under one
    lock (the lease thread has a socket of its own), and replies are matched to
    their requests by id, whichever thread reads them off the socket. The threads
    take turns on that one socket, though: a call waits while another thread polls
    it (a quarter of a second at most), and a timeout or a daemon gone resets the
    socket under all of them, which ends their calls in flight too (Unavailable). A
    server that runs requests side by side gives each its own client (the HTTP
    front's pool).
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        owner: str = "",
        lease_renew_s: float = LEASE_RENEW_INTERVAL_S,
        server_key: str | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> None:
        self.endpoint = endpoint or default_endpoint()
        #: called with the progress of any request of this client (after a call's own ``on_progress``)
        self.on_progress = on_progress
        #: the daemon's CURVE public key (``modeld keys``; env MODELD_SERVER_KEY): the sockets then speak CURVE
        key = server_key if server_key is not None else os.environ.get(SERVER_KEY_ENV, "")
        self._curve = (key.strip().encode(), *zmq.curve_keypair()) if key else None
        self.timeout_s = timeout_s
        self.owner = owner
        self._lease_renew_s = lease_renew_s
        self._ctx = zmq.Context()
        #: the socket's: handed over in arrival order, so a reader polling in a loop cannot starve another call
        self._lock = FairLock()
        #: guards ``_sessions`` alone: the lease thread renews the leases without waiting for the request socket,
        #: which a reader holds a quarter second at a time while it polls behind a long prefill
        self._sessions_lock = threading.Lock()
        self._sock: zmq.Socket[bytes] | None = None
        #: with CURVE: the main socket's monitor, which tells a refused handshake (a wrong server key) from silence
        self._handshakes: zmq.Socket[bytes] | None = None
        self._buffers: dict[bytes, deque[Message]] = {}
        self._abandoned: set[bytes] = set()
        #: per request: seconds of empty polls since its last message (absent until the daemon is known to answer)
        self._silence: dict[bytes, float] = {}
        self._ids = itertools.count(1)
        self._prefix = os.urandom(4)
        #: this client's routing id (``wire.peer_key``): the daemon binds its sessions to it
        self._routing = wire.CLIENT_ID_PREFIX + secrets.token_hex(12).encode()
        self._answered = False
        self._sessions: dict[str, RemoteSession] = {}
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._closed = False

    # --- plumbing --------------------------------------------------------------------------
    def _socket(self) -> zmq.Socket[bytes]:
        if self._closed:
            raise Unavailable("client is closed")
        if self._sock is None:
            path = ipc_path(self.endpoint)
            if path is not None and not path.exists():
                raise Unavailable(self._no_daemon(), endpoint=self.endpoint)
            if path is not None and not _listening(path):
                # ZeroMQ would queue the request for a listener that never comes: say so now
                raise Unavailable(
                    f"no daemon at {self.endpoint}: {path} is a stale socket file left by a daemon that stopped; "
                    "start `modeld serve` (it replaces the file)",
                    endpoint=self.endpoint,
                )
            s = self._ctx.socket(zmq.DEALER)
            prompt_zmq_wakeups()  # the context's I/O thread (started with its first socket) carries every reply
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            # a send never waits long: where the daemon refused the CURVE handshake before the first send, ZeroMQ
            # has no connection to queue it on and would wait for one for ever
            s.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
            s.setsockopt(zmq.ROUTING_ID, self._routing + b"/m")  # the same after a reconnect
            self._secure(s)
            if self._curve is not None:
                self._handshakes = s.get_monitor_socket(_HANDSHAKE_EVENTS)
            s.connect(self.endpoint)
            self._sock = s
        return self._sock

    def _refused_handshake(self) -> bool:
        """The daemon refused this client's CURVE handshake, and none succeeded since (drains the monitor)."""
        if self._handshakes is None:
            return False
        refused = False
        while self._handshakes.poll(0):
            event = recv_monitor_message(self._handshakes)["event"]
            refused = event != zmq.EVENT_HANDSHAKE_SUCCEEDED
        return refused

    def _wrong_key(self) -> str:
        return (f"the daemon at {self.endpoint} refused the CURVE handshake: the server key this client uses "
                "(--server-key or MODELD_SERVER_KEY) is not the daemon's; `modeld keys` on its machine prints it")

    def _secure(self, s: zmq.Socket[bytes]) -> None:
        if self._curve is not None:
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = self._curve

    def _no_daemon(self) -> str:
        return f"no daemon at {self.endpoint} — is `modeld serve` running?"

    def _reset(self) -> None:
        if self._sock is not None:
            if self._handshakes is not None:
                self._sock.disable_monitor()
                self._handshakes.close(0)
                self._handshakes = None
            self._sock.close(0)
            self._sock = None
        self._buffers.clear()
        self._abandoned.clear()
        self._silence.clear()

    # --- the raw wire: what the typed calls are made of, for tools and tests that speak the wire themselves -----

    def send(self, op: Op, body: BaseModel | dict[str, Any], payloads: list[bytes] | None = None) -> bytes:
        """Send a request (a typed message, or a raw map for hand-made requests) without waiting; returns its id,
        which ``receive`` and ``waiting`` take."""
        rid = self._prefix + next(self._ids).to_bytes(8, "big")
        with self._lock:
            sock = self._socket()
            try:
                sock.send_multipart(wire.encode_request(op, rid, body, payloads), copy=False)
            except zmq.Again:
                refused = self._refused_handshake()
                self._reset()
                raise Unavailable(self._wrong_key() if refused else self._no_daemon(), endpoint=self.endpoint) from None
            self._buffers[rid] = deque()
            if self._answered:
                # A daemon that answered before answers or heartbeats this request within a second of taking
                # it: the liveness clock runs from the send, so one that died before its first heartbeat is
                # noticed as quickly as one that died later.
                self._silence[rid] = 0.0
        return rid

    def waiting(self, rid: bytes) -> int:
        """How many messages for request ``rid`` have arrived and wait for ``receive`` (heartbeats included)."""
        with self._lock:
            return len(self._buffers.get(rid, ()))

    def receive(
        self, rid: bytes, timeout_s: float | None = None, on_progress: ProgressCallback | None = None
    ) -> Message:
        """Next message for ``rid``; heartbeats extend the deadline, hand their progress to the callback, and are
        not returned."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        callbacks = [cb for cb in (on_progress, self.on_progress) if cb is not None]
        report: ProgressCallback | None = None
        if callbacks:
            def report(p: Progress) -> None:
                for cb in callbacks:
                    cb(p)
        progress: Progress | None = None
        while True:
            if progress is not None and report is not None:
                p, progress = progress, None
                report(p)  # outside the lock: the callback may take its time (a terminal redraw)
            with self._lock:
                buf = self._buffers.get(rid)
                if buf is None:
                    # another thread's call reset the socket (a timeout, a daemon gone): this reply is lost
                    raise Unavailable(f"the connection to {self.endpoint} was reset while this call waited",
                                      endpoint=self.endpoint)
                if buf:
                    msg = buf.popleft()  # (its arrival reset the request's silence)
                    if msg.kind is Kind.HEARTBEAT:
                        deadline = time.monotonic() + timeout
                        progress = wire.heartbeat_progress(msg) if report is not None else None
                        continue
                    if msg.kind is not None and msg.kind.terminal:
                        self._buffers.pop(rid, None)
                        self._silence.pop(rid, None)
                    return msg
                sock = self._socket()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    answered = self._answered
                    self._reset()
                    if not answered:
                        raise Unavailable(self._no_daemon(), endpoint=self.endpoint)
                    raise DaemonTimeout(f"no reply from {self.endpoint} within {timeout:.1f}s", endpoint=self.endpoint)
                wait_s = min(remaining, 0.25)
                began = time.monotonic()
                if not sock.poll(int(wait_s * 1000) + 1, zmq.POLLIN):
                    if not self._answered and self._refused_handshake():
                        self._reset()  # (ZeroMQ would retry the same key for ever)
                        raise Unavailable(self._wrong_key(), endpoint=self.endpoint)
                    silence = self._silence.get(rid)
                    if silence is None:
                        continue
                    silence = self._silence[rid] = silence + min(time.monotonic() - began, wait_s)
                    if silence > LIVENESS_S:
                        # The daemon heartbeats every request it holds each second, and nothing
                        # is waiting on the socket: it died (or cannot answer). Say so now.
                        self._reset()
                        raise DaemonTimeout(
                            f"{self.endpoint} stopped answering: no heartbeat for {LIVENESS_S:.0f} s "
                            "(the daemon exited or was killed?)",
                            endpoint=self.endpoint,
                        )
                    continue
                frames = sock.recv_multipart()
                try:
                    msg = wire.decode_reply(frames)
                except ModeldError:
                    continue  # a garbled reply cannot be matched to a request; drop it
                self._answered = True
                if msg.request_id in self._abandoned:
                    if msg.kind is not None and msg.kind.terminal:
                        self._abandoned.discard(msg.request_id)
                    continue
                if msg.request_id in self._buffers:
                    self._buffers[msg.request_id].append(msg)
                    self._silence[msg.request_id] = 0.0

    def call(
        self,
        op: Op,
        body: BaseModel | dict[str, Any],
        payloads: list[bytes] | None = None,
        timeout_s: float | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> Message:
        """Send a request and wait for its reply; an ``error`` reply is raised as the daemon's class."""
        return self._await(self.send(op, body, payloads), timeout_s, on_progress)

    def _await(self, rid: bytes, timeout_s: float | None = None, on_progress: ProgressCallback | None = None) -> Message:
        """The reply to request ``rid``, sent already; an ``error`` reply is raised as the daemon's class."""
        try:
            msg = self.receive(rid, timeout_s, on_progress)
        except ModeldError:
            raise
        except BaseException:
            # Ctrl-C (or any interrupt) while waiting: tell the daemon to stop the work,
            # e.g. a long cold prefill, instead of finishing it for nobody.
            self._abandon(rid)
            raise
        if msg.kind is Kind.ERROR:
            raise wire.error_of(msg)
        return msg

    def request(
        self,
        op: Op,
        req: BaseModel,
        reply: type[_R],
        timeout_s: float | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> _R:
        """A unary call: the typed request out, its ``ok`` reply read as ``reply``."""
        return wire.decode_body(reply, self.call(op, req, timeout_s=timeout_s, on_progress=on_progress))

    def _cancel(self, rid: bytes) -> bool:
        """Ask the daemon to stop request ``rid`` and return at once; its reader still reads the end the daemon
        sends (a decode's final chunk says "cancelled"). False when ``rid`` is not waiting for a reply."""
        with self._lock:
            if rid not in self._buffers or self._sock is None:
                return False
            self._sock.send_multipart(wire.encode_request(Op.CANCEL, rid + b"c", CancelRequest(request_id=rid)))
            self._abandoned.add(rid + b"c")  # nobody waits for the cancel's own reply
            return True

    def _report_read(self, rid: bytes, frames: int) -> None:
        """Tell the daemon the reader of stream ``rid`` took its first ``frames`` frames (``ReadRequest``; never
        answered). A decode sent with ``reads`` whose frames stay unread is cancelled by the daemon."""
        with self._lock:
            if rid in self._buffers and self._sock is not None:
                self._sock.send_multipart(wire.encode_request(Op.READ, rid + b"r", ReadRequest(request_id=rid,
                                                                                                  frames=frames)))

    def _abandon(self, rid: bytes) -> None:
        """Cancel ``rid`` and drop whatever still comes for it: its reader is gone."""
        with self._lock:
            if self._cancel(rid):
                self._buffers.pop(rid, None)
                self._abandoned.add(rid)

    # --- ModelController ---------------------------------------------------------------------
    def status(self, timeout_s: float | None = None) -> DaemonStatus:
        return self.request(Op.STATUS, StatusRequest(), DaemonStatus, timeout_s)

    def load_model(self, req: LoadModelRequest, *, on_progress: ProgressCallback | None = None) -> ActiveModel:
        """Load (or switch to) a model; ``on_progress`` receives the load's progress while it runs."""
        return self.request(Op.LOAD, self._fenced(req), ActiveModel, on_progress=on_progress)

    def unload_model(self, req: UnloadModelRequest | None = None) -> None:
        self.request(Op.UNLOAD, self._fenced(req or UnloadModelRequest()), UnloadReply)

    def cancel_turn(self, session_id: str = "") -> CancelTurnReply:
        """End the turn that holds the slot (``modeld cancel``), or ``session_id``'s: its running operation is
        cancelled and its session released. The reply names the session ended ("" when none held the slot)."""
        return self.request(Op.CANCEL_TURN, CancelTurnRequest(owner_instance_id=self.owner, session_id=session_id),
                            CancelTurnReply)

    def takeover(self, epoch: int) -> TakeoverReply:
        """Become the daemon's owner (this client's ``owner``) at ``epoch``, higher than the current owner's.

        The old owner's session, if it holds the slot, is ended (its calls raise
        LostOwner) and its fence is refused from then on; the model stays loaded.
        """
        if not self.owner:
            raise InvalidArgument("takeover needs the client's owner id (Client(owner=...), --owner, MODELD_OWNER)")
        req = wire.parse(TakeoverRequest, {"owner_instance_id": self.owner, "epoch": epoch})
        return self.request(Op.TAKEOVER, req, TakeoverReply)

    def metrics(self) -> str:
        """The daemon's metrics in the Prometheus text format."""
        return self.request(Op.METRICS, MetricsRequest(), MetricsReply).text

    def why(self, last: int = 20) -> list[ReuseRecord]:
        """The last ``last`` requests' prompts, oldest first: how much was reused, and where and why it stopped."""
        return self.request(Op.WHY, wire.parse(WhyRequest, {"last": last}), WhyReply).requests

    # --- workspace cache -------------------------------------------------------------------------
    def cache_list(self) -> CacheListReply:
        """The workspace cache's entries (most recently used first) and its status (``cache`` is None when off)."""
        return self.request(Op.CACHE_LIST, CacheListRequest(), CacheListReply)

    def cache_clear(self) -> int:
        """Drop every workspace cache entry, in RAM and on disk; returns how many (owner-fenced)."""
        return self.request(Op.CACHE_CLEAR, self._fenced(CacheClearRequest()), CacheClearReply).cleared

    # --- Service ---------------------------------------------------------------------------------
    def describe(self, req: OpenSessionRequest) -> ModelInfo:
        return self.request(Op.DESCRIBE, self._fenced(req), ModelInfo)

    def embed(self, req: EmbedRequest) -> EmbedResult:
        reply = self.request(Op.EMBED, self._fenced(req), EmbedReply)
        return reply.result(single=not req.texts)

    def open_session(self, req: OpenSessionRequest) -> RemoteSession:
        """Open a session. One that waits for the slot (``queue_timeout_s``) waits no longer than this client's own
        ``timeout_s``: the daemon's heartbeats keep a running call alive past it, but a call still queued behind
        another client's session (one that stopped answering, say) gives up at the caller's timeout with ModelBusy."""
        if req.queue_timeout_s > self.timeout_s:
            req = req.model_copy(update={"queue_timeout_s": self.timeout_s})
        return self._held(self.request(Op.OPEN, self._fenced(req), OpenReply))

    def _held(self, opened: OpenReply) -> RemoteSession:
        """A session the daemon opened for this client (``open``, ``fork``), its lease renewed from now on."""
        sess = RemoteSession(self, opened)
        with self._sessions_lock:
            self._sessions[sess.session_id] = sess
            if opened.lease_s > 0:  # renew three times per lease: only the client's own messages renew it
                self._lease_renew_s = min(self._lease_renew_s, opened.lease_s / 3)
        self._ensure_heartbeat()
        return sess

    # --- the agent's loop (runtime.chat) -------------------------------------------------------------
    def chat(
        self,
        messages: Iterable[Mapping[str, Any] | ChatMessage],
        tools: Sequence[Mapping[str, Any]] | str | None = None,
        *,
        profile: str = "chat",
        **decode: Any,
    ) -> ChatResult:
        """One turn of a conversation: the whole message list in, the assistant's reply out (see ``runtime.Chat``)."""
        from .chat import Chat

        return Chat(self, profile=profile).send(messages, tools, **decode)

    def chat_stream(
        self,
        messages: Iterable[Mapping[str, Any] | ChatMessage],
        tools: Sequence[Mapping[str, Any]] | str | None = None,
        *,
        profile: str = "chat",
        **decode: Any,
    ) -> Generator[ChatEvent, None, None]:
        """The streaming twin of ``chat``: deltas, then an event carrying the ChatResult."""
        from .chat import Chat

        return Chat(self, profile=profile).stream(messages, tools, **decode)

    def _fenced(self, req: _Fenced) -> _Fenced:
        if self.owner and not req.owner_instance_id:
            return req.model_copy(update={"owner_instance_id": self.owner})
        return req

    # --- leases ------------------------------------------------------------------------------------
    def _ensure_heartbeat(self) -> None:
        with self._lock:  # two threads opening sessions at once start one lease thread
            if self._hb_thread is None or not self._hb_thread.is_alive():
                self._hb_thread = threading.Thread(target=self._heartbeat_main, name="modeld-lease", daemon=True)
                self._hb_thread.start()

    def _heartbeat_main(self) -> None:
        # Its own socket: ZeroMQ sockets must not be shared between threads.
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, self._routing + b"/h")  # the same client: its sessions' leases
        self._secure(sock)
        try:
            sock.connect(self.endpoint)
            while not self._hb_stop.wait(self._lease_renew_s):
                with self._sessions_lock:
                    ids = list(self._sessions)
                if not ids:
                    continue
                sock.send_multipart(wire.encode_request(Op.HEARTBEAT, b"hb", HeartbeatRequest(session_ids=ids)))
                while sock.poll(0):
                    sock.recv_multipart()  # replies only confirm liveness
        except zmq.ZMQError:
            return
        finally:
            sock.close(0)

    def _forget(self, session_id: str) -> None:
        with self._sessions_lock:
            self._sessions.pop(session_id, None)

    # --- lifecycle -------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        with self._sessions_lock:
            open_sessions = list(self._sessions.values())
        for sess in open_sessions:
            try:
                # best effort: a daemon that is gone must not hold the caller for the full
                # timeout (the lease releases the session anyway)
                sess.close(timeout_s=min(self.timeout_s, CLOSE_ON_EXIT_TIMEOUT_S))
            except ModeldError:
                pass
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=2)
        with self._lock:
            self._reset()
            self._closed = True
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteSession:
    """A Session living in the daemon; its id is the handle."""

    def __init__(self, client: Client, opened: OpenReply) -> None:
        self._client = client
        self.session_id: str = opened.session_id
        self.generation: int = opened.generation
        self.num_ctx: int = opened.num_ctx
        self.manifest_defaults: dict[str, str] = dict(opened.manifest)
        self.active: ActiveModel | None = opened.active
        #: the sampling a request that sets none should get on this model (``SamplingParams.fill``)
        self.sampling: SamplingParams = opened.sampling
        self._closed = False
        #: the request id of the operation in flight (a prefill or a decode), for ``cancel``
        self._running: bytes | None = None
        #: called in the calling thread right after an operation that ``cancel`` stops was sent: a caller that
        #: cancels from another thread checks here for a cancel that came before there was anything to stop
        self.on_sent: Callable[[], None] | None = None

    def manifest(self, **overrides: str) -> ContextManifest:
        """A manifest for this model from the daemon's defaults, with ``overrides`` applied."""
        return ContextManifest(**{**self.manifest_defaults, **overrides})

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosed("session is closed", session_id=self.session_id)

    def ensure_prefix(self, prefix: PrefixInput, *, on_progress: ProgressCallback | None = None) -> PrefixStatus:
        """Make the stable prefix resident; ``on_progress`` receives a cold prefill's progress while it runs."""
        self._check_open()
        req = EnsurePrefixRequest.of(self.session_id, prefix)
        return wire.decode_body(PrefixStatus, self._stoppable(Op.ENSURE_PREFIX, req, on_progress))

    def prefill_suffix(self, suffix: SuffixInput, *, on_progress: ProgressCallback | None = None) -> SuffixStatus:
        """Prefill the turn after the prefix; ``on_progress`` receives the prefill's progress while it runs."""
        self._check_open()
        req = PrefillSuffixRequest.of(self.session_id, suffix)
        return wire.decode_body(SuffixStatus, self._stoppable(Op.PREFILL_SUFFIX, req, on_progress))

    def append_image(self, data: bytes, offset: int, *, text: str = "", manifest: ContextManifest | None = None,
                     ) -> SuffixStatus:
        """Append an image (its encoded bytes), after ``text`` when given, at ``offset`` (the resident length the
        last status gave): the daemon expands it into its model's block of image tokens. The status says how
        many positions the image took (``image_tokens``) and the new length (``resident_tokens``); a model
        without an image encoder refuses it (UnsupportedFeature)."""
        return self.prefill_suffix(SuffixInput(text=text, render=False, offset=offset,
                                               images=[ImageInput(data=data, at=len(text))],
                                               manifest=manifest or self.manifest()))

    def _stoppable(self, op: Op, req: BaseModel, on_progress: ProgressCallback | None) -> Message:
        """A unary call that ``cancel`` stops (a prefill): the daemon then answers Cancelled, and keeps what the
        prefill had computed."""
        rid = self._client.send(op, req)
        self._running = rid
        try:
            if self.on_sent is not None:
                self.on_sent()
            return self._client._await(rid, None, on_progress)
        finally:
            if self._running == rid:
                self._running = None

    def count_tokens(self, prefix: PrefixInput, suffix: SuffixInput) -> TokenCount:
        """What ``prefix`` then ``suffix`` come to in tokens, and the window; nothing is prefilled."""
        self._check_open()
        req = CountTokensRequest(session_id=self.session_id, prefix=prefix, suffix=suffix)
        return self._client.request(Op.COUNT_TOKENS, req, TokenCount)

    def decode(self, cfg: DecodeConfig | None = None) -> Generator[StreamChunk, None, None]:
        """Stream chunks; abandoning the iterator (break, close, GC) cancels the decode, and so does leaving it
        unread: the daemon cancels a decode whose frames its reader has not taken for ``wire.UNREAD_STREAM_S``
        (a reader that went away without a word). Read it as it comes, or close it."""
        self._check_open()
        rid = self._client.send(Op.DECODE, DecodeRequest.of(self.session_id, cfg or DecodeConfig(), reads=True))
        self._running = rid
        if self.on_sent is not None:
            self.on_sent()
        return self._stream(rid)

    def cancel(self) -> bool:
        """Stop the operation in flight, from any thread. A decode's stream goes on to the daemon's final chunk,
        whose ``finish_reason`` is "cancelled" (or the decode's own, when it ended first); a prefill
        (``ensure_prefix``, ``prefill_suffix``) raises Cancelled, and the KV keeps the chunks it had finished,
        which the next prefill of the same text reuses. False when nothing is in flight."""
        rid = self._running
        return rid is not None and self._client._cancel(rid)

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called (the daemon may also have ended the session: calls then raise)."""
        return self._closed

    def _stream(self, rid: bytes) -> Generator[StreamChunk, None, None]:
        finished = False
        taken = reported = 0
        last_report = 0.0
        try:
            while True:
                if taken > reported:
                    # What was read is reported before the reader waits for more (or every READ_REPORT_S while
                    # frames are already here): the daemon counts a frame unread from the moment it sent it.
                    now = time.monotonic()
                    if now - last_report >= READ_REPORT_S or not self._client.waiting(rid):
                        self._client._report_read(rid, taken)
                        reported, last_report = taken, now
                msg = self._client.receive(rid)
                if msg.kind is Kind.DATA:
                    taken += 1
                if msg.kind is Kind.ERROR:
                    finished = True
                    raise wire.error_of(msg)
                if msg.kind is not Kind.DATA and msg.kind is not Kind.END:
                    finished = msg.kind is not None and msg.kind.terminal
                    raise BadFrame(f"a {msg.kind.value if msg.kind else '?'} reply inside a decode stream")
                chunk = wire.decode_body(StreamChunk, msg)
                if msg.kind is Kind.END:
                    finished = True
                    yield chunk
                    return
                yield chunk
        finally:
            if self._running == rid:
                self._running = None
            if not finished:
                self._client._abandon(rid)

    def tokenize(self, text: str, *, add_special: bool = False) -> list[int]:
        """``text`` in the model's tokens (special tokens parsed; the model's BOS first with ``add_special``)."""
        self._check_open()
        req = TokenizeRequest(session_id=self.session_id, text=text, add_special=add_special)
        return self._client.request(Op.TOKENIZE, req, TokenizeReply).tokens

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Token ids as text; InvalidArgument for an id the model does not have."""
        self._check_open()
        req = DetokenizeRequest(session_id=self.session_id, tokens=list(tokens))
        return self._client.request(Op.DETOKENIZE, req, DetokenizeReply).text

    def fork(self, at_position: int) -> RemoteSession:
        """A new session whose context is this one's first ``at_position`` tokens; this one is untouched. Both are
        this client's and hold the slot until closed. The fork's first prefill computes only what it appends, and
        switching between the two restores the other's KV from the workspace cache rather than prefilling it."""
        self._check_open()
        opened = self._client.request(Op.FORK, ForkRequest(session_id=self.session_id, at_position=at_position),
                                      OpenReply)
        return self._client._held(opened)

    def explain_context(self) -> ContextReport:
        self._check_open()
        return self._client.request(Op.EXPLAIN, SessionRef(session_id=self.session_id), ContextReport)

    def snapshot(self, include_state: bool = True) -> SessionSnapshot:
        """The session's snapshot; without ``include_state`` only its ``state_id`` (the daemon keeps the bytes)."""
        self._check_open()
        req = SnapshotRequest(session_id=self.session_id, include_state=include_state)
        return self._client.request(Op.SNAPSHOT, req, SnapshotReply).snapshot()

    def restore(self, snap: SessionSnapshot) -> None:
        """Restore ``snap``: its state bytes travel as a frame, or the daemon reads the blob of its ``state_id``."""
        self._check_open()
        self._client.request(Op.RESTORE, RestoreRequest.of(self.session_id, snap), ContextReport)

    def abandon(self) -> None:
        """Stop renewing this session's lease without closing it, as a client that hung would: the daemon
        releases the session (and the slot) when the lease runs out, and answers a later call on it as on a
        closed session (``SessionClosed``). Operations sent meanwhile still renew nothing."""
        self._client._forget(self.session_id)

    def close(self, timeout_s: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        self._client._forget(self.session_id)
        self._client.request(Op.CLOSE, SessionRef(session_id=self.session_id), CloseReply, timeout_s)
