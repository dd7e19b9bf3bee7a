"""Backend-neutral post-processing of a streamed completion.

A backend samples tokens and turns each into bytes; everything after that is the
same for every backend and lives here, so llama.cpp and OpenVINO stream
identical chunks for identical tokens:

    token bytes ─► Utf8Stream ─► StopMatcher ─► ThinkSplitter ─► ToolCallParser ─► chunk
                   (never split   (hold back a   (<think>…</think>   (<tool_call>{json}</tool_call>
                    a character)   partial stop)  → thinking)         → ToolCall)

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
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from contract.errors import UnsupportedFeature
from contract.types import StreamChunk, ToolCall, ToolCallFunction

__all__ = [
    "HERMES_TOOL_CLOSE",
    "HERMES_TOOL_OPEN",
    "PROTOCOL_HERMES",
    "PROTOCOL_THINK",
    "THINK_CLOSE",
    "THINK_OPEN",
    "Delta",
    "OutputPipeline",
    "StopMatcher",
    "ThinkSplitter",
    "ToolCallParser",
    "Utf8Stream",
    "ends_inside_thinking",
    "parse_tool_call_json",
    "resolve_protocols",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
HERMES_TOOL_OPEN = "<tool_call>"
HERMES_TOOL_CLOSE = "</tool_call>"

#: DecodeConfig.parser_protocols names (aliases map to these)
PROTOCOL_THINK = "think"
PROTOCOL_HERMES = "hermes"
_PROTOCOL_ALIASES = {
    "think": PROTOCOL_THINK,
    "reasoning": PROTOCOL_THINK,
    "hermes": PROTOCOL_HERMES,
    "qwen": PROTOCOL_HERMES,
    "tool_call": PROTOCOL_HERMES,
    "tool_calls": PROTOCOL_HERMES,
}
#: reasoning_format values: "" / "auto" / "think" / "deepseek" split <think>; "none" leaves it in the text
_REASONING_SPLIT = {"", "auto", "think", "deepseek"}
_REASONING_RAW = {"none"}


def resolve_protocols(
    protocols: Sequence[str], reasoning_format: str, *, has_tools: bool
) -> tuple[bool, bool]:
    """Which parsers a decode runs: ``(split_thinking, parse_tool_calls)``.

    With no protocols named, thinking is split unless ``reasoning_format`` is
    "none", and Hermes tool calls are parsed when the prefix declared tools.
    Naming protocols selects exactly those. Unknown names are refused rather than
    ignored, so a client never believes a parser ran when it did not.
    """
    if reasoning_format not in _REASONING_SPLIT | _REASONING_RAW:
        raise UnsupportedFeature(
            f"reasoning_format {reasoning_format!r} is not supported; "
            f"use one of {sorted(_REASONING_SPLIT | _REASONING_RAW)}",
            reasoning_format=reasoning_format,
        )
    think_allowed = reasoning_format not in _REASONING_RAW
    if not protocols:
        return think_allowed, has_tools
    resolved: set[str] = set()
    for name in protocols:
        canon = _PROTOCOL_ALIASES.get(name.strip().lower())
        if canon is None:
            raise UnsupportedFeature(
                f"parser protocol {name!r} is not supported; use one of {sorted(_PROTOCOL_ALIASES)}",
                protocol=name,
            )
        resolved.add(canon)
    return (PROTOCOL_THINK in resolved and think_allowed), PROTOCOL_HERMES in resolved


def ends_inside_thinking(prompt_tail: str) -> bool:
    """True when a rendered prompt leaves the model inside an open ``<think>`` block.

    Some templates (DeepSeek-R1, Qwen3 with thinking forced) end the generation
    prompt with ``<think>``; the model's first tokens are then reasoning although
    it never emits the opening tag itself.
    """
    open_at = prompt_tail.rfind(THINK_OPEN)
    return open_at >= 0 and prompt_tail.rfind(THINK_CLOSE) < open_at


def _partial_suffix_len(text: str, needles: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a needle."""
    best = 0
    for needle in needles:
        for k in range(min(len(needle) - 1, len(text)), best, -1):
            if text.endswith(needle[:k]):
                best = k
                break
    return best


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
        keep = _partial_suffix_len(buf, self._stops)
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
            keep = _partial_suffix_len(buf, [tag])
            sink.append(buf[: len(buf) - keep])
            self._held = buf[len(buf) - keep :]
            break
        return "".join(content), "".join(thinking)

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return ("", held) if self.inside else (held, "")


