"""Lanes: one loaded model that serves several sessions at once, each on a KV of its own.

A local engine holds one KV, so its slot serves one session at a time (its forks share that KV and take turns
in it). An engine whose computing is done elsewhere and batched there (a vLLM server) can serve several at
once: ``Lanes`` is its loaded model, a lane per session served at once, each lane a whole ``LoadedModel`` (its own
tape, epoch and session generation) over the engine objects the lanes share (the tokenizer, the connection).
The slot opens a session on a lane no open session uses (``SlotService.open_session``) and runs one operation at
a time on a lane; on different lanes operations run at once, from the daemon's model workers.

What the slot reads of the model's identity (digest, window, template, capabilities, sampling, manifest) is the
same on every lane and read from the first.
"""

from __future__ import annotations

from collections.abc import Sequence

from contract.interfaces import LoadedModel, Session
from contract.types import ContextManifest, SamplingParams, SpeculationStatus

__all__ = ["Lanes", "check_lane"]


def check_lane(lane: int, lanes: int) -> None:
    """ValueError unless ``lane`` is one of a model's ``lanes`` (``LoadedModel.open_session``: a bug in the caller)."""
    if not 0 <= lane < lanes:
        raise ValueError(f"lane {lane} of a model with {lanes}")


class Lanes:
    """A ``LoadedModel`` of ``len(lanes)`` lanes (module doc); closing it closes each lane, the first last (a lane
    built first owns what the others share)."""

    def __init__(self, lanes: Sequence[LoadedModel]) -> None:
        if not lanes:
            raise ValueError("a model needs one lane at least")
        self._lanes = list(lanes)
        first = self._lanes[0]
        self.template_origin = first.template_origin
        self.tool_format_origin = first.tool_format_origin
        self.capabilities = list(first.capabilities)

    @property
    def lanes(self) -> int:
        return len(self._lanes)

    @property
    def digest(self) -> str:
        return self._lanes[0].digest

    @property
    def num_ctx(self) -> int:
        return self._lanes[0].num_ctx

    def open_session(self, lane: int = 0) -> Session:
        check_lane(lane, len(self._lanes))
        return self._lanes[lane].open_session()

    def resident_bytes(self) -> int:
        return sum(m.resident_bytes() for m in self._lanes)

    def manifest_defaults(self) -> ContextManifest:
        return self._lanes[0].manifest_defaults()

    def sampling_defaults(self) -> SamplingParams:
        return self._lanes[0].sampling_defaults()

    def speculation(self) -> SpeculationStatus | None:
        return self._lanes[0].speculation()

    def idle_pending(self) -> bool:
        return any(m.idle_pending() for m in self._lanes)

    def idle_work(self) -> None:
        for m in self._lanes:
            if m.idle_pending():
                m.idle_work()

    def close(self) -> None:
        for m in reversed(self._lanes):
            m.close()
