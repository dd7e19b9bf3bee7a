"""Tool-call (and channel) formats by model family: how a reply's calls are written, read back and forced.

A model writes tool calls in the syntax its chat template renders them in. Each family here is one
``ToolFormat``: the control-token texts it needs to see (``markers``), an incremental parser that
turns the reply's text into content, reasoning and ``ToolCall``s, and the pieces of one forced call
(``forced_pieces``) that each engine turns into its own grammar. The forced text is the text the
family's template renders the call back as, so the next request reuses the decoded call.

===============  ============================================================  ===========================
family           a call as the model writes it                                 detected by (template)
===============  ============================================================  ===========================
hermes           ``<tool_call>\\n{"name": N, "arguments": {…}}\\n</tool_call>``   the default (Qwen2.5, Hermes,
                                                                               and every template that does
                                                                               not render tools itself)
qwen3_coder      ``<tool_call>\\n<function=N>\\n<parameter=K>\\nV\\n</parameter>``  ``<function=`` and
                 ``\\n</function>\\n</tool_call>``                                  ``<parameter=``
llama3_json      ``{"name": N, "parameters": {…}}`` as the whole reply, or after   ``<|python_tag|>`` or
                 ``<|python_tag|>``; several separated by ``;``                   ``"parameters": `` in calls
mistral          ``[TOOL_CALLS][{"name": N, "arguments": {…}, "id": I}]``          ``[TOOL_CALLS]``
mistral_args     ``[TOOL_CALLS]N[ARGS]{…}`` (Magistral/Devstral 2507+)             ``[TOOL_CALLS]`` and ``[ARGS]``
harmony          ``<|channel|>commentary to=functions.N <|constrain|>json``        ``<|channel|>`` and
                 ``<|message|>{…}<|call|>``; ``analysis`` is reasoning            ``to=functions``
deepseek_v3      ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N`` ``tool▁calls▁begin``
                 ``\\n```json\\n{…}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>``;
                 V3.1: ``<｜tool▁call▁begin｜>N<｜tool▁sep｜>{…}<｜tool▁call▁end｜>``
===============  ============================================================  ===========================

The Hermes parser also reads the Qwen3-Coder XML body (both open with ``<tool_call>``), so a model
of either family is understood whichever is detected. A block that does not parse is given back as
content, never dropped and never an error.

No model library is imported here.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from contract.errors import InvalidArgument
from contract.types import ToolCall, ToolCallFunction

__all__ = [
    "FORMATS",
    "Args",
    "CallId",
    "CallParser",
    "Lit",
    "Text",
    "ToolFormat",
    "detect_format",
    "format_named",
    "parse_json_call",
]

IdFactory = Callable[[int], str]


def _default_ids(_: int) -> str:
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


def _call(call_id: str, name: str, args: dict[str, Any]) -> ToolCall:
    return ToolCall(id=call_id, type="function",
                    function=ToolCallFunction(name=name, arguments=json.dumps(args, ensure_ascii=False)))


def _object(value: Any) -> dict[str, Any] | None:
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
    args = _object(raw)
    if args is None:
        return None
    written_id = body.get("id")
    return _call(written_id if isinstance(written_id, str) and written_id else call_id, body["name"], args)


# --- bodies ------------------------------------------------------------------------------------------
_XML_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _xml_value(raw: str, kind: Any) -> Any:
    """A Qwen3-Coder parameter's text as the value its schema type names (text when it names none)."""
    if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
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
    args = {k.strip(): _xml_value(v, kinds.get(k.strip())) for k, v in _XML_PARAMETER.findall(inner)}
    if _XML_PARAMETER.sub("", inner).strip():
        return None  # text between parameters: not a call this parser understands
    return _call(call_id, name, args)


def _json_values(text: str) -> list[Any] | None:
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


def _json_calls(text: str, next_id: Callable[[], str], args_keys: Sequence[str]) -> list[ToolCall] | None:
    """Calls written as JSON objects or lists of objects; None when any of it is not a call."""
    values = _json_values(text)
    if not values:
        return None
    calls: list[ToolCall] = []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            call = parse_json_call(item, "", args_keys=args_keys)
            if call is None:
                return None
            if not call.id:
                call.id = next_id()
            calls.append(call)
    return calls


