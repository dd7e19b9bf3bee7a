"""The families' own parsers: Hermes/Qwen3-Coder bodies, Llama 3.x JSON, Mistral, DeepSeek and gpt-oss harmony."""

from __future__ import annotations

import re
import secrets
import string
from collections.abc import Callable
from typing import Any

from contract.types import ToolCall

from .parsing import (
    BlockParser,
    CallParser,
    IdFactory,
    as_object,
    json_calls,
    json_values,
    make_call,
    parse_json_call,
    parse_xml_call,
    partial_suffix_len,
)


def hermes_body(types: dict[str, dict[str, Any]] | None) -> Callable[[str, CallParser], list[ToolCall] | None]:
    def body(inner: str, parser: CallParser) -> list[ToolCall] | None:
        inner = inner.strip()
        call = parse_xml_call(inner, "", types) if inner.startswith("<function=") else parse_json_call(inner, "")
        if call is None:
            return None
        call.id = parser.next_id()
        return [call]

    return body


class Llama3Parser(CallParser):
    """Llama 3.x: a reply that is JSON call(s) as a whole (``{"name": …, "parameters": …}``, several
    separated by ``;``), or text then ``<|python_tag|>`` and calls. A reply that starts like JSON is held
    to its end; if it is not calls it is content."""

    TAG = "<|python_tag|>"

    def __init__(self, ids: IdFactory | None = None) -> None:
        super().__init__(ids)
        self._tagged = BlockParser(self.TAG, "", self._calls, ids=self._share_ids)
        self._lead = ""  # text before the first non-space character is known
        self._mode = ""  # "" undecided, "json" holding a JSON reply, "text"

    def _share_ids(self, i: int) -> str:
        return self.next_id()

    @property
    def count(self) -> int:
        return self._count + self._tagged.count

    @count.setter
    def count(self, value: int) -> None:
        self._count = value

    def _calls(self, inner: str, parser: CallParser) -> list[ToolCall] | None:
        return json_calls(inner, parser.next_id, ("parameters", "arguments"))

    def feed(self, text: str) -> tuple[str, str, list[ToolCall]]:
        if self._mode == "json":
            self._lead += text
            return "", "", []
        if self._mode == "text":
            return self._tagged.feed(text)
        self._lead += text
        stripped = self._lead.lstrip()
        if not stripped:
            return "", "", []
        if stripped[0] in "{[":
            self._mode = "json"
            return "", "", []
        self._mode = "text"
        lead, self._lead = self._lead, ""
        return self._tagged.feed(lead)

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        if self._mode == "json":
            lead, self._lead = self._lead, ""
            made = self._made
            calls = json_calls(lead, self.next_id, ("parameters", "arguments"))
            if calls is None:
                self._made = made
                return lead, "", []
            self.count += len(calls)
            return "", "", calls
        if self._mode == "":
            lead, self._lead = self._lead, ""
            return lead, "", []
        return self._tagged.finish()


_MISTRAL_ARGS = re.compile(r"\s*([^\s\[\]{}]+?)\s*\[ARGS\]")
_ID_CHARS = string.ascii_letters + string.digits


