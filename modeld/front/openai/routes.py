"""The OpenAI API (chat completions, models, embeddings): the routes, plain and streamed (SSE, keep-alives while the
prefill runs)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from contract.errors import ModeldError
from contract.types import EmbedRequest, TokenLogprob

from ..access import record_of
from ..core import (
    FINISH_REASONS,
    KEEPALIVE_S,
    STREAM_SEND_TIMEOUT_S,
    CallPieces,
    HeldLogprobs,
    Serving,
    Turn,
    TurnStream,
    close_events,
    declared,
    dumped,
    fill_record,
)
from ..errors import ApiError, api_error
from ..queued import abegin_streamed
from .protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    ChunkDelta,
    EmbeddingList,
    EmbeddingOut,
    EmbeddingsRequest,
    EmbeddingUsage,
    ErrorBody,
    ModelCard,
    ModelList,
    Usage,
    error_body,
)
from .translate import call_piece, logprobs_out, tool_calls_out, turn_request, usage_out


def router(serving: Serving) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models", responses=declared(ModelList, ErrorBody))
    async def models() -> JSONResponse:
        try:
            listed, created = await anyio.to_thread.run_sync(serving.models)
        except ModeldError as exc:
            raise api_error(exc) from None
        # ``capabilities`` is an extension field (the SDKs keep it as an extra), left out for a model not loaded
        cards = [ModelCard(id=name, object="model", created=created, owned_by="modeld",
                           **({"capabilities": capabilities} if capabilities is not None else {}))
                 for name, capabilities in listed]
        return JSONResponse(dumped(ModelList(object="list", data=cards)))

    @r.post("/v1/chat/completions", response_model=None, responses=declared(ChatCompletion, ErrorBody, stream=True))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse | EventSourceResponse:
        record = record_of(request)
        record.stream = body.stream
        req = turn_request(body)
        turn = await (abegin_streamed(serving, req, request) if body.stream else serving.abegin(req, request))
        record.model = turn.model
        created = int(time.time())
        rid = "chatcmpl-" + uuid.uuid4().hex[:24]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = _stream(turn, rid, created, include_usage, bool(body.logprobs), request)
            return TurnStream(turn, stream, ping=int(KEEPALIVE_S),
                                       ping_message_factory=lambda: _keepalive(turn, rid, created),
                                       send_timeout=STREAM_SEND_TIMEOUT_S)
        result = await turn.result(request)
        msg = result.message
        message = AssistantMessage(role="assistant", content=msg.content)
        if msg.tool_calls:
            message.tool_calls = tool_calls_out(msg.tool_calls)
        if msg.reasoning:
            message.reasoning_content = msg.reasoning
        choice = Choice(index=0, message=message, logprobs=logprobs_out(result.logprobs) if body.logprobs else None,
                        finish_reason=FINISH_REASONS.get(result.finish_reason, "stop"))
        return JSONResponse(dumped(ChatCompletion(id=rid, object="chat.completion", created=created, model=turn.model,
                                                  choices=[choice], usage=usage_out(result))))

    @r.post("/v1/embeddings", responses=declared(EmbeddingList, ErrorBody))
    async def embeddings(body: EmbeddingsRequest, request: Request) -> JSONResponse:
        texts = [body.input] if isinstance(body.input, str) else body.input

        def run() -> Any:
            with serving.pool.client() as c:
                return c.embed(EmbedRequest(texts=texts))

        try:
            res = await anyio.to_thread.run_sync(run)
        except ModeldError as exc:
            raise api_error(exc) from None
        tokens = sum(res.tokens)  # (the daemon counts each input's)
        record_of(request).model = res.model_name
        record_of(request).prompt_tokens = tokens
        return JSONResponse(dumped(EmbeddingList(
            object="list", model=res.model_name,
            data=[EmbeddingOut(object="embedding", index=i, embedding=v) for i, v in enumerate(res.vectors)],
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )))

    return r


def _chunk(turn: Turn, rid: str, created: int, choices: list[ChunkChoice], usage: Usage | None = None
           ) -> ChatCompletionChunk:
    chunk = ChatCompletionChunk(id=rid, object="chat.completion.chunk", created=created, model=turn.model,
                                choices=choices)
    if usage is not None:
        chunk.usage = usage
    return chunk


def _keepalive(turn: Turn, rid: str, created: int) -> ServerSentEvent:
    """A chunk with an empty delta while the prefill runs, what a client's idle timer counts (Qwen Code's counts
    chunks, and the SDKs drop comments); a comment after it (``Turn.keepalive_chunk``)."""
    empty = ChunkChoice(index=0, delta=ChunkDelta(), logprobs=None, finish_reason=None)
    return turn.keepalive_chunk(dumped(_chunk(turn, rid, created, [empty])))


async def _stream(turn: Turn, rid: str, created: int, include_usage: bool, logprobs: bool, request: Request) -> Any:
    """The reply as ``chat.completion.chunk`` events; an error after the start is an ``error`` event and no
    ``[DONE]`` (the SDK raises it); a disconnect cancels the decode within one token. With ``logprobs``, each
    chunk carries its tokens' (the finish chunk those whose output was nothing)."""
    record = record_of(request)

    def chunk(delta: ChunkDelta, finish: str | None = None, tokens: list[TokenLogprob] | None = None) -> str:
        scores = logprobs_out(tokens or []) if logprobs else None
        choice = ChunkChoice(index=0, delta=delta, logprobs=scores, finish_reason=finish)
        return json.dumps(dumped(_chunk(turn, rid, created, [choice])))

    yield chunk(ChunkDelta(role="assistant", content=""))
    pieces = CallPieces()
    events = turn.aevents(record)
    scores = HeldLogprobs()
    try:
        async for event in events:
            if event.result is not None:
                fill_record(record, event.result)
                scores.add(event)
                yield chunk(ChunkDelta(), FINISH_REASONS.get(event.result.finish_reason, "stop"), scores.take())
                if include_usage:
                    yield json.dumps(dumped(_chunk(turn, rid, created, [], usage_out(event.result))))
                break
            delta = ChunkDelta()
            if event.text:
                delta.content = event.text
            if event.thinking:
                delta.reasoning_content = event.thinking
            calls = [call_piece(p) for p in pieces.of(event)]
            if calls:
                delta.tool_calls = calls
            scores.add(event)
            if delta.model_fields_set:
                yield chunk(delta, tokens=scores.take())
    except (ModeldError, ApiError) as exc:
        err = api_error(exc)
        record.error = err.code or "error"
        yield json.dumps(dumped(error_body(err)))
        return
    finally:
        await close_events(events)
    yield "[DONE]"
