"""The watchdog: whether the model worker still progresses, heartbeats while requests are in flight, and the reaper.

Liveness in tiers: the IO thread always answers, and from it the watchdog sees whether the model
worker progresses (``interrupt.beat``). A worker stalled past the wedge timeout is reported wedged,
and every request waiting on it is told so instead of being left to its timeout. Clients of requests
in flight get a heartbeat each interval (with the progress of the one the worker runs), so a client
tells a long operation from a dead daemon. Every ``REAP_INTERVAL_S`` the worker is woken to release
sessions whose leases ran out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from contract import interrupt, wire
from contract.errors import EngineUnresponsive
from contract.types import Heartbeat, Progress
from contract.wire import Kind

from .defaults import DEFAULT_WEDGE_S, EXIT_WEDGED
from .handlers import Handlers
from .slot import SlotService
from .workqueue import Inflight, Send, WorkQueue

__all__ = ["DEFAULT_WEDGE_S", "EXIT_WEDGED", "REAP_INTERVAL_S", "Watchdog"]

# (the daemon's lines keep one logger name, whichever module writes them)
log = logging.getLogger("modeld.server")

#: the IO thread wakes at least this often for its timers (lease reaping, the wedge watch); otherwise it
#: sleeps until a frame, a heartbeat that is due or a stop wakes it: an idle daemon wakes twice a second
REAP_INTERVAL_S = 0.5


class Watchdog:
    """What the model worker runs and since when, read by the IO thread's timers."""

    def __init__(
        self,
        slot: SlotService,
        work: WorkQueue,
        handlers: Handlers,
        *,
        wedge_s: float,
        exit_when_wedged: bool,
        stop: Callable[[int], None],
    ) -> None:
        self.slot = slot
        self._work = work
        self._handlers = handlers
        #: the model worker is reported wedged after this long without progress
        self.wedge_s = wedge_s
        self.exit_when_wedged = exit_when_wedged
        #: stops the daemon with an exit status
        self._stop = stop
        #: the requests the model workers run now and since when, by worker thread (the IO thread reads them; one
        #: worker but on an engine of several lanes)
        self._runs: dict[int, tuple[Inflight, float]] = {}
        self.wedged = False
        self._last_reap = 0.0

    # --- the model worker ------------------------------------------------------------------------
    @contextmanager
    def runs(self, inf: Inflight) -> Iterator[None]:
        """The calling model worker runs ``inf`` inside this block."""
        me = threading.get_ident()
        self._runs[me] = (inf, time.monotonic())
        try:
            yield
        finally:
            self._runs.pop(me, None)

    def _oldest(self) -> tuple[Inflight, float] | None:
        """The request a model worker runs and since when, the longest running of them when several do."""
        return min(list(self._runs.values()), key=lambda r: r[1], default=None)  # (a copy: workers change it)

    @property
    def running(self) -> Inflight | None:
        oldest = self._oldest()
        return oldest[0] if oldest is not None else None

    def release_expired(self) -> None:
        """On the model worker, when woken: release a session whose lease expired, and forget closed ones."""
        self.slot.reap()  # (it logs whose session went, and why)
        self._handlers.prune()

    # --- the IO thread ---------------------------------------------------------------------------
    def start(self, now: float) -> None:
        """The reap timer starts with the IO loop."""
        self._last_reap = now

    def next_reap(self) -> float:
        return self._last_reap + REAP_INTERVAL_S

    def reap(self, now: float) -> None:
        """Every ``REAP_INTERVAL_S``: stop a holder whose lease ran out mid-operation, and wake the worker
        to reap expired leases."""
        if now - self._last_reap > REAP_INTERVAL_S:
            self._last_reap = now
            self._stop_silent_holder()
            self._work.wake()

    def _stop_silent_holder(self) -> None:
        """A holder whose lease ran out mid-operation (a stopped client: its decode streams into a full
        queue) gets that operation cancelled, so the worker is free to reap it within a token."""
        sid = self.slot.expired_holder()
        peer = self._handlers.session_peers.get(sid) if sid else None
        if peer is not None:
            self._work.cancel_peer(peer, f"its lease ran out (no renewal for {self.slot.lease_s:g} s)")

    def stalled_s(self, now: float | None = None) -> float:
        """Seconds the model worker has been running one request without progress (0 when idle)."""
        oldest = self._oldest()
        if oldest is None:
            return 0.0
        now = time.monotonic() if now is None else now
        return max(0.0, now - max(oldest[1], interrupt.last_beat()))

    def check(self, send: Send, now: float) -> None:
        """Whether the model worker progresses.

        A worker stalled past ``wedge_s`` is wedged: status says so, the running
        request and every request waiting for the worker get EngineUnresponsive
        naming the stuck operation (their clients stop waiting), and with
        ``exit_when_wedged`` the daemon stops with EXIT_WEDGED for a supervisor
        to restart it.
        """
        stalled = self.stalled_s(now)
        running = self.running
        if stalled < self.wedge_s or running is None:
            if self.wedged:
                log.warning("the model worker is making progress again")
                self.wedged = False
            return
        if not self.wedged:
            self.wedged = True
            log.error("the model worker has made no progress for %.0f s in %s; it is wedged", stalled, running.op.value)
            if self.exit_when_wedged:
                self._stop(EXIT_WEDGED)
        self._work.fail_model_work(send, EngineUnresponsive(
            f"the model worker has made no progress for {stalled:.0f} s in {running.op.value}; "
            f"restart the daemon (or serve with --exit-when-wedged under a supervisor)",
            operation=running.op.value,
            stalled_s=round(stalled, 1),
        ))

    def heartbeats(self, send: Send, now: float) -> None:
        due = self._work.due_heartbeats(now)
        runs = list(self._runs.values())
        # only the request the model worker runs has progress (the engine reports one prefill's at a time: with
        # requests running on several lanes, none is told whose it would be); a waiting one gets an empty heartbeat
        running = runs[0][0] if len(runs) == 1 else None
        progress = self._progress() if any(inf is running for inf in due) else None
        for inf in due:
            inf.last_hb = now
            body = Heartbeat(progress=progress) if progress is not None and inf is running else None
            send(inf.identity, wire.encode_reply(Kind.HEARTBEAT, inf.request_id, body))

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
