"""Backend-neutral post-processing of a streamed completion.

A backend samples tokens and turns each into bytes; everything after that is the
same for every backend and lives here, so llama.cpp and OpenVINO stream
identical chunks for identical tokens:

    token bytes ─► Utf8Stream ─► StopMatcher ─► ThinkSplitter ─► ToolCallParser ─► chunk
                   (never split   (hold back a   (<think>…</think>   (the model family's
                    a character)   partial stop)  → thinking)         format → ToolCall, and
                                                                      each call as it is written
                                                                      → ToolCallDelta s,
                                                                      ``toolformats``)

Every stage is incremental: it accepts text in arbitrary pieces and holds back
only what it cannot decide yet (an incomplete UTF-8 sequence, text that may be
the start of a stop string or of a tag, an unterminated tool call). Feeding the
same text in any chunking gives the same concatenated output; ``finish()``
releases whatever is still held back. ``OutputPipeline`` wires the stages
together the way a backend's decode loop uses them.

No model library is imported here.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from contract.errors import UnsupportedFeature
from contract.types import StreamChunk, TokenLogprob, ToolCall, ToolCallDelta

from .toolformats import ToolFormat, format_named, known_names, partial_suffix_len

__all__ = [
    "PROTOCOL_THINK",
    "THINK_CLOSE",
    "THINK_OPEN",
    "Delta",
    "OutputPipeline",
    "PerToken",
    "StopMatcher",
    "ThinkSplitter",
    "Utf8Stream",
    "ends_inside_thinking",
    "resolve_protocols",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

#: DecodeConfig.parser_protocols names for the reasoning split (the rest name tool-call formats)
PROTOCOL_THINK = "think"
_THINK_NAMES = {"think", "reasoning"}
#: reasoning_format values: "" / "auto" / "think" / "deepseek" split <think>; "none" leaves it in the text
_REASONING_SPLIT = {"", "auto", "think", "deepseek"}
_REASONING_RAW = {"none"}


def resolve_protocols(
    protocols: Sequence[str], reasoning_format: str, *, has_tools: bool, model_format: ToolFormat
) -> tuple[bool, ToolFormat | None]:
    """Which parsers a decode runs: ``(split_thinking, tool-call format or None)``.

    With no protocols named, thinking is split unless ``reasoning_format`` is
    "none", and calls are parsed in the model's format (``model_format``, from its
    template) when the prefix declared tools; a format that carries reasoning in
    channels of its own (harmony) runs whenever reasoning is split. Naming
    protocols selects exactly those ("think", and at most one format). Unknown
    names are refused rather than ignored, so a client never believes a parser
    ran when it did not.
    """
    if reasoning_format not in _REASONING_SPLIT | _REASONING_RAW:
        raise UnsupportedFeature(
            f"reasoning_format {reasoning_format!r} is not supported; "
            f"use one of {sorted(_REASONING_SPLIT | _REASONING_RAW)}",
            reasoning_format=reasoning_format,
        )
    think_allowed = reasoning_format not in _REASONING_RAW
    if not protocols:
        runs = has_tools or (model_format.own_reasoning and think_allowed)
        return think_allowed and not model_format.own_reasoning, (model_format if runs else None)
    think = False
    chosen: ToolFormat | None = None
    for name in protocols:
        if name.strip().lower() in _THINK_NAMES:
            think = True
            continue
        found = format_named(name)
        if found is None:
            raise UnsupportedFeature(
                f"parser protocol {name!r} is not supported; use one of {sorted(_THINK_NAMES | set(known_names()))}",
                protocol=name,
            )
        if chosen is not None and chosen is not found:
            raise UnsupportedFeature(f"parser protocols name two tool-call formats ({chosen.name}, {found.name})",
                                     protocol=name)
        chosen = found
    own = chosen is not None and chosen.own_reasoning
    return think and think_allowed and not own, chosen


def ends_inside_thinking(prompt_tail: str) -> bool:
    """True when a rendered prompt leaves the model inside an open ``<think>`` block.

    Some templates (DeepSeek-R1, Qwen3 with thinking forced) end the generation
    prompt with ``<think>``; the model's first tokens are then reasoning although
    it never emits the opening tag itself.
    """
    open_at = prompt_tail.rfind(THINK_OPEN)
    return open_at >= 0 and prompt_tail.rfind(THINK_CLOSE) < open_at


class Utf8Stream:
    """Incremental UTF-8 decoding of token bytes: a character split across tokens
    is held back until its last byte arrives. Invalid bytes become U+FFFD rather
    than aborting a stream (a model can emit a lone continuation byte)."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        return self._dec.decode(data, final=False)

    def finish(self) -> str:
        return self._dec.decode(b"", final=True)


