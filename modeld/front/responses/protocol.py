"""The OpenAI Responses API: the request models (validated at the edge: a malformed field is a 400 naming it) and the
reply models (what ``/openapi.json`` declares)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ..core import (
    Loose,
)

ENCRYPTED_REASONING = "reasoning.encrypted_content"


class TextFormat(Loose):
    type: Literal["text", "json_schema", "json_object"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class TextConfig(Loose):
    format: TextFormat | None = None


class ResponsesRequest(Loose):
    model: str = ""
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=10.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class InputTokensRequest(ResponsesRequest):
    """``POST /v1/responses/input_tokens``: what a request's input would come to."""
