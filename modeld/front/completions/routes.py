"""``POST /v1/completions``, plain and streamed (SSE, keep-alives while the prefill runs)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from contract.errors import ModeldError
from contract.types import FinishReason

from ..access import record_of
from ..core import (
    FINISH_REASONS,
    KEEPALIVE_S,
    STREAM_SEND_TIMEOUT_S,
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
from ..openai.protocol import ErrorBody, Usage, error_body
from ..openai.translate import usage_out
from ..queued import abegin_streamed
from .protocol import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest
from .translate import joined, logprobs_out, prompt_logprobs_out, prompt_of, turn_request


def router(serving: Serving) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/completions", response_model=None, responses=declared(Completion, ErrorBody, stream=True))
    async def completions(body: CompletionRequest, request: Request) -> JSONResponse | EventSourceResponse:
        record = record_of(request)
        record.stream = body.stream
        turn_req = turn_request(body)
        echo = ""
        if body.echo:
            prompt = prompt_of(body)
            echo = prompt if isinstance(prompt, str) else await serving.aon_session(
                body.model, lambda s: s.detokenize(prompt))
        turn = await (abegin_streamed(serving, turn_req, request) if body.stream else serving.abegin(turn_req, request))
        record.model = turn.model
        created = int(time.time())
        rid = "cmpl-" + uuid.uuid4().hex[:24]
        scored = body.logprobs is not None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return TurnStream(turn, _stream(turn, rid, created, echo, scored, include_usage, request),
                              ping=int(KEEPALIVE_S), ping_message_factory=lambda: _keepalive(turn, rid, created),
                              send_timeout=STREAM_SEND_TIMEOUT_S)
        result = await turn.result(request)
        text = result.message.content or ""
        # one entry per sampled token, the end-of-generation token that ended the reply too (its text empty), as
        # vLLM and OpenAI's legacy API give them: a scorer reads the figures past the prompt's by position
        sampled = [*result.logprobs, *([result.end_logprob] if result.end_logprob is not None else [])]
        scores = logprobs_out(sampled, len(echo)) if scored else None
        if scores is not None and body.echo:
            scores = joined(prompt_logprobs_out(echo, result.prompt_logprobs), scores)
        choice = CompletionChoice(index=0, text=echo + text, logprobs=scores,
                                  finish_reason=_finish(result.finish_reason))
        return JSONResponse(dumped(Completion(id=rid, object="text_completion", created=created, model=turn.model,
                                              choices=[choice], usage=usage_out(result))))

    return r


def _finish(reason: FinishReason) -> str:
    """The legacy API's finish reason: it has no tool calls (a raw prompt's reply is its text)."""
    out = FINISH_REASONS.get(reason, "stop")
    return "stop" if out == "tool_calls" else out


def _chunk(turn: Turn, rid: str, created: int, text: str | None, finish: str | None = None,
           logprobs: CompletionLogprobs | None = None, usage: Usage | None = None) -> Completion:
    """A ``text_completion`` chunk: one choice with ``text``, or (None) the usage alone."""
    chunk = Completion(id=rid, object="text_completion", created=created, model=turn.model, choices=[])
    if text is not None:
        chunk.choices = [CompletionChoice(index=0, text=text, logprobs=logprobs, finish_reason=finish)]
    if usage is not None:
        chunk.usage = usage
    return chunk


def _data(chunk: Completion) -> str:
    """A chunk as its event's data."""
    return json.dumps(dumped(chunk))


def _keepalive(turn: Turn, rid: str, created: int) -> ServerSentEvent:
    """A chunk with no text while the prefill runs, a comment after it (``Turn.keepalive_chunk``)."""
    return turn.keepalive_chunk(dumped(_chunk(turn, rid, created, "")))


async def _stream(turn: Turn, rid: str, created: int, echo: str, scored: bool, include_usage: bool,
                  request: Request) -> Any:
    """The reply as ``text_completion`` chunks (the echoed prompt first: scored, once the prefill scored it), the
    last with the finish reason; an error after the start is an ``error`` event and no ``[DONE]``; a disconnect
    cancels the decode within one token."""
    record = record_of(request)
    if echo and not scored:
        yield _data(_chunk(turn, rid, created, echo))
    offset = len(echo)  # where the next token's text starts in the whole text
    held = HeldLogprobs()

    def scores() -> CompletionLogprobs | None:
        nonlocal offset
        if not scored:
            return None
        tokens = held.take()
        out = logprobs_out(tokens, offset)
        offset += sum(len(t.token) for t in tokens)
        return out

    events = turn.aevents(record)
    try:
        async for event in events:
            if echo and scored:  # the first event comes after the prefill, which scored the prompt
                yield _data(_chunk(turn, rid, created, echo, None, prompt_logprobs_out(echo, turn.prompt_logprobs)))
                echo = ""
            if event.result is not None:
                fill_record(record, event.result)
                held.add(event)
                held.add_end(event.result)  # (the end token that ended the reply: its entry, text empty)
                finish = _finish(event.result.finish_reason)
                yield _data(_chunk(turn, rid, created, "", finish, scores()))
                if include_usage:
                    yield _data(_chunk(turn, rid, created, None, usage=usage_out(event.result)))
                break
            held.add(event)
            if event.text:
                yield _data(_chunk(turn, rid, created, event.text, None, scores()))
    except (ModeldError, ApiError) as exc:
        err = api_error(exc)
        record.error = err.code or "error"
        yield json.dumps(dumped(error_body(err)))
        return
    finally:
        await close_events(events)
    yield "[DONE]"
