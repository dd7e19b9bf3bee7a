"""The OpenAI API (chat completions, models, embeddings): the request models (validated at the edge: a malformed field
is a 400 naming it) and the reply models (what ``/openapi.json`` declares)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from ..core import Loose, Shape
from ..errors import ApiError


class ContentPart(Loose):
    type: str
    text: str | None = None
    refusal: str | None = None
    #: an ``image_url`` part's ``{"url": "data:…", "detail": …}`` (a bare URL string is taken too)
    image_url: dict[str, Any] | str | None = None


class FunctionCall(Loose):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = ""


class ToolCallIn(Loose):
    id: str = ""
    type: str = "function"
    function: FunctionCall


class MessageIn(Loose):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(Loose):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(Loose):
    type: str = "function"
    function: FunctionDef | None = None


class NamedFunction(Loose):
    name: str


class NamedToolChoice(Loose):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Loose):
    name: str = ""
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class ResponseFormat(Loose):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(Loose):
    include_usage: bool = False


class EmbeddingsRequest(Loose):
    """``/v1/embeddings``: text input only (token-id arrays are refused); ``encoding_format`` is accepted and the
    vectors always come back as floats, which the SDKs read whatever they asked for."""

    model: str = ""
    input: str | Annotated[list[str], Field(min_length=1)]


class SamplingRequest(Loose):
    """The sampling fields both OpenAI generation APIs (chat and legacy completions) take."""

    temperature: float | None = Field(None, ge=0.0, le=10.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    #: llama-server's and Ollama's extension (over the last ``repeat_last_n`` tokens)
    repeat_penalty: float | None = Field(None, gt=0.0, le=10.0)
    repeat_last_n: int | None = Field(None, ge=0, le=1_000_000)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None


class ChatCompletionRequest(SamplingRequest):
    model: str = ""
    messages: list[MessageIn] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    #: each reply token's log probability (``choices[].logprobs.content``), and with ``top_logprobs`` the
    #: likeliest tokens at its step
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


# --- replies (declared in /openapi.json; ``make fuzz`` checks every reply against them) --------------------------
class PromptTokensDetails(Shape):
    #: the prompt's tokens reused from what the daemon held
    cached_tokens: int


class CompletionTokensDetails(Shape):
    #: speculative drafts kept and rejected (OpenAI's names for predicted-output tokens)
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class Usage(Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class FunctionCallOut(Shape):
    name: str
    arguments: str


class ToolCallOut(Shape):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(Shape):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    #: the model's reasoning, where its template separates it
    reasoning_content: str | None = None


class TopLogprobOut(Shape):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprobOut):
    top_logprobs: list[TopLogprobOut]


class ChoiceLogprobs(Shape):
    """Every reply token's log probability, in order (tokens of the reasoning and of tool calls included)."""

    content: list[TokenLogprobOut] | None
    refusal: None = None


class Choice(Shape):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter"]


class ChatCompletion(Shape):
    """A chat completion (``stream: true``: ``chat.completion.chunk`` events instead)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class FunctionPiece(Shape):
    #: the first piece of a call names its function
    name: str | None = None
    arguments: str


class ToolCallPiece(Shape):
    """A ``choices[0].delta.tool_calls`` entry: the first of a call carries its id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionPiece


class ChunkDelta(Shape):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallPiece] | None = None


class ChunkChoice(Shape):
    index: int
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter"] | None


class ChatCompletionChunk(Shape):
    """A ``chat.completion.chunk`` event of a streamed chat completion; the last, with ``include_usage``, has no
    choices and the usage. A keep-alive chunk adds nothing to the reply and says what the turn waits on (extension
    fields ``queued``, ``prefill``)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(Shape):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    #: what the model can be asked for ("text", "vision", "tools", "reasoning"): the loaded model's, from its
    #: weights and template; absent for a model the daemon can load but has not
    capabilities: list[str] | None = None


class ModelList(Shape):
    object: Literal["list"]
    data: list[ModelCard]


class EmbeddingOut(Shape):
    object: Literal["embedding"]
    index: int
    embedding: list[float]


class EmbeddingUsage(Shape):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Shape):
    object: Literal["list"]
    model: str
    data: list[EmbeddingOut]
    usage: EmbeddingUsage


class ErrorDetail(Shape):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(Shape):
    """OpenAI's error object (every route but the Messages API's)."""

    error: ErrorDetail


def error_body(err: ApiError) -> ErrorBody:
    """``err`` as OpenAI's error object."""
    return ErrorBody(error=ErrorDetail(message=err.message, type=err.openai_type, param=err.param, code=err.code))