class StopMatcher:
    """Cuts the stream at the first stop string, holding back text that may be the
    start of one. ``stopped`` turns True once a stop string was seen; the stop
    string itself and anything after it are never emitted."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        #: the stop string that ended the stream ("" until one does)
        self.matched = ""

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        # The stop that *completes* first wins (ties: the one starting earlier), which is
        # what a token stream sees; so every chunking of the same text cuts at one place.
        hits = [(i + len(s), i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        cut = min(hits)[1] if hits else -1
        if cut >= 0:
            self.matched = min(hits)[2]
            self.stopped = True
            self._held = ""
            return buf[:cut]
        keep = partial_suffix_len(buf, self._stops)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def finish(self) -> str:
        out, self._held = ("" if self.stopped else self._held), ""
        return out


class ThinkSplitter:
    """Routes ``<think>…</think>`` text to reasoning and the rest to content.

    ``feed`` returns ``(content, thinking)``. Tags are removed; a tag split across
    pieces is held back until it is complete or proven not to be a tag.
    """

    def __init__(self, *, start_inside: bool = False, open_tag: str = THINK_OPEN, close_tag: str = THINK_CLOSE) -> None:
        self.inside = start_inside
        self._open = open_tag
        self._close = close_tag
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        buf = self._held + text
        self._held = ""
        content: list[str] = []
        thinking: list[str] = []
        while buf:
            tag = self._close if self.inside else self._open
            sink = thinking if self.inside else content
            at = buf.find(tag)
            if at >= 0:
                sink.append(buf[:at])
                buf = buf[at + len(tag) :]
                self.inside = not self.inside
                continue
            keep = partial_suffix_len(buf, [tag])
            sink.append(buf[: len(buf) - keep])
            self._held = buf[len(buf) - keep :]
            break
        return "".join(content), "".join(thinking)

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return ("", held) if self.inside else (held, "")


@dataclass
class Delta:
    """What one fed piece (or the final flush) contributes to the stream."""

    text: str = ""
    thinking: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    #: the calls as they are written (a call's first piece comes before or with the call)
    tool_call_deltas: list[ToolCallDelta] = field(default_factory=list)
    #: a stop string was reached: the decode loop should stop sampling
    stopped: bool = False

    def __bool__(self) -> bool:
        return bool(self.text or self.thinking or self.tool_calls or self.tool_call_deltas)

    def chunk(self, token_ids: list[int] | None = None) -> StreamChunk:
        return StreamChunk(
            text=self.text, thinking=self.thinking, tool_calls=self.tool_calls,
            tool_call_deltas=self.tool_call_deltas, token_ids=token_ids or [],
        )


class OutputPipeline:
    """The decode loop's text side: bytes in, content/thinking/tool calls out."""

    def __init__(
        self,
        *,
        stops: Sequence[str] = (),
        split_thinking: bool = True,
        start_in_thinking: bool = False,
        tool_format: ToolFormat | None = None,
        parameter_types: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self._utf8 = Utf8Stream()
        self._stop = StopMatcher(stops)
        self._think = ThinkSplitter(start_inside=start_in_thinking) if split_thinking else None
        self._tools = tool_format.streamer(parameter_types) if tool_format is not None else None
        #: the control-token texts the decode must feed as text (the format's markers)
        self.markers: frozenset[str] = frozenset(tool_format.markers) if tool_format is not None else frozenset()

    @property
    def stop_sequence(self) -> str:
        """The stop string that ended the answer ("" when none did)."""
        return self._stop.matched

    @property
    def tool_call_count(self) -> int:
        return self._tools.count if self._tools is not None else 0

    def feed_bytes(self, data: bytes) -> Delta:
        return self._route(self._stop.feed(self._utf8.feed(data)), final=False)

    def finish(self) -> Delta:
        tail = self._utf8.finish()
        text = self._stop.feed(tail) if tail else ""
        text += self._stop.finish()
        return self._route(text, final=True)

    def _route(self, text: str, *, final: bool) -> Delta:
        stopped = self._stop.stopped
        content, thinking = text, ""
        if self._think is not None:
            content, thinking = self._think.feed(text)
            if final or stopped:
                c2, t2 = self._think.finish()
                content, thinking = content + c2, thinking + t2
        calls: list[ToolCall] = []
        deltas: list[ToolCallDelta] = []
        if self._tools is not None:
            content, reasoning, calls, deltas = self._tools.feed(content)
            if final or stopped:
                c3, r3, more, more_deltas = self._tools.finish()
                content += c3
                reasoning += r3
                calls += more
                deltas += more_deltas
            thinking += reasoning
        return Delta(text=content, thinking=thinking, tool_calls=calls, tool_call_deltas=deltas, stopped=stopped)


class PerToken:
    """The chunks of a decode that hands out token ids (``DecodeConfig.return_token_ids``): exactly one per sampled
    token, with its own id, its log probability and its share of the text, in order.

    A token whose text the output holds back (a possible stop string, a tool call being parsed) waits, and goes out
    with the token that releases it: each of them with the text its own bytes spell when the released text is just
    their bytes (a stop string that did not come), else the whole release on the last of them (a parser rewrote it:
    tags dropped, a call parsed) and none on the others. Tokens never released (a stop string that came) go out at
    the end with no text. A reader then sends a token a message, its position one past the last, whatever frames
    the daemon merged the chunks into."""

    def __init__(self) -> None:
        self._waiting: list[tuple[int, bytes, TokenLogprob | None]] = []

    def add(self, token: int, fed: bytes, logprob: TokenLogprob | None, delta: Delta) -> list[StreamChunk]:
        """The token just sampled (``fed``: the bytes it fed the output) and what the output gave for it."""
        self._waiting.append((token, fed, logprob))
        return self._release(delta) if delta else []

    def flush(self, tail: Delta) -> list[StreamChunk]:
        """At the end: what still waits, with the output's last text (``OutputPipeline.finish``)."""
        if not self._waiting:
            return [tail.chunk()] if tail else []
        return self._release(tail)

    def _release(self, delta: Delta) -> list[StreamChunk]:
        waiting, self._waiting = self._waiting, []
        parts = [""] * len(waiting)
        plain = not (delta.thinking or delta.tool_calls or delta.tool_call_deltas)
        if plain and delta.text:
            dec = codecs.getincrementaldecoder("utf-8")("replace")
            spelled = [dec.decode(fed) for _, fed, _ in waiting]
            spelled[-1] += dec.decode(b"", final=True)
            parts = spelled if "".join(spelled) == delta.text else [*parts[:-1], delta.text]
        out = []
        for i, ((token, _, logprob), text) in enumerate(zip(waiting, parts, strict=True)):
            last = i == len(waiting) - 1
            chunk = delta.chunk([token]) if last and not plain else StreamChunk(text=text, token_ids=[token])
            chunk.logprobs = [logprob] if logprob is not None else []
            out.append(chunk)
        return out
