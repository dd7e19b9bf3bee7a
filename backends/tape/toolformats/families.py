"""The families' own parsers: Hermes/Qwen3-Coder bodies, Llama 3.x JSON, Mistral, DeepSeek and gpt-oss harmony."""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from typing import Any, Protocol

from contract.types import ToolCall

from .parsing import (
    BlockParser,
    CallParser,
    IdFactory,
    as_object,
    is_text_kind,
    json_calls,
    json_values,
    make_call,
    parse_json_call,
    parse_xml_call,
    partial_suffix_len,
    xml_value,
)
from .streaming import Partial, canonical_prefix, json_call_partial

_ARGS_KEYS = ("arguments", "parameters")


class _Ids(Protocol):
    def upcoming_id(self, k: int = 0) -> str: ...

_LLAMA_KEYS = ("parameters", "arguments")


def hermes_body(types: dict[str, dict[str, Any]] | None) -> Callable[[str, CallParser], list[ToolCall] | None]:
    def body(inner: str, parser: CallParser) -> list[ToolCall] | None:
        inner = inner.strip()
        call = parse_xml_call(inner, "", types) if inner.startswith("<function=") else parse_json_call(inner, "")
        if call is None:
            return None
        call.id = parser.next_id()
        return [call]

    return body


_XML_OPEN = re.compile(r"<function=([^>\n]+)>")
_XML_PARAM_OPEN = re.compile(r"<parameter=([^>\n]+)>")
_XML_CLOSE = "</parameter>"


def _xml_arguments(s: str, types: dict[str, dict[str, Any]] | None) -> tuple[str, str] | None:
    """A Qwen3-Coder call being written: its name and the certain part of its arguments as JSON (a string
    parameter's text as it comes, less what may still be the line break before ``</parameter>``; any other
    value once its parameter closes); None until the name is known."""
    m = _XML_OPEN.match(s)
    if m is None:
        return None
    name = m.group(1).strip()
    kinds = (types or {}).get(name, {})
    out = ["{"]
    pos = m.end()
    while (pm := _XML_PARAM_OPEN.search(s, pos)) is not None:
        key = pm.group(1).strip()
        out.append((", " if len(out) > 1 else "") + json.dumps(key, ensure_ascii=False) + ": ")
        close = s.find(_XML_CLOSE, pm.end())
        raw = s[pm.end() : close if close >= 0 else len(s)]
        if close >= 0:  # as parse_xml_call reads it: one line break either side is the layout
            value = raw[1:] if raw.startswith("\n") else raw
            value = value[:-1] if value.endswith("\n") else value
            out.append(json.dumps(xml_value(value, kinds.get(key)), ensure_ascii=False))
            pos = close + len(_XML_CLOSE)
            continue
        if is_text_kind(kinds.get(key)):  # a string parameter: its text goes out as it comes
            out.append('"')
            if raw:
                value = raw[1:] if raw.startswith("\n") else raw
                hold = partial_suffix_len(value, ["\n" + _XML_CLOSE, _XML_CLOSE])
                out.append(json.dumps(value[: len(value) - hold], ensure_ascii=False)[1:-1])
        break
    return name, "".join(out)


def hermes_partial(types: dict[str, dict[str, Any]] | None) -> Callable[[str, CallParser], list[Partial]]:
    def partial(inner: str, parser: CallParser) -> list[Partial]:
        s = inner.lstrip()
        if s.startswith("<function="):
            found = _xml_arguments(s, types)
            return [] if found is None else [Partial(parser.upcoming_id(), found[0], found[1])]
        if not s.startswith("{"):
            return []
        so_far = json_call_partial(s, 0, _ARGS_KEYS)
        return [Partial(parser.upcoming_id(), so_far.name, so_far.arguments or "")] if so_far.name else []

    return partial


