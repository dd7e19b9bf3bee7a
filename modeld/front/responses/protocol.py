"""The OpenAI Responses API: the request models (validated at the edge: a malformed field is a 400 naming it) and the
reply models (what ``/openapi.json`` declares)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ..core import Loose, Shape

ENCRYPTED_REASONING = "reasoning.encrypted_content"
#: ``include``: the reply text's token log probabilities (``top_logprobs`` alternatives at each)
TEXT_LOGPROBS = "message.output_text.logprobs"


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
    top_logprobs: int | None = Field(None, ge=0, le=20)
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


    def logprobs(self) -> int | None:
        """``DecodeConfig.logprobs``: asked by ``include`` or by ``top_logprobs``."""
        if TEXT_LOGPROBS in (self.include or []) or self.top_logprobs is not None:
            return self.top_logprobs or 0
        return None


class InputTokensRequest(ResponsesRequest):
    """``POST /v1/responses/input_tokens``: what a request's input would come to."""


# --- replies (declared in /openapi.json; ``make fuzz`` checks every reply against them) --------------------------
class InputTokensDetails(Shape):
    #: the input's tokens reused from what the daemon held
    cached_tokens: int


class OutputTokensDetails(Shape):
    reasoning_tokens: int


class ResponseUsage(Shape):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class OutputItem(Shape):
    """An output item: ``message``, ``reasoning``, ``function_call`` or ``custom_tool_call`` (their other fields
    as the API defines them)."""

    type: str
    id: str


class Response(Shape):
    """A response object (``stream: true``: its events instead; ``response.completed`` carries this)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "cancelled", "failed"]
    model: str
    output: list[OutputItem]
    #: None while it runs
    usage: ResponseUsage | None
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    output_text: str


class DeletedResponse(Shape):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class InputTokens(Shape):
    object: Literal["response.input_tokens"]
    input_tokens: int


class ResponseRef(Shape):
    """``POST /v1/responses/{id}/cancel``: the response's status (the whole response when it had finished)."""

    id: str
    object: Literal["response"]
    status: str
