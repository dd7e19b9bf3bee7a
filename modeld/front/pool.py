"""Long-lived runtime clients for the HTTP front: one per concurrent request, reused across requests.

A ``runtime.Client`` is one ZeroMQ context and socket pair. It is safe to
share between threads, but they take turns on its one request socket, and a
transport failure in one resets it under all of them; so each request borrows
a client for its whole life and gives it back, and no request waits on
another's socket. Opening one per request would cost a context, two sockets and a
heartbeat thread every time; the pool keeps up to ``max_idle`` of them. A
client whose request failed in transport (timeout, daemon gone, a bad frame)
is closed rather than reused: its socket may hold a half-read exchange.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from contract.errors import ModeldError, Unavailable, WireError
from runtime import Client

__all__ = ["ClientPool"]


class ClientPool:
    """Clients of one daemon endpoint, borrowed with ``client()``; thread-safe."""

    def __init__(self, connect: Callable[[], Client], max_idle: int = 8) -> None:
        self._connect = connect
        self._max_idle = max_idle
        self._idle: list[Client] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self) -> Client:
        """A client for the caller alone until it is handed back with ``give``."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def give(self, client: Client, *, healthy: bool = True) -> None:
        """Hand a client back; an unhealthy one (a transport failure) is closed instead of kept."""
        with self._lock:
            keep = healthy and not self._closed and len(self._idle) < self._max_idle
            if keep:
                self._idle.append(client)
        if not keep:
            client.close()

    @contextmanager
    def client(self) -> Iterator[Client]:
        """Borrow a client for a ``with`` block."""
        c = self.take()
        healthy = False
        try:
            yield c
            healthy = True
        except ModeldError as exc:
            healthy = not isinstance(exc, (Unavailable, WireError))
            raise
        finally:
            self.give(c, healthy=healthy)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()
