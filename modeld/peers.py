"""Which clients are still connected: a client that is gone is seen at once, not after its lease.

A client process that dies (SIGKILL, a crash, a closed laptop lid over a local socket) closes its
connections, and the ROUTER's monitor reports each closed descriptor (``EVENT_DISCONNECTED``). Each
message carries the descriptor it came on (``zmq.SRCFD``), so the IO thread knows which peers
(``wire.peer_key``: a runtime Client's sockets share one) each connection carried. A peer whose last
connection closed, and that does not come back within ``grace_s`` (ZeroMQ reconnects a dropped TCP
connection with the same routing id), is gone: the daemon cancels its requests and releases its session.

Descriptor numbers are reused. The monitor reports a close before the same number can be accepted
again, and the IO thread reads every monitor event before any message; when one batch of events holds
both the close of a descriptor and a new accept on it, the peers recorded on it may include the new
connection's, so none of them is declared gone: their leases decide, as without this watch.

A client that is stopped but still connected (SIGSTOP, a debugger) is not gone: it loses the slot at
its lease, as before.
"""

from __future__ import annotations

import zmq

from contract import wire

__all__ = ["DISCONNECT_GRACE_S", "MONITOR_EVENTS", "PeerWatch"]

#: how long a peer whose connections all closed may take to reconnect before it is gone
DISCONNECT_GRACE_S = 1.0
#: what the ROUTER's monitor reports
MONITOR_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


class PeerWatch:
    """Peers by connection descriptor, and the peers whose connections all closed."""

    def __init__(self, grace_s: float = DISCONNECT_GRACE_S) -> None:
        self.grace_s = grace_s
        self._fd_peers: dict[int, set[bytes]] = {}
        self._peer_fds: dict[bytes, set[int]] = {}
        #: peer -> when its last connection closed
        self._closed: dict[bytes, float] = {}
        #: since start: connections accepted and closed (the monitor's events), and peers reported gone
        self.accepted = self.closed = self.gone_total = 0

    def seen(self, identity: bytes, fd: int) -> None:
        """A message from ``identity`` came on descriptor ``fd`` (-1: unknown)."""
        if fd < 0:
            return
        peer = wire.peer_key(identity)
        self._fd_peers.setdefault(fd, set()).add(peer)
        self._peer_fds.setdefault(peer, set()).add(fd)
        self._closed.pop(peer, None)

    def events(self, batch: list[tuple[int, int]], now: float) -> None:
        """One batch of monitor events, ``(event, descriptor)``, in the order the monitor sent them."""
        for i, (event, fd) in enumerate(batch):
            if event == zmq.EVENT_ACCEPTED:
                self.accepted += 1
            if event != zmq.EVENT_DISCONNECTED:
                continue
            self.closed += 1
            peers = self._fd_peers.pop(fd, set())
            reused = any(e == zmq.EVENT_ACCEPTED and f == fd for e, f in batch[i + 1:])
            for peer in peers:
                fds = self._peer_fds.get(peer)
                if fds is None:
                    continue
                fds.discard(fd)
                if not fds:
                    del self._peer_fds[peer]
                    if not reused:
                        self._closed[peer] = now

    def gone(self, now: float) -> list[bytes]:
        """Peers whose last connection closed ``grace_s`` ago and that have not come back (each reported once)."""
        due = [p for p, t in self._closed.items() if now - t >= self.grace_s]
        for p in due:
            del self._closed[p]
        self.gone_total += len(due)
        return due

    def next_due(self) -> float | None:
        """When the next closed peer is due to be reported gone (None: none waits)."""
        return min(self._closed.values()) + self.grace_s if self._closed else None

    @property
    def closing(self) -> int:
        """Peers whose connections all closed, within the grace (neither back nor yet reported gone)."""
        return len(self._closed)

    def __len__(self) -> int:
        return len(self._peer_fds)
