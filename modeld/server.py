"""The daemon's socket loop: the IO thread binds the ROUTER, polls, decodes each message and sends the replies.

The IO thread owns every socket. It answers cheap requests itself (``modeld.handlers``' IO table:
status, cancel, heartbeat, explain) and posts model work to the worker threads (``modeld.worker``)
through the work queue (``modeld.workqueue``), so status is answered while a decode streams; each
round of the loop also runs the watchdog's timers (``modeld.watchdog``). A bad message gets a typed
error reply and a log line, and the daemon keeps serving. How the threads fit together, and what
the stream interval was measured to cost: docs/daemon.md.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
import traceback
from pathlib import Path
from typing import Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from contract import wire
from contract.endpoint import ipc_path
from contract.errors import FrameTooLarge, Internal, ModeldError, ShuttingDown, WireError
from contract.messages import StatusRequest
from contract.types import DaemonStatus, LoadModelRequest, SlotState
from contract.wire import Kind, Op
from runtime.wakeups import prompt_wakeups, prompt_zmq_wakeups

from .blobs import BlobStore
from .handlers import IO_HANDLERS, Handlers
from .metrics import Metrics
from .netsec import check_runtime_dir, is_default_runtime_dir
from .peers import MONITOR_EVENTS, PeerWatch
from .sdnotify import activated_fd
from .settings import ServeSettings
from .slot import SlotService
from .watchdog import EXIT_WEDGED, REAP_INTERVAL_S, Watchdog
from .worker import OUT_ENDPOINT, Workers
from .workqueue import WorkQueue

# (the watchdog's constants too; the settings' defaults are ``modeld.defaults``')
__all__ = ["EXIT_WEDGED", "REAP_INTERVAL_S", "Daemon", "DaemonSettings"]

log = logging.getLogger("modeld.server")

#: how long a stop waits for the model worker before it gives up on a wedged one
SHUTDOWN_WAIT_S = 10.0
#: how long it waits for a worker the watchdog already found wedged (it made no progress for the whole
#: wedge timeout; a cancel it has not seen by then is not seen in ten more seconds either)
WEDGED_SHUTDOWN_WAIT_S = 1.0
#: how long a stop waits for a model worker that saw it to release the model (its tape saved to the workspace
#: cache, which writes it to disk: seconds on a loaded machine with a long context)
RELEASE_WAIT_S = 120.0
#: while the workers stop, what they reply is sent on and heartbeats go out this often (their usual second at most)
SHUTDOWN_BEAT_S = 0.5
LINGER_MS = 500
SEND_HWM = 100_000


class DaemonSettings(Protocol):
    """What the daemon reads of the serve settings (``modeld.settings.ServeSettings`` is one)."""

    @property
    def wedge_timeout(self) -> float: ...  # the model worker is wedged after this long without progress

    @property
    def exit_when_wedged(self) -> bool: ...  # then exit EXIT_WEDGED for a supervisor

    @property
    def stream_interval_ms(self) -> float: ...  # a decode stream's frames at most this often (0: one a token)

    @property
    def engine_nice(self) -> int: ...  # the model's threads this much nicer than the daemon


class Daemon:
    """One daemon: its IO loop, and the work queue, watchdog and worker threads it wires together."""

    def __init__(
        self,
        slot: SlotService,
        endpoint: str,
        blobs: BlobStore,
        settings: DaemonSettings | None = None,
        *,
        curve_keys: tuple[bytes, bytes] | None = None,
    ) -> None:
        """``settings``: the serve settings' defaults when None."""
        settings = settings if settings is not None else ServeSettings.model_construct()
        self.slot = slot
        self.metrics = Metrics(slot.status)
        #: status reports the uptime from here
        self._started = time.monotonic()
        #: (public, secret) Z85 CURVE keys: the socket then speaks CURVE only (``modeld.netsec``)
        self._curve_keys = curve_keys
        self.endpoint = endpoint
        self.blobs = blobs
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        #: while ``serve`` runs: the socket pair ``stop`` writes a byte into, so that the IO thread, asleep
        #: until its next timer, stops at once
        self._wake: tuple[socket.socket, socket.socket] | None = None
        #: the connections each peer came on, and the peers whose connections all closed (the IO thread keeps it;
        #: metrics read its counts)
        self._peers = PeerWatch()
        self.metrics.watch_peers(self._peers)
        self._bound_ipc: Path | None = None
        self.ready = threading.Event()
        #: what ``modeld serve`` exits with: 1 when the model it was told to serve did not load
        self.exit_code = 0
        self.preload_error = ""
        self.work = WorkQueue(slot.full, self._stop, workers=max(1, slot.backend.lanes))
        #: the operations and the session table (``modeld.handlers``)
        self.handlers = Handlers(slot, blobs, self.metrics, self._stop, daemon_status=self._daemon_status,
                                 work=self.work)
        self.watchdog = Watchdog(slot, self.work, self.handlers, wedge_s=settings.wedge_timeout,
                                 exit_when_wedged=settings.exit_when_wedged, stop=self._stop_with)
        self.workers = Workers(self._ctx, slot, self.handlers, self.metrics, self.work, self.watchdog, self._stop,
                               stream_interval_s=settings.stream_interval_ms / 1000, engine_nice=settings.engine_nice,
                               preload_failed=self._preload_failed)

    # --- lifecycle -------------------------------------------------------------------------
    def preload(self, req: LoadModelRequest) -> None:
        """Queue a load on the worker so status shows Loading while it runs."""
        self.workers.preload(req)

    def stop(self) -> None:
        """Ask the daemon to stop; safe from signal handlers and other threads, idempotent."""
        self._stop.set()
        wake = self._wake
        if wake is not None:
            try:
                wake[1].send(b"\0")
            except OSError:
                pass  # a wake-up is already pending (the buffer is full), or serve has just closed it

    def close(self) -> None:
        """Release what a daemon that never served holds (its ZeroMQ context); ``serve`` releases its own."""
        if not self._ctx.closed:
            self._ctx.term()

    def _stop_with(self, code: int) -> None:
        self.exit_code = code
        self.stop()

    def _preload_failed(self, exc: ModeldError) -> None:
        """The model ``serve --model`` names did not load: stop with exit code 1, so a supervisor sees it."""
        self.preload_error = f"{type(exc).__name__}: {exc.message}"
        log.error("the model to serve did not load: %s", self.preload_error)
        self._stop_with(1)

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
        pull.bind(OUT_ENDPOINT)
        self.workers.start()
        # this thread and ZeroMQ's carry every message: woken, they take a core from the engine's threads at
        # once (the threads they make later start with the default slice)
        prompt_wakeups()
        prompt_zmq_wakeups()
        self.ready.set()
        log.info("modeld serving %s backend on %s", self.slot.backend.name, self.endpoint)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        wake = wake_r.fileno()
        poller.register(wake, zmq.POLLIN)  # (a plain descriptor: poll reports it by its number)

        def send(identity: bytes, frames: list[bytes]) -> bool:
            return self._send(router, identity, frames)

        self.watchdog.start(time.monotonic())
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(self._sleep_ms()))
                self.metrics.wakeups.labels(cause="event" if events else "timer").inc()
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
                self.watchdog.check(send, now)
                self.work.expire_waits(send, now)
                self.work.stop_unread(now)
                self.watchdog.heartbeats(send, now)
                self.watchdog.reap(now)
        finally:
            router.disable_monitor()
            monitor.close(0)
            self._shutdown(router, pull)

    def _sleep_ms(self) -> int:
        """How long the IO thread may sleep: until the next reap, or sooner when a heartbeat or a wait's end is due."""
        due = min(t for t in (self.watchdog.next_reap(), self.work.next_due(), self._peers.next_due()) if t is not None)
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
        self.work.cancel_all()
        self.work.wake()
        # Queued requests that never started get ShuttingDown.
        pending = self.work.take_queued()
        self.work.stop_workers()
        wait_s = WEDGED_SHUTDOWN_WAIT_S if self.watchdog.wedged else SHUTDOWN_WAIT_S
        stuck = not self._join_answering(router, pull, wait_s)
        if stuck:
            # A wedged worker holds its socket and the model: the context cannot be terminated
            # cleanly, and waiting longer helps nobody. Answer what we can and leave.
            log.error("the model worker did not stop within %.0f s (wedged); exiting without releasing it", wait_s)
            self.exit_code = self.exit_code or 1
        self._drain_out(router, pull)
        for inf in [inf for inf, _msg in pending] + self.work.clear():
            self._send(router, inf.identity, wire.encode_error(inf.request_id, ShuttingDown("modeld is shutting down")))
        pull.close(0)
        router.close(LINGER_MS)  # sockets first, then the context, or term() can hang
        if not stuck:
            self._ctx.term()  # (with a wedged worker its socket is still open: term() would hang)
        if self._bound_ipc is not None:
            self._bound_ipc.unlink(missing_ok=True)
        log.info("modeld stopped")

    def _join_answering(self, router: zmq.Socket[bytes], pull: zmq.Socket[bytes], wait_s: float) -> bool:
        """Wait up to ``wait_s`` for the workers to stop, answering meanwhile: what a worker replies (a cancelled
        prefill's ShuttingDown) goes out at once, and the requests still in flight keep their heartbeats. On a busy
        machine a worker can take seconds to stop, and a client reads seconds without a heartbeat as a daemon that
        died. False: a worker is still running (wedged)."""
        deadline = time.monotonic() + wait_s

        def send(identity: bytes, frames: list[bytes]) -> bool:
            return self._send(router, identity, frames)

        while True:
            if self.workers.join(min(SHUTDOWN_BEAT_S, max(0.0, deadline - time.monotonic()))):
                return True
            self._drain_out(router, pull)
            self.watchdog.heartbeats(send, time.monotonic())
            releasing = self.workers.releasing_since
            if releasing is not None:  # (it saw the stop and saves what it computed: a slow disk is not a wedge)
                deadline = max(deadline, releasing + RELEASE_WAIT_S)
            if time.monotonic() >= deadline:
                return False

    # --- IO thread ---------------------------------------------------------------------------
    def _send(self, router: zmq.Socket[bytes], identity: bytes, frames: list[bytes]) -> bool:
        try:
            router.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as exc:
            # EHOSTUNREACH: the peer is gone (ROUTER_MANDATORY). EAGAIN: it stopped reading.
            if exc.errno in (errno.EHOSTUNREACH, zmq.EAGAIN):
                why = "its socket is gone" if exc.errno == errno.EHOSTUNREACH else "it stopped reading its replies"
                self.work.cancel_peer(wire.peer_key(identity), why)
                return False
            raise

    def _peer_vanished(self, peer: bytes) -> None:
        """Every connection of ``peer`` closed (its process is gone): its requests are cancelled and the
        session it holds is released as soon as the worker is free, not at the end of its lease."""
        self.work.cancel_peer(peer, "its connections all closed")
        held = self.handlers.sessions_of(peer)
        if any(self.slot.vanished(sid) for sid in held):
            log.info("a client's connections closed: releasing its session without waiting for its lease")
            self.work.wake()  # the worker reaps it

    def _drain_out(self, router: zmq.Socket[bytes], pull: zmq.Socket[bytes]) -> None:
        """Send on what the workers replied; a terminal reply ends its request, a stream's frame counts as a heartbeat."""
        while True:
            try:
                frames = pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, rest = frames[0], frames[1:]
            kind = wire.reply_kind(rest)
            if kind is not None and kind.terminal:
                self.work.finished(identity, rest[2])
            elif kind is Kind.DATA:
                self.work.heard(identity, rest[2])
            self._send(router, identity, rest)

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
                reply = answer(self.handlers, identity, req)
                if reply is not None:  # (a stream's read report is not answered)
                    self._send(router, identity, wire.encode_reply(Kind.OK, rid, reply))
                    self.metrics.request(msg.op.value)
            else:
                if self._stop.is_set():
                    raise ShuttingDown("modeld is shutting down")
                if msg.op is Op.RESTORE and msg.payloads:
                    self._check_state_size(len(msg.payloads[0]))
                self.work.post(identity, msg.op, msg)
        except ModeldError as exc:
            self._send(router, identity, wire.encode_error(rid, exc))
        except Exception as exc:  # never let one request take the IO loop down
            log.error("internal error on %s: %s", msg.op, traceback.format_exc())
            self._send(router, identity, wire.encode_error(rid, Internal(f"{type(exc).__name__}: {exc}")))

    # --- what only the daemon knows, for the handlers -------------------------------------------------
    def _daemon_status(self, st: DaemonStatus) -> DaemonStatus:
        if self.workers.preload_queued and st.state is SlotState.EMPTY:
            st.state, st.busy_operation = SlotState.LOADING, st.busy_operation or Op.LOAD.value
        st.uptime_s = round(time.monotonic() - self._started, 1)
        stalled = self.watchdog.stalled_s()
        st.worker_stalled_s = round(stalled, 1) if stalled >= 1.0 else None
        st.wedged = self.watchdog.wedged
        st.waiting = self.work.waiting()
        return st



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
