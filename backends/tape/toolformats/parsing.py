"""What every family's parser shares: call ids, JSON and XML call bodies, and the incremental block parser."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from contract.types import ToolCall, ToolCallFunction

from .streaming import Partial

IdFactory = Callable[[int], str]


def default_id(_: int) -> str:
    """A call id unique across turns (clients key tool results, and some their history, by it)."""
    return f"call_{secrets.token_hex(12)}"


def partial_suffix_len(text: str, needles: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a needle."""
    best = 0
    for needle in needles:
        for k in range(min(len(needle) - 1, len(text)), best, -1):
            if text.endswith(needle[:k]):
                best = k
                break
    return best


def make_call(call_id: str, name: str, args: dict[str, Any]) -> ToolCall:
    return ToolCall(id=call_id, type="function",
                    function=ToolCallFunction(name=name, arguments=json.dumps(args, ensure_ascii=False)))


def as_object(value: Any) -> dict[str, Any] | None:
    """Call arguments as an object: an object, or a JSON string holding one; None otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def parse_json_call(body: Any, call_id: str, *, args_keys: Sequence[str] = ("arguments", "parameters")) -> ToolCall | None:
    """A call written as JSON ``{"name": N, "arguments"|"parameters": {…}}`` (text or parsed), or None.

    Arguments may be an object or a JSON string holding one; they are re-serialised compactly, as
    OpenAI-style clients expect a string. A model-written ``"id"`` (Mistral) becomes the call's id.
    """
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]:
        return None
    raw: Any = next((body[k] for k in args_keys if k in body), {})
    args = as_object(raw)
    if args is None:
        return None
    written_id = body.get("id")
    return make_call(written_id if isinstance(written_id, str) and written_id else call_id, body["name"], args)


# --- bodies ------------------------------------------------------------------------------------------
_XML_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def is_text_kind(kind: Any) -> bool:
    """Whether a Qwen3-Coder parameter of this schema type is kept as its text."""
    return kind in (None, "string") or (isinstance(kind, list) and "string" in kind)


def xml_value(raw: str, kind: Any) -> Any:
    """A Qwen3-Coder parameter's text as the value its schema type names (text when it names none)."""
    if is_text_kind(kind):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parse_xml_call(body: str, call_id: str, types: dict[str, dict[str, Any]] | None = None) -> ToolCall | None:
    """A Qwen3-Coder call body ``<function=N><parameter=K>V</parameter>…</function>``, or None.

    A parameter's text is read as JSON when the tool's schema gives it a non-string type
    (``types``: tool name → parameter → schema type), else kept as text.
    """
    m = _XML_FUNCTION.match(body)
    if m is None:
        return None
    name = m.group(1).strip()
    inner = m.group(2)
    kinds = (types or {}).get(name, {})
    args = {k.strip(): xml_value(v, kinds.get(k.strip())) for k, v in _XML_PARAMETER.findall(inner)}
    if _XML_PARAMETER.sub("", inner).strip():
        return None  # text between parameters: not a call this parser understands
    return make_call(call_id, name, args)


def json_values(text: str) -> list[Any] | None:
    """The JSON values ``text`` is made of (one value, or several separated by ``;``/whitespace); None when
    any part is not JSON."""
    dec = json.JSONDecoder()
    out: list[Any] = []
    i, n = 0, len(text)
    while True:
        while i < n and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i >= n:
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


def json_calls(text: str, next_id: Callable[[], str], args_keys: Sequence[str], *,
               written_ids: bool = True) -> list[ToolCall] | None:
    """Calls written as JSON objects or lists of objects; None when any of it is not a call. A model-written
    ``"id"`` is kept where ``written_ids`` (Mistral: its template renders it back)."""
    values = json_values(text)
    if not values:
        return None
    calls: list[ToolCall] = []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            call = parse_json_call(item, "", args_keys=args_keys)
            if call is None:
                return None
            if not call.id or not written_ids:
                call.id = next_id()
            calls.append(call)
    return calls


