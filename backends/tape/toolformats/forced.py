"""The pieces of a forced call, per family: literal text, a JSON value held to a schema, a text value, a call id."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


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


def marker_split(text: str, tokens: Mapping[str, int]) -> list[str | int]:
    """``text`` (a ``Lit``) cut at each marker of ``tokens``: the marker's token id in its place, the text
    around it as strings (none empty). An engine's grammar writes an id as that one token, the rest as text."""
    out: list[str | int] = []
    start = at = 0
    while tokens and at < len(text):
        # the longest marker starting here (no marker here is a prefix of another in any family, but be sure)
        hit = max((m for m in tokens if m and text.startswith(m, at)), key=len, default="")
        if not hit:
            at += 1
            continue
        if at > start:
            out.append(text[start:at])
        out.append(tokens[hit])
        start = at = at + len(hit)
    if start < len(text):
        out.append(text[start:])
    return out


def _json_name(name: str) -> str:
    return json.dumps(name, ensure_ascii=False)[1:-1]


def hermes_forced(name: str, schema: dict[str, Any]) -> list[Piece]:
    return [Lit('<tool_call>\n{"name": "' + _json_name(name) + '", "arguments": '), Args(schema), Lit("}\n</tool_call>")]


def xml_forced(name: str, schema: dict[str, Any]) -> list[Piece]:
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


def llama3_forced(name: str, schema: dict[str, Any]) -> list[Piece]:
    return [Lit('{"name": "' + _json_name(name) + '", "parameters": '), Args(schema), Lit("}")]


def mistral_forced(name: str, schema: dict[str, Any]) -> list[Piece]:
    # the id is written by the model and kept by the parser, so the call renders back as it was decoded
    return [Lit('[TOOL_CALLS][{"name": "' + _json_name(name) + '", "arguments": '), Args(schema), Lit(', "id": "'),
            CallId(), Lit('"}]')]


def mistral_args_forced(name: str, schema: dict[str, Any]) -> list[Piece]:
    return [Lit(f"[TOOL_CALLS]{name}[ARGS]"), Args(schema)]


def harmony_forced(name: str, schema: dict[str, Any]) -> list[Piece]:
    # after the generation prompt's "<|start|>assistant": the recipient in the role part, as the template
    # renders a call back (the model may also write it after the channel; the parser reads both)
    return [Lit(f" to=functions.{name}<|channel|>commentary json<|message|>"), Args(schema), Lit("<|call|>")]


def deepseek_forced(name: str, schema: dict[str, Any]) -> list[Piece]:
    return [Lit(f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n"), Args(schema),
            Lit("\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")]


def deepseek_v31_forced(name: str, schema: dict[str, Any]) -> list[Piece]:
    return [Lit(f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>"), Args(schema),
            Lit("<｜tool▁call▁end｜><｜tool▁calls▁end｜>")]
