"""Stream chunks coalesced into fewer frames: at most one frame per interval while a decode streams.

Every frame of a decode stream wakes four threads outside the engine: the
daemon's IO thread, the daemon's and the client's ZeroMQ IO threads, and the
client. On a machine with as many cores as engine threads, each wake-up takes
a core from the engine in the middle of a step, and its other threads wait for
it at the next barrier: a frame per token cost a measurable share of decode
speed on 2 cores, and OpenVINO, whose threads meet at every operation, lost
more. At one frame per 50 ms (the default) both engines decode within about a
percent of in process (docs/benchmarks.md, "Streaming frames and decode speed").

So the worker sends a chunk at once when the last frame went out at least
``interval_s`` ago (the first chunk always goes at once: time to first token is
untouched), and otherwise holds it and merges the chunks that follow into it
until the interval has passed. A held chunk waits at most the interval plus one
engine step. The final chunk flushes whatever is held, then goes out itself,
and nothing held is dropped on an error: ``flush`` hands it over first. With an
interval of 0 every chunk is its own frame.

A speculative step yields several chunks back to back; they merge into one
frame the same way.

A merged chunk keeps the pieces its text and reasoning came in (``text_pieces``,
``thinking_pieces``), and the client (``runtime.chat``) hands them on one by one:
the HTTP APIs send one event per decode step, as servers that send a frame a
token do. Readers count on that: litellm (aider, mini-swe-agent) ends a stream
as "the model is repeating the same chunk" after 100 equal deltas, and a reply
that repeats a few tokens, decoded at a steady rate, gave 100 equal merged deltas
where the same reply token by token gives none.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from contract.types import StreamChunk

__all__ = ["ChunkCoalescer", "merge", "mergeable"]


def mergeable(first: StreamChunk, then: StreamChunk) -> bool:
    """Whether one chunk can say both without reordering them for a reader of its fields in their order
    (thinking, text, tool calls): reasoning after answer text, or text after a tool call, stays apart."""
    calls = first.tool_calls or first.tool_call_deltas
    if then.thinking and (first.text or calls):
        return False
    return not (then.text and calls)


def merge(first: StreamChunk, then: StreamChunk) -> StreamChunk:
    """One data chunk saying what ``first`` and then ``then`` said: texts joined, lists extended, and each text's
    pieces kept (``text_pieces``, ``thinking_pieces``), so a reader can still send them apart."""
    text = first.text_steps() + then.text_steps()
    thinking = first.thinking_steps() + then.thinking_steps()
    return StreamChunk(
        text=first.text + then.text,
        thinking=first.thinking + then.thinking,
        tool_calls=[*first.tool_calls, *then.tool_calls],
        tool_call_deltas=[*first.tool_call_deltas, *then.tool_call_deltas],
        token_ids=[*first.token_ids, *then.token_ids],
        logprobs=[*first.logprobs, *then.logprobs],
        text_pieces=text if len(text) > 1 else [],
        thinking_pieces=thinking if len(thinking) > 1 else [],
    )


class ChunkCoalescer:
    """Decides which chunks go out now; the rest are held and merged (see the module doc)."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._held: StreamChunk | None = None
        self._sent_at: float | None = None

    def push(self, chunk: StreamChunk) -> list[StreamChunk]:
        """The chunks to send now, in order, after ``chunk`` arrived."""
        if chunk.done or chunk.error is not None:
            return [*self.flush(), chunk]
        now = self._clock()
        due = self._sent_at is None or now - self._sent_at >= self.interval_s
        out: list[StreamChunk] = []
        if self._held is not None:
            if mergeable(self._held, chunk):
                chunk = merge(self._held, chunk)
            else:
                out.append(self._held)
                due = True  # (the held chunk goes now, so the one after it does too)
            self._held = None
        if not due:
            self._held = chunk
            return []
        self._sent_at = now
        return [*out, chunk]

    def flush(self) -> list[StreamChunk]:
        """What is held (nothing, or one merged chunk), handed over now."""
        held, self._held = self._held, None
        if held is None:
            return []
        self._sent_at = self._clock()
        return [held]
