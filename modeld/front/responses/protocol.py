"""The OpenAI Responses API: the request models (validated at the edge: a malformed field is a 400 naming it), the
reply models (what ``/openapi.json`` declares, and what the routes build) and the stream's events."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from ..core import Loose, Shape
from ..openai.protocol import ErrorDetail, TokenLogprobOut

ENCRYPTED_REASONING = "reasoning.encrypted_content"
#: ``include``: the reply text's token log probabilities (``top_logprobs`` alternatives at each)
TEXT_LOGPROBS = "message.output_text.logprobs"


class TextFormat(Loose):
    type: Literal["text", "json_schema", "json_object"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class TextConfig(Loose):
    format: TextFormat | None = None


class ToolSpec(Loose):
    """A tool the client offers: ``function``, ``custom`` (free-form input), a ``namespace`` of those, or one this
    daemon does not run (``web_search`` and the like: left out of the prompt, named in the log). A tool without a
    type is a function (as a namespace's tools often are)."""

    type: str = "function"
    name: str | None = None
    description: str | None = None
    #: a function's JSON schema
    parameters: dict[str, Any] | None = None
    #: a namespace's tools
    tools: list[ToolSpec] | None = None


class ToolChoiceSpec(Loose):
    """A forced call: ``{type: function | custom, name, namespace?}``."""

    type: str
    name: str | None = None
    namespace: str | None = None


class ReasoningConfig(Loose):
    effort: str | None = None
    summary: str | None = None


class ContentPart(Loose):
    """A part of an input item's content: text (``input_text``, ``output_text``, ``summary_text`` …), a
    ``refusal``, or an ``input_image`` (a data or http URL in ``image_url``; a ``file_id`` is refused by name)."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None
    file_id: str | None = None


#: a message's or a call output's content: text, or a list of parts
Content = str | list[ContentPart]


class MessageIn(Loose):
    """A message (``type`` may be left out): a developer message is a system one."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content = ""


class _CallIn(Loose):
    """A call the model made, sent back with the conversation: its id, the tool's name and namespace."""

    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    namespace: str | None = None


class FunctionCallIn(_CallIn):
    type: Literal["function_call"]
    arguments: str = ""


class CustomToolCallIn(_CallIn):
    type: Literal["custom_tool_call"]
    input: str = ""


class CallOutputIn(Loose):
    """A call's result."""

    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str = Field(min_length=1)
    output: Content = ""


class ReasoningIn(Loose):
    """The model's reasoning, sent back: the daemon's sealed copy (``encrypted_content``) when it is one, else the
    summary's text."""

    type: Literal["reasoning"]
    summary: list[ContentPart] = Field(default_factory=list)
    encrypted_content: str | None = None


class ItemReference(Loose):
    """A stored item named by id: refused (this daemon keeps responses, not their items apart)."""

    type: Literal["item_reference"]


class OtherItem(Loose):
    """An item this daemon does not read (a hosted tool's call, …): left out of the prompt, named in the log."""

    type: str


#: the input items read by ``type``
_ITEMS = {"message", "function_call", "custom_tool_call", "function_call_output", "custom_tool_call_output",
          "reasoning", "item_reference"}


def _item_kind(item: Any) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return kind if isinstance(kind, str) and kind in _ITEMS else "other"  # (a type that is no text: refused there)


#: an input item, read by its ``type`` (a message when it has none)
InputItem = Annotated[
    Annotated[MessageIn, Tag("message")] | Annotated[FunctionCallIn, Tag("function_call")]
    | Annotated[CustomToolCallIn, Tag("custom_tool_call")]
    | Annotated[CallOutputIn, Tag("function_call_output")] | Annotated[CallOutputIn, Tag("custom_tool_call_output")]
    | Annotated[ReasoningIn, Tag("reasoning")] | Annotated[ItemReference, Tag("item_reference")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_kind)]


class ResponsesRequest(Loose):
    model: str = ""
    #: the input items; a string is one user message
    input: list[InputItem] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: str | ToolChoiceSpec | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=10.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


    @field_validator("input", mode="before")
    @classmethod
    def _text_input(cls, value: Any) -> Any:
        return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value

    def logprobs(self) -> int | None:
        """``DecodeConfig.logprobs``: asked by ``include`` or by ``top_logprobs``."""
        if TEXT_LOGPROBS in (self.include or []) or self.top_logprobs is not None:
            return self.top_logprobs or 0
        return None


class InputTokensRequest(ResponsesRequest):
    """``POST /v1/responses/input_tokens``: what a request's input would come to."""


# --- replies (declared in /openapi.json; built as these models and dumped with ``core.dumped``) ---------------------
#: an output item's state: streaming, finished, or cut short (a reply that ended inside a call)
ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["completed", "incomplete", "in_progress", "cancelled", "failed"]


class InputTokensDetails(Shape):
    #: the input's tokens reused from what the daemon held
    cached_tokens: int


class OutputTokensDetails(Shape):
    reasoning_tokens: int


class ResponseUsage(Shape):
    """The turn's tokens (with the extension field ``cache_miss`` when the prompt lost something the daemon held)."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class OutputText(Shape):
    """A message's text; with log probabilities asked, its tokens' (``TEXT_LOGPROBS``)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[TokenLogprobOut]


class SummaryText(Shape):
    type: Literal["summary_text"]
    text: str


class MessageItem(Shape):
    type: Literal["message"]
    id: str
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class ReasoningItem(Shape):
    """The model's reasoning as its summary; with ``include: reasoning.encrypted_content``, also sealed by the
    daemon (``encrypted_content``), so that an echoed item renders the turn as it was decoded."""

    type: Literal["reasoning"]
    id: str
    summary: list[SummaryText]
    status: ItemStatus
    encrypted_content: str | None = None


class FunctionCallItem(Shape):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus
    #: the ``namespace`` tool the function belongs to (absent for a top-level tool)
    namespace: str | None = None


class CustomToolCallItem(Shape):
    type: Literal["custom_tool_call"]
    id: str
    call_id: str
    name: str
    input: str
    status: ItemStatus
    namespace: str | None = None


CallItem = FunctionCallItem | CustomToolCallItem
#: an output item, told apart by its ``type``
OutputItem = Annotated[MessageItem | ReasoningItem | FunctionCallItem | CustomToolCallItem, Field(discriminator="type")]


class IncompleteDetails(Shape):
    reason: Literal["max_output_tokens"]


class ResponseError(Shape):
    code: str
    message: str


class Response(Shape):
    """A response object (``stream: true``: its events instead; the last of them carries this). The request's
    settings are echoed as the API does."""

    id: str
    object: Literal["response"]
    created_at: int
    status: ResponseStatus
    model: str
    output: list[OutputItem]
    #: None while it runs
    usage: ResponseUsage | None
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[ToolSpec] = Field(default_factory=list)
    tool_choice: str | ToolChoiceSpec = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    metadata: dict[str, Any] = Field(default_factory=dict)
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


# --- stream events (each with its ``sequence_number``, in the order they are sent) -----------------------------
class ResponseEvent(Shape):
    """The response as it stands: at the start (``created``, ``in_progress``; again as a keep-alive while the prefill
    runs, with the extension field ``prefill``, or ``queued`` while the request waits for the slot), and at the end
    (``completed``, ``incomplete``, ``failed``)."""

    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    sequence_number: int
    response: Response


class OutputItemEvent(Shape):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(Shape):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(Shape):
    type: Literal["response.output_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[TokenLogprobOut]


class OutputTextDone(Shape):
    type: Literal["response.output_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


class SummaryPartEvent(Shape):
    type: Literal["response.reasoning_summary_part.added", "response.reasoning_summary_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    summary_index: int
    part: SummaryText


class SummaryTextDelta(Shape):
    type: Literal["response.reasoning_summary_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    summary_index: int
    delta: str


class SummaryTextDone(Shape):
    type: Literal["response.reasoning_summary_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    summary_index: int
    text: str


class ArgumentsDelta(Shape):
    type: Literal["response.function_call_arguments.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDone(Shape):
    type: Literal["response.function_call_arguments.done"]
    sequence_number: int
    item_id: str
    output_index: int
    arguments: str


class CustomInputDelta(Shape):
    type: Literal["response.custom_tool_call_input.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class CustomInputDone(Shape):
    type: Literal["response.custom_tool_call_input.done"]
    sequence_number: int
    item_id: str
    output_index: int
    input: str


class ErrorEvent(Shape):
    """A stream that failed after it started: the error (also as OpenAI's error object, on which the SDKs raise),
    then ``response.failed``."""

    type: Literal["error"]
    sequence_number: int
    code: str
    message: str
    param: str | None
    error: ErrorDetail


#: any event of a stream, told apart by its ``type``
StreamEvent = Annotated[ResponseEvent | OutputItemEvent | ContentPartEvent | OutputTextDelta | OutputTextDone
                        | SummaryPartEvent | SummaryTextDelta | SummaryTextDone | ArgumentsDelta | ArgumentsDone
                        | CustomInputDelta | CustomInputDone | ErrorEvent, Field(discriminator="type")]
