"""A session handle of the slot's: what ``SlotService.open_session`` and ``fork`` hand out.

Every operation goes through the slot (``SessionHost``: ``SlotService`` is the one), which checks the handle's
owner, generation and lease, marks the slot busy, and serialises the operation with the others on its KV.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Protocol, TypeVar

from contract.interfaces import Session
from contract.manifest import ContextManifest
from contract.types import (
    ContextReport,
    DaemonStatus,
    DecodeConfig,
    PrefixInput,
    PrefixStatus,
    SessionSnapshot,
    StreamChunk,
    SuffixInput,
    SuffixStatus,
    TokenCount,
)

from .holders import Holder

__all__ = ["SessionHost", "SlotSession"]

_T = TypeVar("_T")


class SessionHost(Protocol):
    """What a session handle asks of the slot it holds (``SlotService``)."""

    def run_op(self, holder: Holder, name: str, fn: Callable[[Session], _T]) -> _T: ...

    def stream_op(self, holder: Holder, it: Generator[StreamChunk, None, None]) -> Generator[StreamChunk, None, None]: ...

    def fork_session(self, holder: Holder, at_position: int) -> SlotSession: ...

    def release_session(self, session_id: str) -> None: ...

    def holds(self, session_id: str) -> bool: ...

    def manifest_defaults(self) -> ContextManifest: ...

    def status(self) -> DaemonStatus: ...

    def now(self) -> float: ...


class SlotSession:
    """A session handle bound to the slot's owner and generation."""

    def __init__(self, slot: SessionHost, holder: Holder) -> None:
        self._slot = slot
        self._holder = holder

    @property
    def session_id(self) -> str:
        return self._holder.session_id

    @property
    def generation(self) -> int:
        return self._holder.generation

    @property
    def manifest_defaults(self) -> ContextManifest:
        return self._slot.manifest_defaults()

    @property
    def num_ctx(self) -> int:
        active = self._slot.status().active
        return active.effective_context if active else 0

    def ensure_prefix(self, prefix: PrefixInput) -> PrefixStatus:
        return self._slot.run_op(self._holder, "ensure_prefix", lambda s: s.ensure_prefix(prefix))

    def prefill_suffix(self, suffix: SuffixInput) -> SuffixStatus:
        return self._slot.run_op(self._holder, "prefill_suffix", lambda s: s.prefill_suffix(suffix))

    def count_tokens(self, prefix: PrefixInput, suffix: SuffixInput) -> TokenCount:
        return self._slot.run_op(self._holder, "count_tokens", lambda s: s.count_tokens(prefix, suffix))

    def decode(self, cfg: DecodeConfig) -> Generator[StreamChunk, None, None]:
        inner_iter = self._slot.run_op(self._holder, "decode", lambda s: s.decode(cfg))
        return self._slot.stream_op(self._holder, inner_iter)

    def tokenize(self, text: str, *, add_special: bool = False) -> list[int]:
        return self._slot.run_op(self._holder, "tokenize", lambda s: s.tokenize(text, add_special=add_special))

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._slot.run_op(self._holder, "detokenize", lambda s: s.detokenize(tokens))

    def explain_context(self) -> ContextReport:
        """The context report; also the no-op that refreshes the session's TTL."""
        h = self._holder
        h.last_op = self._slot.now()
        if h.closed or not self._slot.holds(h.session_id):
            rep = h.inner.explain_context()
            return rep.model_copy(update={"closed": True})
        return h.inner.explain_context()

    def snapshot(self) -> SessionSnapshot:
        return self._slot.run_op(self._holder, "snapshot", lambda s: s.snapshot())

    def restore(self, snap: SessionSnapshot) -> None:
        self._slot.run_op(self._holder, "restore", lambda s: s.restore(snap))

    def fork(self, at_position: int) -> SlotSession:
        return self._slot.fork_session(self._holder, at_position)

    def close(self) -> None:
        self._slot.release_session(self._holder.session_id)
