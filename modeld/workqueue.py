"""The work queue: the requests in flight, the queues that feed the worker threads, and the opens waiting for the slot.

Shaped like llama.cpp server's task queue: the IO thread posts a request, a worker claims it and runs
it; an open that finds the slot held is deferred (``defer``) and served in arrival order once the slot
is free (``pop_deferred``). The in-flight table is shared by both threads under one lock: the IO
thread answers what a worker has not started (an open at its queue deadline, every waiter of a wedged
worker), and a worker runs only what it claimed first, so each request gets one terminal answer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from contract import wire
from contract.errors import Cancelled, InvalidArgument, ModelBusy, ModeldError, ShuttingDown
from contract.types import OpenSessionRequest
from contract.wire import Message, Op

__all__ = ["PARKED_POLL_S", "Emit", "Inflight", "Parked", "Send", "WorkQueue", "queue_deadline"]

#: how often the worker looks at waiting opens (cancelled, or the slot free) while any wait
PARKED_POLL_S = 0.05


@dataclass
class Inflight:
    """A request the daemon has taken and not yet answered for good."""

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
    #: an open's request, read from its body when it was taken (None: another op, or a body that does not parse)
    open_request: OpenSessionRequest | None = None
    #: a decode whose client reports the frames it reads (``DecodeRequest.reads``)
    reads: bool = False
    #: of such a stream: when each frame sent and not yet reported read went out, oldest first
    unread: deque[float] = field(default_factory=deque)
    #: data frames sent, and of them reported read; when the reader last took one
    sent: int = 0
    read: int = 0
    read_at: float = 0.0

    def unread_since(self) -> float | None:
        """Since when nobody has read this stream: the later of its oldest unread frame's send and the reader's last
        take (a slow reader that keeps taking frames is reading); None when nothing waits to be read."""
        return max(self.unread[0], self.read_at) if self.unread else None


@dataclass
class Parked:
    """An open_session waiting for the slot (see ``WorkQueue.defer``)."""

    inf: Inflight
    msg: Message


#: a worker's reply to one request: its frames, without the client's identity
Emit = Callable[[Inflight, list[bytes]], None]
#: the IO thread's send to a client: its identity and the reply's frames (False: the client is gone)
Send = Callable[[bytes, list[bytes]], bool]

_Item = tuple[Inflight, Message]

# (the daemon's lines keep one logger name, whichever module writes them)
log = logging.getLogger("modeld.server")


def _open_request(msg: Message) -> OpenSessionRequest | None:
    """An open's request, None when its body does not parse (which the worker answers)."""
    try:
        return wire.decode_body(OpenSessionRequest, msg)
    except ModeldError:
        return None


def queue_deadline(req: OpenSessionRequest | None) -> float | None:
    """When an open stops waiting for the slot (None: it does not wait, or its body does not parse)."""
    if req is None:
        return None
    return time.monotonic() + req.queue_timeout_s if req.queue_timeout_s > 0 else None


