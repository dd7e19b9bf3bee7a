"""The OpenAI API: ``/v1/chat/completions`` (plain and streamed), ``/v1/models``, ``/v1/embeddings``.

Requests are validated at the edge by the models below: a malformed field is a
400 naming it (``param``), and fields this daemon does not act on are accepted
and ignored where OpenAI documents them as hints (``user``, ``store``,
``metadata``, ``prompt_cache_key``, ``parallel_tool_calls``, penalties), never
where ignoring would change the answer (``n`` > 1, ``logprobs``, image parts:
400). ``top_k`` and ``min_p`` are accepted as llama-server and vLLM accept
them. No ``max_tokens`` means no limit: the reply runs to the end of
generation or of the context window (finish reason ``length``).

Tool choice: ``auto``; ``none`` keeps the tools in the prompt and parses no
calls; ``required`` and a named function are enforced by a grammar that admits
exactly one call in the template's own (Hermes) format.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field
from sse_starlette import EventSourceResponse, ServerSentEvent

from contract.errors import ModeldError
from contract.types import EmbedRequest, StructuredOutputConfig, ToolCallDelta
from runtime.chat import ChatResult

from .access import record_of
from .core import (
    FINISH_REASONS,
    KEEPALIVE_S,
    STREAM_SEND_TIMEOUT_S,
    CallPieces,
    Loose,
    Serving,
    Turn,
    TurnRequest,
    TurnStream,
    close_events,
    fill_record,
    with_miss,
)
from .errors import ApiError, api_error

__all__ = ["ChatCompletionRequest", "call_schemas", "router", "tool_choice_options"]


class ContentPart(Loose):
    type: str
    text: str | None = None
    refusal: str | None = None


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


class ChatCompletionRequest(Loose):
    model: str = ""
    messages: list[MessageIn] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
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
    logprobs: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


# --- request mapping -------------------------------------------------------------------------------
def text_of(content: str | list[ContentPart] | None, where: str) -> str | None:
    """Message content as text: text (and refusal) parts joined; any other part is refused."""
    if content is None or isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(content):
        if part.type in ("text", "input_text", "output_text") and part.text is not None:
            parts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            parts.append(part.refusal)
        else:
            raise ApiError(400, f"{where}.content[{i}] is a {part.type!r} part; this model reads text only",
                           code="unsupported_content", param=f"{where}.content")
    return "".join(parts)


def _messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": text_of(m.content, f"messages[{i}]")}
        if m.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": c.function.arguments if isinstance(c.function.arguments, str)
                              else json.dumps(c.function.arguments, ensure_ascii=False)}}
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.name and m.role == "tool":
            msg["name"] = m.name
        if m.reasoning_content:
            msg["reasoning_content"] = m.reasoning_content
        if m.role == "tool" and msg["content"] is None:
            msg["content"] = ""
        out.append(msg)
    return out


def _tools(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.type != "function" or t.function is None:
            raise ApiError(400, f"tools[{i}] has type {t.type!r}; chat completions take function tools",
                           param=f"tools[{i}].type")
        tools.append({"type": "function", "function": t.function.model_dump(exclude_none=True)})
    return tools


def call_schemas(tools: list[dict[str, Any]]) -> dict[str, str]:
    """Each function tool's name and the JSON schema of its arguments, as a forced call holds them."""
    return {t["function"]["name"]: json.dumps(t["function"].get("parameters") or {}) for t in tools}


def tool_choice_options(choice: str | None, forced: str | None, schemas: dict[str, str]) -> dict[str, Any]:
    """Decode options for a tool choice: ``choice`` auto/none/required, or ``forced`` (one function's
    name); ``schemas`` holds each tool's arguments schema (``call_schemas``)."""
    names = list(schemas)
    if choice == "none":
        return {"parser_protocols": []}
    if choice in (None, "auto") and forced is None:
        return {}
    if not names:
        raise ApiError(400, "tool_choice forces a call but no tools were given", param="tool_choice")
    if forced is not None:
        if forced not in names:
            raise ApiError(400, f"tool_choice names {forced!r}, which is not among the tools", param="tool_choice")
        names = [forced]
    return {"structured_output": StructuredOutputConfig(tool_call={n: schemas[n] for n in names})}


def _decode(req: ChatCompletionRequest, tools: list[dict[str, Any]]) -> dict[str, Any]:
    if req.n not in (None, 1):
        raise ApiError(400, "n > 1 is not supported: one model slot decodes one reply", param="n")
    if req.logprobs:
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    opts: dict[str, Any] = {}
    limit = req.max_completion_tokens or req.max_tokens
    if limit is not None:
        opts["max_tokens"] = limit
    for name in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repeat_penalty",
                 "repeat_last_n", "seed"):
        value = getattr(req, name)
        if value is not None:
            opts[name] = value
    if req.stop:
        opts["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        opts["structured_output"] = StructuredOutputConfig(json_schema=json.dumps({"type": "object"}))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format json_schema needs json_schema.schema (an object)",
                           param="response_format.json_schema.schema")
        opts["structured_output"] = StructuredOutputConfig(json_schema=json.dumps(schema))
    choice = req.tool_choice
    forced = choice.function.name if isinstance(choice, NamedToolChoice) else None
    plain = choice if isinstance(choice, str) else None
    calls = tool_choice_options(plain, forced, call_schemas(tools))
    if "structured_output" in calls and "structured_output" in opts:
        raise ApiError(400, "a forced tool call and a response_format cannot be combined", param="tool_choice")
    opts.update(calls)
    return opts


