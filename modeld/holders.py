"""The sessions that hold the slot, and the lanes of the model they are on.

A session holds the slot from its open to its close (or its lease's end). On a model of one lane (a local engine:
one KV) one session holds it, with its forks beside it taking turns in the KV. On a model of several lanes
(``backends.lanes``: an engine that batches) each session has a lane of its own, its forks on the same lane, and
an operation holds its lane's lock (``Holders.lock``) instead of the slot's op lock, so operations on different
lanes run at once. ``SlotService`` keeps one ``Holders`` and reads and changes it under its own locks.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

from contract.interfaces import Session

__all__ = ["Holder", "Holders"]


@dataclass
class Holder:
    """One session holding the slot."""

    session_id: str
    generation: int
    owner: str
    inner: Session
    #: when its client was last heard (the slot's clock)
    last_seen: float = 0.0
    #: the end of its last operation (heartbeats do not count): the session TTL runs from here
    last_op: float = 0.0
    in_operation: int = 0
    closed: bool = False
    #: its client's connections all closed, or ``modeld cancel`` ended its turn: released at the next reap
    vanished: bool = False
    #: who opened it (``OpenSessionRequest.client``) and when (the slot's clock), for status
    client: str = ""
    opened: float = 0.0
    #: the model's lane its session is on (``LoadedModel.lanes``; a fork is on its origin's)
    lane: int = 0
    #: the operation it runs now ("" between operations) and since when (the slot's clock), for status
    op: str = ""
    op_since: float = 0.0


class Holders:
    """The sessions holding the slot: the first (whose turn status shows) and, by session id, the ones beside it
    (forks, and on a model of several lanes the sessions on the other lanes), the first of which becomes the first
    when it goes; and per lane of the loaded model, its lock and the client that last opened a session there."""

    def __init__(self) -> None:
        self.first: Holder | None = None
        self._beside: dict[str, Holder] = {}
        #: a lock a lane, on a model of several (none on a model of one: the slot's op lock serialises it)
        self._locks: list[threading.RLock] = []
        #: per lane, the client that last opened a session on it
        self._clients: list[str] = [""]

    def all(self) -> list[Holder]:
        return ([self.first] if self.first is not None else []) + list(self._beside.values())

    def __len__(self) -> int:
        return len(self._beside) + (self.first is not None)

    def beside(self) -> int:
        return len(self._beside)

    def held(self, session_id: str) -> Holder | None:
        return next((h for h in self.all() if h.session_id == session_id), None)

    def holds(self, holder: Holder) -> bool:
        """Whether ``holder`` itself (not a released one of the same id) holds the slot."""
        return self.first is holder or self._beside.get(holder.session_id) is holder

    def add(self, holder: Holder) -> bool:
        """``holder`` holds the slot from now on; True when it is the first (the slot was free)."""
        if self.first is None:
            self.first = holder
            return True
        self._beside[holder.session_id] = holder
        return False

    def remove(self, holder: Holder) -> bool:
        """``holder`` holds the slot no more (the first one beside it takes the first's place); True when the slot
        is free now."""
        if self._beside.get(holder.session_id) is holder:
            del self._beside[holder.session_id]
        elif self.first is holder:
            self.first = self._beside.pop(next(iter(self._beside))) if self._beside else None
        return self.first is None

    # --- lanes ----------------------------------------------------------------------------------
    @property
    def lanes(self) -> int:
        """The loaded model's lanes (``LoadedModel.lanes``; 1 while none is loaded)."""
        return len(self._clients)

    def set_lanes(self, lanes: int) -> None:
        """A model of ``lanes`` lanes is loaded (1: none is): called with no session open, at a load or unload."""
        self._clients = [""] * lanes
        self._locks = [threading.RLock() for _ in range(lanes)] if lanes > 1 else []

    def free_lane(self, client: str) -> int | None:
        """A lane no session is on, None when every one is taken: the one ``client`` last opened a session on, if
        free (its conversation's tape is there), else the first."""
        taken = {h.lane for h in self.all()}
        free = [i for i in range(self.lanes) if i not in taken]
        if not free:
            return None
        return next((i for i in free if client and self._clients[i] == client), free[0])

    def lanes_taken(self) -> int:
        return len({h.lane for h in self.all()})

    def opened_on(self, lane: int, client: str) -> None:
        self._clients[lane] = client

    @property
    def concurrent(self) -> bool:
        """Whether the loaded model has several lanes: operations then take their lane's lock, not the op lock."""
        return bool(self._locks)

    def lock(self, holder: Holder) -> threading.RLock | contextlib.nullcontext[None]:
        """The lock of ``holder``'s lane on a model of several (operations on one lane take turns in its KV); a
        no-op on a model of one, whose operations the slot's op lock serialises."""
        return self._locks[holder.lane] if self._locks else contextlib.nullcontext()
