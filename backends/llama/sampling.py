"""One llama.cpp decode pass: the sampler chain (with a grammar when asked) over the context's logits."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import llama_cpp
import numpy as np
from llama_cpp import _internals as llama_internals
from llama_cpp.llama_grammar import SchemaConverter, json_schema_to_gbnf

from contract.errors import InvalidArgument, UnsupportedFeature
from contract.types import DecodeConfig, StructuredOutputConfig

from ..tape.decoding import LogitsSteps
from ..tape.forced import arguments_schema
from ..tape.toolformats import FORMATS, Args, CallId, Lit, ToolFormat, marker_split
from .native import log_mark, log_since

if TYPE_CHECKING:
    from .model import LlamaLoadedModel


class LlamaSteps(LogitsSteps):
    """DecodeSteps on a llama.cpp context: its sampler chain over the context's logits."""

    def __init__(self, m: LlamaLoadedModel, sampler: llama_internals.LlamaSampler) -> None:
        self._m = m
        self._sampler = sampler

    def start(self) -> None:
        self._m.refresh_logits()

    def sample(self) -> int:
        return int(self._sampler.sample(self._m.llm._ctx, -1))

    def feed(self, token: int) -> None:
        self._m.append(token)

    def is_end(self, token: int) -> bool:
        return self._m.is_eog(token)

    def piece(self, token: int) -> bytes:
        return self._m.piece(token)

    def settle(self, token: int) -> None:
        with contextlib.suppress(Exception):
            self._m.append(token)  # a failed eval leaves n_tokens and the tape unchanged

    def verify(self, tokens: list[int]) -> None:
        self._m.verify(tokens)

    def sample_row(self, i: int) -> int:
        # the batch's output index i is row i: verify asked for logits on every row
        return int(self._sampler.sample(self._m.llm._ctx, i))

    def logits(self, row: int | None) -> np.ndarray:
        # (the sampler chain reads the context's rows without changing them)
        m = self._m
        ptr = llama_cpp.llama_get_logits_ith(m.llm._ctx.ctx, -1 if row is None else row)
        return np.ctypeslib.as_array(ptr, shape=(m.vocab_size,))

    def rollback(self, n: int) -> None:
        self._m.rollback(n)

    def close(self) -> None:
        self._sampler.close()


def grammar_source(so: StructuredOutputConfig, fmt: ToolFormat = FORMATS["hermes"],
                   markers: Mapping[str, int] | None = None) -> str | None:
    """The GBNF text for a structured-output request (None when unconstrained); a forced call in ``fmt``, its
    ``markers`` (text: control token id) written as those tokens."""
    if so.regex:
        raise UnsupportedFeature("the llama backend does not constrain output by regex; use grammar or json_schema")
    if so.tool_call:
        return tool_call_gbnf(so.tool_call, fmt, markers)
    if so.json_schema:
        try:
            schema = json.loads(so.json_schema)
        except ValueError as exc:
            raise InvalidArgument(f"json_schema is not valid JSON: {exc}") from exc
        ignored = sorted(_unenforced_keywords(schema))
        if ignored:
            raise UnsupportedFeature(
                f"the llama backend's JSON-schema grammar cannot enforce {ignored}; refusing to drop them silently",
                keywords=ignored,
            )
        try:
            return str(json_schema_to_gbnf(so.json_schema))
        # the converter asserts on schemas it does not recognise
        except (ValueError, KeyError, TypeError, AssertionError, RecursionError) as exc:
            raise InvalidArgument(f"json_schema cannot be turned into a grammar: {exc!r}") from exc
    return so.grammar or None


def _converter() -> SchemaConverter:
    return SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def tool_call_gbnf(tools: dict[str, str], fmt: ToolFormat = FORMATS["hermes"],
                   markers: Mapping[str, int] | None = None) -> str:
    """GBNF for one call to one of ``tools`` (name: arguments schema) in ``fmt``'s syntax, its arguments
    held to the schema.

    Each of ``markers`` (a marker's text: the id of the one control token the vocabulary has for it) is
    written as a token reference, ``<[ID]>``, which matches that token only. A string literal would match it
    too (llama.cpp's grammar reads a control token as its text) but also the same text in ordinary tokens,
    and a model that has not seen the marker written out may take those: the next prompt, tokenized from
    the template's text, has the one token, so reuse would stop at the marker.

    A schema llama-cpp-python's converter cannot turn into rules (a remote ``$ref``, a construct it
    asserts on) holds that tool's arguments to any JSON object instead; keywords the converter does
    not enforce (``minimum`` …) are left to the tool, as a call's shape is what the grammar is for.
    """
    converter = _converter()
    calls = []
    for i, (name, text) in enumerate(tools.items()):
        parts = []
        for j, piece in enumerate(fmt.forced_pieces(name, arguments_schema(text))):
            if isinstance(piece, Lit):
                parts += [json.dumps(p) if isinstance(p, str) else f"<[{p}]>"
                          for p in marker_split(piece.text, markers or {})]
            elif isinstance(piece, Args):
                schema = piece.schema
                try:  # on a scratch converter first: a failed visit leaves rules that name rules never added
                    _converter().visit(_converter().resolve_refs(schema, "tool"), f"args{i}-{j}")
                except (ValueError, KeyError, TypeError, AssertionError, RecursionError, NotImplementedError):
                    schema = piece.fallback
                parts.append(converter.visit(converter.resolve_refs(schema, "tool"), f"args{i}-{j}"))
            elif isinstance(piece, CallId):
                parts.append("[a-zA-Z0-9]{9}")
            elif piece.choices:
                parts.append("(" + " | ".join(json.dumps(c) for c in piece.choices) + ")")
            else:
                parts.append("[^<]*")
        calls.append(f"call{i} ::= {' '.join(parts)}")
    root = " | ".join(f"call{i}" for i in range(len(calls)))
    return _json_dumps_spelling("\n".join([f"root ::= {root}", *calls, converter.format_grammar()]))


