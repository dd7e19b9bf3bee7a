"""The Anthropic Messages API: the routes, plain and streamed (SSE, keep-alives while the prefill runs)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from contract.errors import ModeldError

from ..access import AccessRecord, record_of
from ..core import (
    KEEPALIVE_S,
    STREAM_SEND_TIMEOUT_S,
    CallPieces,
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
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensRequest,
    DeltaUsage,
    ErrorBody,
    InputJsonDelta,
    MessageDelta,
    MessageOut,
    MessagesRequest,
    MessageStart,
    MessageStop,
    MessageUsage,
    Ping,
    SignatureDelta,
    StartedMessage,
    StopDelta,
    StreamEvent,
    TextDelta,
    TextOut,
    ThinkingDelta,
    ThinkingOut,
    TokenCount,
    ToolUseOut,
    error_body,
)
from .translate import message_body, stop_reason, tool_id, turn_request, usage_of


def router(serving: Serving) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/messages", response_model=None, responses=declared(MessageOut, ErrorBody, stream=True))
    async def messages(body: MessagesRequest, request: Request) -> JSONResponse | EventSourceResponse:
        record = record_of(request)
        record.stream = body.stream
        req = turn_request(body, serving)
        turn = await (abegin_streamed(serving, req, request) if body.stream else serving.abegin(req, request))
        record.model = turn.model
        msg_id = f"msg_{uuid.uuid4().hex[:24]}"
        if body.stream:
            return TurnStream(turn, _stream(turn, msg_id, serving, request), ping=int(KEEPALIVE_S),
                                       ping_message_factory=lambda: _ping(turn), send_timeout=STREAM_SEND_TIMEOUT_S)
        result = await turn.result(request)
        return JSONResponse(dumped(message_body(result, turn.model, msg_id, serving)))

    @r.post("/v1/messages/count_tokens", responses=declared(TokenCount, ErrorBody))
    async def count_tokens(body: CountTokensRequest) -> JSONResponse:
        count = await serving.acount(turn_request(body, serving))
        return JSONResponse(dumped(TokenCount(input_tokens=count.prompt_tokens)))

    return r


def _ping(turn: Turn) -> ServerSentEvent:
    """The keep-alive: while the prefill runs, a ``message_delta`` that changes nothing (no stop reason yet, no
    output tokens) with how far the prefill came (``prefill``: the SDKs ignore it); after it, a ``ping``.

    The SDKs drop ``ping`` events before their callers see them (the Anthropic SDKs yield only the message and
    content block events), and an agent's stream watchdog (Claude Code's, 300 s) is reset by the events its SDK
    yields: pings alone keep the bytes flowing but not the agent. A ``message_delta`` reaches it, and the message
    it assembles reads the same (the final ``message_delta`` sets the stop reason and the usage).

    While the turn waits for the slot, a ``ping``: ``message_start`` (which the deltas need before them) carries
    the prompt's size, not known until the turn begins, and Claude Code's watchdog (300 s) outlasts the queue's
    timeout (300 s by default)."""
    if turn.prefilling and not turn.queued:
        progress = turn.progress()
        keepalive = MessageDelta(type="message_delta", delta=StopDelta(stop_reason=None, stop_sequence=None),
                                 usage=DeltaUsage(output_tokens=0), **({"prefill": progress} if progress else {}))
        return _sse(keepalive)
    return _sse(Ping(type="ping"))


def _error(exc: ModeldError | ApiError, record: AccessRecord) -> dict[str, str]:
    """The ``error`` event that ends a stream that failed after it started."""
    err = api_error(exc)
    record.error = err.code or "error"
    return {"event": "error", "data": json.dumps(dumped(error_body(err)))}


def _event(event: StreamEvent) -> dict[str, str]:
    """An event as SSE: its name is its ``type``."""
    return {"event": event.type, "data": json.dumps(dumped(event), ensure_ascii=False)}


def _sse(event: StreamEvent) -> ServerSentEvent:
    """An event as the stream's keep-alive sends it."""
    sent = _event(event)
    return ServerSentEvent(event=sent["event"], data=sent["data"])


async def _stream(turn: Turn, msg_id: str, serving: Serving, request: Request) -> AsyncGenerator[dict[str, str], None]:
    """The documented event order: message_start, then per block content_block_start / deltas / stop,
    message_delta (stop reason, usage), message_stop; an error after the start is an ``error`` event."""
    record = record_of(request)
    try:
        turn = await turn.ready()  # (a stream that started while its request waits for the slot)
    except (ModeldError, ApiError) as exc:
        yield _error(exc, record)
        return
    count = turn.count
    yield _event(MessageStart(type="message_start", message=StartedMessage(
        id=msg_id, type="message", role="assistant", model=turn.model, content=[], stop_reason=None,
        stop_sequence=None,
        usage=MessageUsage(input_tokens=count.prompt_tokens - count.resident_tokens, cache_creation_input_tokens=0,
                           cache_read_input_tokens=count.resident_tokens, output_tokens=0))))
    yield _event(Ping(type="ping"))  # as the API does: a ping at once, then every KEEPALIVE_S while nothing else goes out
    index = -1
    open_kind = ""  # the kind of the block being streamed: "text", "thinking", "tool_use" or ""
    thinking = ""
    pieces = CallPieces()

    def delta(piece: TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta) -> dict[str, str]:
        return _event(ContentBlockDelta(type="content_block_delta", index=index, delta=piece))

    def close_block() -> list[dict[str, str]]:
        nonlocal open_kind, thinking
        out = []
        if open_kind == "thinking":
            out.append(delta(SignatureDelta(type="signature_delta", signature=serving.sealer.sign(thinking))))
        if open_kind:
            out.append(_event(ContentBlockStop(type="content_block_stop", index=index)))
        open_kind, thinking = "", ""
        return out

    def open_block(block: TextOut | ThinkingOut | ToolUseOut) -> list[dict[str, str]]:
        nonlocal index, open_kind
        out = close_block()
        index += 1
        open_kind = block.type
        out.append(_event(ContentBlockStart(type="content_block_start", index=index, content_block=block)))
        return out

    events = turn.aevents(record)
    try:
        async for event in events:
            if event.result is not None:
                for e in close_block():
                    yield e
                result = event.result
                fill_record(record, result)
                yield _event(MessageDelta(
                    type="message_delta",
                    delta=StopDelta(stop_reason=stop_reason(result), stop_sequence=result.stop_sequence or None),
                    usage=DeltaUsage(**usage_of(result).model_dump())))
                yield _event(MessageStop(type="message_stop"))
                return
            if event.thinking:
                if open_kind != "thinking":
                    for e in open_block(ThinkingOut(type="thinking", thinking="")):
                        yield e
                thinking += event.thinking
                yield delta(ThinkingDelta(type="thinking_delta", thinking=event.thinking))
            if event.text:
                if open_kind != "text":
                    for e in open_block(TextOut(type="text", text="")):
                        yield e
                yield delta(TextDelta(type="text_delta", text=event.text))
            # a call's block opens at its first piece; its input streams as the model writes the arguments (they
            # are a JSON object, so the partial_json pieces joined are the input), and the next block closes it
            for piece in pieces.of(event):
                if piece.id or piece.name:
                    for e in open_block(ToolUseOut(type="tool_use", id=tool_id(piece.id), name=piece.name or "", input={})):
                        yield e
                if piece.arguments and open_kind == "tool_use":
                    yield delta(InputJsonDelta(type="input_json_delta", partial_json=piece.arguments))
    except (ModeldError, ApiError) as exc:
        yield _error(exc, record)
    finally:
        await close_events(events)