# --- parsers ---------------------------------------------------------------------------------------
class CallParser:
    """The incremental reader of one family's replies: ``feed`` → (content, reasoning, calls).

    Feeding the same text in any chunking gives the same concatenated output; ``finish`` releases
    whatever is still held. ``count`` is the number of calls returned so far.
    """

    def __init__(self, ids: IdFactory | None = None) -> None:
        self._ids = ids or _default_ids
        self._made = 0  # ids handed out
        self.count = 0

    def next_id(self) -> str:
        call_id = self._ids(self._made)
        self._made += 1
        return call_id

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
    ) -> None:
        super().__init__(ids)
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
            self._made = made  # ids handed out to a block that did not parse are taken back
            return block, []
        self.count += len(calls)
        return "", calls

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


def _hermes_body(types: dict[str, dict[str, Any]] | None) -> Callable[[str, CallParser], list[ToolCall] | None]:
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
        return _json_calls(inner, parser.next_id, ("parameters", "arguments"))

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
            calls = _json_calls(lead, self.next_id, ("parameters", "arguments"))
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


_NINE = re.compile(r"[A-Za-z0-9]{9}")


def template_call_id(call_id: str, fmt: ToolFormat) -> str:
    """The id a template is handed for ``call_id``: as it is, except where the family's templates accept only
    nine letters and digits (Mistral), where any other id maps to nine hex digits of its hash (the same call
    and its result get the same one, so a conversation renders the same every time)."""
    if fmt.make_id is not mistral_id or _NINE.fullmatch(call_id):
        return call_id
    return hashlib.sha256(call_id.encode("utf-8")).hexdigest()[:9]


def _mistral_body(inner: str, parser: CallParser) -> list[ToolCall] | None:
    """After ``[TOOL_CALLS]``: a JSON list of calls, or ``name[ARGS]{…}`` (repeated with ``[TOOL_CALLS]``)."""
    pieces = [p for p in inner.split("[TOOL_CALLS]")]
    calls: list[ToolCall] = []
    for piece in pieces:
        if not piece.strip():
            continue
        m = _MISTRAL_ARGS.match(piece)
        if m is not None:
            values = _json_values(piece[m.end() :])
            if not values or len(values) != 1:
                return None
            args = _object(values[0])
            if args is None:
                return None
            calls.append(_call(parser.next_id(), m.group(1), args))
            continue
        found = _json_calls(piece, parser.next_id, ("arguments", "parameters"))
        if found is None:
            return None
        calls += found
    return calls or None


_DS_CALL = re.compile(
    r"<｜tool▁call▁begin｜>\s*(?:function\s*<｜tool▁sep｜>\s*(?P<name1>[^\n<]+?)\s*\n```(?:json)?\s*\n(?P<args1>.*?)\n```"
    r"|(?P<name2>[^<]+?)\s*<｜tool▁sep｜>\s*(?P<args2>.*?))\s*<｜tool▁call▁end｜>",
    re.DOTALL,
)


def _deepseek_body(inner: str, parser: CallParser) -> list[ToolCall] | None:
    calls: list[ToolCall] = []
    pos = 0
    for m in _DS_CALL.finditer(inner):
        if inner[pos : m.start()].strip():
            return None
        pos = m.end()
        name = m.group("name1") or m.group("name2")
        args = _object(m.group("args1") if m.group("name1") else m.group("args2"))
        if args is None:
            return None
        calls.append(_call(parser.next_id(), name.strip(), args))
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
            args = _object(self._body.strip())
            if m is not None and args is not None:
                calls.append(_call(self.next_id(), m.group(1), args))
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


# --- forced calls ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Lit:
    """Literal text of a forced call."""

    text: str


@dataclass(frozen=True)
class Args:
    """A JSON value held to ``schema`` (a call's arguments object, or one XML parameter's value)."""

    schema: dict[str, Any]
    #: what holds the value where an engine's grammar cannot hold ``schema``: any object (a call's arguments)
    fallback: dict[str, Any] = field(default_factory=lambda: {"type": "object"})


@dataclass(frozen=True)
class Text:
    """A Qwen3-Coder string parameter's value: one of ``choices`` (its schema's ``enum``), else any text
    without ``<`` (the value runs up to ``</parameter>``)."""

    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class CallId:
    """A call id the model writes itself: nine letters and digits (Mistral's templates accept no other)."""


Piece = Lit | Args | Text | CallId


def _json_name(name: str) -> str:
    return json.dumps(name, ensure_ascii=False)[1:-1]