def mistral_id(_: int = 0) -> str:
    """A call id as Mistral's templates require: nine letters and digits."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


def mistral_body(inner: str, parser: CallParser) -> list[ToolCall] | None:
    """After ``[TOOL_CALLS]``: a JSON list of calls, or ``name[ARGS]{…}`` (repeated with ``[TOOL_CALLS]``)."""
    pieces = [p for p in inner.split("[TOOL_CALLS]")]
    calls: list[ToolCall] = []
    for piece in pieces:
        if not piece.strip():
            continue
        m = _MISTRAL_ARGS.match(piece)
        if m is not None:
            values = json_values(piece[m.end() :])
            if not values or len(values) != 1:
                return None
            args = as_object(values[0])
            if args is None:
                return None
            calls.append(make_call(parser.next_id(), m.group(1), args))
            continue
        found = json_calls(piece, parser.next_id, ("arguments", "parameters"))
        if found is None:
            return None
        calls += found
    return calls or None


_DS_CALL = re.compile(
    r"<｜tool▁call▁begin｜>\s*(?:function\s*<｜tool▁sep｜>\s*(?P<name1>[^\n<]+?)\s*\n```(?:json)?\s*\n(?P<args1>.*?)\n```"
    r"|(?P<name2>[^<]+?)\s*<｜tool▁sep｜>\s*(?P<args2>.*?))\s*<｜tool▁call▁end｜>",
    re.DOTALL,
)


def deepseek_body(inner: str, parser: CallParser) -> list[ToolCall] | None:
    calls: list[ToolCall] = []
    pos = 0
    for m in _DS_CALL.finditer(inner):
        if inner[pos : m.start()].strip():
            return None
        pos = m.end()
        name = m.group("name1") or m.group("name2")
        args = as_object(m.group("args1") if m.group("name1") else m.group("args2"))
        if args is None:
            return None
        calls.append(make_call(parser.next_id(), name.strip(), args))
    if inner[pos:].strip() or not calls:
        return None
    return calls


class HarmonyParser(CallParser):
    """gpt-oss harmony messages: ``<|channel|>C<|message|>…`` ended by ``<|end|>``/``<|call|>``/the reply's end,
    the next opened by ``<|start|>assistant``. ``analysis`` is reasoning, ``final`` (and a commentary
    preamble) content, a message whose header names ``to=functions.N`` a call to N.

    The generation prompt ends with ``<|start|>assistant``, so a reply opens in a message's role part,
    where a recipient may stand (`` to=functions.N<|channel|>commentary json<|message|>``, the form the
    template renders calls back in). Text outside any message, or a role part that is plainly not one
    (a line break, or longer than ``_ROLE_MAX``: a model that writes no headers), is content.
    """

    _ROLE_MAX = 256

    MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
    _TO = re.compile(r"to=functions\.([^\s<]+)")

    def __init__(self, ids: IdFactory | None = None) -> None:
        super().__init__(ids)
        self._held = ""
        self._state = "role"  # out | role (after <|start|>) | header (after <|channel|>) | body
        self._header = ""
        self._body = ""
        self._sink = "content"  # where the body goes: content | reasoning | call

    def _open_body(self) -> None:
        header = self._header
        self._body = ""
        if self._TO.search(header):
            self._sink = "call"
        elif "<|channel|>analysis" in header:
            self._sink = "reasoning"
        else:
            self._sink = "content"

    def _close_body(self, out: tuple[list[str], list[str], list[ToolCall]], *, raw_end: str) -> None:
        content, reasoning, calls = out
        if self._sink == "call":
            m = self._TO.search(self._header)
            args = as_object(self._body.strip())
            if m is not None and args is not None:
                calls.append(make_call(self.next_id(), m.group(1), args))
                self.count += 1
            else:  # a call that does not parse is shown as it was written
                content.append(self._header + "<|message|>" + self._body + raw_end)
        self._header = ""
        self._body = ""
        self._sink = "content"
        self._state = "out"

    def feed(self, text: str) -> tuple[str, str, list[ToolCall]]:
        buf = self._held + text
        self._held = ""
        content: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        out = (content, reasoning, calls)
        while buf:
            hits = [(i, mk) for mk in self.MARKERS if (i := buf.find(mk)) >= 0]
            at, marker = min(hits) if hits else (-1, "")
            if at < 0:
                keep = partial_suffix_len(buf, self.MARKERS)
                piece, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
                self._take(piece, out)
                break
            self._take(buf[:at], out)
            buf = buf[at + len(marker) :]
            self._marker(marker, out)
        return "".join(content), "".join(reasoning), calls

    def _take(self, piece: str, out: tuple[list[str], list[str], list[ToolCall]]) -> None:
        if not piece:
            return
        if self._state == "role" and ("\n" in self._header + piece or len(self._header + piece) > self._ROLE_MAX):
            out[0].append(self._header + piece)  # not a role part: text outside any message
            self._header = ""
            self._state = "out"
        elif self._state in ("role", "header"):
            self._header += piece  # the role and recipient after <|start|>, or the channel's header
        elif self._state == "body":
            if self._sink == "call":
                self._body += piece
            elif self._sink == "reasoning":
                out[1].append(piece)
            else:
                out[0].append(piece)
        else:
            out[0].append(piece)  # text outside any message (a model that writes no headers)

    def _marker(self, marker: str, out: tuple[list[str], list[str], list[ToolCall]]) -> None:
        if self._state == "body" and marker != "<|message|>":
            self._close_body(out, raw_end=marker if marker in ("<|end|>", "<|call|>", "<|return|>") else "")
        if marker == "<|start|>":
            self._state = "role"
            self._header = ""
        elif marker in ("<|channel|>", "<|constrain|>"):
            if self._state == "out":
                self._header = ""
            self._state = "header"
            self._header += marker
        elif marker == "<|message|>":
            if self._state not in ("role", "header"):
                self._header = ""
            self._state = "body"
            self._open_body()
        else:  # <|end|>, <|call|>, <|return|>
            self._state = "out"

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        content: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        out = (content, reasoning, calls)
        held, self._held = self._held, ""
        self._take(held, out)
        if self._state == "body":
            self._close_body(out, raw_end="")
        elif self._state in ("role", "header") and self._header:
            content.append(self._header)  # a header never followed by a message: shown as written
        self._state = "out"
        self._header = ""
        return "".join(content), "".join(reasoning), calls