def json_calls_partial(text: str, parser: _Ids, args_keys: tuple[str, ...], *,
                       written_ids: bool) -> list[Partial]:
    """Calls written as JSON objects, or lists of them, separated by ``;`` or whitespace (as ``json_calls``
    reads them), as far as they are written. With ``written_ids`` a call is shown once its model-written
    ``"id"`` is read or its object ends without one (the id it gets depends on it)."""
    out: list[Partial] = []
    k = 0  # calls so far that get an id of ours
    i, n = 0, len(text)
    while True:
        while i < n and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i >= n:
            return out
        listed = text[i] == "["
        if listed:
            i += 1
        while True:
            while i < n and text[i].isspace():
                i += 1
            if i >= n:
                return out
            if listed and text[i] == "]":
                i += 1
                break
            so_far = json_call_partial(text, i, args_keys, written_id=written_ids)
            if not so_far.name or (written_ids and so_far.id is None and so_far.end is None):
                return out
            if written_ids and so_far.id:
                call_id = so_far.id
            else:
                call_id = parser.upcoming_id(k)
                k += 1
            out.append(Partial(call_id, so_far.name, so_far.arguments or "",
                               complete=so_far.arguments_done or so_far.end is not None))
            if so_far.end is None:
                return out
            i = so_far.end
            if not listed:
                break
            while i < n and text[i].isspace():
                i += 1
            if i < n and text[i] == ",":
                i += 1


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
        return json_calls(inner, parser.next_id, _LLAMA_KEYS, written_ids=False)

    def partial(self) -> list[Partial]:
        if self._mode == "json":
            text = self._lead
        elif self._mode == "text" and self._tagged.inside:
            text = self._tagged.held[len(self.TAG) :]
        else:
            return []
        try:  # (every id comes from this parser: the tagged one asks it for each)
            return json_calls_partial(text, self, _LLAMA_KEYS, written_ids=False)
        except ValueError:
            return []

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
            calls = json_calls(lead, self.next_id, _LLAMA_KEYS, written_ids=False)
            if calls is None:
                self.take_back_ids(made)
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


def mistral_partial(inner: str, parser: CallParser) -> list[Partial]:
    out: list[Partial] = []
    for piece in inner.split("[TOOL_CALLS]"):
        if not piece.strip():
            continue
        m = _MISTRAL_ARGS.match(piece)
        if m is not None:
            rest = piece[m.end() :]
            args, end = canonical_prefix(rest) if rest.lstrip().startswith("{") else ("", None)
            out.append(Partial(parser.upcoming_id(len(out)), m.group(1), args, complete=end is not None))
            continue
        if not piece.lstrip().startswith(("[", "{")):
            return out  # a name still being written, or not a call
        # (the ids of ours in this piece come after those of the pieces before it)
        shift = len(out)
        more = json_calls_partial(piece, _Shifted(parser, shift), _ARGS_KEYS, written_ids=True)
        out += more
        return out
    return out


class _Shifted:
    """A parser's upcoming ids from the ``shift``-th on (the calls before are in earlier pieces)."""

    def __init__(self, parser: CallParser, shift: int) -> None:
        self._parser = parser
        self._shift = shift

    def upcoming_id(self, k: int = 0) -> str:
        return self._parser.upcoming_id(self._shift + k)


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


_DS_BEGIN = "<｜tool▁call▁begin｜>"
_DS_V3_HEAD = re.compile(r"\s*function\s*<｜tool▁sep｜>\s*([^\n<]+?)\s*\n")
_DS_V3_FENCE = re.compile(r"```(?:json)?\s*\n")
_DS_V31_HEAD = re.compile(r"\s*([^<]+?)\s*<｜tool▁sep｜>")


def deepseek_partial(inner: str, parser: CallParser) -> list[Partial]:
    out: list[Partial] = []
    for seg in inner.split(_DS_BEGIN)[1:]:
        seg = seg.split("<｜tool▁call▁end｜>")[0]
        m = _DS_V3_HEAD.match(seg)
        if m is not None:
            fence = _DS_V3_FENCE.match(seg, m.end())
            start = fence.end() if fence is not None else -1
        elif seg.lstrip().startswith("function"):
            return out  # V3's head, its name not yet whole
        elif (m := _DS_V31_HEAD.match(seg)) is not None:
            start = m.end()
        else:
            return out
        args, end = "", None
        if start >= 0 and seg[start:].lstrip().startswith("{"):
            args, end = canonical_prefix(seg, start)
        out.append(Partial(parser.upcoming_id(len(out)), m.group(1).strip(), args, complete=end is not None))
    return out


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

    def partial(self) -> list[Partial]:
        if self._state != "body" or self._sink != "call":
            return []
        m = self._TO.search(self._header)
        if m is None:
            return []
        args = ""
        if self._body.lstrip().startswith("{"):
            try:
                args = canonical_prefix(self._body)[0]
            except ValueError:
                return []
        return [Partial(self.upcoming_id(), m.group(1), args)]

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
