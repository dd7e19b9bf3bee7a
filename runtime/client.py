"""The runtime client: the contract's Service, Session and ModelController over ZeroMQ.

A coding agent imports this (``runtime.Client``); it needs only pyzmq, msgpack
and pydantic. Every call has a timeout: a receive waits behind ``poll``, a
heartbeat frame from a daemon that is still working pushes the deadline out,
and silence past it raises ``DaemonTimeout`` (or ``Unavailable`` when nothing
has ever answered). After a timeout the socket is closed with LINGER=0 and a
fresh one is connected; nothing is resent automatically, since a decode or a
prefill must never run twice behind the caller's back.

A background thread renews the lease of open sessions, so an agent that thinks
for a while between turns keeps its slot, while a client that dies loses it
after the daemon's lease time.
"""

from __future__ import annotations

import itertools
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Generator
from typing import Any

import zmq

from contract import wire
from contract.endpoint import default_endpoint, ipc_path
from contract.errors import DaemonTimeout, ModeldError, SessionClosed, Unavailable, from_wire
from contract.manifest import ContextManifest
from contract.types import (
    ActiveModel,
    ContextReport,
    DaemonStatus,
    DecodeConfig,
    EmbedRequest,
    EmbedResult,
    LoadModelRequest,
    ModelInfo,
    OpenSessionRequest,
    PrefixInput,
    PrefixStatus,
    SessionSnapshot,
    StreamChunk,
    SuffixInput,
    SuffixStatus,
    UnloadModelRequest,
)
from contract.wire import Kind, Message, Op

DEFAULT_TIMEOUT_S = 60.0
LEASE_RENEW_INTERVAL_S = 5.0
#: how long Client.close() waits for each still-open session to close (then the lease does it)
CLOSE_ON_EXIT_TIMEOUT_S = 2.0


