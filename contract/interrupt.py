"""Interrupting long engine work (a cold prefill) from outside the Session interface.

The Session methods take no cancel token: the seed's signatures have none. The
daemon runs each request inside ``interruptible(event)``, where the event is set
when the client cancels the request, its connection is gone, or the daemon
shuts down; a backend checks it between units of work (``check``) or hands
``current()`` to the engine's own abort hook. Outside a scope nothing is ever
interrupted, so in-process callers see no difference.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import Cancelled

__all__ = ["beat", "check", "current", "interruptible", "last_beat"]

_scope = threading.local()
#: when engine work last showed progress (``beat``); the daemon's liveness watch reads it
_last_beat = [time.monotonic()]


def beat() -> None:
    """Note that the engine is making progress (a prefill chunk, a graph node, a decoded token)."""
    _last_beat[0] = time.monotonic()


def last_beat() -> float:
    """``time.monotonic()`` of the last ``beat`` (or ``check``)."""
    return _last_beat[0]


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


def check(action: str) -> None:
    """Raise Cancelled when this thread's work has been interrupted (a check is also a ``beat``)."""
    _last_beat[0] = time.monotonic()
    event = current()
    if event is not None and event.is_set():
        raise Cancelled(f"{action} was cancelled")
