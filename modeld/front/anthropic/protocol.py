"""The Anthropic Messages API: the request models (validated at the edge: a malformed field is a 400 naming it) and the
reply models (what ``/openapi.json`` declares)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from contract.types import FinishReason

from ..core import Loose, Shape

#: the start of a system block that only carries a client's billing header (it changes every request)
BILLING_HEADER = "x-anthropic-billing-header:"


#: a decode's finish reason as stop_reason (cancelled: the API has no value for a reply a cancel cut short;
#: "max_tokens" says the reply is incomplete, where "end_turn" would say the model ended it)
STOP_REASONS: dict[FinishReason, str] = {
    "stop": "end_turn", "length": "max_tokens", "context_full": "max_tokens", "tool_calls": "tool_use",
    "cancelled": "max_tokens",
}


class Block(Loose):
    type: str
    text: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: Any = None
    # tool_result
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    # thinking
    thinking: str | None = None
    signature: str | None = None
    # image: {"type": "base64", "media_type": "image/png", "data": "…"} or {"type": "url", "url": "…"}
    source: dict[str, Any] | None = None


class Message(Loose):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(Loose):
    name: str = Field(min_length=1, max_length=256)
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(Loose):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Loose):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class MessagesRequest(Loose):
    model: str = ""
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    max_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    thinking: Thinking | None = None


class CountTokensRequest(Loose):
    model: str = ""
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


# --- replies (declared in /openapi.json; ``make fuzz`` checks every reply against them) --------------------------
class MessageUsage(Shape):
    #: what was prefilled, what was reused, nothing created on request (every prefilled token is kept), the reply
    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int


class ContentBlockOut(Shape):
    """A reply's block: ``text``, ``thinking`` (signed) or ``tool_use`` (their other fields as the API defines)."""

    type: Literal["text", "thinking", "tool_use"]


class MessageOut(Shape):
    """A message (``stream: true``: its events instead)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlockOut]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(Shape):
    input_tokens: int


class ErrorDetail(Shape):
    type: str
    message: str
    #: modeld's machine-readable code where it has one (``vision_unsupported``, ``context_length_exceeded``, …):
    #: Anthropic's ``type`` values are a fixed set
    code: str | None = None


class ErrorBody(Shape):
    """Anthropic's error object (the Messages API's routes)."""

    type: Literal["error"]
    error: ErrorDetail
