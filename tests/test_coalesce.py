"""modeld.coalesce: which decode chunks go out at once and which are held and merged, on an injected clock."""

from __future__ import annotations

import pytest

from contract.types import ErrorInfo, StreamChunk, TokenLogprob, ToolCall, ToolCallFunction
from modeld.coalesce import ChunkCoalescer, merge, mergeable
from runtime.chat import ChatEvent


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def text(s: str, tok: int) -> StreamChunk:
    return StreamChunk(text=s, token_ids=[tok])


def test_first_chunk_goes_at_once_then_one_frame_per_interval() -> None:
    clock = Clock()
    c = ChunkCoalescer(0.020, clock)
    assert c.push(text("a", 1)) == [text("a", 1)]  # time to first token untouched
    clock.now += 0.010
    assert c.push(text("b", 2)) == []  # held: the last frame went 10 ms ago
    clock.now += 0.005
    assert c.push(text("c", 3)) == []
    clock.now += 0.010  # 25 ms since the last frame
    assert c.push(text("d", 4)) == [StreamChunk(text="bcd", token_ids=[2, 3, 4], text_pieces=["b", "c", "d"])]
    clock.now += 0.030  # a slow step: its chunk is due at once
    assert c.push(text("e", 5)) == [text("e", 5)]


def test_final_chunk_flushes_what_is_held_first() -> None:
    clock = Clock()
    c = ChunkCoalescer(0.020, clock)
    c.push(text("a", 1))
    assert c.push(text("b", 2)) == []
    final = StreamChunk(done=True, finish_reason="stop")
    assert c.push(final) == [text("b", 2), final]
    assert c.flush() == []


def test_an_error_chunk_is_never_held_nor_merged() -> None:
    clock = Clock()
    c = ChunkCoalescer(1.0, clock)
    c.push(text("a", 1))
    c.push(text("b", 2))
    err = StreamChunk(error=ErrorInfo(code=13, name="Internal", message="boom"))
    assert c.push(err) == [text("b", 2), err]


def test_flush_hands_over_held_text_once() -> None:
    clock = Clock()
    c = ChunkCoalescer(1.0, clock)
    c.push(text("a", 1))
    c.push(text("b", 2))
    c.push(text("c", 3))
    assert c.flush() == [StreamChunk(text="bc", token_ids=[2, 3], text_pieces=["b", "c"])]
    assert c.flush() == []
    assert c.push(text("d", 4)) == []  # the flush counts as a frame: the interval starts again


def test_interval_zero_sends_every_chunk() -> None:
    clock = Clock()
    c = ChunkCoalescer(0.0, clock)
    chunks = [text(s, i) for i, s in enumerate("abcdef")]
    assert [out for ch in chunks for out in c.push(ch)] == chunks


def test_merge_joins_every_channel() -> None:
    call = ToolCall(id="c1", function=ToolCallFunction(name="read", arguments='{"path": "a"}'))
    scores = [TokenLogprob(token_id=t, logprob=-0.5 * t) for t in range(1, 5)]
    a = StreamChunk(thinking="hm", token_ids=[1], logprobs=scores[:1])
    b = StreamChunk(thinking=" ok", text="Hi", token_ids=[2, 3], logprobs=scores[1:3])
    c = StreamChunk(tool_calls=[call], token_ids=[4], logprobs=scores[3:])
    merged = merge(merge(a, b), c)
    assert merged == StreamChunk(thinking="hm ok", text="Hi", tool_calls=[call], token_ids=[1, 2, 3, 4],
                                 thinking_pieces=["hm", " ok"], logprobs=scores)
    # the client hands a merged frame's log probabilities on with its first event
    assert [e.logprobs for e in ChatEvent.steps(merged)] == [scores, [], [], []]


def test_a_merged_chunk_keeps_its_pieces_and_the_client_hands_them_on_one_by_one() -> None:
    """A reply that repeats a few tokens, merged a steady number of steps a frame, makes equal frames; the pieces
    it came in are kept, and the chat client yields an event a piece (what the HTTP APIs send a delta for)."""
    steps = [StreamChunk(thinking="so"), StreamChunk(thinking=" yes"), *(text(s, i) for i, s in enumerate("#\n```\n"))]
    merged = steps[0]
    for step in steps[1:]:
        merged = merge(merged, step)
    assert (merged.thinking, merged.text) == ("so yes", "#\n```\n")
    assert (merged.thinking_pieces, merged.text_pieces) == (["so", " yes"], ["#", "\n", "`", "`", "`", "\n"])
    assert merge(text("a", 1), StreamChunk(token_ids=[2])).text_pieces == []  # one piece: none listed
    merged = merge(merged, StreamChunk(tool_calls=[ToolCall(id="f")], token_ids=[9]))
    events = ChatEvent.steps(merged)
    assert [(e.thinking, e.text) for e in events[:-1]] == [("so", ""), (" yes", ""), *(("", s) for s in "#\n```\n")]
    assert [c.id for c in events[-1].tool_calls] == ["f"] and not events[-1].text
    # an unmerged frame stays one event
    one = StreamChunk(thinking="t", text="x", tool_calls=[ToolCall(id="g")])
    assert [(e.thinking, e.text, len(e.tool_calls)) for e in ChatEvent.steps(one)] == [("t", "x", 1)]


@pytest.mark.parametrize(
    ("first", "then", "ok"),
    [
        (StreamChunk(thinking="a"), StreamChunk(text="b"), True),
        (StreamChunk(text="a"), StreamChunk(thinking="b"), False),  # reasoning after the answer text
        (StreamChunk(text="a"), StreamChunk(tool_calls=[ToolCall(id="f")]), True),
        (StreamChunk(tool_calls=[ToolCall(id="f")]), StreamChunk(text="b"), False),  # text after a call
        (StreamChunk(tool_calls=[ToolCall(id="f")]), StreamChunk(tool_calls=[ToolCall(id="g")]), True),
    ],
)
def test_mergeable_keeps_the_order_of_the_fields(first: StreamChunk, then: StreamChunk, ok: bool) -> None:
    assert mergeable(first, then) is ok


def test_an_unmergeable_chunk_sends_the_held_one_and_itself() -> None:
    clock = Clock()
    c = ChunkCoalescer(1.0, clock)
    c.push(text("a", 1))
    c.push(text("b", 2))
    late = StreamChunk(thinking="x")
    assert c.push(late) == [text("b", 2), late]