def turn_request(req: ChatCompletionRequest) -> TurnRequest:
    tools = _tools(req)
    return TurnRequest(messages=_messages(req), tools=tools, decode=_decode(req, tools), model=req.model)


# --- replies ---------------------------------------------------------------------------------------
def tool_calls_out(calls: list[Any], first_index: int = 0) -> list[dict[str, Any]]:
    return [
        {"index": first_index + i, "id": c.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for i, c in enumerate(calls)
    ]


def usage_out(result: ChatResult) -> dict[str, Any]:
    u = result.usage
    return with_miss({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.reused_tokens},
        # OpenAI's names for predicted-output tokens: here, speculative drafts kept and rejected
        "completion_tokens_details": {
            "accepted_prediction_tokens": u.accepted_tokens,
            "rejected_prediction_tokens": u.drafted_tokens - u.accepted_tokens,
        },
    }, u)


def router(serving: Serving) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    async def models() -> dict[str, Any]:
        try:
            names, created = await anyio.to_thread.run_sync(serving.models)
        except ModeldError as exc:
            raise api_error(exc) from None
        return {"object": "list",
                "data": [{"id": n, "object": "model", "created": created, "owned_by": "modeld"} for n in names]}

    @r.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse | EventSourceResponse:
        record = record_of(request)
        record.stream = body.stream
        turn = await serving.abegin(turn_request(body), request)
        record.model = turn.model
        created = int(time.time())
        rid = "chatcmpl-" + uuid.uuid4().hex[:24]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return TurnStream(turn, _stream(turn, rid, created, include_usage, request), ping=int(KEEPALIVE_S),
                                       ping_message_factory=lambda: _keepalive(turn, rid, created),
                                       send_timeout=STREAM_SEND_TIMEOUT_S)
        result = await turn.result(request)
        msg = result.message
        message: dict[str, Any] = {"role": "assistant", "content": msg.content}
        if msg.tool_calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in tool_calls_out(msg.tool_calls)]
        if msg.reasoning:
            message["reasoning_content"] = msg.reasoning
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": turn.model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": FINISH_REASONS.get(result.finish_reason, "stop")}],
            "usage": usage_out(result),
        })

    @r.post("/v1/embeddings")
    async def embeddings(body: EmbeddingsRequest, request: Request) -> JSONResponse:
        texts = [body.input] if isinstance(body.input, str) else body.input

        def run() -> Any:
            with serving.pool.client() as c:
                return c.embed(EmbedRequest(texts=texts))

        try:
            res = await anyio.to_thread.run_sync(run)
        except ModeldError as exc:
            raise api_error(exc) from None
        record_of(request).model = res.model_name
        record_of(request).prompt_tokens = res.tokens
        return JSONResponse({
            "object": "list",
            "model": res.model_name,
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(res.vectors)],
            "usage": {"prompt_tokens": res.tokens, "total_tokens": res.tokens},
        })

    return r


def _call_piece(piece: ToolCallDelta) -> dict[str, Any]:
    """A ``choices[0].delta.tool_calls`` entry: the first of a call carries its id, type and name."""
    if piece.id or piece.name:
        return {"index": piece.index, "id": piece.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": piece.name, "arguments": piece.arguments}}
    return {"index": piece.index, "function": {"arguments": piece.arguments}}


def _keepalive(turn: Turn, rid: str, created: int) -> ServerSentEvent:
    """While the prefill runs: a chunk with an empty delta and how far the prefill came (``prefill``, which the SDKs
    ignore), what a client's idle timer counts (Qwen Code's counts chunks, and the SDKs drop comments); after it,
    while the reply streams, a comment (a chunk made here could land between two of the reply's)."""
    if not turn.prefilling:
        return turn.keepalive_comment()
    progress = turn.progress()
    return ServerSentEvent(data=json.dumps({
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": turn.model,
        "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}],
        **({"prefill": progress} if progress else {})}))


async def _stream(turn: Turn, rid: str, created: int, include_usage: bool, request: Request) -> Any:
    """The reply as ``chat.completion.chunk`` events; an error after the start is an ``error`` event and no
    ``[DONE]`` (the SDK raises it); a disconnect cancels the decode within one token."""
    record = record_of(request)

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created, "model": turn.model,
                           "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

    yield chunk({"role": "assistant", "content": ""})
    pieces = CallPieces()
    events = turn.aevents(record)
    try:
        async for event in events:
            if event.result is not None:
                fill_record(record, event.result)
                yield chunk({}, FINISH_REASONS.get(event.result.finish_reason, "stop"))
                if include_usage:
                    yield json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                      "model": turn.model, "choices": [], "usage": usage_out(event.result)})
                break
            delta: dict[str, Any] = {}
            if event.text:
                delta["content"] = event.text
            if event.thinking:
                delta["reasoning_content"] = event.thinking
            calls = [_call_piece(p) for p in pieces.of(event)]
            if calls:
                delta["tool_calls"] = calls
            if delta:
                yield chunk(delta)
    except ModeldError as exc:
        err = api_error(exc)
        record.error = err.code or "error"
        yield json.dumps(err.openai())
        return
    finally:
        await close_events(events)
    yield "[DONE]"
