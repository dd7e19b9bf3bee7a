"""A forced tool call: the reply is one call, in the Hermes form the templates render calls back in.

Both engines turn ``StructuredOutputConfig.tool_call`` into their own grammar
(GBNF for llama.cpp, Lark with JSON-schema rules for llguidance) from these
pieces, so a forced call decodes the same text on either, and the next request,
which renders the call back, reuses it.
"""

from __future__ import annotations

import json
from typing import Any

#: a call's text around its name and its arguments object
HEAD = '<tool_call>\n{"name": "'
MIDDLE = '", "arguments": '
TAIL = "}\n</tool_call>"

#: the arguments of a tool whose schema the engine's grammar cannot hold: any JSON object
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def call_prefix(name: str) -> str:
    """The text of a call to ``name`` up to its arguments."""
    return HEAD + json.dumps(name)[1:-1] + MIDDLE


def arguments_schema(text: str) -> dict[str, Any]:
    """The schema a call's arguments are held to (``ANY_OBJECT`` when there is none to hold them to).

    An object schema that lists its properties and says nothing of others is closed (no property
    the tool does not declare), as strict function calling reads it: a small model otherwise
    fills a forced call with keys it copied from elsewhere in the prompt.
    """
    try:
        schema = json.loads(text) if text else None
    except ValueError:
        return ANY_OBJECT
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        return ANY_OBJECT
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        schema = {**schema, "additionalProperties": False}
    return schema
