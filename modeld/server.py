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
* An open_session that finds the slot held may wait for it (its
  ``queue_timeout_s``): the worker keeps such opens in arrival order and serves
  the first whenever the slot comes free, answering ModelBusy only when a
  request's own timeout runs out.

What each operation does, and the session table, are in ``modeld.handlers``;
this module moves messages: decoding, queueing, the worker loops, replies,
heartbeats, the wedge watch and the shutdown. It is over the house's ~400
lines because the IO loop, the worker loop and the slot queue share the
in-flight table and the shutdown sequence.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import socket
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.utils.monitor import recv_monitor_message

from contract import interrupt, wire
from contract.endpoint import ipc_path
from contract.errors import (
    Cancelled,
    EngineUnresponsive,
    FrameTooLarge,
    Internal,
    InvalidArgument,
    ModelBusy,
    ModeldError,
    ShuttingDown,
    WireError,
)
from contract.messages import (
    StatusRequest,
)
from contract.types import (
    DaemonStatus,
    Heartbeat,
    LoadModelRequest,
    OpenSessionRequest,
    Progress,
    SlotState,
)
from contract.wire import Kind, Message, Op

from .blobs import BlobStore
from .coalesce import ChunkCoalescer
from .handlers import HANDLERS, IO_HANDLERS, STREAM_HANDLERS, Handlers
from .metrics import Metrics
from .netsec import check_runtime_dir, is_default_runtime_dir
from .peers import MONITOR_EVENTS, PeerWatch
from .priority import lower_this_thread
from .sdnotify import activated_fd
from .slot import SlotService

log = logging.getLogger("modeld.server")

#: the IO thread wakes at least this often for its timers (lease reaping, the wedge watch); otherwise it
#: sleeps until a frame, a heartbeat that is due or a stop wakes it: an idle daemon wakes twice a second
REAP_INTERVAL_S = 0.5
#: a model worker that shows no progress (``interrupt.beat``) for this long is wedged; well above any
#: legitimate step (a prefill chunk, a graph node, a decoded token; a load reports progress too)
DEFAULT_WEDGE_S = 120.0
#: how long a stop waits for the model worker before it gives up on a wedged one
SHUTDOWN_WAIT_S = 10.0
#: a decode stream's frames at most this often (``modeld.coalesce``): on 2 cores at ~100 tokens/s a frame
#: per token cost llama.cpp ~5% of its decode speed, and a frame per 20 ms still cost OpenVINO (bf16) ~3.5%;
#: at 50 ms both are within ~1% of in process, and 20 updates a second still read as a smooth stream
DEFAULT_STREAM_INTERVAL_S = 0.050
#: how much nicer the model workers (and the engine threads they start) run than the IO thread
DEFAULT_ENGINE_NICE = 10
#: the exit status when ``--exit-when-wedged`` stops a daemon whose worker is wedged
EXIT_WEDGED = 3
#: how often the worker looks at waiting opens (cancelled, or the slot free) while any wait
PARKED_POLL_S = 0.05
LINGER_MS = 500
SEND_HWM = 100_000

_OUT_ENDPOINT = "inproc://modeld-worker-out"


@dataclass
class _Parked:
    """An open_session waiting for the slot (see ``Daemon._serve_parked``)."""

    inf: _Inflight
    msg: Message


@dataclass
class _Inflight:
    identity: bytes
    request_id: bytes
    op: Op
    cancel: threading.Event = field(default_factory=threading.Event)
    last_hb: float = field(default_factory=time.monotonic)
    #: the IO thread already gave it its terminal answer (the worker must not run it)
    answered: bool = False
    #: an open's queue timeout, as a monotonic deadline: the IO thread answers ModelBusy there if the
    #: worker has not started it, whatever the worker is busy with
    queue_deadline: float | None = None
    #: the worker took it to run (set under the inflight lock, as ``answered`` is)
    started: bool = False


