"""The Anthropic Messages API: the request models (validated at the edge: a malformed field is a 400 naming it) and the
reply models (what ``/openapi.json`` declares)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from contract.types import FinishReason

from ..core import Loose, Shape
from ..errors import ApiError

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


class TextOut(Shape):
    type: Literal["text"]
    text: str


class ThinkingOut(Shape):
    """The model's reasoning, signed by this daemon (a stream sends the signature as the block's last delta)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ToolUseOut(Shape):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


#: a reply's content block
ContentBlockOut = Annotated[TextOut | ThinkingOut | ToolUseOut, Field(discriminator="type")]


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


# --- a stream's events (``event:`` is the data's ``type``) -------------------------------------------------------
class StartedMessage(Shape):
    """``message_start``'s message: no content, no stop reason yet; its usage the prompt's."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlockOut]
    stop_reason: None
    stop_sequence: None
    usage: MessageUsage


class MessageStart(Shape):
    type: Literal["message_start"]
    message: StartedMessage


class ContentBlockStart(Shape):
    type: Literal["content_block_start"]
    index: int
    content_block: ContentBlockOut


class TextDelta(Shape):
    type: Literal["text_delta"]
    text: str


class ThinkingDelta(Shape):
    type: Literal["thinking_delta"]
    thinking: str


class SignatureDelta(Shape):
    type: Literal["signature_delta"]
    signature: str


class InputJsonDelta(Shape):
    """A piece of a tool call's input (the pieces joined are its JSON object)."""

    type: Literal["input_json_delta"]
    partial_json: str


class ContentBlockDelta(Shape):
    type: Literal["content_block_delta"]
    index: int
    delta: Annotated[TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta, Field(discriminator="type")]


class ContentBlockStop(Shape):
    type: Literal["content_block_stop"]
    index: int


class StopDelta(Shape):
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None


class DeltaUsage(Shape):
    """A ``message_delta``'s usage: the final one's is the whole turn's; a keep-alive's only ``output_tokens`` 0."""

    output_tokens: int
    input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class MessageDelta(Shape):
    """The stop reason and the usage at the end; while a prefill runs, a keep-alive that changes nothing (with the
    extension field ``prefill``: how far it came)."""

    type: Literal["message_delta"]
    delta: StopDelta
    usage: DeltaUsage


class MessageStop(Shape):
    type: Literal["message_stop"]


class Ping(Shape):
    type: Literal["ping"]


#: any event of a stream but ``error``
StreamEvent = (MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop
               | Ping)


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


def error_body(err: ApiError) -> ErrorBody:
    """``err`` as Anthropic's error object: its ``type`` one of Anthropic's fixed set, modeld's own code
    (``vision_unsupported``, ``context_length_exceeded``, …) beside it as ``error.code``, for a client to read
    without parsing the prose (the SDKs keep an unknown field on the error's body)."""
    detail = ErrorDetail(type=err.anthropic_type, message=err.anthropic_message or err.message)
    if err.code:
        detail.code = err.code
    return ErrorBody(type="error", error=detail)
