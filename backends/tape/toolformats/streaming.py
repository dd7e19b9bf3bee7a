"""Tool calls as they are written: each call's id and name once known, then its arguments piece by piece.

A family's parser returns a call once its text is complete; a client streaming the reply wants the arguments
as the model writes them (OpenAI's ``tool_calls[i].function.arguments`` deltas, Anthropic's
``input_json_delta``, Responses' ``function_call_arguments.delta``). Each parser shows the calls of the block
it is reading (``CallParser.partial``): for every call whose name is known, its id and the part of its
arguments that is already certain. ``CallStreamer`` turns the growth of that view into ``ToolCallDelta`` s.

What is certain: the finished call's ``arguments`` are the JSON the parser re-serialises (``json.dumps``,
``", "``/``": "`` separators, keys in written order), not the model's spelling. ``canonical_prefix`` writes
the arguments read so far in that form, holding back what the next characters may still change: a number
or ``true``/``false``/``null`` until it ends, an escape until it is whole (``\\u`` surrogate pairs joined),
whitespace dropped. So the pieces of a call, joined, are its finished ``arguments`` exactly. Two cases are
held whole, never streamed: arguments written as a JSON string holding an object (Hermes allows it), and a
Mistral list call whose model-written ``"id"`` (the id its template renders back) is not yet read.

A block that turns out not to be a call after its pieces were sent (a reply cut off mid-call, text after the
arguments) is given back as content as before; its pieces stay sent, as a reply cut short leaves an
unfinished call in OpenAI's own streams.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from contract.types import ToolCall, ToolCallDelta

__all__ = ["CallSoFar", "CallStreamer", "Partial", "canonical_prefix", "json_call_partial"]

log = logging.getLogger("modeld.toolformats")


@dataclass(frozen=True)
class Partial:
    """A call being written: its id, its name and the certain part of its arguments (canonical JSON)."""

    id: str
    name: str
    arguments: str
    #: the arguments are whole (nothing but the call's end may follow)
    complete: bool = False


class _More(Exception):
    """The text ends inside the value: what was written out so far is all that is certain."""


_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("-+.eE0123456789")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")


def _esc(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _hex4(s: str, i: int) -> int:
    """The code unit of the four hex digits at ``i``; _More when the text ends first."""
    digits = s[i : i + 4]
    if any(c not in _HEX for c in digits):
        raise ValueError("not an escape")
    if len(digits) < 4:
        raise _More
    return int(digits, 16)


def _string(s: str, i: int, out: list[str]) -> int:
    out.append('"')
    i += 1
    n = len(s)
    while True:
        if i >= n:
            raise _More
        c = s[i]
        if c == '"':
            out.append('"')
            return i + 1
        if c == "\\":
            if i + 1 >= n:
                raise _More
            e = s[i + 1]
            if e != "u":
                if e not in _ESCAPES:
                    raise ValueError("not an escape")
                out.append(_esc(_ESCAPES[e]))
                i += 2
                continue
            unit = _hex4(s, i + 2)
            i += 6
            if 0xD800 <= unit < 0xDC00:  # a high surrogate: json joins it with a low one that follows
                if i < n and s[i] == "\\":
                    if i + 1 >= n:
                        raise _More
                    if s[i + 1] == "u":
                        low = _hex4(s, i + 2)
                        if 0xDC00 <= low < 0xE000:
                            out.append(_esc(chr(0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00))))
                            i += 6
                            continue
                elif i >= n:
                    raise _More
            out.append(_esc(chr(unit)))
            continue
        if ord(c) < 0x20:
            raise ValueError("a control character in a string")
        j = i
        while j < n and s[j] not in '"\\' and ord(s[j]) >= 0x20:
            j += 1
        out.append(_esc(s[i:j]))
        i = j


def _value(s: str, i: int, out: list[str]) -> int:
    i = _ws(s, i)
    if i >= len(s):
        raise _More
    c = s[i]
    if c == "{":
        return _members(s, i, out, "{", "}", keyed=True)
    if c == "[":
        return _members(s, i, out, "[", "]", keyed=False)
    if c == '"':
        return _string(s, i, out)
    if c in "-0123456789":
        j = i
        while j < len(s) and s[j] in _NUMBER_CHARS:
            j += 1
        if j >= len(s):
            raise _More  # the number may go on
        if _NUMBER.fullmatch(s, i, j) is None:
            raise ValueError("not a number")
        out.append(json.dumps(json.loads(s[i:j])))
        return j
    for word in ("true", "false", "null"):
        if s.startswith(word, i):
            out.append(word)
            return i + len(word)
        if word.startswith(s[i:]):
            raise _More
    raise ValueError("not JSON")


def _members(s: str, i: int, out: list[str], opening: str, closing: str, *, keyed: bool) -> int:
    out.append(opening)
    i = _ws(s, i + 1)
    if i >= len(s):
        raise _More
    if s[i] == closing:
        out.append(closing)
        return i + 1
    while True:
        if keyed:
            i = _ws(s, i)
            if i >= len(s):
                raise _More
            if s[i] != '"':
                raise ValueError("not a key")
            i = _ws(s, _string(s, i, out))
            if i >= len(s):
                raise _More
            if s[i] != ":":
                raise ValueError("no colon after a key")
            out.append(": ")
            i += 1
        i = _ws(s, _value(s, i, out))
        if i >= len(s):
            raise _More
        if s[i] == closing:
            out.append(closing)
            return i + 1
        if s[i] != ",":
            raise ValueError("no comma between members")
        out.append(", ")
        i += 1


def canonical_prefix(text: str, start: int = 0) -> tuple[str, int | None]:
    """The JSON value that begins at ``start`` (after whitespace), as far as it is certain, written as
    ``json.dumps(json.loads(value), ensure_ascii=False)`` writes it; and where it ends (None while it goes on).

    ValueError when the text is not the beginning of a JSON value.
    """
    out: list[str] = []
    try:
        end: int | None = _value(text, start, out)
    except _More:
        end = None
    return "".join(out), end


def _key_at(s: str, i: int) -> tuple[str, int]:
    out: list[str] = []
    end = _string(s, i, out)
    return json.loads("".join(out)), end


@dataclass(frozen=True)
class CallSoFar:
    """A JSON call object as far as it is read (``json_call_partial``)."""

    name: str | None = None
    #: the model-written id (None when none is read)
    id: str | None = None
    #: the certain part of the arguments, once they begin as an object
    arguments: str | None = None
    #: the arguments object has ended
    arguments_done: bool = False
    #: where the call object ends (None while it goes on)
    end: int | None = None


def json_call_partial(text: str, start: int, args_keys: tuple[str, ...], *, written_id: bool = False) -> CallSoFar:
    """A call object ``{"name": N, "arguments": {…}, …}`` read so far from ``start``. The arguments stay
    None until they begin as an object (and when they are written as a string); ``written_id`` reads a
    model-written ``"id"``. ValueError when the text is not such an object."""
    name: str | None = None
    call_id: str | None = None
    args: str | None = None
    done = False
    i = _ws(text, start)
    if i >= len(text):
        return CallSoFar()
    if text[i] != "{":
        raise ValueError("not an object")
    i += 1
    try:
        while True:
            i = _ws(text, i)
            if i >= len(text):
                raise _More
            if text[i] == "}":
                return CallSoFar(name, call_id, args, done, i + 1)
            if text[i] == ",":
                i = _ws(text, i + 1)
                if i >= len(text):
                    raise _More
            key, i = _key_at(text, i)
            i = _ws(text, i)
            if i >= len(text):
                raise _More
            if text[i] != ":":
                raise ValueError("no colon after a key")
            i = _ws(text, i + 1)
            if i >= len(text):
                raise _More
            if key in args_keys and args is None:
                if text[i] == "{":
                    out: list[str] = []
                    try:
                        i = _value(text, i, out)
                        done = True
                    finally:
                        args = "".join(out)
                else:
                    i = _value(text, i, [])
            elif key in ("name", "id") and text[i] == '"':
                value, i = _key_at(text, i)
                if key == "name":
                    name = value
                elif written_id:
                    call_id = value
            else:
                i = _value(text, i, [])
    except _More:
        return CallSoFar(name, call_id, args, done, None)


@dataclass
class _Sent:
    index: int
    arguments: str = ""
    complete: bool = False


class CallStreamer:
    """A family's parser with its calls also given as ``ToolCallDelta`` s: ``feed`` → (content, reasoning,
    calls, deltas). Every call the parser returns has had (or gets with it) a first delta with its id and
    name, and the arguments of its deltas joined are its ``function.arguments``. Calls come one after
    another: a call's first delta waits until the arguments of the call before it are whole, so a reader
    may take a call's first delta as the end of the one before (Anthropic's blocks, Responses' items)."""

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self._open: dict[str, _Sent] = {}  # call id -> what was sent of it
        self._next = 0

    @property
    def count(self) -> int:
        return int(self.parser.count)

    def feed(self, text: str) -> tuple[str, str, list[ToolCall], list[ToolCallDelta]]:
        content, reasoning, calls = self.parser.feed(text)
        return content, reasoning, calls, self._deltas(calls)

    def finish(self) -> tuple[str, str, list[ToolCall], list[ToolCallDelta]]:
        content, reasoning, calls = self.parser.finish()
        return content, reasoning, calls, self._deltas(calls)

    def _start(self, call_id: str, name: str, out: list[ToolCallDelta]) -> _Sent:
        sent = self._open[call_id] = _Sent(self._next)
        self._next += 1
        out.append(ToolCallDelta(index=sent.index, id=call_id, name=name))
        return sent

    def _deltas(self, calls: list[ToolCall]) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        for call in calls:
            sent = self._open.pop(call.id, None)
            if sent is None:  # a call whose block was read whole at once: it comes with its first piece
                sent = self._start(call.id, call.function.name, out)
                del self._open[call.id]
            final = call.function.arguments
            if not final.startswith(sent.arguments):  # (cannot be taken back: said, so it shows in a log)
                log.warning("tool call %s: the streamed arguments %r are not the start of the parsed %r",
                            call.id, sent.arguments, final)
                continue
            self._add(sent, final, out)
        current = self.parser.partial()
        for p in current:
            known = self._open.get(p.id)
            if known is None:
                if any(not s.complete for s in self._open.values()):
                    break  # a call's pieces all come before the next call's first: it waits for the one before
                known = self._start(p.id, p.name, out)
            if p.arguments.startswith(known.arguments):
                self._add(known, p.arguments, out)
                known.complete = p.complete
        live = {p.id for p in current}
        for call_id in [k for k in self._open if k not in live]:
            del self._open[call_id]  # a block that was not a call after all: given back as content
        return out

    @staticmethod
    def _add(sent: _Sent, arguments: str, out: list[ToolCallDelta]) -> None:
        more = arguments[len(sent.arguments) :]
        if not more:
            return
        if out and out[-1].index == sent.index:
            out[-1] = out[-1].model_copy(update={"arguments": out[-1].arguments + more})
        else:
            out.append(ToolCallDelta(index=sent.index, arguments=more))
        sent.arguments = arguments


