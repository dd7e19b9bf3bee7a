"""A forced tool call: the reply is one call, in the form the model's family writes and its template renders.

Both engines turn ``StructuredOutputConfig.tool_call`` into their own grammar
(GBNF for llama.cpp, Lark with JSON-schema rules for llguidance) from the
pieces the model's ``ToolFormat`` gives (``backends.tape.toolformats``), so a
forced call decodes the same text on either, and the next request, which
renders the call back, reuses it.
"""

from __future__ import annotations

import json
from typing import Any

#: the arguments of a call with no schema to hold them to: any JSON object
ANY_OBJECT: dict[str, Any] = {"type": "object"}


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
