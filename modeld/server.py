"""The daemon's socket layer: one ROUTER, one IO thread, one model worker thread.

* The IO thread owns every socket. It decodes each message's small raw frames,
  answers cheap requests itself (status, cancel, heartbeat, explain) and queues
  model work for the worker. Because the IO thread never waits on the model,
  status is answered while a decode streams.
* The worker thread owns the model: it runs one operation at a time against the
  ``SlotService`` and hands reply frames back to the IO thread over an inproc
  PUSH/PULL pair (ZeroMQ sockets are not thread-safe, so the worker never
  touches the ROUTER).
* A bad message gets a typed error reply and a log line; the daemon keeps
  serving. ROUTER_MANDATORY makes a send to a vanished client fail instead of
  being dropped silently, which cancels that client's stream; a session it held
  is released when its lease runs out.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import struct
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from contract import interrupt, wire
from contract.endpoint import ipc_path
from contract.errors import (
    Cancelled,
    Internal,
    InvalidArgument,
    ModeldError,
    SessionClosed,
    ShuttingDown,
    WireError,
)
from contract.types import (
    DecodeConfig,
    EmbedRequest,
    LoadModelRequest,
    OpenSessionRequest,
    PrefixInput,
    SessionSnapshot,
    StreamChunk,
    SuffixInput,
    UnloadModelRequest,
)
from contract.wire import Kind, Message, Op

from .blobs import BlobStore
from .slot import SlotService, SlotSession

log = logging.getLogger("modeld.server")

POLL_INTERVAL_MS = 50
REAP_INTERVAL_S = 0.5
LINGER_MS = 500
SEND_HWM = 100_000

_OUT_ENDPOINT = "inproc://modeld-worker-out"


@dataclass
class _Inflight:
    identity: bytes
    request_id: bytes
    op: Op
    cancel: threading.Event = field(default_factory=threading.Event)
    last_hb: float = field(default_factory=time.monotonic)


def _session_id(body: dict[str, Any]) -> str:
    sid = body.get("session_id")
    if not isinstance(sid, str) or not sid:
        raise InvalidArgument("session_id (a non-empty string) is required")
    return sid


class Daemon:
    def __init__(self, slot: SlotService, endpoint: str, blobs: BlobStore) -> None:
        self.slot = slot
        self.endpoint = endpoint
        self.blobs = blobs
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._work: queue.Queue[tuple[_Inflight, Message] | None] = queue.Queue()
        # Embeddings have their own thread and model, so they run while a decode streams.
        self._embed_work: queue.Queue[tuple[_Inflight, Message] | None] = queue.Queue()
        self._inflight: dict[tuple[bytes, bytes], _Inflight] = {}
        self._inflight_lock = threading.Lock()
        self._sessions: dict[str, SlotSession] = {}
        self._worker = threading.Thread(target=self._worker_main, name="modeld-worker", daemon=True)
        self._embed_worker = threading.Thread(target=self._embed_main, name="modeld-embed", daemon=True)
        self._bound_ipc: Path | None = None
        self.ready = threading.Event()

    # --- lifecycle -------------------------------------------------------------------------
    def preload(self, req: LoadModelRequest) -> None:
        """Queue a load on the worker so status shows Loading while it runs."""
        inf = _Inflight(b"", b"preload", Op.LOAD)
        self._work.put((inf, Message(request_id=b"preload", body=wire.to_body(req), op=Op.LOAD)))

    def stop(self) -> None:
        """Ask the daemon to stop; safe from signal handlers and other threads, idempotent."""
        self._stop.set()

    def serve(self) -> None:
        router = self._bind()
        pull = self._ctx.socket(zmq.PULL)
        pull.bind(_OUT_ENDPOINT)
        self._worker.start()
        self._embed_worker.start()
        self.ready.set()
        log.info("modeld serving %s backend on %s", self.slot.backend.name, self.endpoint)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        last_reap = time.monotonic()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(POLL_INTERVAL_MS))
                if pull in events:
                    self._drain_out(router, pull)
                if router in events:
                    for _ in range(100):  # bounded batch so worker output is not starved
                        try:
                            frames = router.recv_multipart(zmq.NOBLOCK, copy=True)
                        except zmq.Again:
                            break
                        self._on_message(router, frames)
                now = time.monotonic()
                self._heartbeats(router, now)
                if now - last_reap > REAP_INTERVAL_S:
                    last_reap = now
                    self._work.put(None)  # a wake-up: the worker reaps expired leases
        finally:
            self._shutdown(router, pull)

    def _bind(self) -> zmq.Socket[bytes]:
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.LINGER, LINGER_MS)
        router.setsockopt(zmq.SNDHWM, SEND_HWM)
        router.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_PART_BYTES)
        path = ipc_path(self.endpoint)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            if path.exists():
                if _answers(self._ctx, self.endpoint):
                    router.close(0)
                    raise RuntimeError(f"another modeld is already serving {self.endpoint}")
                path.unlink()  # stale socket file from a daemon that died
        router.bind(self.endpoint)
        if path is not None:
            os.chmod(path, 0o600)
            self._bound_ipc = path
        return router

    def _shutdown(self, router: zmq.Socket[bytes], pull: zmq.Socket[bytes]) -> None:
        log.info("modeld shutting down")
        with self._inflight_lock:
            for inf in self._inflight.values():
                inf.cancel.set()
        self._work.put(None)
        # Queued requests that never started get ShuttingDown.
        pending: list[tuple[_Inflight, Message]] = []
        while True:
            try:
                item = self._work.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                pending.append(item)
        self._work.put(None)
        self._embed_work.put(None)
        self._embed_worker.join(timeout=30)
        self._worker.join(timeout=30)
        self._drain_out(router, pull)
        for inf, _msg in pending:
            self._send(router, inf.identity, wire.encode_error(inf.request_id, ShuttingDown("modeld is shutting down")))
        with self._inflight_lock:
            leftovers = list(self._inflight.values())
            self._inflight.clear()
        for inf in leftovers:
            self._send(router, inf.identity, wire.encode_error(inf.request_id, ShuttingDown("modeld is shutting down")))
        pull.close(0)
        router.close(LINGER_MS)  # sockets first, then the context, or term() can hang
        self._ctx.term()
        if self._bound_ipc is not None:
            self._bound_ipc.unlink(missing_ok=True)
        log.info("modeld stopped")

    # --- IO thread ---------------------------------------------------------------------------
    def _send(self, router: zmq.Socket[bytes], identity: bytes, frames: list[bytes]) -> bool:
        try:
            router.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as exc:
            # EHOSTUNREACH: the peer is gone (ROUTER_MANDATORY). EAGAIN: it stopped reading.
            if exc.errno in (errno.EHOSTUNREACH, zmq.EAGAIN):
                self._peer_gone(identity)
                return False
            raise

    def _peer_gone(self, identity: bytes) -> None:
        with self._inflight_lock:
            for (ident, _rid), inf in self._inflight.items():
                if ident == identity:
                    inf.cancel.set()

    def _drain_out(self, router: zmq.Socket[bytes], pull: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, rest = frames[0], frames[1:]
            kind = rest[1]
            if kind in (b"ok", b"end", b"error"):
                with self._inflight_lock:
                    self._inflight.pop((identity, rest[2]), None)
            self._send(router, identity, rest)

    def _heartbeats(self, router: zmq.Socket[bytes], now: float) -> None:
        with self._inflight_lock:
            due = [inf for inf in self._inflight.values() if now - inf.last_hb >= wire.HEARTBEAT_INTERVAL_S]
        for inf in due:
            inf.last_hb = now
            self._send(router, inf.identity, wire.encode_reply(Kind.HEARTBEAT, inf.request_id))

    def _on_message(self, router: zmq.Socket[bytes], frames: list[bytes]) -> None:
        if len(frames) < 2:
            return  # not even an identity and one frame: nothing to answer to
        identity, rest = frames[0], frames[1:]
        try:
            msg = wire.decode_request(rest)
        except WireError as exc:
            log.warning("rejected a bad message: %s", exc.message)
            self._send(router, identity, wire.encode_error(wire.request_id_of(rest), exc))
            return
        rid = msg.request_id
        try:
            assert msg.op is not None
            if msg.op is Op.STATUS:
                self._send(router, identity, wire.encode_reply(Kind.OK, rid, wire.to_body(self.slot.status())))
            elif msg.op is Op.CANCEL:
                target = msg.body.get("request_id")
                if not isinstance(target, bytes):
                    raise InvalidArgument("cancel needs request_id (bytes)")
                with self._inflight_lock:
                    inf = self._inflight.get((identity, target))
                if inf is not None:
                    inf.cancel.set()
                self._send(router, identity, wire.encode_reply(Kind.OK, rid, {"cancelled": inf is not None}))
            elif msg.op is Op.HEARTBEAT:
                ids = msg.body.get("session_ids", [])
                if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                    raise InvalidArgument("heartbeat needs session_ids (a list of strings)")
                alive = [sid for sid in ids if self.slot.touch(sid)]
                self._send(router, identity, wire.encode_reply(Kind.OK, rid, {"alive": alive}))
            elif msg.op is Op.EXPLAIN:
                sess = self._sessions.get(_session_id(msg.body))
                if sess is None:
                    raise SessionClosed("unknown or closed session")
                self._send(router, identity, wire.encode_reply(Kind.OK, rid, wire.to_body(sess.explain_context())))
            else:
                if self._stop.is_set():
                    raise ShuttingDown("modeld is shutting down")
                key = (identity, rid)
                with self._inflight_lock:
                    if key in self._inflight:
                        raise InvalidArgument("a request with this id is already running")
                    inf = self._inflight[key] = _Inflight(identity, rid, msg.op)
                (self._embed_work if msg.op is Op.EMBED else self._work).put((inf, msg))
        except ModeldError as exc:
            self._send(router, identity, wire.encode_error(rid, exc))
        except Exception as exc:  # never let one request take the IO loop down
            log.error("internal error on %s: %s", msg.op, traceback.format_exc())
            self._send(router, identity, wire.encode_error(rid, Internal(f"{type(exc).__name__}: {exc}")))

    # --- worker thread ---------------------------------------------------------------------------
    def _worker_main(self) -> None:
        out, emit = self._emitter()
        try:
            while True:
                try:
                    item = self._work.get(timeout=REAP_INTERVAL_S)
                except queue.Empty:
                    item = None
                if item is None:
                    if self._stop.is_set():
                        break
                    self._reap()
                    continue
                self._serve_item(*item, emit)
        finally:
            try:
                self.slot.shutdown()  # the model belongs to this thread: release it here
            except Exception:
                log.error("error while unloading at shutdown: %s", traceback.format_exc())
            out.close(0)

    def _embed_main(self) -> None:
        out, emit = self._emitter()
        try:
            while True:
                item = self._embed_work.get()
                if item is None:
                    break
                self._serve_item(*item, emit)
        finally:
            out.close(0)

    def _emitter(self) -> tuple[zmq.Socket[bytes], _Emit]:
        """A worker thread's own PUSH socket to the IO thread, and the function that replies through it."""
        out = self._ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        out.setsockopt(zmq.SNDHWM, 0)  # never drop a stream frame on the way to the IO thread
        out.connect(_OUT_ENDPOINT)

        def emit(inf: _Inflight, frames: list[bytes]) -> None:
            if not inf.identity:  # an internal request (preload): log instead of replying
                if frames[1] == b"error":
                    log.error("preload failed: %s", wire.unpack(frames[3]).get("message"))
                else:
                    log.info("preloaded the model")
                return
            out.send_multipart([inf.identity, *frames], copy=False)

        return out, emit

    def _serve_item(self, inf: _Inflight, msg: Message, emit: _Emit) -> None:
        if self._stop.is_set():
            emit(inf, wire.encode_error(inf.request_id, ShuttingDown("modeld is shutting down")))
        else:
            self._run(inf, msg, emit)

    def _reap(self) -> None:
        if self.slot.reap():
            log.info("released a session whose lease expired")
        live = self.slot.holder_id()
        for sid in [s for s in self._sessions if s != live]:
            del self._sessions[sid]

    def _run(self, inf: _Inflight, msg: Message, emit: Callable[[_Inflight, list[bytes]], None]) -> None:
        rid = inf.request_id
        try:
            handler = _HANDLERS[inf.op]
            # a cancel, a vanished client or shutdown stops a long prefill between engine steps
            with interrupt.interruptible(inf.cancel):
                handler(self, inf, msg, emit)
        except Cancelled as exc:
            stopped = ShuttingDown("modeld is shutting down; the request was stopped") if self._stop.is_set() else exc
            emit(inf, wire.encode_error(rid, stopped))
        except ModeldError as exc:
            emit(inf, wire.encode_error(rid, exc))
        except Exception as exc:
            log.error("internal error on %s: %s", inf.op.value, traceback.format_exc())
            emit(inf, wire.encode_error(rid, Internal(f"{type(exc).__name__}: {exc}")))

    def _session(self, body: dict[str, Any]) -> SlotSession:
        sid = _session_id(body)
        sess = self._sessions.get(sid)
        if sess is None:
            raise SessionClosed("unknown or closed session", session_id=sid)
        return sess

    # --- handlers (worker thread) -------------------------------------------------------------------
    def _h_load(self, inf: _Inflight, msg: Message, emit: _Emit) -> None:
        active = self.slot.load_model(wire.parse(LoadModelRequest, msg.body))
        emit(inf, wire.encode_reply(Kind.OK, inf.request_id, wire.to_body(active)))

    def _h_unload(self, inf: _Inflight, msg: Message, emit: _Emit) -> None:
        self.slot.unload_model(wire.parse(UnloadModelRequest, msg.body))
        emit(inf, wire.encode_reply(Kind.OK, inf.request_id, {"generation": self.slot.generation}))

    def _h_describe(self, inf: _Inflight, msg: Message, emit: _Emit) -> None:
        info = self.slot.describe(wire.parse(OpenSessionRequest, msg.body))
        emit(inf, wire.encode_reply(Kind.OK, inf.request_id, wire.to_body(info)))

    def _h_embed(self, inf: _Inflight, msg: Message, emit: _Emit) -> None:
        req = wire.parse(EmbedRequest, msg.body)
        res = self.slot.embed(req)
        vectors = res.vectors or ([res.vector] if res.vector else [])
        dims = len(vectors[0]) if vectors else 0
        if any(len(v) != dims for v in vectors):
            raise Internal("backend returned vectors of different sizes")
        payload = struct.pack(f"<{dims * len(vectors)}f", *(x for v in vectors for x in v))
        body = {
            "dims": dims,
            "count": len(vectors),
            "model_name": res.model_name,
            "digest": res.digest,
            "tokens": res.tokens,
            "truncated": res.truncated,
        }
        emit(inf, wire.encode_reply(Kind.OK, inf.request_id, body, [payload]))

    def _h_open(self, inf: _Inflight, msg: Message, emit: _Emit) -> None:
        sess = self.slot.open_session(wire.parse(OpenSessionRequest, msg.body))
        self._sessions[sess.session_id] = sess
        status = self.slot.status()
        body = {
            "session_id": sess.session_id,
            "generation": sess.generation,
            "num_ctx": sess.num_ctx,
            "manifest": self.slot.manifest_defaults().identity(),
            "active": wire.to_body(status.active) if status.active else None,
        }
        emit(inf, wire.encode_reply(Kind.OK, inf.request_id, body))

    def _h_ensure_prefix(self, inf: _Inflight, msg: Message, emit: _Emit) -> None:
        prefix = wire.parse(PrefixInput, _without(msg.body, "session_id"))
        sess = self._session(msg.body)
        emit(inf, wire.encode_reply(Kind.OK, inf.request_id, wire.to_body(sess.ensure_prefix(prefix))))

    def _h_prefill_suffix(self, inf: _Inflight, msg: Message, emit: _Emit) -> None:
        suffix = wire.parse(SuffixInput, _without(msg.body, "session_id"))
        sess = self._session(msg.body)
        emit(inf, wire.encode_reply(Kind.OK, inf.request_id, wire.to_body(sess.prefill_suffix(suffix))))

    def _h_decode(self, inf: _Inflight, msg: Message, emit: _Emit) -> None:
        cfg = wire.parse(DecodeConfig, _without(msg.body, "session_id"))
        sess = self._session(msg.body)
        stream = sess.decode(cfg)
        final: StreamChunk | None = None
        try:
            for chunk in stream:
                if inf.cancel.is_set():
                    break
                if chunk.done:
                    final = chunk
                    break
                emit(inf, wire.encode_reply(Kind.DATA, inf.request_id, wire.to_body(chunk, exclude={"usage"})))
        finally:
            stream.close()  # cancels the backend within one token when we stopped early
        if final is None:
            if self._stop.is_set():
                raise ShuttingDown("modeld is shutting down; the stream was ended")
            final = StreamChunk(done=True, finish_reason="cancelled")
            if not inf.cancel.is_set():
                raise Cancelled("the stream ended without a final chunk")
        emit(inf, wire.encode_reply(Kind.END, inf.request_id, wire.to_body(final)))

    def _h_snapshot(self, inf: _Inflight, msg: Message, emit: _Emit) -> None:
        sess = self._session(msg.body)
        snap = sess.snapshot()
        state_id = self.blobs.put(snap.state)
        body = wire.to_body(snap, exclude={"state"})
        body["state_id"] = state_id
        body["state_bytes"] = len(snap.state)
        payloads = [snap.state] if msg.body.get("include_state") is True else []
        emit(inf, wire.encode_reply(Kind.OK, inf.request_id, body, payloads))

    def _h_restore(self, inf: _Inflight, msg: Message, emit: _Emit) -> None:
        sess = self._session(msg.body)
        raw = msg.body.get("snapshot")
        if not isinstance(raw, dict):
            raise InvalidArgument("restore needs snapshot (a map)")
        snap = wire.parse(SessionSnapshot, {k: v for k, v in raw.items() if k not in ("state", "state_bytes")})
        if msg.payloads:
            state = msg.payloads[0]
        elif snap.state_id:
            state = self.blobs.get(snap.state_id)
        else:
            raise InvalidArgument("restore needs the state bytes as a payload frame or a state_id")
        sess.restore(snap.model_copy(update={"state": state}))
        emit(inf, wire.encode_reply(Kind.OK, inf.request_id, wire.to_body(sess.explain_context())))

    def _h_close(self, inf: _Inflight, msg: Message, emit: _Emit) -> None:
        sid = _session_id(msg.body)
        sess = self._sessions.pop(sid, None)
        if sess is not None:
            sess.close()
        emit(inf, wire.encode_reply(Kind.OK, inf.request_id, {"closed": sess is not None}))


_Emit = Callable[[_Inflight, list[bytes]], None]

_HANDLERS: dict[Op, Callable[[Daemon, _Inflight, Message, _Emit], None]] = {
    Op.LOAD: Daemon._h_load,
    Op.UNLOAD: Daemon._h_unload,
    Op.DESCRIBE: Daemon._h_describe,
    Op.EMBED: Daemon._h_embed,
    Op.OPEN: Daemon._h_open,
    Op.ENSURE_PREFIX: Daemon._h_ensure_prefix,
    Op.PREFILL_SUFFIX: Daemon._h_prefill_suffix,
    Op.DECODE: Daemon._h_decode,
    Op.SNAPSHOT: Daemon._h_snapshot,
    Op.RESTORE: Daemon._h_restore,
    Op.CLOSE: Daemon._h_close,
}


def _without(body: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in keys}


def _answers(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> bool:
    """Whether a daemon answers a status request at ``endpoint`` (stale socket-file check)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart(wire.encode_request(Op.STATUS, b"probe", {}))
        return bool(sock.poll(500, zmq.POLLIN))
    finally:
        sock.close(0)