#: one token of a GBNF rule body: a string literal, a character class, a rule name, any other character
_GBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[\w-]+|\S')
_SEPARATORS = {'":"': '": "', '","': '", "'}


def _json_dumps_spelling(grammar: str) -> str:
    """``grammar`` (the converter's rules) holding JSON to the spelling ``json.dumps`` writes it in.

    The converter lets a space follow every brace, separator and value (its ``space`` rule); a
    call is rendered back into the next prompt as ``{"key": value, …}``, so a call decoded in any
    other spelling would not be reused. The separators carry the one space ``json.dumps`` puts
    after them, and the ``space`` rule goes.
    """
    rules = []
    for line in grammar.splitlines():
        name, _, body = line.partition(" ::= ")
        if name == "space":
            continue
        body = _GBNF_TOKEN.sub(lambda t: "" if t[0] == "space" else _SEPARATORS.get(t[0], t[0]), body)
        rules.append(f"{name} ::= {body}")
    return "\n".join(rules)


#: JSON-schema keywords llama-cpp-python's json_schema_to_gbnf accepts but does not enforce
_UNENFORCED_SCHEMA_KEYWORDS = frozenset(
    {
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "uniqueItems",
        "minProperties",
        "maxProperties",
        "patternProperties",
        "propertyNames",
        "not",
        "if",
        "then",
        "else",
        "contains",
        "minContains",
        "maxContains",
        "dependentRequired",
        "dependentSchemas",
        "unevaluatedProperties",
        "unevaluatedItems",
    }
)
#: keywords whose value maps names to subschemas (the names are data, not keywords)
_SCHEMA_MAPS = ("properties", "$defs", "definitions")


def _unenforced_keywords(node: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(node, list):
        for item in node:
            found |= _unenforced_keywords(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                for sub in value.values():
                    found |= _unenforced_keywords(sub)
            elif key in ("const", "enum", "default", "examples", "description", "title"):
                continue  # literal data
            else:
                if key in _UNENFORCED_SCHEMA_KEYWORDS:
                    found.add(key)
                found |= _unenforced_keywords(value)
    return found


def build_sampler(m: LlamaLoadedModel, cfg: DecodeConfig, grammar: str | None) -> llama_internals.LlamaSampler:
    """A sampler chain in llama.cpp's order: penalties, grammar, then greedy or top-k/top-p/min-p/temp/dist.

    A field left unset (None) or 0 adds no step. The penalties' window starts
    with the prompt's last ``repeat_last_n`` tokens; the chain then takes in each
    token it samples, draft rows included (a row's token is the reply's next one
    until the first the draft did not foresee, which is the reply's too).
    """
    sampler = llama_internals.LlamaSampler()
    try:
        penalties = cfg.penalties()
        if penalties is not None:
            last_n, repeat, freq, present = penalties
            p = llama_cpp.llama_sampler_init_penalties(m.llm.n_vocab(), last_n, repeat, freq, present)
            for token in m.res.tokens[-last_n:]:
                llama_cpp.llama_sampler_accept(p, token)
            llama_cpp.llama_sampler_chain_add(sampler.sampler, p)
        if grammar is not None:
            mark = log_mark()
            g = llama_cpp.llama_sampler_init_grammar(m.llm._model.vocab, grammar.encode("utf-8"), b"root")
            if not g:  # llama.cpp returns NULL for a grammar it cannot parse
                raise InvalidArgument(f"the grammar does not parse{log_since(mark)}")
            llama_cpp.llama_sampler_chain_add(sampler.sampler, g)
        if not cfg.temperature:
            sampler.add_greedy()
        else:
            if cfg.top_k:
                sampler.add_top_k(cfg.top_k)
            if cfg.top_p is not None and cfg.top_p < 1.0:
                sampler.add_top_p(cfg.top_p, 1)
            if cfg.min_p:
                sampler.add_min_p(cfg.min_p, 1)
            sampler.add_temp(cfg.temperature)
            seed = llama_cpp.LLAMA_DEFAULT_SEED if cfg.seed is None else cfg.seed & 0xFFFFFFFF
            m.llm.set_seed(seed)
            sampler.add_dist(seed)
    except BaseException:
        sampler.close()
        raise
    return sampler
