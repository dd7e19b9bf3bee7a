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

Every parser also shows the calls it is reading (``CallParser.partial``), so a reply's calls stream as they
are written: ``ToolFormat.streamer`` gives each call's id and name once known, then its arguments piece by
piece, the pieces joined being the finished call's arguments (``streaming``).

The Hermes parser also reads the Qwen3-Coder XML body (both open with ``<tool_call>``), so a model
of either family is understood whichever is detected. A block that does not parse is given back as
content, never dropped and never an error.

No model library is imported here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from contract.errors import InvalidArgument

from .families import (
    HarmonyParser,
    Llama3Parser,
    deepseek_body,
    deepseek_partial,
    hermes_body,
    hermes_partial,
    mistral_body,
    mistral_id,
    mistral_partial,
)
from .forced import (
    Args,
    CallId,
    Lit,
    Piece,
    Text,
    deepseek_forced,
    deepseek_v31_forced,
    harmony_forced,
    hermes_forced,
    llama3_forced,
    marker_split,
    mistral_args_forced,
    mistral_forced,
    xml_forced,
)
from .parsing import BlockParser, CallParser, IdFactory, default_id, parse_json_call, partial_suffix_len
from .streaming import CallStreamer, Partial, canonical_prefix

__all__ = [
    "Args",
    "CallId",
    "CallParser",
    "CallStreamer",
    "FORMATS",
    "Lit",
    "Partial",
    "Piece",
    "Text",
    "ToolFormat",
    "canonical_prefix",
    "detect_format",
    "format_named",
    "known_names",
    "marker_split",
    "parameter_types",
    "parse_json_call",
    "partial_suffix_len",
    "require_format",
    "template_call_id",
]


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
    make_id: IdFactory = field(default=default_id)
    #: the only call ids its templates accept: this many letters and digits (0: any id)
    id_length: int = 0
    #: a call in this syntax with placeholders (what a generic tool block shows a model)
    example: str = ""

    def parser(self, types: dict[str, dict[str, Any]] | None = None) -> CallParser:
        return self.make_parser(types)

    def streamer(self, types: dict[str, dict[str, Any]] | None = None) -> CallStreamer:
        """A parser whose calls also come as ``ToolCallDelta`` s, arguments piece by piece (``streaming``)."""
        return CallStreamer(self.make_parser(types))

    def forced_pieces(self, name: str, schema: dict[str, Any]) -> list[Piece]:
        return self.forced(name, schema)


def _hermes(types: dict[str, dict[str, Any]] | None) -> CallParser:
    return BlockParser("<tool_call>", "</tool_call>", hermes_body(types), partial=hermes_partial(types))


def _mistral(types: dict[str, dict[str, Any]] | None) -> CallParser:
    return BlockParser("[TOOL_CALLS]", "", mistral_body, ids=mistral_id, partial=mistral_partial)


def _deepseek(types: dict[str, dict[str, Any]] | None) -> CallParser:
    return BlockParser("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", deepseek_body, end_closes=True,
                       partial=deepseek_partial)


_DS_MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
               "<｜tool▁calls▁end｜>")

FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        ToolFormat("hermes", ("<tool_call>", "</tool_call>"), _hermes, hermes_forced,
                   example='<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'),
        ToolFormat("qwen3_coder", ("<tool_call>", "</tool_call>"), _hermes, xml_forced,
                   example="<tool_call>\n<function=<function-name>>\n<parameter=<parameter-name>>\n<value>\n"
                   "</parameter>\n</function>\n</tool_call>"),
        ToolFormat("llama3_json", (Llama3Parser.TAG,), lambda types: Llama3Parser(), llama3_forced,
                   example='{"name": <function-name>, "parameters": <arguments-json-object>}'),
        ToolFormat("mistral", ("[TOOL_CALLS]",), _mistral, mistral_forced, make_id=mistral_id, id_length=9,
                   example='[TOOL_CALLS][{"name": <function-name>, "arguments": <arguments-json-object>, '
                   '"id": <nine-letters-or-digits>}]'),
        ToolFormat("mistral_args", ("[TOOL_CALLS]", "[ARGS]"), _mistral, mistral_args_forced, make_id=mistral_id,
                   id_length=9,
                   example="[TOOL_CALLS]<function-name>[ARGS]<arguments-json-object>"),
        ToolFormat("harmony", HarmonyParser.MARKERS, lambda types: HarmonyParser(), harmony_forced,
                   own_reasoning=True,
                   example="<|start|>assistant to=functions.<function-name><|channel|>commentary json<|message|>"
                   "<arguments-json-object><|call|>"),
        ToolFormat("deepseek_v3", _DS_MARKERS, _deepseek, deepseek_forced,
                   example="<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜><function-name>\n```json\n"
                   "<arguments-json-object>\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
        ToolFormat("deepseek_v3_1", _DS_MARKERS, _deepseek, deepseek_v31_forced,
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


def template_call_id(call_id: str, fmt: ToolFormat) -> str:
    """The id a template is handed for ``call_id``: as it is, except where the family's templates accept only
    ids of ``id_length`` letters and digits (Mistral: nine), where any other id maps to that many hex digits of
    its hash (the same call and its result get the same one, so a conversation renders the same every time)."""
    n = fmt.id_length
    if not n or (len(call_id) == n and call_id.isascii() and call_id.isalnum()):
        return call_id
    return hashlib.sha256(call_id.encode("utf-8")).hexdigest()[:n]
