"""Structured output for a decode loop that samples in numpy: llguidance token masks.

The OpenVINO backend drives the IR itself (see ``backends.openvino.model``), so
openvino-genai's grammar engine (XGrammar, inside its C++ sampler) is out of
reach. llguidance is the constrained-decoding engine llama.cpp can be built with
and vLLM/SGLang use: a Rust library with a small, dependency-free wheel that
compiles a JSON schema, a regex or a context-free grammar (Lark, or llama.cpp's
GBNF via its converter) into a matcher that yields, before every sampled token,
the bitmask of the tokens that keep the output inside the language. The
xgrammar wheel was the other candidate; it needs torch and triton at run time.

The mask is exact over the model's own vocabulary (every token's bytes), so a
greedy decode under a constraint picks the most likely *allowed* token each
step — the same thing GenAI's sampler does with XGrammar (compared token for
token in the tests). When the language is complete only the end-of-generation
tokens remain allowed, so the stream ends with finish_reason "stop".

Dialects: ``json_schema`` is a JSON Schema (keywords llguidance cannot enforce
are refused, never dropped); ``regex`` is Rust ``regex`` syntax, matched against
the whole output; ``grammar`` is GBNF (llama.cpp's dialect, also what the llama
backend takes) or Lark.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import llguidance
import numpy as np

from contract.errors import Internal, InvalidArgument, UnsupportedFeature
from contract.types import StructuredOutputConfig

from ..tape.forced import arguments_schema
from ..tape.toolformats import FORMATS, Args, CallId, Lit, ToolFormat, marker_split

__all__ = ["TokenGuide", "build_tokenizer", "compile_grammar"]

#: llguidance marks special (control) tokens by a leading 0xFF byte, which no UTF-8 text has
_SPECIAL_MARK = b"\xff"


def build_tokenizer(
    pieces: list[bytes],
    *,
    special: Iterable[int],
    eog: Iterable[int],
    bos_id: int,
    encode: Callable[[str], list[int]],
) -> llguidance.LLTokenizer:
    """An llguidance tokenizer over a vocabulary given as each token's bytes.

    ``encode`` tokenizes plain text (no special tokens); llguidance uses it for
    literal strings in grammars. Building one costs ~0.2 s for a 49k vocabulary:
    keep it with the loaded model.
    """
    special_ids = sorted(set(special))
    tokens = list(pieces)
    for i in special_ids:
        tokens[i] = _SPECIAL_MARK + tokens[i]
    end_ids = sorted(set(eog))
    if not end_ids:
        raise UnsupportedFeature("the model has no end-of-generation token, so a constraint could never finish")

    class _Vocab:
        eos_token_id = end_ids[0]
        bos_token_id = bos_id if bos_id >= 0 else None
        special_token_ids = special_ids

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: str) -> list[int]:
            if not isinstance(text, str):  # llguidance probes for a bytes API; give it text
                raise TypeError("the vocabulary tokenizes text")
            return encode(text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab()), eos_token=end_ids)


_DUMPS_SPELLING = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_call_lark(tools: dict[str, str], fmt: ToolFormat = FORMATS["hermes"],
                   markers: Mapping[str, int] | None = None) -> str:
    """The llguidance grammar for one call to one of ``tools`` (name: arguments schema) in ``fmt``'s syntax,
    its arguments held to the schema (a ``%json`` rule); a schema llguidance cannot compile holds that
    tool's arguments to any JSON object instead.

    Each of ``markers`` (a marker's text: the id of the one control token the vocabulary has for it) is
    written as a token reference, ``<[ID]>``: llguidance matches a string literal against text only, and a
    control token is no text to it (``build_tokenizer`` marks it), so a literal marker would be decoded as
    ordinary tokens that the next prompt, tokenized from the template's text, does not hold.
    """
    rules = []
    for i, (name, text) in enumerate(tools.items()):
        parts = []
        for j, piece in enumerate(fmt.forced_pieces(name, arguments_schema(text))):
            if isinstance(piece, Lit):
                parts += [json.dumps(p) if isinstance(p, str) else f"<[{p}]>"
                          for p in marker_split(piece.text, markers or {})]
                continue
            rule = f"args{i}_{j}"
            parts.append(rule)
            if isinstance(piece, CallId):
                rules.append(f"{rule}: /[a-zA-Z0-9]{{9}}/")
                continue
            if not isinstance(piece, Args):
                rules.append(f"{rule}: " + (" | ".join(json.dumps(c) for c in piece.choices) or "/[^<]*/"))
                continue
            # the spelling json.dumps writes, which is how the call is rendered back into the next prompt
            args = f"{rule}: %json {json.dumps({**piece.schema, 'x-guidance': _DUMPS_SPELLING})}"
            failed, _ = llguidance.LLMatcher.validate_grammar_with_warnings(
                llguidance.grammar_from("lark", f"start: {rule}\n{args}\n"))
            if failed:
                args = f"{rule}: %json {json.dumps({**piece.fallback, 'x-guidance': _DUMPS_SPELLING})}"
            rules.append(args)
        rules.insert(0, f"call{i}: {' '.join(parts)}")
    start = " | ".join(f"call{i}" for i in range(len(tools)))
    return llguidance.grammar_from("lark", "\n".join([f"start: {start}", *rules]) + "\n")


def compile_grammar(so: StructuredOutputConfig, fmt: ToolFormat = FORMATS["hermes"],
                    markers: Mapping[str, int] | None = None) -> str:
    """The llguidance grammar for a request (a forced call in ``fmt``, its ``markers`` written as those
    control tokens); InvalidArgument/UnsupportedFeature for bad ones."""
    if so.tool_call:
        grammar = tool_call_lark(so.tool_call, fmt, markers)
        what = "tool_call"
    elif so.json_schema:
        try:
            schema: Any = json.loads(so.json_schema)
        except ValueError as exc:
            raise InvalidArgument(f"json_schema is not valid JSON: {exc}") from exc
        if not isinstance(schema, dict | bool):
            raise InvalidArgument("json_schema must be a JSON object (or true/false)")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema if isinstance(schema, dict) else so.json_schema)
        what = "json_schema"
    elif so.regex:
        grammar = llguidance.LLMatcher.grammar_from_regex(so.regex)
        what = "regex"
    elif so.grammar:
        try:
            grammar = llguidance.grammar_from("grammar", so.grammar)
        except ValueError as exc:  # the GBNF → Lark converter
            raise InvalidArgument(f"the grammar does not parse: {exc}") from exc
        what = "grammar"
    else:
        raise InvalidArgument("structured_output is empty")
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        message = messages[0] if messages else "rejected"
        if "Unimplemented" in message or "nsupported" in message:
            raise UnsupportedFeature(f"{what} uses what the constraint engine cannot enforce: {message}", reason=message)
        raise InvalidArgument(f"{what} is not valid: {message}", reason=message)
    return grammar


class TokenGuide:
    """One decode pass's constraint: masks logits before sampling, follows sampled tokens."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise InvalidArgument(f"the constraint does not compile: {self._matcher.get_error()}")
        self._n = tokenizer.vocab_size
        self._words = np.zeros((self._n + 31) // 32, np.int32)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` with every disallowed token at -inf (logits past the vocabulary too)."""
        m = self._matcher
        m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if m.is_error():
            raise Internal(f"structured output: the constraint engine failed: {m.get_error()}")
        allowed = np.unpackbits(self._words.view(np.uint8), bitorder="little", count=self._n).view(bool)
        if not allowed.any():
            raise Internal("structured output: no token can continue the constrained output")
        k = min(self._n, logits.shape[0])
        out = np.full(logits.shape[0], -np.inf, np.float32)
        np.copyto(out[:k], logits[:k], where=allowed[:k])
        return out

    def accept(self, token: int) -> None:
        """Advance past a sampled token (one the last mask allowed)."""
        if not self._matcher.consume_token(token):
            raise Internal(f"structured output: token {token} was sampled outside the constraint: {self._matcher.get_error()}")