class WorkQueue:
    """The in-flight table, the model worker's and the embedding worker's queues, and the deferred opens."""

    def __init__(self, full: Callable[[int, OpenSessionRequest | None], bool], stopping: threading.Event, *,
                 workers: int = 1) -> None:
        #: whether the slot takes no more sessions now, with so many opens on their way to it, for this open
        #: (``SlotService.full``: one that switches the model waits for every session to close): a deferred open
        #: waits while it does
        self._full = full
        self._stopping = stopping
        #: how many model workers take from ``model`` (``Workers``: one a lane of the engine's models)
        self.workers = workers
        #: the model worker's requests; a None only wakes it (to reap, to look at deferred opens, to stop)
        self.model: queue.Queue[_Item | None] = queue.Queue()
        # Embeddings have their own thread and model, so they run while a decode streams.
        self.embed: queue.Queue[_Item | None] = queue.Queue()
        self._inflight: dict[tuple[bytes, bytes], Inflight] = {}
        self._lock = threading.Lock()
        #: opens waiting for the slot, oldest first (the model workers', under ``_parked_lock``)
        self._parked: deque[Parked] = deque()
        self._parked_lock = threading.Lock()
        #: opens a model worker took to run and has not finished (``defer`` said run, ``pop_deferred`` handed one
        #: out; ``opened`` ends each): another worker counts them taken, so two never race for the last lane
        self._opening = 0
        #: set by every request for the model worker (and by shutdown): it stops the worker's idle work
        self.arrived = threading.Event()

    # --- the IO thread ---------------------------------------------------------------------------
    def post(self, identity: bytes, op: Op, msg: Message) -> Inflight:
        """Take a request for a worker: into the in-flight table, then onto its worker's queue."""
        key = (identity, msg.request_id)
        with self._lock:
            if key in self._inflight:
                raise InvalidArgument("a request with this id is already running")
            inf = self._inflight[key] = Inflight(identity, msg.request_id, op)
        if op is Op.OPEN:
            inf.open_request = _open_request(msg)  # (read once: the deadline, and each look at the slot's room)
            inf.queue_deadline = queue_deadline(inf.open_request)
        elif op is Op.DECODE:
            inf.reads = msg.body.get("reads") is True  # (a body that does not parse is the worker's to answer)
        (self.embed if op is Op.EMBED else self.model).put((inf, msg))
        if op is not Op.EMBED:
            self.arrived.set()
        return inf

    def wake(self) -> None:
        """Wake the model worker with nothing to run: it reaps expired leases and looks at the deferred opens."""
        self.model.put(None)

    def stop_workers(self) -> None:
        """Wake every worker to stop (a None each: a model worker stops on it once stopping is set)."""
        for _ in range(self.workers):
            self.model.put(None)
        self.embed.put(None)
        self.arrived.set()

    def cancel_event(self, identity: bytes, request_id: bytes) -> threading.Event | None:
        with self._lock:
            inf = self._inflight.get((identity, request_id))
        return inf.cancel if inf is not None else None

    def cancel_peer(self, peer: bytes, why: str) -> None:
        """Cancel every running or queued request of one client (``wire.peer_key``); the log says ``why``, so a
        request the daemon ended of its own accord can be told from one its client cancelled."""
        with self._lock:
            hit = [inf for (ident, _rid), inf in self._inflight.items()
                   if wire.peer_key(ident) == peer and not inf.cancel.is_set()]
            for inf in hit:
                inf.cancel.set()
        if hit:
            log.info("cancelled %s of a client: %s", ", ".join(inf.op.value for inf in hit), why)

    def cancel_all(self) -> None:
        with self._lock:
            for inf in self._inflight.values():
                inf.cancel.set()

    def finished(self, identity: bytes, request_id: bytes) -> None:
        """Its terminal reply went out: the request leaves the table."""
        with self._lock:
            self._inflight.pop((identity, request_id), None)

    def heard(self, identity: bytes, request_id: bytes) -> None:
        """A stream's frame went out: it tells its client the daemon is alive as well as a heartbeat would (the
        next heartbeat is due a full interval after it, not while data flows), and it waits to be read."""
        with self._lock:
            inf = self._inflight.get((identity, request_id))
            if inf is not None:
                inf.last_hb = time.monotonic()
                inf.sent += 1
                if inf.reads:
                    inf.unread.append(inf.last_hb)

    def read(self, identity: bytes, request_id: bytes, frames: int) -> None:
        """The reader of a stream took its first ``frames`` frames (a report of fewer than before changes nothing)."""
        with self._lock:
            inf = self._inflight.get((identity, request_id))
            if inf is None:
                return
            if frames > inf.read:
                inf.read_at = time.monotonic()
            while inf.read < min(frames, inf.sent) and inf.unread:
                inf.unread.popleft()
                inf.read += 1

    def stop_unread(self, now: float) -> None:
        """Cancel each stream whose reader took none of the frames waiting for it for ``wire.UNREAD_STREAM_S``: it
        stopped reading, which is a reader gone (a route that went away, whose own cancel was lost); the decode
        ends within a step."""
        with self._lock:
            stale = [inf for inf in self._inflight.values() if (since := inf.unread_since()) is not None
                     and not inf.cancel.is_set() and now - since >= wire.UNREAD_STREAM_S]
            for inf in stale:
                inf.cancel.set()
        for inf in stale:
            log.info("cancelled a decode of a client: it left %d of %d frames unread for %.0f s (nobody reads it)",
                     inf.sent - inf.read, inf.sent, wire.UNREAD_STREAM_S)

    def due_heartbeats(self, now: float) -> list[Inflight]:
        with self._lock:
            return [inf for inf in self._inflight.values() if now - inf.last_hb >= wire.HEARTBEAT_INTERVAL_S]

    def next_due(self) -> float | None:
        """The next heartbeat or wait's end due (None: nothing in flight)."""
        with self._lock:
            if not self._inflight:
                return None
            due = min(inf.last_hb for inf in self._inflight.values()) + wire.HEARTBEAT_INTERVAL_S
            waits = [inf.queue_deadline for inf in self._inflight.values()
                     if inf.queue_deadline is not None and not inf.started]
            waits += [since + wire.UNREAD_STREAM_S for inf in self._inflight.values()
                      if (since := inf.unread_since()) is not None and not inf.cancel.is_set()]
        return min(due, min(waits)) if waits else due

    def expire_waits(self, send: Send, now: float) -> None:
        """Opens still waiting at their queue deadline get ModelBusy from here, whether they wait in the
        worker's queue behind a running decode or parked for the slot: a timeout is the caller's, not the
        worker's to notice when it next looks."""
        with self._lock:
            expired = [inf for inf in self._inflight.values() if inf.queue_deadline is not None
                       and now >= inf.queue_deadline and not inf.started and not inf.answered]
            waiting = sum(1 for inf in self._inflight.values() if inf.op is Op.OPEN and not inf.started)
            for inf in expired:
                inf.answered = True
                self._inflight.pop((inf.identity, inf.request_id), None)
        for inf in expired:
            send(inf.identity, wire.encode_error(inf.request_id, ModelBusy(
                "the slot stayed busy for the whole queue timeout", holder_busy=True, waiting=waiting)))

    def waiting(self) -> int:
        """Opens waiting for the slot: taken, not yet run by the worker, not yet answered."""
        with self._lock:
            return sum(1 for inf in self._inflight.values()
                       if inf.op is Op.OPEN and not inf.started and not inf.answered)

    def fail_model_work(self, send: Send, err: ModeldError) -> None:
        """Answer ``err`` to every request of the model worker, running or waiting, and cancel it."""
        with self._lock:
            stuck = [inf for inf in self._inflight.values() if inf.op is not Op.EMBED and not inf.answered]
            for inf in stuck:
                inf.answered = True
                inf.cancel.set()
                self._inflight.pop((inf.identity, inf.request_id), None)
        for inf in stuck:
            send(inf.identity, wire.encode_error(inf.request_id, err))

    def take_queued(self) -> list[_Item]:
        """At shutdown: the model worker's requests that never started, taken off its queue."""
        pending: list[_Item] = []
        while True:
            try:
                item = self.model.get_nowait()
            except queue.Empty:
                return pending
            if item is not None:
                pending.append(item)

    def clear(self) -> list[Inflight]:
        """At shutdown: every request still in flight, and an empty table."""
        with self._lock:
            leftovers = list(self._inflight.values())
            self._inflight.clear()
        return leftovers

    # --- the model worker ------------------------------------------------------------------------
    def next_model_work(self) -> _Item | None:
        """The model worker's next request; None for a wake-up, or after ``PARKED_POLL_S`` while opens wait."""
        try:
            # (with none waiting, it sleeps until work comes: the IO thread wakes it every REAP_INTERVAL_S)
            return self.model.get(timeout=PARKED_POLL_S if self._parked else None)
        except queue.Empty:
            return None

    def start_idle(self) -> bool:
        """Whether the model worker may start idle work: no request queued or waiting. ``arrived`` is cleared
        first, so a request posted from here on stops that work (``interrupt``)."""
        self.arrived.clear()
        return self.model.empty() and not self._parked

    def claim(self, inf: Inflight) -> bool:
        """The worker takes ``inf`` to run: False when the IO thread answered it already."""
        with self._lock:
            if inf.answered:
                return False
            inf.started = True
            return True

    def defer(self, inf: Inflight, msg: Message) -> bool:
        """Queue an open that would find the slot busy (or others already waiting); False: run it now, and call
        ``opened`` once it ran.

        A request that does not parse, or asks for no waiting (no ``queue_deadline``: the IO thread
        read its body at arrival), runs now and gets its answer (InvalidArgument, or ModelBusy at once).
        """
        with self._parked_lock:
            if inf.queue_deadline is None or (not self._parked and not self._full(self._opening, inf.open_request)):
                self._opening += 1
                return False
            self._parked.append(Parked(inf, msg))
            return True

    def opened(self) -> None:
        """An open that ``defer`` said to run, or ``pop_deferred`` handed out, has run (or was answered)."""
        with self._parked_lock:
            self._opening = max(0, self._opening - 1)

    def sweep_deferred(self, emit: Emit) -> None:
        """Answer the waiting opens that were cancelled (or that shutdown ends); forget those the IO thread
        answered at their deadline. The others keep their place in line.

        Waiting requests get heartbeats from the IO thread like any running request, and ModelBusy from it
        when their queue timeout runs out (``expire_waits``).
        """
        keep: deque[Parked] = deque()
        ended: list[tuple[Parked, ModeldError]] = []
        with self._parked_lock:
            for p in self._parked:
                if p.inf.answered:
                    continue  # the IO thread answered it at its deadline
                if self._stopping.is_set():
                    ended.append((p, ShuttingDown("modeld is shutting down")))
                elif p.inf.cancel.is_set():
                    ended.append((p, Cancelled("the wait for the slot was cancelled")))
                else:
                    keep.append(p)
            self._parked = keep
        for p, err in ended:
            emit(p.inf, wire.encode_error(p.inf.request_id, err))

    def pop_deferred(self) -> Parked | None:
        """The first waiting open, claimed to run, while the slot is free; None while it is held (an open
        that still finds it busy stays first in line) or none waits."""
        with self._parked_lock:
            while (self._parked and not self._full(self._opening, self._parked[0].inf.open_request)
                   and not self._stopping.is_set()):
                p = self._parked.popleft()
                if self.claim(p.inf):
                    self._opening += 1
                    return p
            return None
