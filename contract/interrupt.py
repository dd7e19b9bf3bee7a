"""Interrupting long engine work (a cold prefill) from outside the Session interface.

The Session methods take no cancel token: the contract's signatures have none. The
daemon runs each request inside ``interruptible(event)``, where the event is set
when the client cancels the request, its connection is gone, or the daemon
shuts down; a backend checks it between units of work (``check``) or hands
``current()`` to the engine's own abort hook. Outside a scope nothing is ever
interrupted, so in-process callers see no difference.

Progress travels the same way: the tape layer opens a ``prefilling`` window
over the tape positions a prefill computes, the engine reports each finished
chunk with ``prefilled``, and the daemon's IO thread reads ``prefill_progress``
for the heartbeats of the request the model worker runs. There is one model
worker, so there is one window at a time.

It lives in the contract although it holds state: it is the one channel the
daemon and every backend share beside the Session interface, and the daemon
imports no backend (only ``modeld.bootstrap`` does), so neither side can own it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import Cancelled

__all__ = [
    "beat", "check", "chunk_done", "current", "interruptible", "last_beat", "prefill_progress", "prefilled", "prefilling",
    "set_chunk_delay", "set_slow_prefix", "stopped", "decoded", "decode_progress", "prefill_span",
]

_scope = threading.local()
#: when engine work last showed progress (``beat``); the daemon's liveness watch reads it
_last_beat = [time.monotonic()]


def beat() -> None:
    """Note that the engine is making progress (a prefill chunk, a graph node, a decoded token)."""
    _last_beat[0] = time.monotonic()


def last_beat() -> float:
    """``time.monotonic()`` of the last ``beat`` (or ``check``)."""
    return _last_beat[0]


#: the running prefill as (first, end, reached) tape positions, None when none runs; the model
#: worker writes it, the IO thread reads it (a tuple is replaced whole, never changed in place)
_prefill: list[tuple[int, int, int] | None] = [None]
_prefill_lock = threading.Lock()


#: the running prefill is of a stable prefix (``prefilling(stable=True)``): ``set_slow_prefix`` holds it back
_stable = [False]


@contextmanager
def prefilling(first: int, end: int, *, stable: bool = False) -> Iterator[None]:
    """Inside the block a prefill computes tape positions ``first`` to ``end`` (``stable``: of a stable prefix); the
    engine reports with ``prefilled``."""
    span = (first, end, first) if end > first else None
    with _prefill_lock:
        _prefill[0] = span
        _stable[0] = stable
    try:
        yield
    finally:
        with _prefill_lock:
            _prefill[0] = None
            _stable[0] = False


def prefilled(position: int) -> None:
    """The engine's KV now holds ``position`` tokens of the running prefill (also a ``beat``).

    Outside a ``prefilling`` window it only beats, so an engine may call it
    from a hook that also runs for other work.
    """
    _last_beat[0] = time.monotonic()
    if _prefill[0] is None:
        return
    with _prefill_lock:
        span = _prefill[0]
        if span is not None and position > span[2]:
            _prefill[0] = (span[0], span[1], min(position, span[1]))


#: seconds each prefill chunk is held back (``serve --prefill-chunk-delay-ms``): a slower machine on demand, for
#: tests and demonstrations of what a long prefill does; 0 in normal serving
_chunk_delay_s = [0.0]
#: how often a held-back chunk still beats: the wedge watch reads progress, and a pause is not a wedge
_DELAY_BEAT_S = 0.25


def set_chunk_delay(seconds: float) -> None:
    """Hold each prefill chunk back ``seconds`` (0: never), as if the machine were that much slower."""
    _chunk_delay_s[0] = max(0.0, seconds)


#: seconds a stable prefix's whole prefill is stretched to at least (``serve --slow-prefix-s``; 0: never)
_slow_prefix_s = [0.0]


def set_slow_prefix(seconds: float) -> None:
    """Hold a stable prefix's prefill back so that it takes at least ``seconds`` in all (0: never): each chunk waits
    its share of them, what it computed over what the prefill computes."""
    _slow_prefix_s[0] = max(0.0, seconds)


def chunk_done(position: int) -> None:
    """A prefill chunk is in the KV, which now holds ``position`` tokens: ``prefilled``, then the chunk delay
    (when one is set) for a request's prefill, or the draft costs' timing (inside ``prefilling``; a load's warm-up
    is not held back), which a cancel ends at once."""
    span = _prefill[0]
    prefilled(position)
    delay = _chunk_delay_s[0]
    if span is not None and _stable[0] and _slow_prefix_s[0] > 0 and span[1] > span[0]:
        computed = max(0, min(position, span[1]) - span[2])  # this chunk's tokens, of what the prefill computes
        delay += _slow_prefix_s[0] * computed / (span[1] - span[0])
    if delay <= 0 or _prefill[0] is None:
        return
    event = current()
    end = time.monotonic() + delay
    while (left := end - time.monotonic()) > 0:
        if event is not None and event.wait(min(left, _DELAY_BEAT_S)):
            return  # cancelled: the next ``check`` says so
        if event is None:
            time.sleep(min(left, _DELAY_BEAT_S))
        beat()


#: the running decode's tokens so far (the model worker writes it, status reads it)
_decoded = [0]


def decoded(tokens: int) -> None:
    """The running decode has written ``tokens`` tokens (0: a decode starts)."""
    _decoded[0] = tokens


def decode_progress() -> int:
    """Tokens the running (or last) decode has written."""
    return _decoded[0]


def prefill_span() -> tuple[int, int, int] | None:
    """The running prefill as ``(first, end, reached)`` tape positions (the context holds ``reached`` tokens of the
    ``end`` it needs; it held ``first`` when the prefill began), or None when none runs."""
    return _prefill[0]


def prefill_progress() -> tuple[int, int] | None:
    """``(done, total)`` tokens of the running prefill, or None when none runs."""
    span = _prefill[0]
    if span is None:
        return None
    first, end, reached = span
    return max(0, reached - first), end - first


@contextmanager
def interruptible(event: threading.Event) -> Iterator[None]:
    """Work done by this thread inside the block stops when ``event`` is set."""
    previous = getattr(_scope, "event", None)
    _scope.event = event
    try:
        yield
    finally:
        _scope.event = previous


def current() -> threading.Event | None:
    """The event interrupting this thread's work, if it runs inside a scope."""
    event: threading.Event | None = getattr(_scope, "event", None)
    return event


def stopped() -> bool:
    """Whether this thread's work has been interrupted (a check that raises nothing, for a loop that ends itself:
    a decode that yields no text for many steps, a tool call or a possible stop string held back, still stops
    within one step). Also a ``beat``."""
    beat()
    event = current()
    return event is not None and event.is_set()


def check(action: str) -> None:
    """Raise Cancelled when this thread's work has been interrupted (a check is also a ``beat``)."""
    _last_beat[0] = time.monotonic()
    event = current()
    if event is not None and event.is_set():
        raise Cancelled(f"{action} was cancelled")