class Client:
    """Service + ModelController over ZeroMQ. Safe to share between threads."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        owner: str = "",
        lease_renew_s: float = LEASE_RENEW_INTERVAL_S,
    ) -> None:
        self.endpoint = endpoint or default_endpoint()
        self.timeout_s = timeout_s
        self.owner = owner
        self._lease_renew_s = lease_renew_s
        self._ctx = zmq.Context()
        self._lock = threading.RLock()
        self._sock: zmq.Socket[bytes] | None = None
        self._buffers: dict[bytes, deque[Message]] = {}
        self._abandoned: set[bytes] = set()
        self._ids = itertools.count(1)
        self._prefix = os.urandom(4)
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
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            s.connect(self.endpoint)
            self._sock = s
        return self._sock

    def _no_daemon(self) -> str:
        return f"no daemon at {self.endpoint} — is `modeld serve` running?"

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._buffers.clear()
        self._abandoned.clear()

    def _send(self, op: Op, body: dict[str, Any], payloads: list[bytes] | None = None) -> bytes:
        rid = self._prefix + next(self._ids).to_bytes(8, "big")
        with self._lock:
            sock = self._socket()
            sock.send_multipart(wire.encode_request(op, rid, body, payloads), copy=False)
            self._buffers[rid] = deque()
        return rid

    def _recv(self, rid: bytes, timeout_s: float | None = None) -> Message:
        """Next message for ``rid``; heartbeats extend the deadline and are not returned."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                buf = self._buffers.get(rid)
                if buf:
                    msg = buf.popleft()
                    if msg.kind is Kind.HEARTBEAT:
                        deadline = time.monotonic() + timeout
                        continue
                    if msg.kind in (Kind.OK, Kind.END, Kind.ERROR):
                        self._buffers.pop(rid, None)
                    return msg
                sock = self._socket()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    answered = self._answered
                    self._reset()
                    if not answered:
                        raise Unavailable(self._no_daemon(), endpoint=self.endpoint)
                    raise DaemonTimeout(f"no reply from {self.endpoint} within {timeout:.1f}s", endpoint=self.endpoint)
                if not sock.poll(int(min(remaining, 0.25) * 1000) + 1, zmq.POLLIN):
                    continue
                frames = sock.recv_multipart()
                try:
                    msg = wire.decode_reply(frames)
                except ModeldError:
                    continue  # a garbled reply cannot be matched to a request; drop it
                self._answered = True
                if msg.request_id in self._abandoned:
                    if msg.kind in (Kind.OK, Kind.END, Kind.ERROR):
                        self._abandoned.discard(msg.request_id)
                    continue
                if msg.request_id in self._buffers:
                    self._buffers[msg.request_id].append(msg)

    def _call(self, op: Op, body: dict[str, Any], payloads: list[bytes] | None = None, timeout_s: float | None = None) -> Message:
        rid = self._send(op, body, payloads)
        try:
            msg = self._recv(rid, timeout_s)
        except ModeldError:
            raise
        except BaseException:
            # Ctrl-C (or any interrupt) while waiting: tell the daemon to stop the work,
            # e.g. a long cold prefill, instead of finishing it for nobody.
            self._abandon(rid)
            raise
        if msg.kind is Kind.ERROR:
            raise from_wire(msg.body)
        return msg

    def _abandon(self, rid: bytes) -> None:
        with self._lock:
            if rid in self._buffers:
                self._buffers.pop(rid, None)
                self._abandoned.add(rid)
                if self._sock is not None:
                    self._sock.send_multipart(wire.encode_request(Op.CANCEL, rid + b"c", {"request_id": rid}))
                    self._abandoned.add(rid + b"c")

    # --- ModelController ---------------------------------------------------------------------
    def status(self, timeout_s: float | None = None) -> DaemonStatus:
        return DaemonStatus.model_validate(self._call(Op.STATUS, {}, timeout_s=timeout_s).body)

    def load_model(self, req: LoadModelRequest) -> ActiveModel:
        req = self._fenced(req)
        return ActiveModel.model_validate(self._call(Op.LOAD, wire.to_body(req)).body)

    def unload_model(self, req: UnloadModelRequest | None = None) -> None:
        req = self._fenced(req or UnloadModelRequest())
        self._call(Op.UNLOAD, wire.to_body(req))

    # --- Service ---------------------------------------------------------------------------------
    def describe(self, req: OpenSessionRequest) -> ModelInfo:
        return ModelInfo.model_validate(self._call(Op.DESCRIBE, wire.to_body(self._fenced(req))).body)

    def embed(self, req: EmbedRequest) -> EmbedResult:
        msg = self._call(Op.EMBED, wire.to_body(self._fenced(req)))
        dims, count = int(msg.body.get("dims", 0)), int(msg.body.get("count", 0))
        data = msg.payloads[0] if msg.payloads else b""
        if len(data) != 4 * dims * count:
            raise from_wire({"code": 60, "message": f"embedding payload of {len(data)} bytes for {count}x{dims} floats"})
        flat = struct.unpack(f"<{dims * count}f", data)
        vectors = [list(flat[i * dims : (i + 1) * dims]) for i in range(count)]
        return EmbedResult(
            vector=vectors[0] if vectors and not req.texts else [],
            vectors=vectors,
            dims=dims,
            model_name=str(msg.body.get("model_name", "")),
            digest=str(msg.body.get("digest", "")),
            tokens=list(msg.body.get("tokens") or []),
            truncated=list(msg.body.get("truncated") or []),
        )

    def open_session(self, req: OpenSessionRequest) -> RemoteSession:
        body = self._call(Op.OPEN, wire.to_body(self._fenced(req))).body
        sess = RemoteSession(self, body)
        with self._lock:
            self._sessions[sess.session_id] = sess
        self._ensure_heartbeat()
        return sess

    def _fenced(self, req: Any) -> Any:
        if self.owner and not req.owner_instance_id:
            return req.model_copy(update={"owner_instance_id": self.owner})
        return req

    # --- leases ------------------------------------------------------------------------------------
    def _ensure_heartbeat(self) -> None:
        if self._hb_thread is None or not self._hb_thread.is_alive():
            self._hb_thread = threading.Thread(target=self._heartbeat_main, name="modeld-lease", daemon=True)
            self._hb_thread.start()

    def _heartbeat_main(self) -> None:
        # Its own socket: ZeroMQ sockets must not be shared between threads.
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.endpoint)
            while not self._hb_stop.wait(self._lease_renew_s):
                with self._lock:
                    ids = list(self._sessions)
                if not ids:
                    continue
                sock.send_multipart(wire.encode_request(Op.HEARTBEAT, b"hb", {"session_ids": ids}))
                while sock.poll(0):
                    sock.recv_multipart()  # replies only confirm liveness
        except zmq.ZMQError:
            return
        finally:
            sock.close(0)

    def _forget(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    # --- lifecycle -------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        for sess in list(self._sessions.values()):
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

    def __init__(self, client: Client, open_reply: dict[str, Any]) -> None:
        self._client = client
        self.session_id: str = open_reply["session_id"]
        self.generation: int = int(open_reply.get("generation", 0))
        self.num_ctx: int = int(open_reply.get("num_ctx", 0))
        self.manifest_defaults: dict[str, str] = dict(open_reply.get("manifest") or {})
        active = open_reply.get("active")
        self.active = ActiveModel.model_validate(active) if active else None
        self._closed = False

    def manifest(self, **overrides: str) -> ContextManifest:
        """A manifest for this model from the daemon's defaults, with ``overrides`` applied."""
        return ContextManifest(**{**self.manifest_defaults, **overrides})

    def _body(self, extra: dict[str, Any]) -> dict[str, Any]:
        if self._closed:
            raise SessionClosed("session is closed", session_id=self.session_id)
        return {"session_id": self.session_id, **extra}

    def ensure_prefix(self, prefix: PrefixInput) -> PrefixStatus:
        msg = self._client._call(Op.ENSURE_PREFIX, self._body(wire.to_body(prefix)))
        return PrefixStatus.model_validate(msg.body)

    def prefill_suffix(self, suffix: SuffixInput) -> SuffixStatus:
        msg = self._client._call(Op.PREFILL_SUFFIX, self._body(wire.to_body(suffix)))
        return SuffixStatus.model_validate(msg.body)

    def decode(self, cfg: DecodeConfig | None = None) -> Generator[StreamChunk, None, None]:
        """Stream chunks; abandoning the iterator (break, close, GC) cancels the decode."""
        rid = self._client._send(Op.DECODE, self._body(wire.to_body(cfg or DecodeConfig())))
        return self._stream(rid)

    def _stream(self, rid: bytes) -> Generator[StreamChunk, None, None]:
        finished = False
        try:
            while True:
                msg = self._client._recv(rid)
                if msg.kind is Kind.ERROR:
                    finished = True
                    raise from_wire(msg.body)
                chunk = StreamChunk.model_validate(msg.body)
                if msg.kind is Kind.END:
                    finished = True
                    yield chunk
                    return
                yield chunk
        finally:
            if not finished:
                self._client._abandon(rid)

    def explain_context(self) -> ContextReport:
        return ContextReport.model_validate(self._client._call(Op.EXPLAIN, self._body({})).body)

    def snapshot(self, include_state: bool = True) -> SessionSnapshot:
        msg = self._client._call(Op.SNAPSHOT, self._body({"include_state": include_state}))
        body = {k: v for k, v in msg.body.items() if k != "state_bytes"}
        snap = SessionSnapshot.model_validate(body)
        if msg.payloads:
            snap = snap.model_copy(update={"state": msg.payloads[0]})
        return snap

    def restore(self, snap: SessionSnapshot) -> None:
        payloads = [snap.state] if snap.state else []
        self._client._call(Op.RESTORE, self._body({"snapshot": wire.to_body(snap, exclude={"state"})}), payloads)

    def close(self, timeout_s: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        self._client._forget(self.session_id)
        self._client._call(Op.CLOSE, {"session_id": self.session_id}, timeout_s=timeout_s)