# --- the families ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call syntax: parser, the control-token texts it reads, and a forced call's pieces."""

    name: str
    #: control-token texts the decode must show this family's parser (they are otherwise not text)
    markers: tuple[str, ...]
    #: a parser for one reply (``types``: tool name → parameter → schema type, for XML bodies)
    make_parser: Callable[[dict[str, dict[str, Any]] | None], CallParser]
    #: the pieces of a forced call to ``name`` whose arguments follow ``schema``
    forced: Callable[[str, dict[str, Any]], list[Piece]]
    #: whether this family's parser also splits reasoning (its own channels), so ``<think>`` is not split
    own_reasoning: bool = False
    #: a call id in the form this family's template accepts
    make_id: IdFactory = field(default=_default_ids)
    #: a call in this syntax with placeholders (what a generic tool block shows a model)
    example: str = ""

    def parser(self, types: dict[str, dict[str, Any]] | None = None) -> CallParser:
        return self.make_parser(types)

    def forced_pieces(self, name: str, schema: dict[str, Any]) -> list[Piece]:
        return self.forced(name, schema)


def _hermes_forced(name: str, schema: dict[str, Any]) -> list[Piece]:
    return [Lit('<tool_call>\n{"name": "' + _json_name(name) + '", "arguments": '), Args(schema), Lit("}\n</tool_call>")]


def _xml_forced(name: str, schema: dict[str, Any]) -> list[Piece]:
    """A Qwen3-Coder call: the required parameters (all, when the schema names none required) in the schema's
    order, a string as plain text, any other value as JSON held to its schema."""
    given = schema.get("properties")
    props: dict[str, Any] = given if isinstance(given, dict) else {}
    listed = schema.get("required")
    required = [k for k in listed if k in props] if isinstance(listed, list) else list(props)
    pieces: list[Piece] = [Lit(f"<tool_call>\n<function={name}>\n")]
    for key in required:
        sub = props[key] if isinstance(props[key], dict) else {}
        pieces.append(Lit(f"<parameter={key}>\n"))
        enum = sub.get("enum")
        choices = tuple(v for v in enum if isinstance(v, str)) if isinstance(enum, list) else ()
        pieces.append(Text(choices) if sub.get("type", "string") == "string" else Args(sub, fallback={}))
        pieces.append(Lit("\n</parameter>\n"))
    pieces.append(Lit("</function>\n</tool_call>"))
    return pieces


def _llama3_forced(name: str, schema: dict[str, Any]) -> list[Piece]:
    return [Lit('{"name": "' + _json_name(name) + '", "parameters": '), Args(schema), Lit("}")]


def _mistral_forced(name: str, schema: dict[str, Any]) -> list[Piece]:
    # the id is written by the model and kept by the parser, so the call renders back as it was decoded
    return [Lit('[TOOL_CALLS][{"name": "' + _json_name(name) + '", "arguments": '), Args(schema), Lit(', "id": "'),
            CallId(), Lit('"}]')]


def _mistral_args_forced(name: str, schema: dict[str, Any]) -> list[Piece]:
    return [Lit(f"[TOOL_CALLS]{name}[ARGS]"), Args(schema)]


def _harmony_forced(name: str, schema: dict[str, Any]) -> list[Piece]:
    # after the generation prompt's "<|start|>assistant": the recipient in the role part, as the template
    # renders a call back (the model may also write it after the channel; the parser reads both)
    return [Lit(f" to=functions.{name}<|channel|>commentary json<|message|>"), Args(schema), Lit("<|call|>")]


