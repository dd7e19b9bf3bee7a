"""The slot's lifecycle: its states, the moves between them, and the one checked way to make a move.

``TRANSITIONS`` is the table; ``Lifecycle`` holds the state and refuses a move the table does not list (a bug in
the slot: ``Internal``; any move once shutting down: ``ShuttingDown``). ``SlotService`` makes every state change
through it, and ``tests/test_slot.py`` checks that the slot takes every edge of the table and no other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from contract.errors import Internal, ShuttingDown
from contract.types import SlotState

__all__ = ["TRANSITIONS", "Lifecycle", "TransitionHook"]

_S = SlotState
#: The slot's lifecycle: state -> the states it may move to. ``Lifecycle.move`` is the only
#: way the slot's state changes, and it refuses anything not listed here.
TRANSITIONS: Mapping[SlotState, frozenset[SlotState]] = {
    # load, or open_session auto-loading an empty slot
    _S.EMPTY: frozenset({_S.LOADING, _S.SHUTTING_DOWN}),
    # Ready on success, Failed when the backend's load raised (a planner refusal
    # comes before Loading and leaves the state as it was)
    _S.LOADING: frozenset({_S.READY, _S.FAILED, _S.SHUTTING_DOWN}),
    # open_session, load of another model, unload
    _S.READY: frozenset({_S.BUSY, _S.SWITCHING, _S.UNLOADING, _S.SHUTTING_DOWN}),
    # the holder closed, its lease ran out, or its client vanished
    _S.BUSY: frozenset({_S.READY, _S.SHUTTING_DOWN}),
    # Ready with the new model, or with the old one when the new one failed (kept alongside, or
    # loaded again); Failed only when the old one could not be loaded again either
    _S.SWITCHING: frozenset({_S.READY, _S.FAILED, _S.SHUTTING_DOWN}),
    _S.UNLOADING: frozenset({_S.EMPTY, _S.SHUTTING_DOWN}),
    # a new load may be attempted; unload clears the failure
    _S.FAILED: frozenset({_S.LOADING, _S.EMPTY, _S.SHUTTING_DOWN}),
    # terminal: the process is exiting (shutdown may run again; it changes nothing)
    _S.SHUTTING_DOWN: frozenset({_S.SHUTTING_DOWN}),
}



#: ``SlotService(on_transition=...)``: told (from, to) after each move (under the slot's state lock: keep it short)
TransitionHook = Callable[[SlotState, SlotState], None]


class Lifecycle:
    """The slot's state and the one checked way to change it (``TRANSITIONS``): the state is read-only
    elsewhere, so no code path can set a state the table does not allow."""

    def __init__(self, on_move: TransitionHook | None = None) -> None:
        self._state = SlotState.EMPTY
        self._on_move = on_move

    @property
    def state(self) -> SlotState:
        return self._state

    def move(self, to: SlotState) -> None:
        """Move to ``to``. Leaving ShuttingDown raises ShuttingDown (an operation that raced the shutdown ends
        with it); any other move not in ``TRANSITIONS`` is a bug in the slot and raises Internal."""
        frm = self._state
        if to in TRANSITIONS[frm]:
            self._state = to
            if self._on_move is not None:
                self._on_move(frm, to)
            return
        if frm is SlotState.SHUTTING_DOWN:
            raise ShuttingDown("modeld is shutting down")
        raise Internal(
            f"invalid slot state transition {frm.value} -> {to.value}; allowed from {frm.value}: "
            + (", ".join(sorted(s.value for s in TRANSITIONS[frm])) or "none"),
            state=frm.value,
            to=to.value,
        )
