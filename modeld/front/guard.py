"""Connection limits for the HTTP front: a cap on open connections, a deadline for a request head, and the
descriptor budget both come from.

uvicorn's h11 protocol accepts every connection and keeps a silent one open for ever. 1,200 sockets that
each send half a request header use up a 1,024 descriptor limit, and the next ZeroMQ client then makes
libzmq abort the daemon (``Too many open files``). Here:

* at start the soft ``RLIMIT_NOFILE`` is raised toward the hard one, and the connection cap is kept
  ``RESERVED_FDS``, the lingering refused connections and ``ACCEPT_BURSTS`` accept bursts below it, so the
  model, its files and the ZeroMQ clients always find descriptors;
* a connection past the cap is answered ``503`` (``Retry-After``) at once and half-closed, then lingers
  while its request is read and dropped: a client that wrote its request, or writes it after the answer,
  reads the ``503`` rather than a reset or a broken pipe. The linger ends as soon as the request is read
  whole (head and body), when the client closes, after ``LINGER_S``, or past ``LINGER_READ_MAX``
  bytes. At most ``LINGER_MAX`` linger, the descriptors of one accept burst; when a refused connection
  finds them all taken, the oldest is closed to make room. A flood of half-sent connections therefore
  holds them only in turn: every refused connection gets its answer and time to send its request (up to
  ``LINGER_S``, or until ``LINGER_MAX`` newer refused connections have come), and the descriptors held
  stay within the budget below;
* a connection that has not completed a request head ``header_timeout_s`` after it opened (or after its
  last head) and is not being answered is sent ``408`` and closed: slowloris clients cannot hold slots.
  A request being answered, however long its stream, is never cut.

An idle keep-alive connection is closed by uvicorn itself after ``timeout_keep_alive`` (5 s).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from dataclasses import dataclass, field
from typing import Any

import h11  # uvicorn's own HTTP parser, which the protocol extended here runs on
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..defaults import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS

log = logging.getLogger("modeld.front")

__all__ = ["ACCEPT_BACKLOG", "ACCEPT_BURSTS", "DEFAULT_HEADER_TIMEOUT_S", "DEFAULT_MAX_CONNECTIONS", "LINGER_MAX", "LINGER_READ_MAX",
           "LINGER_S", "RESERVED_FDS", "connection_cap", "guarded_protocol"]

#: descriptors kept for everything that is not an HTTP connection: the model's files, ZeroMQ's sockets and
#: their clients, the workspace cache, logs
RESERVED_FDS = 256
#: the soft limit asked for when the hard one allows it
WANTED_FDS = 65536
#: how long a refused connection lingers at most
LINGER_S = 1.0
#: bytes a lingering connection reads and drops before it is closed (a request of ordinary size is read whole)
LINGER_READ_MAX = 1 << 20
#: the listen backlog, which is also how many connections asyncio accepts in one tick of its loop before the
#: cap sees any of them. (Smaller, a flood of connects overflows the kernel's queue and each dropped SYN costs
#: its client a one-second retry.)
ACCEPT_BACKLOG = 128
#: accept bursts whose descriptors are open before the cap has closed any of them: asyncio accepts a burst in
#: one tick, makes each connection (``connection_made``, where the cap refuses it) a tick or two later, and a
#: refused connection's socket closes a tick after that, while the listener goes on accepting each tick. With
#: two, a flood of 1,200 connects against a 1,024 limit reached ``EMFILE`` on a loaded machine; with three
#: its peak stays below the reserve (docs/apis.md).
ACCEPT_BURSTS = 3
#: refused connections that may linger at once, on top of the accept bursts, so lingering never eats into
#: ``RESERVED_FDS``
LINGER_MAX = ACCEPT_BACKLOG


def _reply(status: str, kind: str, code: str, message: str, extra: str = "") -> bytes:
    body = json.dumps({"error": {"message": message, "type": kind, "code": code}}).encode()
    head = (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n")
    return head.encode() + body


def connection_cap(wanted: int) -> int:
    """Raise the soft descriptor limit toward the hard one and return how many HTTP connections fit: at most
    ``wanted``, always ``RESERVED_FDS``, ``LINGER_MAX`` lingering refused connections and ``ACCEPT_BURSTS``
    accept bursts (connections accepted before the cap has closed them) below the limit, and at least 8."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = WANTED_FDS if hard == resource.RLIM_INFINITY else min(hard, WANTED_FDS)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # a container may forbid it: the budget is what there is
            log.info("open files limit stays %d (%s)", soft, exc)
    limit = WANTED_FDS if soft == resource.RLIM_INFINITY else soft
    cap = max(8, min(wanted, limit - RESERVED_FDS - LINGER_MAX - ACCEPT_BURSTS * ACCEPT_BACKLOG))
    if cap < wanted:
        log.warning("the open files limit is %d: the HTTP front serves at most %d connections (--http-max-connections "
                    "%d asked for; raise `ulimit -n`)", limit, cap, wanted)
    return cap