class Daemon:
    def __init__(
        self,
        slot: SlotService,
        endpoint: str,
        blobs: BlobStore,
        *,
        curve_keys: tuple[bytes, bytes] | None = None,
        wedge_s: float = DEFAULT_WEDGE_S,
        exit_when_wedged: bool = False,
        stream_interval_s: float = DEFAULT_STREAM_INTERVAL_S,
        engine_nice: int = DEFAULT_ENGINE_NICE,
    ) -> None:
        self.slot = slot
        #: a decode stream sends at most one frame per this many seconds (``modeld.coalesce``)
        self.stream_interval_s = stream_interval_s
        #: the model workers run this much nicer than the IO thread (``modeld.priority``)
        self.engine_nice = engine_nice
        self.metrics = Metrics(slot.status)
        #: status reports the uptime from here
        self._started = time.monotonic()
        #: the model worker is reported wedged after this long without progress
        self.wedge_s = wedge_s
        self.exit_when_wedged = exit_when_wedged
        #: the request the model worker runs now, and since when (IO thread reads them)
        self._running: _Inflight | None = None
        self._running_since = 0.0
        self._wedged = False
        #: (public, secret) Z85 CURVE keys: the socket then speaks CURVE only (``modeld.netsec``)
        self._curve_keys = curve_keys
        self.endpoint = endpoint
        self.blobs = blobs
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        #: while ``serve`` runs: the socket pair ``stop`` writes a byte into, so that the IO thread, asleep
        #: until its next timer, stops at once
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._work: queue.Queue[tuple[_Inflight, Message] | None] = queue.Queue()
        # Embeddings have their own thread and model, so they run while a decode streams.
        self._embed_work: queue.Queue[tuple[_Inflight, Message] | None] = queue.Queue()
        self._inflight: dict[tuple[bytes, bytes], _Inflight] = {}
        self._inflight_lock = threading.Lock()
        #: the connections each peer came on, and the peers whose connections all closed (IO thread only)
        self._peers = PeerWatch()
        #: opens waiting for the slot, oldest first (worker thread only)
        self._parked: deque[_Parked] = deque()
        self._worker = threading.Thread(target=self._worker_main, name="modeld-worker", daemon=True)
        self._embed_worker = threading.Thread(target=self._embed_main, name="modeld-embed", daemon=True)
        self._bound_ipc: Path | None = None
        self.ready = threading.Event()
        #: the preload queued by ``preload`` (its failure stops the daemon)
        self._preload: _Inflight | None = None
        #: the preload is queued and has not answered yet: until the worker takes it, the slot itself
        #: still says Empty, and a client polling right after the start must not read "no model"
        self._preload_queued = False
        #: what ``modeld serve`` exits with: 1 when the model it was told to serve did not load
        self.exit_code = 0
        self.preload_error = ""
        #: the operations and the session table (``modeld.handlers``)
        self.handlers = Handlers(slot, blobs, self.metrics, self._stop, daemon_status=self._daemon_status,
                                 cancel_event=self._cancel_event)

    # --- lifecycle -------------------------------------------------------------------------
    def preload(self, req: LoadModelRequest) -> None:
        """Queue a load on the worker so status shows Loading while it runs."""
        inf = _Inflight(b"", b"preload", Op.LOAD)
        self._preload = inf
        self._preload_queued = True
        self._work.put((inf, Message(request_id=b"preload", body=wire.to_body(req), op=Op.LOAD)))

    def stop(self) -> None:
        """Ask the daemon to stop; safe from signal handlers and other threads, idempotent."""
        self._stop.set()
        wake = self._wake
        if wake is not None:
            try:
                wake[1].send(b"\0")
            except OSError:
                pass  # a wake-up is already pending (the buffer is full), or serve has just closed it

    def serve(self) -> None:
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        self._wake = (wake_r, wake_w)
        try:
            self._serve(wake_r)
        finally:
            self._wake = None
            wake_r.close()
            wake_w.close()

    def _serve(self, wake_r: socket.socket) -> None:
        router = self._bind()
        monitor = router.get_monitor_socket(MONITOR_EVENTS)
        pull = self._ctx.socket(zmq.PULL)
        pull.bind(_OUT_ENDPOINT)
        self._worker.start()
        self._embed_worker.start()
        self.ready.set()
        log.info("modeld serving %s backend on %s", self.slot.backend.name, self.endpoint)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        wake = wake_r.fileno()
        poller.register(wake, zmq.POLLIN)  # (a plain descriptor: poll reports it by its number)
        last_reap = time.monotonic()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(self._sleep_ms(last_reap)))
                if wake in events:
                    _drain(wake_r)
                if pull in events:
                    self._drain_out(router, pull)
                if monitor in events:  # (before any message: see modeld.peers on reused descriptors)
                    self._peers.events(_monitor_batch(monitor), time.monotonic())
                if router in events:
                    for _ in range(100):  # bounded batch so worker output is not starved
                        try:
                            parts = router.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        frames = [f.bytes for f in parts]
                        self._peers.seen(frames[0], _source_fd(parts[0]))
                        self._on_message(router, frames)
                now = time.monotonic()
                for peer in self._peers.gone(now):
                    self._peer_vanished(peer)
                self._watch_worker(router, now)
                self._expire_waits(router, now)
                self._heartbeats(router, now)
                if now - last_reap > REAP_INTERVAL_S:
                    last_reap = now
                    self._stop_silent_holder()
                    self._work.put(None)  # a wake-up: the worker reaps expired leases
        finally:
            router.disable_monitor()
            monitor.close(0)
            self._shutdown(router, pull)

    def _sleep_ms(self, last_reap: float) -> int:
        """How long the IO thread may sleep: until the next reap, or sooner when a heartbeat or a wait's end is due."""
        due = last_reap + REAP_INTERVAL_S
        with self._inflight_lock:
            if self._inflight:
                due = min(due, min(inf.last_hb for inf in self._inflight.values()) + wire.HEARTBEAT_INTERVAL_S)
                waits = [inf.queue_deadline for inf in self._inflight.values()
                         if inf.queue_deadline is not None and not inf.started]
                if waits:
                    due = min(due, min(waits))
        gone = self._peers.next_due()
        if gone is not None:
            due = min(due, gone)
        # (+1: poll rounds down to whole milliseconds, and waking a hair early only loops once more)
        return max(0, int((due - time.monotonic()) * 1000) + 1)

    def _bind(self) -> zmq.Socket[bytes]:
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # a client that reconnects (after a timeout) keeps its routing id, and so its sessions
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        router.setsockopt(zmq.LINGER, LINGER_MS)
        router.setsockopt(zmq.SNDHWM, SEND_HWM)
        router.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_PART_BYTES)
        if self._curve_keys is not None:
            router.curve_server = True
            router.curve_publickey, router.curve_secretkey = self._curve_keys
        fd = activated_fd()
        if fd is not None:
            # systemd socket activation: the listening socket is already bound (its unit owns
            # the file and its mode); ZeroMQ takes it over instead of binding a new one
            router.setsockopt(zmq.USE_FD, fd)
            router.bind(self.endpoint)
            log.info("serving the socket systemd passed (fd %d) as %s", fd, self.endpoint)
            return router
        path = ipc_path(self.endpoint)
        if path is not None:
            if is_default_runtime_dir(path.parent):
                check_runtime_dir(path.parent)  # 0700 and ours, or a clear refusal
            else:
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
        self._embed_worker.join(timeout=SHUTDOWN_WAIT_S)
        self._worker.join(timeout=SHUTDOWN_WAIT_S)
        stuck = self._worker.is_alive() or self._embed_worker.is_alive()
        if stuck:
            # A wedged worker holds its socket and the model: the context cannot be terminated
            # cleanly, and waiting longer helps nobody. Answer what we can and leave.
            log.error("the model worker did not stop within %.0f s (wedged); exiting without releasing it",
                      SHUTDOWN_WAIT_S)
            self.exit_code = self.exit_code or 1
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
        if not stuck:
            self._ctx.term()  # (with a wedged worker its socket is still open: term() would hang)
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

    def _stop_silent_holder(self) -> None:
        """A holder whose lease ran out mid-operation (a stopped client: its decode streams into a full
        queue) gets that operation cancelled, so the worker is free to reap it within a token."""
        sid = self.slot.expired_holder()
        peer = self.handlers.session_peers.get(sid) if sid else None
        if peer is not None:
            self._cancel_peer(peer)

    def _peer_gone(self, identity: bytes) -> None:
        self._cancel_peer(wire.peer_key(identity))

    def _peer_vanished(self, peer: bytes) -> None:
        """Every connection of ``peer`` closed (its process is gone): its requests are cancelled and the
        session it holds is released as soon as the worker is free, not at the end of its lease."""
        self._cancel_peer(peer)
        held = self.handlers.sessions_of(peer)
        if any(self.slot.vanished(sid) for sid in held):
            log.info("a client's connections closed: releasing its session without waiting for its lease")
            self._work.put(None)  # a wake-up: the worker reaps it

    def _cancel_peer(self, peer: bytes) -> None:
        """Cancel every running or queued request of one client (``wire.peer_key``)."""
        with self._inflight_lock:
            for (ident, _rid), inf in self._inflight.items():
                if wire.peer_key(ident) == peer:
                    inf.cancel.set()

    def _drain_out(self, router: zmq.Socket[bytes], pull: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, rest = frames[0], frames[1:]
            kind = wire.reply_kind(rest)
            if kind is not None and kind.terminal:
                with self._inflight_lock:
                    self._inflight.pop((identity, rest[2]), None)
            elif kind is Kind.DATA:
                # a stream's frame tells its client the daemon is alive as well as a heartbeat
                # would: the next heartbeat is due a full interval after it, not while data flows
                with self._inflight_lock:
                    inf = self._inflight.get((identity, rest[2]))
                    if inf is not None:
                        inf.last_hb = time.monotonic()
            self._send(router, identity, rest)

    def stalled_s(self, now: float | None = None) -> float:
        """Seconds the model worker has been running one request without progress (0 when idle)."""
        running = self._running
        if running is None:
            return 0.0
        now = time.monotonic() if now is None else now
        return max(0.0, now - max(self._running_since, interrupt.last_beat()))

    @staticmethod
    def _queue_deadline(msg: Message) -> float | None:
        """When an open stops waiting for the slot (None: it does not wait, or its body does not parse,
        which the worker answers)."""
        try:
            req = wire.decode_body(OpenSessionRequest, msg)
        except ModeldError:
            return None
        return time.monotonic() + req.queue_timeout_s if req.queue_timeout_s > 0 else None

    def _expire_waits(self, router: zmq.Socket[bytes], now: float) -> None:
        """Opens still waiting at their queue deadline get ModelBusy from here, whether they wait in the
        worker's queue behind a running decode or parked for the slot: a timeout is the caller's, not the
        worker's to notice when it next looks."""
        with self._inflight_lock:
            expired = [inf for inf in self._inflight.values() if inf.queue_deadline is not None
                       and now >= inf.queue_deadline and not inf.started and not inf.answered]
            waiting = sum(1 for inf in self._inflight.values() if inf.op is Op.OPEN and not inf.started)
            for inf in expired:
                inf.answered = True
                self._inflight.pop((inf.identity, inf.request_id), None)
        for inf in expired:
            self._send(router, inf.identity, wire.encode_error(inf.request_id, ModelBusy(
                "the slot stayed busy for the whole queue timeout", holder_busy=True, waiting=waiting)))

    def _claim(self, inf: _Inflight) -> bool:
        """The worker takes ``inf`` to run: False when the IO thread answered it already."""
        with self._inflight_lock:
            if inf.answered:
                return False
            inf.started = True
            return True

    def _watch_worker(self, router: zmq.Socket[bytes], now: float) -> None:
        """Liveness in tiers: the IO thread answers, and it watches that the model worker progresses.

        A worker stalled past ``wedge_s`` is wedged: status says so, the running
        request and every request waiting for the worker get EngineUnresponsive
        naming the stuck operation (their clients stop waiting), and with
        ``exit_when_wedged`` the daemon stops with EXIT_WEDGED for a supervisor
        to restart it.
        """
        stalled = self.stalled_s(now)
        running = self._running
        if stalled < self.wedge_s or running is None:
            if self._wedged:
                log.warning("the model worker is making progress again")
                self._wedged = False
            return
        if not self._wedged:
            self._wedged = True
            log.error("the model worker has made no progress for %.0f s in %s; it is wedged", stalled, running.op.value)
            if self.exit_when_wedged:
                self.exit_code = EXIT_WEDGED
                self.stop()
        err = EngineUnresponsive(
            f"the model worker has made no progress for {stalled:.0f} s in {running.op.value}; "
            f"restart the daemon (or serve with --exit-when-wedged under a supervisor)",
            operation=running.op.value,
            stalled_s=round(stalled, 1),
        )
        with self._inflight_lock:
            stuck = [inf for inf in self._inflight.values() if inf.op is not Op.EMBED and not inf.answered]
            for inf in stuck:
                inf.answered = True
                inf.cancel.set()
                self._inflight.pop((inf.identity, inf.request_id), None)
        for inf in stuck:
            self._send(router, inf.identity, wire.encode_error(inf.request_id, err))

    def _check_state_size(self, size: int) -> None:
        """Refuse state bytes larger than the loaded model's whole resident size before they are queued.

        A snapshot holds at most the model's KV (and a few logits rows), so more than
        the model's weights and KV together (at least ``MAX_BODY_BYTES``) is not a state
        of this model; the frame is dropped here instead of being held until the worker
        reaches it.
        """
        loaded = self.slot.generation_resident_bytes()
        # never below a body's own limit: a model too small to say (the reference) still takes states
        limit = max(loaded, wire.MAX_BODY_BYTES)
        if loaded and size > limit:
            raise FrameTooLarge(
                f"restore state of {size} bytes exceeds the loaded model's {limit} bytes (weights and KV)",
                limit=limit,
            )

    def _heartbeats(self, router: zmq.Socket[bytes], now: float) -> None:
        with self._inflight_lock:
            due = [inf for inf in self._inflight.values() if now - inf.last_hb >= wire.HEARTBEAT_INTERVAL_S]
        running = self._running
        # only the request the model worker runs has progress; a waiting one gets an empty heartbeat
        progress = self._progress() if any(inf is running for inf in due) else None
        for inf in due:
            inf.last_hb = now
            body = Heartbeat(progress=progress) if progress is not None and inf is running else None
            self._send(router, inf.identity, wire.encode_reply(Kind.HEARTBEAT, inf.request_id, body))

    def _progress(self) -> Progress | None:
        """The running request's progress: its prefill's (``interrupt.prefilling``), else the model load's."""
        prefill = interrupt.prefill_progress()
        if prefill is not None:
            done, total = prefill
            return Progress(stage="prefill", done=done, total=total, fraction=min(1.0, done / total) if total else 0.0)
        load = self.slot.load_progress
        if load is not None:
            return Progress(stage="load", fraction=load)
        return None

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
            answer = IO_HANDLERS.get(msg.op)
            if answer is not None:
                req = wire.decode_body(wire.SCHEMAS[msg.op].request, msg)
                self._send(router, identity, wire.encode_reply(Kind.OK, rid, answer(self.handlers, identity, req)))
                self.metrics.request(msg.op.value)
            else:
                if self._stop.is_set():
                    raise ShuttingDown("modeld is shutting down")
                if msg.op is Op.RESTORE and msg.payloads:
                    self._check_state_size(len(msg.payloads[0]))
                key = (identity, rid)
                with self._inflight_lock:
                    if key in self._inflight:
                        raise InvalidArgument("a request with this id is already running")
                    inf = self._inflight[key] = _Inflight(identity, rid, msg.op)
                if msg.op is Op.OPEN:
                    inf.queue_deadline = self._queue_deadline(msg)
                (self._embed_work if msg.op is Op.EMBED else self._work).put((inf, msg))
        except ModeldError as exc:
            self._send(router, identity, wire.encode_error(rid, exc))
        except Exception as exc:  # never let one request take the IO loop down
            log.error("internal error on %s: %s", msg.op, traceback.format_exc())
            self._send(router, identity, wire.encode_error(rid, Internal(f"{type(exc).__name__}: {exc}")))

    # --- worker thread ---------------------------------------------------------------------------
    def _worker_main(self) -> None:
        lower_this_thread(self.engine_nice)  # before the engine creates its threads: they inherit it
        out, emit = self._emitter()
        try:
            while True:
                try:
                    # (unparked, it sleeps until work comes: the IO thread wakes it every REAP_INTERVAL_S)
                    item = self._work.get(timeout=PARKED_POLL_S if self._parked else None)
                except queue.Empty:
                    item = None
                if item is None:
                    if self._stop.is_set():
                        break
                    self._reap()
                    self._serve_parked(emit)
                    continue
                self._running, self._running_since = item[0], time.monotonic()
                try:
                    self._serve_item(*item, emit)
                finally:
                    self._running = None
                self._serve_parked(emit)
        finally:
            try:
                self.slot.shutdown()  # the model belongs to this thread: release it here
            except Exception:
                log.error("error while unloading at shutdown: %s", traceback.format_exc())
            out.close(0)

    def _embed_main(self) -> None:
        lower_this_thread(self.engine_nice)
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
            interrupt.beat()  # a reply or a chunk: the worker is alive
            if not inf.identity:  # an internal request (preload): log instead of replying
                self._preload_queued = False
                if wire.reply_kind(frames) is Kind.ERROR:
                    log.error("preload failed: %s", wire.error_of(wire.decode_reply(frames)).message)
                else:
                    log.info("preloaded the model")
                return
            out.send_multipart([inf.identity, *frames], copy=False)

        return out, emit

    def _serve_item(self, inf: _Inflight, msg: Message, emit: _Emit) -> None:
        if inf.answered:
            return  # the IO thread answered it (the worker was wedged while it waited)
        if self._stop.is_set():
            emit(inf, wire.encode_error(inf.request_id, ShuttingDown("modeld is shutting down")))
        elif inf.op is Op.OPEN and self._park(inf, msg):
            return
        elif self._claim(inf):
            self._run(inf, msg, emit)

    # --- the queue for the slot ----------------------------------------------------------------
    def _park(self, inf: _Inflight, msg: Message) -> bool:
        """Queue an open that would find the slot busy (or others already waiting); False: run it now.

        A request that does not parse, or asks for no waiting (no ``queue_deadline``: the IO thread
        read its body at arrival), runs now and gets its answer (InvalidArgument, or ModelBusy at once).
        """
        if inf.queue_deadline is None or (not self._parked and not self.slot.holder_id()):
            return False
        self._parked.append(_Parked(inf, msg))
        return True

    def _serve_parked(self, emit: _Emit) -> None:
        """Serve waiting opens in arrival order while the slot is free; answer the cancelled.

        An open that still finds the slot busy stays first in line. Waiting
        requests get heartbeats from the IO thread like any running request, and
        ModelBusy from it when their queue timeout runs out (``_expire_waits``).
        """
        keep: deque[_Parked] = deque()
        for p in self._parked:
            if p.inf.answered:
                continue  # the IO thread answered it at its deadline
            if self._stop.is_set():
                emit(p.inf, wire.encode_error(p.inf.request_id, ShuttingDown("modeld is shutting down")))
            elif p.inf.cancel.is_set():
                emit(p.inf, wire.encode_error(p.inf.request_id, Cancelled("the wait for the slot was cancelled")))
            else:
                keep.append(p)
        self._parked = keep
        while self._parked and not self.slot.holder_id() and not self._stop.is_set():
            p = self._parked.popleft()
            if self._claim(p.inf):
                self._run(p.inf, p.msg, emit)

    def _reap(self) -> None:
        if self.slot.reap():
            log.info("released a session whose lease expired")
        self.handlers.prune()

    def _run(self, inf: _Inflight, msg: Message, emit: _Emit) -> None:
        """Decode the request, run its handler, and emit what it answers: the one place replies are encoded."""
        rid = inf.request_id
        self.handlers.caller.peer = wire.peer_key(inf.identity)
        try:
            # a cancel, a vanished client or shutdown stops a long prefill between engine steps
            with interrupt.interruptible(inf.cancel):
                req = wire.decode_body(wire.SCHEMAS[inf.op].request, msg)
                stream = STREAM_HANDLERS.get(inf.op)
                # metrics are counted before the last reply goes out: a client that reads them
                # after its answer sees its request in them
                if stream is not None:
                    coalescer = ChunkCoalescer(self.stream_interval_s)
                    try:
                        with closing(stream(self.handlers, inf.cancel, req)) as chunks:
                            for chunk in chunks:
                                if chunk.done:
                                    self.metrics.reply(getattr(req, "session_id", ""), chunk)
                                    self.metrics.request(inf.op.value)
                                for out in coalescer.push(chunk):
                                    emit(inf, wire.encode_chunk(rid, out))
                    finally:
                        for out in coalescer.flush():  # text held back goes out before any error reply
                            emit(inf, wire.encode_chunk(rid, out))
                else:
                    reply = HANDLERS[inf.op](self.handlers, req)
                    self.metrics.reply(getattr(req, "session_id", ""), reply)
                    self.metrics.request(inf.op.value)
                    emit(inf, wire.encode_reply(Kind.OK, rid, reply))
        except Cancelled as exc:
            stopped = ShuttingDown("modeld is shutting down; the request was stopped") if self._stop.is_set() else exc
            self.metrics.request(inf.op.value, type(stopped).__name__)
            emit(inf, wire.encode_error(rid, stopped))
        except ModeldError as exc:
            self._check_preload(inf, exc)
            self.metrics.request(inf.op.value, type(exc).__name__)
            emit(inf, wire.encode_error(rid, exc))
        except Exception as exc:
            log.error("internal error on %s: %s", inf.op.value, traceback.format_exc())
            err = Internal(f"{type(exc).__name__}: {exc}")
            self._check_preload(inf, err)
            self.metrics.request(inf.op.value, "Internal")
            emit(inf, wire.encode_error(rid, err))

    def _check_preload(self, inf: _Inflight, exc: ModeldError) -> None:
        """The model ``serve --model`` names did not load: stop with exit code 1, so a supervisor sees it."""
        if inf is self._preload:
            self.preload_error = f"{type(exc).__name__}: {exc.message}"
            log.error("the model to serve did not load: %s", self.preload_error)
            self.exit_code = 1
            self.stop()

    # --- what only the daemon knows, for the handlers -------------------------------------------------
    def _daemon_status(self, st: DaemonStatus) -> DaemonStatus:
        if self._preload_queued and st.state is SlotState.EMPTY:
            st.state, st.busy_operation = SlotState.LOADING, st.busy_operation or Op.LOAD.value
        st.uptime_s = round(time.monotonic() - self._started, 1)
        stalled = self.stalled_s()
        st.worker_stalled_s = round(stalled, 1) if stalled >= 1.0 else None
        st.wedged = self._wedged
        return st

    def _cancel_event(self, identity: bytes, request_id: bytes) -> threading.Event | None:
        with self._inflight_lock:
            inf = self._inflight.get((identity, request_id))
        return inf.cancel if inf is not None else None

    def _io_status(self, identity: bytes, req: StatusRequest) -> DaemonStatus:
        """Status as the IO thread answers it (also for a daemon that never served)."""
        return self.handlers.status(identity, req)


_Emit = Callable[[_Inflight, list[bytes]], None]


def _source_fd(frame: zmq.Frame) -> int:
    """The descriptor of the connection a message came on (-1 where the transport does not say)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except zmq.ZMQError:
        return -1


def _monitor_batch(monitor: zmq.Socket[bytes]) -> list[tuple[int, int]]:
    """Every monitor event waiting, as ``(event, descriptor)``, in order."""
    batch: list[tuple[int, int]] = []
    while True:
        try:
            msg = recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return batch
        batch.append((int(msg["event"]), int(msg["value"])))


def _drain(sock: socket.socket) -> None:
    """Read a non-blocking socket until it is empty."""
    try:
        while sock.recv(64):
            pass
    except BlockingIOError:
        pass


def _answers(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> bool:
    """Whether a daemon answers a status request at ``endpoint`` (stale socket-file check)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart(wire.encode_request(Op.STATUS, b"probe", StatusRequest()))
        return bool(sock.poll(500, zmq.POLLIN))
    finally:
        sock.close(0)
