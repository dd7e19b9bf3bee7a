"""The Anthropic Messages API: ``POST /v1/messages`` (plain and streamed) and ``/v1/messages/count_tokens``.

A request becomes the same neutral turn as a chat completion (``core``), so a
conversation renders to the same tokens whichever API carried it:

* ``system`` (a string or text blocks) is the stable prefix, blocks joined by
  a blank line. A block that only carries a client's per-request billing
  header (``x-anthropic-billing-header: …``, which Claude Code rewrites every
  request) is left out, so it cannot cost the prefix its reuse;
  ``--keep-billing-header`` keeps it. ``cache_control`` markers are hints the
  daemon does not need (it reuses every resident token): they never change
  the tokens.
* ``messages``: text blocks are a turn's text; ``tool_use`` blocks the
  assistant's calls; ``tool_result`` blocks tool messages answering them
  (``is_error`` marks the text); ``thinking`` blocks the assistant's reasoning
  when their signature is the daemon's own (others are left out);
  ``redacted_thinking`` is left out; ``image`` and ``document`` are refused
  with 400 (this model reads text). A ``system`` role inside ``messages`` is
  a system turn.
* ``tools`` (``input_schema``) become function tools; server tools (a
  ``type`` other than ``custom``) are left out and logged. ``tool_choice``:
  ``auto``, ``any`` (a call is forced), ``tool`` (that one is forced), ``none``.
* ``max_tokens`` is a cap (the reply stops at the context's end); ``thinking``
  ``enabled``/``adaptive``/``disabled`` is the template's reasoning switch;
  ``metadata``, ``context_management``, ``output_config``, ``service_tier``
  and any ``anthropic-beta`` header are accepted.

Usage: ``input_tokens`` is what was prefilled, ``cache_read_input_tokens``
what was reused, ``cache_creation_input_tokens`` 0 (the daemon keeps every
prefilled token without being asked), ``output_tokens`` the reply.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncGenerator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field
from sse_starlette import EventSourceResponse, ServerSentEvent

from contract.errors import ModeldError
from contract.types import FinishReason
from runtime.chat import ChatResult

from .access import record_of
from .core import (
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
from .openai import call_schemas, tool_choice_options

__all__ = ["MessagesRequest", "router"]

log = logging.getLogger("modeld.http")

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


# --- request mapping -------------------------------------------------------------------------------
def _text_of_blocks(blocks: list[Block], where: str, *, allow: tuple[str, ...] = ("text",)) -> str:
    parts = []
    for i, b in enumerate(blocks):
        if b.type in allow and b.text is not None:
            parts.append(b.text)
        else:
            raise ApiError(400, f"{where}[{i}] is a {b.type!r} block; this model reads text only",
                           code="unsupported_content", param=where)
    return "\n\n".join(parts) if len(parts) > 1 else "".join(parts)


def system_text(system: str | list[Block] | None, *, keep_billing_header: bool) -> str:
    """The stable prefix: the system text, blocks joined by a blank line, the billing header left out."""
    if system is None or isinstance(system, str):
        text = system or ""
        if not keep_billing_header and text.startswith(BILLING_HEADER):
            return ""
        return text
    kept = [b for b in system if keep_billing_header or b.type != "text" or not (b.text or "").startswith(BILLING_HEADER)]
    return _text_of_blocks(kept, "system")


def _tool_result_text(block: Block, where: str) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = _text_of_blocks(content, f"{where}.content")
    return f"Error: {text}" if block.is_error else text


def _messages(req: MessagesRequest | CountTokensRequest, serving: Serving) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = system_text(req.system, keep_billing_header=serving.settings.keep_billing_header)
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        if m.role == "assistant":
            texts: list[str] = []
            calls: list[dict[str, Any]] = []
            reasoning = ""
            for j, b in enumerate(m.content):
                if b.type == "text":
                    texts.append(b.text or "")
                elif b.type == "tool_use":
                    if not b.id or not b.name:
                        raise ApiError(400, f"{where}[{j}]: a tool_use block needs an id and a name", param=where)
                    calls.append({"id": b.id, "type": "function", "function": {
                        "name": b.name, "arguments": json.dumps(b.input if b.input is not None else {}, ensure_ascii=False)}})
                elif b.type == "thinking":
                    if b.thinking and b.signature and serving.sealer.verify(b.thinking, b.signature):
                        reasoning += b.thinking
                    else:
                        log.info("a thinking block the daemon did not sign was left out of the prompt")
                elif b.type == "redacted_thinking":
                    continue
                else:
                    raise ApiError(400, f"{where}[{j}] is a {b.type!r} block, which an assistant turn cannot carry here",
                                   code="unsupported_content", param=where)
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = reasoning
            if msg["content"] is None and not calls and not reasoning:
                msg["content"] = ""
            out.append(msg)
            continue
        # a user (or system) turn: tool results first, as the calls they answer precede them, then its text
        texts = []
        for j, b in enumerate(m.content):
            if b.type == "tool_result":
                if not b.tool_use_id:
                    raise ApiError(400, f"{where}[{j}]: a tool_result block needs a tool_use_id", param=where)
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _tool_result_text(b, f"{where}[{j}]")})
            elif b.type == "text":
                texts.append(b.text or "")
            else:
                raise ApiError(400, f"{where}[{j}] is a {b.type!r} block; this model reads text only",
                               code="unsupported_content", param=where)
        if texts:
            out.append({"role": m.role, "content": "\n\n".join(texts) if len(texts) > 1 else texts[0]})
    return out


def _tools(tools: list[Tool] | None) -> list[dict[str, Any]]:
    out = []
    for t in tools or []:
        if t.type not in (None, "custom"):
            log.info("the server tool %r (%s) is not run by this daemon; left out of the prompt", t.name, t.type)
            continue
        fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema or {"type": "object", "properties": {}}}
        if t.description:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return out


def _thinking(req: MessagesRequest | CountTokensRequest) -> bool | None:
    if req.thinking is None:
        return None
    return req.thinking.type != "disabled"


def turn_request(req: MessagesRequest | CountTokensRequest, serving: Serving) -> TurnRequest:
    tools = _tools(req.tools)
    decode: dict[str, Any] = {}
    if isinstance(req, MessagesRequest):
        if req.max_tokens is not None:
            decode["max_tokens"] = req.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                decode[name] = getattr(req, name)
        if req.stop_sequences:
            decode["stop"] = list(req.stop_sequences)
    choice = req.tool_choice
    if choice is not None:
        names = call_schemas(tools)
        plain = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
        if choice.type == "tool" and not choice.name:
            raise ApiError(400, "tool_choice of type 'tool' needs a name", param="tool_choice.name")
        decode.update(tool_choice_options(plain, choice.name if choice.type == "tool" else None, names))
    return TurnRequest(messages=_messages(req, serving), tools=tools, decode=decode, model=req.model,
                       enable_thinking=_thinking(req))


# --- replies ---------------------------------------------------------------------------------------
def _usage(result: ChatResult) -> dict[str, Any]:
    u = result.usage
    return with_miss({"input_tokens": u.prompt_tokens - u.reused_tokens, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": u.reused_tokens, "output_tokens": u.completion_tokens}, u)


def _stop_reason(result: ChatResult) -> str:
    if result.stop_sequence:
        return "stop_sequence"
    return STOP_REASONS.get(result.finish_reason, "end_turn")


def _tool_id(call_id: str) -> str:
    return call_id if call_id.startswith("toolu_") else f"toolu_{uuid.uuid4().hex[:24]}"


def _input_of(arguments: str) -> Any:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {"arguments": arguments}  # the model's text as it wrote it, never lost
    return value if isinstance(value, dict) else {"value": value}


def message_body(result: ChatResult, model: str, msg_id: str, serving: Serving) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    msg = result.message
    if msg.reasoning:
        content.append({"type": "thinking", "thinking": msg.reasoning, "signature": serving.sealer.sign(msg.reasoning)})
    if msg.content:
        content.append({"type": "text", "text": msg.content})
    for call in msg.tool_calls:
        content.append({"type": "tool_use", "id": _tool_id(call.id), "name": call.function.name,
                        "input": _input_of(call.function.arguments)})
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": _stop_reason(result), "stop_sequence": result.stop_sequence or None, "usage": _usage(result)}


def router(serving: Serving) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/messages", response_model=None)
    async def messages(body: MessagesRequest, request: Request) -> JSONResponse | EventSourceResponse:
        record = record_of(request)
        record.stream = body.stream
        turn = await serving.abegin(turn_request(body, serving), request)
        record.model = turn.model
        msg_id = f"msg_{uuid.uuid4().hex[:24]}"
        if body.stream:
            return TurnStream(turn, _stream(turn, msg_id, serving, request), ping=int(KEEPALIVE_S),
                                       ping_message_factory=lambda: _ping(turn), send_timeout=STREAM_SEND_TIMEOUT_S)
        result = await turn.result(request)
        return JSONResponse(message_body(result, turn.model, msg_id, serving))

    @r.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, Any]:
        count = await serving.acount(turn_request(body, serving))
        return {"input_tokens": count.prompt_tokens}

    return r


def _ping(turn: Turn) -> ServerSentEvent:
    """A ``ping`` event; while the prefill runs it carries how far it came (``prefill``: the SDKs ignore it)."""
    progress = turn.progress()
    return ServerSentEvent(event="ping", data=json.dumps({"type": "ping", **({"prefill": progress} if progress else {})}))


def _event(name: str, data: dict[str, Any]) -> dict[str, str]:
    return {"event": name, "data": json.dumps({"type": name, **data}, ensure_ascii=False)}


async def _stream(turn: Turn, msg_id: str, serving: Serving, request: Request) -> AsyncGenerator[dict[str, str], None]:
    """The documented event order: message_start, then per block content_block_start / deltas / stop,
    message_delta (stop reason, usage), message_stop; an error after the start is an ``error`` event."""
    record = record_of(request)
    count = turn.count
    yield _event("message_start", {"message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": turn.model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": count.prompt_tokens - count.resident_tokens, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": count.resident_tokens, "output_tokens": 0}}})
    yield _event("ping", {})  # as the API does: a ping at once, then every KEEPALIVE_S while nothing else goes out
    index = -1
    open_kind = ""  # the kind of the block being streamed: "text", "thinking", "tool_use" or ""
    thinking = ""
    pieces = CallPieces()

    def close_block() -> list[dict[str, str]]:
        nonlocal open_kind, thinking
        out = []
        if open_kind == "thinking":
            out.append(_event("content_block_delta", {"index": index, "delta": {
                "type": "signature_delta", "signature": serving.sealer.sign(thinking)}}))
        if open_kind:
            out.append(_event("content_block_stop", {"index": index}))
        open_kind, thinking = "", ""
        return out

    def open_block(kind: str, block: dict[str, Any]) -> list[dict[str, str]]:
        nonlocal index, open_kind
        out = close_block()
        index += 1
        open_kind = kind
        out.append(_event("content_block_start", {"index": index, "content_block": block}))
        return out

    events = turn.aevents(record)
    try:
        async for event in events:
            if event.result is not None:
                for e in close_block():
                    yield e
                result = event.result
                fill_record(record, result)
                usage = _usage(result)
                yield _event("message_delta", {"delta": {"stop_reason": _stop_reason(result),
                                                         "stop_sequence": result.stop_sequence or None},
                                               "usage": usage})
                yield _event("message_stop", {})
                return
            if event.thinking:
                if open_kind != "thinking":
                    for e in open_block("thinking", {"type": "thinking", "thinking": ""}):
                        yield e
                thinking += event.thinking
                yield _event("content_block_delta", {"index": index, "delta": {"type": "thinking_delta",
                                                                               "thinking": event.thinking}})
            if event.text:
                if open_kind != "text":
                    for e in open_block("text", {"type": "text", "text": ""}):
                        yield e
                yield _event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": event.text}})
            # a call's block opens at its first piece; its input streams as the model writes the arguments (they
            # are a JSON object, so the partial_json pieces joined are the input), and the next block closes it
            for piece in pieces.of(event):
                if piece.id or piece.name:
                    for e in open_block("tool_use", {"type": "tool_use", "id": _tool_id(piece.id), "name": piece.name,
                                                     "input": {}}):
                        yield e
                if piece.arguments and open_kind == "tool_use":
                    yield _event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                                   "partial_json": piece.arguments}})
    except ModeldError as exc:
        err = api_error(exc)
        record.error = err.code or "error"
        body = err.anthropic()
        yield {"event": "error", "data": json.dumps(body)}
    finally:
        await close_events(events)