# --- parsers ---------------------------------------------------------------------------------------
class CallParser:
    """The incremental reader of one family's replies: ``feed`` → (content, reasoning, calls).

    Feeding the same text in any chunking gives the same concatenated output; ``finish`` releases
    whatever is still held. ``count`` is the number of calls returned so far. ``partial`` shows the calls
    being written (``streaming``): an id shown there is the id the finished call gets.
    """

    def __init__(self, ids: IdFactory | None = None) -> None:
        self._ids = ids or default_id
        self._made = 0  # ids handed out
        self._memo: dict[int, str] = {}  # the n-th id, once asked for (shown while a call is written)
        self.count = 0

    def id_at(self, n: int) -> str:
        if n not in self._memo:
            self._memo[n] = self._ids(n)
        return self._memo[n]

    def next_id(self) -> str:
        call_id = self.id_at(self._made)
        self._made += 1
        return call_id

    def upcoming_id(self, k: int = 0) -> str:
        """The id the ``k``-th call from now gets."""
        return self.id_at(self._made + k)

    def take_back_ids(self, made: int) -> None:
        """Ids handed out to a block that did not parse are taken back; any it showed are not handed out again."""
        self._made = made
        self._memo = {n: v for n, v in self._memo.items() if n < made}

    def partial(self) -> list[Partial]:
        """The calls being written now whose name is known (none, for a parser that does not show them)."""
        return []

    def feed(self, text: str) -> tuple[str, str, list[ToolCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        raise NotImplementedError


class BlockParser(CallParser):
    """Content until an opening marker; from it to the closing one (or to the end of the reply, when
    ``close`` is empty or the reply ends first and ``end_closes``) a block ``body`` turns into calls.

    A block whose body is not understood is given back verbatim as content.
    """

    def __init__(
        self,
        open_tag: str,
        close_tag: str,
        body: Callable[[str, CallParser], list[ToolCall] | None],
        *,
        end_closes: bool = False,
        ids: IdFactory | None = None,
        partial: Callable[[str, CallParser], list[Partial]] | None = None,
    ) -> None:
        super().__init__(ids)
        self._partial = partial
        self._open = open_tag
        self._close = close_tag
        self._body = body
        self._end_closes = end_closes or not close_tag
        self._held = ""
        self._inside = False

    def _block(self, block: str, inner: str) -> tuple[str, list[ToolCall]]:
        made = self._made
        calls = self._body(inner, self)
        if calls is None:
            self.take_back_ids(made)
            return block, []
        self.count += len(calls)
        return "", calls

    @property
    def inside(self) -> bool:
        """Whether a block is open (its text so far is ``held``)."""
        return self._inside

    @property
    def held(self) -> str:
        return self._held

    def partial(self) -> list[Partial]:
        if not self._inside or self._partial is None:
            return []
        try:
            return self._partial(self._held[len(self._open) :], self)
        except ValueError:
            return []  # not a call as far as it goes: nothing is shown, the block decides at its end

    def feed(self, text: str) -> tuple[str, str, list[ToolCall]]:
        buf = self._held + text
        self._held = ""
        content: list[str] = []
        calls: list[ToolCall] = []
        while buf:
            if not self._inside:
                at = buf.find(self._open)
                if at < 0:
                    keep = partial_suffix_len(buf, [self._open])
                    content.append(buf[: len(buf) - keep])
                    self._held = buf[len(buf) - keep :]
                    break
                content.append(buf[:at])
                buf = buf[at:]
                self._inside = True
                continue
            end = buf.find(self._close, len(self._open)) if self._close else -1
            if end < 0:
                self._held = buf  # the whole block so far, opening tag included
                break
            block = buf[: end + len(self._close)]
            buf = buf[end + len(self._close) :]
            self._inside = False
            text_back, found = self._block(block, block[len(self._open) : -len(self._close)])
            content.append(text_back)
            calls += found
        return "".join(content), "", calls

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        held, self._held = self._held, ""
        inside, self._inside = self._inside, False
        if inside and self._end_closes:
            text_back, found = self._block(held, held[len(self._open) :])
            return text_back, "", found
        return held, "", []