@dataclass
class _Limits:
    """What every connection of one front shares: its limits, the replies they send, and the refused
    connections lingering now, oldest first (a dict keeps its insertion order)."""

    max_connections: int
    header_timeout_s: float
    busy: bytes = b""
    slow: bytes = b""
    last_warned: float = 0.0
    lingering: dict[Any, None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.busy = _reply("503 Service Unavailable", "server_error", "too_many_connections",
                           f"the HTTP front is serving its limit of {self.max_connections} connections; retry shortly",
                           "retry-after: 1\r\n")
        self.slow = _reply("408 Request Timeout", "invalid_request_error", "request_timeout",
                           f"no complete request head within {self.header_timeout_s:g} s")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the connection cap and the request-head deadline of ``limits``
    (``guarded_protocol`` makes the class for one front)."""

    limits: _Limits
    _head_timer: asyncio.TimerHandle | None = None
    _armed_cycle: Any = None
    _refused = False
    _linger_timer: asyncio.TimerHandle | None = None
    _dropped = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(transport)
        elif self.limits.header_timeout_s > 0:
            self._arm()

    def _refuse(self, transport: asyncio.Transport) -> None:
        """A connection past the cap: answered 503, its request read and dropped, then closed."""
        limits = self.limits
        now = time.monotonic()
        if now - limits.last_warned > 10.0:
            limits.last_warned = now
            log.warning("HTTP connection refused: %d open, the limit is %d", len(self.connections) - 1,
                        limits.max_connections)
        self._refused = True
        transport.write(limits.busy)
        if not transport.can_write_eof():
            transport.close()  # connection_lost follows and forgets it
            return
        # half-closed, not closed: closing a socket with the request unread (or before it comes)
        # resets it, and the client's send fails or its read loses the answer
        transport.write_eof()
        if len(limits.lingering) >= LINGER_MAX:
            next(iter(limits.lingering))._end_linger()  # the oldest has had the longest to send its request
        limits.lingering[self] = None
        self._linger_timer = self.loop.call_later(LINGER_S, self._end_linger)

    def _end_linger(self) -> None:
        self.limits.lingering.pop(self, None)
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        self.transport.close()

    def _drop(self, data: bytes) -> None:
        """Read a refused connection's request and drop it; once it is whole, nothing is left unread and
        the connection closes cleanly."""
        if self not in self.limits.lingering:
            return
        self._dropped += len(data)
        try:
            self.conn.receive_data(data)
            while (event := self.conn.next_event()) is not h11.NEED_DATA and event is not h11.PAUSED:
                if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    self._end_linger()
                    return
        except h11.RemoteProtocolError:  # not HTTP: nothing to wait for
            self._end_linger()
            return
        if self._dropped > LINGER_READ_MAX:
            self._end_linger()

    def _arm(self) -> None:
        self._armed_cycle = self.cycle
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_deadline)

    def _head_deadline(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if (cycle is not None and not cycle.response_complete) or cycle is not self._armed_cycle:
            self._arm()  # a request is being answered, or a head came since: a new deadline
            return
        self.transport.write(self.limits.slow)
        self.transport.close()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        # the connection is the WebSocket protocol's from here: no request-head deadline any more
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().handle_websocket_upgrade(event)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            self._drop(data)
            return
        super().data_received(data)

    def eof_received(self) -> bool | None:  # type: ignore[override]
        if self._refused:
            self._end_linger()  # the client is done: no need to wait out the linger
            return None
        super().eof_received()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.limits.lingering.pop(self, None)
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)


def guarded_protocol(max_connections: int, header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the connection cap and the request-head deadline: a class of its own per
    front, whose connections share ``_Limits``."""
    limits = _Limits(max_connections, header_timeout_s)
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