def _deepseek_forced(name: str, schema: dict[str, Any]) -> list[Piece]:
    return [Lit(f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n"), Args(schema),
            Lit("\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")]


def _deepseek_v31_forced(name: str, schema: dict[str, Any]) -> list[Piece]:
    return [Lit(f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>"), Args(schema),
            Lit("<｜tool▁call▁end｜><｜tool▁calls▁end｜>")]


def _hermes(types: dict[str, dict[str, Any]] | None) -> CallParser:
    return BlockParser("<tool_call>", "</tool_call>", _hermes_body(types))


def _mistral(types: dict[str, dict[str, Any]] | None) -> CallParser:
    return BlockParser("[TOOL_CALLS]", "", _mistral_body, ids=mistral_id)


def _deepseek(types: dict[str, dict[str, Any]] | None) -> CallParser:
    return BlockParser("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", _deepseek_body, end_closes=True)


_DS_MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
               "<｜tool▁calls▁end｜>")

FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        ToolFormat("hermes", ("<tool_call>", "</tool_call>"), _hermes, _hermes_forced,
                   example='<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'),
        ToolFormat("qwen3_coder", ("<tool_call>", "</tool_call>"), _hermes, _xml_forced,
                   example="<tool_call>\n<function=<function-name>>\n<parameter=<parameter-name>>\n<value>\n"
                   "</parameter>\n</function>\n</tool_call>"),
        ToolFormat("llama3_json", (Llama3Parser.TAG,), lambda types: Llama3Parser(), _llama3_forced,
                   example='{"name": <function-name>, "parameters": <arguments-json-object>}'),
        ToolFormat("mistral", ("[TOOL_CALLS]",), _mistral, _mistral_forced, make_id=mistral_id,
                   example='[TOOL_CALLS][{"name": <function-name>, "arguments": <arguments-json-object>, '
                   '"id": <nine-letters-or-digits>}]'),
        ToolFormat("mistral_args", ("[TOOL_CALLS]", "[ARGS]"), _mistral, _mistral_args_forced, make_id=mistral_id,
                   example="[TOOL_CALLS]<function-name>[ARGS]<arguments-json-object>"),
        ToolFormat("harmony", HarmonyParser.MARKERS, lambda types: HarmonyParser(), _harmony_forced,
                   own_reasoning=True,
                   example="<|start|>assistant to=functions.<function-name><|channel|>commentary json<|message|>"
                   "<arguments-json-object><|call|>"),
        ToolFormat("deepseek_v3", _DS_MARKERS, _deepseek, _deepseek_forced,
                   example="<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜><function-name>\n```json\n"
                   "<arguments-json-object>\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
        ToolFormat("deepseek_v3_1", _DS_MARKERS, _deepseek, _deepseek_v31_forced,
                   example="<｜tool▁calls▁begin｜><｜tool▁call▁begin｜><function-name><｜tool▁sep｜>"
                   "<arguments-json-object><｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    )
}
#: names a request or ``--tool-format`` may use for a family
_ALIASES = {"qwen": "hermes", "tool_call": "hermes", "tool_calls": "hermes", "qwen2_5": "hermes",
            "llama3": "llama3_json", "llama": "llama3_json", "gpt_oss": "harmony", "gpt-oss": "harmony",
            "deepseek": "deepseek_v3", "deepseek_v3.1": "deepseek_v3_1", "qwen3-coder": "qwen3_coder",
            "devstral": "mistral_args", "magistral": "mistral_args"}


def format_named(name: str) -> ToolFormat | None:
    """The family ``name`` (or an alias) selects; None when it names none."""
    key = name.strip().lower()
    found = FORMATS.get(_ALIASES.get(key, key))
    return found


def known_names() -> list[str]:
    return sorted(set(FORMATS) | set(_ALIASES))


def require_format(name: str) -> ToolFormat:
    found = format_named(name)
    if found is None:
        raise InvalidArgument(f"tool-call format {name!r} is not supported; use one of {known_names()}",
                              tool_format=name)
    return found


def detect_format(source: str) -> ToolFormat:
    """The family a chat template's source writes tool calls in (Hermes when it shows none it knows)."""
    if "[TOOL_CALLS]" in source:
        return FORMATS["mistral_args" if "[ARGS]" in source else "mistral"]
    if "<|channel|>" in source and "<|message|>" in source and "<|start|>" in source:
        return FORMATS["harmony"]
    if "tool▁calls▁begin" in source:
        # V3 writes 'function<｜tool▁sep｜>NAME' and a ```json fence; V3.1 writes 'NAME<｜tool▁sep｜>ARGS'
        return FORMATS["deepseek_v3" if "```json" in source else "deepseek_v3_1"]
    if "<function=" in source and "<parameter=" in source:
        return FORMATS["qwen3_coder"]
    if "<|python_tag|>" in source or ('"parameters": ' in source and "<|start_header_id|>" in source):
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


def parameter_types(tools: list[Any] | None) -> dict[str, dict[str, Any]]:
    """Tool name → parameter → its schema ``type`` (what an XML parameter's text is read as)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters") or fn.get("input_schema") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        if isinstance(props, dict):
            out[fn["name"]] = {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
    return out