def parse_tool_call_json(body: str, call_id: str) -> ToolCall | None:
    """A Hermes/Qwen tool-call body ``{"name": …, "arguments": {…}}`` as a ToolCall.

    Returns None when the body is not a JSON object with a string ``name``;
    ``arguments`` (or ``parameters``) may be an object or a JSON string and is
    re-serialised compactly, as OpenAI-style clients expect a string.
    """
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(
        id=call_id,
        type="function",
        function=ToolCallFunction(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False)),
    )


class ToolCallParser:
    """Extracts ``<tool_call>{json}</tool_call>`` blocks from streamed content.

    ``feed`` returns ``(content, calls)``. Text inside a block is held until the
    closing tag; a block whose body is not a valid call is given back verbatim
    as content (a model that writes about tool calls is not silently eaten).
    An unterminated block at ``finish`` is likewise returned as content.
    """

    def __init__(
        self,
        *,
        open_tag: str = HERMES_TOOL_OPEN,
        close_tag: str = HERMES_TOOL_CLOSE,
        id_factory: Callable[[int], str] | None = None,
    ) -> None:
        self._open = open_tag
        self._close = close_tag
        self._ids = id_factory or (lambda i: f"call_{i}")
        self._held = ""
        self._inside = False
        self.count = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        buf = self._held + text
        self._held = ""
        content: list[str] = []
        calls: list[ToolCall] = []
        while buf:
            if not self._inside:
                at = buf.find(self._open)
                if at < 0:
                    keep = _partial_suffix_len(buf, [self._open])
                    content.append(buf[: len(buf) - keep])
                    self._held = buf[len(buf) - keep :]
                    break
                content.append(buf[:at])
                buf = buf[at:]
                self._inside = True
                continue
            end = buf.find(self._close)
            if end < 0:
                self._held = buf  # the whole block so far, opening tag included
                break
            block = buf[: end + len(self._close)]
            buf = buf[end + len(self._close) :]
            self._inside = False
            call = parse_tool_call_json(block[len(self._open) : -len(self._close)].strip(), self._ids(self.count))
            if call is None:
                content.append(block)
            else:
                calls.append(call)
                self.count += 1
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        self._inside = False
        return held, []


@dataclass
class Delta:
    """What one fed piece (or the final flush) contributes to the stream."""

    text: str = ""
    thinking: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    #: a stop string was reached: the decode loop should stop sampling
    stopped: bool = False

    def __bool__(self) -> bool:
        return bool(self.text or self.thinking or self.tool_calls)

    def chunk(self, token_ids: list[int] | None = None) -> StreamChunk:
        return StreamChunk(
            text=self.text, thinking=self.thinking, tool_calls=self.tool_calls, token_ids=token_ids or []
        )


class OutputPipeline:
    """The decode loop's text side: bytes in, content/thinking/tool calls out."""

    def __init__(
        self,
        *,
        stops: Sequence[str] = (),
        split_thinking: bool = True,
        start_in_thinking: bool = False,
        parse_tools: bool = False,
    ) -> None:
        self._utf8 = Utf8Stream()
        self._stop = StopMatcher(stops)
        self._think = ThinkSplitter(start_inside=start_in_thinking) if split_thinking else None
        self._tools = ToolCallParser() if parse_tools else None

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
        if self._tools is not None:
            content, calls = self._tools.feed(content)
            if final or stopped:
                c3, more = self._tools.finish()
                content += c3
                calls += more
        return Delta(text=content, thinking=thinking, tool_calls=calls, stopped=stopped)
