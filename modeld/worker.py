"""The worker threads: each runs one request at a time against its model and replies through its own socket.

The model worker owns the ``SlotService`` (the model, its sessions, the lease reaper) and serves the
opens waiting for the slot; the embedding worker owns the embedding model, so embeddings run while a
decode streams. ZeroMQ sockets are not thread-safe, so a worker never touches the ROUTER: it hands
its reply frames to the IO thread over an inproc PUSH/PULL pair (``OUT_ENDPOINT``).
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import closing

import zmq

from contract import interrupt, wire
from contract.errors import Cancelled, Internal, ModeldError, ShuttingDown
from contract.types import LoadModelRequest
from contract.wire import Kind, Message, Op

from .coalesce import ChunkCoalescer
from .defaults import DEFAULT_ENGINE_NICE, DEFAULT_STREAM_INTERVAL_S
from .handlers import HANDLERS, STREAM_HANDLERS, Handlers
from .metrics import Metrics
from .priority import lower_this_thread
from .slot import SlotService
from .watchdog import Watchdog
from .workqueue import Emit, Inflight, WorkQueue

__all__ = ["DEFAULT_ENGINE_NICE", "DEFAULT_STREAM_INTERVAL_S", "OUT_ENDPOINT", "Workers"]

# (the daemon's lines keep one logger name, whichever module writes them)
log = logging.getLogger("modeld.server")

#: how long the first model worker waits at a stop for each other one to end its request before it releases the
#: model (their requests were cancelled: a decode ends within a token, a server's prefill within its reply)
LANE_STOP_S = 30.0

#: where the workers' replies go: the IO thread binds a PULL socket there, each worker connects a PUSH
OUT_ENDPOINT = "inproc://modeld-worker-out"


class Workers:
    """The model worker and the embedding worker, and the preload the model worker runs first."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        slot: SlotService,
        handlers: Handlers,
        metrics: Metrics,
        work: WorkQueue,
        watchdog: Watchdog,
        stopping: threading.Event,
        *,
        stream_interval_s: float,
        engine_nice: int,
        preload_failed: Callable[[ModeldError], None],
    ) -> None:
        self._ctx = ctx
        self.slot = slot
        self.handlers = handlers
        self.metrics = metrics
        self._work = work
        self._watchdog = watchdog
        self._stopping = stopping
        #: a decode stream sends at most one frame per this many seconds (``modeld.coalesce``)
        self.stream_interval_s = stream_interval_s
        #: the model workers run this much nicer than the IO thread (``modeld.priority``)
        self.engine_nice = engine_nice
        #: when the model worker began releasing the model at a stop (its tape saved to the workspace cache, which
        #: writes it to disk): a worker that got there saw the stop, and is not wedged however long that takes
        self.releasing_since: float | None = None
        #: the model ``serve --model`` names did not load: the daemon stops and says why
        self._preload_failed = preload_failed
        self.model_thread = threading.Thread(target=self._model_main, name="modeld-worker", daemon=True)
        #: on an engine whose models serve several sessions at once (``Backend.lanes``), a model worker more for
        #: each lane past the first: they take requests from the same queue; the first alone runs the idle work
        #: and the release at the stop
        self.lane_threads = [threading.Thread(target=self._lane_main, name=f"modeld-worker-{i}", daemon=True)
                             for i in range(1, work.workers)]
        self.embed_thread = threading.Thread(target=self._embed_main, name="modeld-embed", daemon=True)
        #: the preload queued by ``preload`` (its failure stops the daemon)
        self._preload: Inflight | None = None
        #: the preload is queued and has not answered yet: until the worker takes it, the slot itself
        #: still says Empty, and a client polling right after the start must not read "no model"
        self.preload_queued = False

    def preload(self, req: LoadModelRequest) -> None:
        """Queue a load on the model worker so status shows Loading while it runs."""
        inf = Inflight(b"", b"preload", Op.LOAD)
        self._preload = inf
        self.preload_queued = True
        self._work.model.put((inf, Message(request_id=b"preload", body=wire.to_body(req), op=Op.LOAD)))

    def start(self) -> None:
        self.model_thread.start()
        for t in self.lane_threads:
            t.start()
        self.embed_thread.start()

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for each worker to stop (``WorkQueue.stop_workers`` asks them); False: one
        is still running (wedged)."""
        self.embed_thread.join(timeout=timeout_s)
        self.model_thread.join(timeout=timeout_s)
        return not (self.model_thread.is_alive() or self.embed_thread.is_alive()
                    or any(t.is_alive() for t in self.lane_threads))

    # --- the loops -------------------------------------------------------------------------------
    def _model_main(self) -> None:
        lower_this_thread(self.engine_nice)  # before the engine creates its threads: they inherit it
        out, emit = self._emitter()
        try:
            self._serve(emit, idle=True)
        finally:
            self.releasing_since = time.monotonic()  # it saw the stop: what is left is releasing the model
            for t in self.lane_threads:  # (their requests were cancelled with the stop: each ends within a step)
                t.join(timeout=LANE_STOP_S)
            try:
                self.slot.shutdown()  # the model belongs to this thread: release it here
            except Exception:
                log.error("error while unloading at shutdown: %s", traceback.format_exc())
            out.close(0)

    def _lane_main(self) -> None:
        """A model worker past the first (``lane_threads``): requests, waiting opens and the reaper, no idle work."""
        lower_this_thread(self.engine_nice)
        out, emit = self._emitter()
        try:
            self._serve(emit, idle=False)
        finally:
            out.close(0)

    def _serve(self, emit: Emit, *, idle: bool) -> None:
        """A model worker's loop until the stop: requests, the waiting opens, the reaper when woken with nothing to
        run, and (``idle``: the first worker) the model's idle work while nothing waits."""
        while True:
            if idle:
                self._idle_work()
            item = self._work.next_model_work()
            if item is None:
                if self._stopping.is_set():
                    break
                self._watchdog.release_expired()
                self._serve_deferred(emit)
                continue
            with self._watchdog.runs(item[0]):
                self._serve_item(*item, emit)
            self._serve_deferred(emit)

    def _idle_work(self) -> None:
        """What the loaded model does while nothing waits (``LoadedModel.idle_work``: its draft costs' timing),
        stopped at its next unit of work by the next request's arrival, so a request never waits for it."""
        if self._stopping.is_set() or not self.slot.idle_pending() or not self._work.start_idle():
            return
        try:
            with interrupt.interruptible(self._work.arrived):
                self.slot.idle_work()
        except Cancelled:
            log.info("idle work (draft cost timing) stopped for a request; it runs again when the slot is idle "
                     "with nothing resident")
        except Exception:
            log.error("idle work failed: %s", traceback.format_exc())

    def _embed_main(self) -> None:
        lower_this_thread(self.engine_nice)
        out, emit = self._emitter()
        try:
            while True:
                item = self._work.embed.get()
                if item is None:
                    break
                self._serve_item(*item, emit)
        finally:
            out.close(0)

    def _emitter(self) -> tuple[zmq.Socket[bytes], Emit]:
        """A worker thread's own PUSH socket to the IO thread, and the function that replies through it."""
        out = self._ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        out.setsockopt(zmq.SNDHWM, 0)  # never drop a stream frame on the way to the IO thread
        out.connect(OUT_ENDPOINT)

        def emit(inf: Inflight, frames: list[bytes]) -> None:
            interrupt.beat()  # a reply or a chunk: the worker is alive
            if not inf.identity:  # an internal request (preload): log instead of replying
                self.preload_queued = False
                if wire.reply_kind(frames) is Kind.ERROR:
                    log.error("preload failed: %s", wire.error_of(wire.decode_reply(frames)).message)
                else:
                    log.info("preloaded the model")
                return
            out.send_multipart([inf.identity, *frames], copy=False)

        return out, emit

    def _serve_item(self, inf: Inflight, msg: Message, emit: Emit) -> None:
        if inf.answered:
            return  # the IO thread answered it (the worker was wedged while it waited)
        if self._stopping.is_set():
            emit(inf, wire.encode_error(inf.request_id, ShuttingDown("modeld is shutting down")))
        elif inf.op is Op.OPEN:
            if self._work.defer(inf, msg):
                return
            try:
                if self._work.claim(inf):
                    self._run(inf, msg, emit)
            finally:
                self._work.opened()
        elif self._work.claim(inf):
            self._run(inf, msg, emit)

    def _serve_deferred(self, emit: Emit) -> None:
        """Serve waiting opens in arrival order while the slot has room; answer the cancelled."""
        self._work.sweep_deferred(emit)
        while (p := self._work.pop_deferred()) is not None:
            # marked running like any request: an open that switches the slot (a request naming another
            # model) loads a model here, and the wedge watch and the load's progress heartbeats must see it
            try:
                with self._watchdog.runs(p.inf):
                    self._run(p.inf, p.msg, emit)
            finally:
                self._work.opened()

    # --- one request -----------------------------------------------------------------------------
    def _run(self, inf: Inflight, msg: Message, emit: Emit) -> None:
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
                    # a decode that hands out token ids sends a frame a token: each carries its one id, log
                    # probability and text, which a merged frame could not keep apart for its reader
                    per_token = bool(getattr(req, "return_token_ids", False))
                    coalescer = ChunkCoalescer(0.0 if per_token else self.stream_interval_s)
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
            stopped = ShuttingDown("modeld is shutting down; the request was stopped") if self._stopping.is_set() else exc
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

    def _check_preload(self, inf: Inflight, exc: ModeldError) -> None:
        if inf is self._preload:
            self._preload_failed(exc)
