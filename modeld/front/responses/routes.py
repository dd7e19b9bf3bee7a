"""The OpenAI Responses API: the routes, plain and streamed (SSE, keep-alives while the prefill runs)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from contract.errors import ModeldError
from contract.types import ChatMessage, ToolCallDelta
from runtime.chat import ChatEvent

from ..access import record_of
from ..core import (
    KEEPALIVE_S,
    STREAM_SEND_TIMEOUT_S,
    CallPieces,
    HeldLogprobs,
    Serving,
    Turn,
    TurnRequest,
    TurnStream,
    close_events,
    declared,
    dumped,
    fill_record,
    prompt_message,
    turn_messages,
)
from ..errors import ApiError, api_error
from ..images import ImageRef
from ..openai.protocol import ErrorBody, error_body
from ..openai.translate import token_logprobs_out
from ..queued import abegin_streamed
from ..stored import ResponseStore
from .protocol import (
    ArgumentsDelta,
    ArgumentsDone,
    CallItem,
    ContentPartEvent,
    CustomInputDelta,
    CustomInputDone,
    DeletedResponse,
    ErrorEvent,
    FunctionCallItem,
    InputTokens,
    InputTokensRequest,
    MessageItem,
    OutputItemEvent,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    ReasoningItem,
    Response,
    ResponseError,
    ResponseEvent,
    ResponseRef,
    ResponsesRequest,
    SummaryPartEvent,
    SummaryText,
    SummaryTextDelta,
    SummaryTextDone,
    ToolSpec,
)
from .translate import (
    Reply,
    ToolMap,
    build_output,
    conversation,
    merge_earlier,
    message_item,
    request_options,
    text_part,
    thinking_of,
)

#: any event model of the stream
Event = (ResponseEvent | OutputItemEvent | ContentPartEvent | OutputTextDelta | OutputTextDone | SummaryPartEvent
         | SummaryTextDelta | SummaryTextDone | ArgumentsDelta | ArgumentsDone | CustomInputDelta | CustomInputDone
         | ErrorEvent)


# --- routes ----------------------------------------------------------------------------------------
class _Running:
    """Responses being generated, by id, so ``cancel`` can stop one."""

    def __init__(self) -> None:
        self.turns: dict[str, Turn] = {}


def _prepare(body: ResponsesRequest, serving: Serving,
             store: ResponseStore) -> tuple[TurnRequest, ToolMap, list[ToolSpec]]:
    """The turn for ``body``, its tools, and the tools it was given (its own, else the stored response's)."""
    earlier: list[ChatMessage] = []
    tools_given = body.tools
    if body.previous_response_id:
        stored = store.get(body.previous_response_id)
        if stored is None:
            raise ApiError(404, f"no stored response {body.previous_response_id!r} (unknown, deleted or pruned)",
                           code="previous_response_not_found", param="previous_response_id")
        earlier = turn_messages(stored.get("conversation") or [])
        if tools_given is None:
            tools_given = [ToolSpec.model_validate(t) for t in stored.get("tools") or []]
    tools = ToolMap(tools_given)
    images: list[ImageRef] = []
    messages = conversation(body, tools, serving, images)
    if earlier:
        # the stored instructions led the earlier turns; this request's (if any) replace them
        if body.instructions is not None and earlier and earlier[0].role == "system":
            earlier = earlier[1:]
        elif body.instructions is None and earlier and earlier[0].role == "system":
            messages = [earlier[0], *messages]
            earlier = earlier[1:]
    if body.instructions:
        messages = [prompt_message(0, role="system", content=body.instructions), *messages]
    full = merge_earlier(messages, earlier)
    if not full:
        raise ApiError(400, "input is empty", param="input")
    turn_req = TurnRequest(messages=full, tools=tools.functions, decode=request_options(body, tools), model=body.model,
                           enable_thinking=thinking_of(body), images=images)
    return turn_req, tools, tools_given or []


def router(serving: Serving, store: ResponseStore) -> APIRouter:
    r = APIRouter()
    running = _Running()

    def keep(reply: Reply, turn_req: TurnRequest, tools_given: list[ToolSpec]) -> None:
        if reply.req.store:
            store.put(reply.id, {"response": dumped(reply.body()),
                                 "conversation": [m.model_dump(mode="json", exclude_defaults=True)
                                                  for m in (*turn_req.messages, reply.assistant_message())],
                                 "tools": [dumped(t) for t in tools_given]})

    @r.post("/v1/responses", response_model=None, responses=declared(Response, ErrorBody, stream=True))
    async def create(body: ResponsesRequest, request: Request) -> JSONResponse | EventSourceResponse:
        record = record_of(request)
        record.stream = body.stream
        turn_req, tools, tools_given = _prepare(body, serving, store)
        turn = await (abegin_streamed(serving, turn_req, request) if body.stream else serving.abegin(turn_req, request))
        record.model = turn.model
        reply = Reply(body, tools, turn.model, serving)
        running.turns[reply.id] = turn
        if body.stream:
            numbered = _Events()
            return TurnStream(
                turn, _stream(turn, reply, request, running, lambda: keep(reply, turn_req, tools_given), numbered),
                ping=int(KEEPALIVE_S), ping_message_factory=lambda: _keepalive(turn, reply, numbered),
                send_timeout=STREAM_SEND_TIMEOUT_S)
        try:
            result = await turn.result(request)
        finally:
            running.turns.pop(reply.id, None)
        build_output(reply, result)
        reply.finish(result)
        keep(reply, turn_req, tools_given)
        return JSONResponse(dumped(reply.body()))

    @r.post("/v1/responses/input_tokens", response_model=InputTokens, response_model_exclude_unset=True,
            responses=declared(InputTokens, ErrorBody))
    async def input_tokens(body: InputTokensRequest) -> InputTokens:
        turn_req, _, _ = _prepare(body, serving, store)
        count = await serving.acount(turn_req)
        return InputTokens(object="response.input_tokens", input_tokens=count.prompt_tokens)

    def stored_response(response_id: str, missing: str) -> Response:
        """A stored response as it was sent (checked against its model: the store is a file another version of
        the daemon may have written)."""
        stored = store.get(response_id)
        if stored is None:
            raise ApiError(404, missing, code="not_found", param="response_id")
        return Response.model_validate(stored["response"])

    @r.get("/v1/responses/{response_id}", response_model=Response, response_model_exclude_unset=True,
           responses=declared(Response, ErrorBody))
    async def retrieve(response_id: str) -> Response:
        return stored_response(response_id, f"no stored response {response_id!r}")

    @r.delete("/v1/responses/{response_id}", response_model=DeletedResponse, response_model_exclude_unset=True,
              responses=declared(DeletedResponse, ErrorBody))
    async def delete(response_id: str) -> DeletedResponse:
        if not store.delete(response_id):
            raise ApiError(404, f"no stored response {response_id!r}", code="not_found", param="response_id")
        return DeletedResponse(id=response_id, object="response.deleted", deleted=True)

    @r.post("/v1/responses/{response_id}/cancel", response_model=Response | ResponseRef,
            response_model_exclude_unset=True, responses=declared(ResponseRef, ErrorBody))
    async def cancel(response_id: str) -> Response | ResponseRef:
        turn = running.turns.get(response_id)
        if turn is None:  # already finished (the whole response), or unknown
            return stored_response(response_id, f"no response {response_id!r} is running or stored")
        # the decode stops within a token; the request that runs it answers with the reply cut there
        await anyio.to_thread.run_sync(turn.cancel)
        return ResponseRef(id=response_id, object="response", status="cancelled")

    return r


class _Events:
    """A stream's events, numbered (``sequence_number``) in the order they are made: the reply's and the
    keep-alives' alike."""

    def __init__(self) -> None:
        self._next = 0

    def make(self, kind: type[Event], **fields: Any) -> dict[str, str]:
        """An event of model ``kind`` with the next number, as SSE (its name is its ``type``)."""
        event = kind(sequence_number=self._next, **fields)
        self._next += 1
        return {"event": event.type, "data": json.dumps(dumped(event), ensure_ascii=False)}


def _keepalive(turn: Turn, reply: Reply, events: _Events) -> ServerSentEvent:
    """While the prefill runs: ``response.in_progress`` again, with how far it came (``prefill``, which the SDKs
    ignore), an event that a client's idle timer counts (Codex's counts events, not comments); afterwards, while
    the reply streams, a comment (an event made here could overtake one the reply made and has not sent yet)."""
    if not turn.prefilling:
        return turn.keepalive_comment()
    e = events.make(ResponseEvent, type="response.in_progress", response=reply.body(), **turn.waiting())
    return ServerSentEvent(event=e["event"], data=e["data"])


class _Items:
    """A streamed reply's output items as the events that build them: a message, a reasoning item or a call opens
    at its first piece, its text or arguments stream as deltas, and the next item (or the end) closes it."""

    def __init__(self, reply: Reply, events: _Events) -> None:
        self.reply = reply
        self.event = events.make
        #: the item being streamed (None: none is open), and its text (a message's, a summary's, a call's arguments)
        self.current: MessageItem | ReasoningItem | CallItem | None = None
        self.text = ""
        #: the open call's name as the model wrote it (``call_item`` maps it back to the client's)
        self.call_name = ""
        self.pieces = CallPieces()
        self.asked = reply.req.logprobs() is not None
        self.held = HeldLogprobs()

    def step(self, ev: ChatEvent) -> list[dict[str, str]]:
        """The events one of the turn's steps makes (not its last, which carries the result)."""
        self.held.add(ev)
        out: list[dict[str, str]] = []
        index = len(self.reply.output) - 1
        if ev.thinking:
            if not isinstance(self.current, ReasoningItem):
                out += self.open_item(self.reply.reasoning_item())
                index = len(self.reply.output) - 1
            self.text += ev.thinking
            out.append(self.event(SummaryTextDelta, type="response.reasoning_summary_text.delta",
                                  item_id=self._current_id(), output_index=index, summary_index=0, delta=ev.thinking))
        if ev.text:
            if not isinstance(self.current, MessageItem):
                out += self.open_item(message_item("in_progress", []))
                index = len(self.reply.output) - 1
            self.text += ev.text
            out.append(self.event(OutputTextDelta, type="response.output_text.delta", item_id=self._current_id(),
                                  output_index=index, content_index=0, delta=ev.text,
                                  logprobs=token_logprobs_out(self.held.take()) if self.asked else []))
        for piece in self.pieces.of(ev):
            out += self._call_piece(piece)
        return out

    def _current_id(self) -> str:
        return self.current.id if self.current else ""

    def _call_piece(self, piece: ToolCallDelta) -> list[dict[str, str]]:
        """A call's item opens at its first piece and its arguments stream as the model writes them."""
        out: list[dict[str, str]] = []
        reply = self.reply
        if piece.id or piece.name:
            out += self.close_current()
            item = reply.call_item(piece.name, "", piece.id)
            item.status = "in_progress"
            reply.output.append(item)
            self.current, self.call_name = item, piece.name
            shown = item.model_copy(update={"arguments": ""} if isinstance(item, FunctionCallItem) else {"input": ""})
            out.append(self.event(OutputItemEvent, type="response.output_item.added",
                                  output_index=len(reply.output) - 1, item=shown))
        if not isinstance(self.current, CallItem):
            return out
        self.text += piece.arguments
        if piece.arguments and isinstance(self.current, FunctionCallItem):
            out.append(self.event(ArgumentsDelta, type="response.function_call_arguments.delta",
                                  item_id=self.current.id, output_index=len(reply.output) - 1, delta=piece.arguments))
        return out

    def close_current(self) -> list[dict[str, str]]:
        """The events that close the open item (none when none is open)."""
        current, text, reply, event = self.current, self.text, self.reply, self.event
        if current is None:
            return []
        out: list[dict[str, str]] = []
        index = len(reply.output) - 1
        self.current, self.text = None, ""
        ids = {"item_id": current.id, "output_index": index}
        if isinstance(current, CallItem):
            item = reply.call_item(self.call_name, text, current.call_id)
            item.id = current.id
            if current.call_id not in self.pieces.finished:
                item.status = "incomplete"  # the reply ended inside the call: its arguments are cut short
            reply.output[index] = item
            if isinstance(item, FunctionCallItem):
                out.append(event(ArgumentsDone, type="response.function_call_arguments.done", **ids,
                                 arguments=item.arguments))
            else:  # a custom tool's input is the text inside the arguments: it goes whole once they are
                out.append(event(CustomInputDelta, type="response.custom_tool_call_input.delta", **ids,
                                 delta=item.input))
                out.append(event(CustomInputDone, type="response.custom_tool_call_input.done", **ids,
                                 input=item.input))
            out.append(event(OutputItemEvent, type="response.output_item.done", output_index=index, item=item))
            return out
        if isinstance(current, MessageItem):
            part = text_part(text, reply.req, self.held.all)
            current.content = [part]
            out.append(event(OutputTextDone, type="response.output_text.done", **ids, content_index=0, text=text))
            out.append(event(ContentPartEvent, type="response.content_part.done", **ids, content_index=0, part=part))
            current.status = "completed"
        else:
            reply.seal_reasoning(current, text)
            out.append(event(SummaryTextDone, type="response.reasoning_summary_text.done", **ids, summary_index=0,
                             text=text))
            out.append(event(SummaryPartEvent, type="response.reasoning_summary_part.done", **ids, summary_index=0,
                             part=SummaryText(type="summary_text", text=text)))
        out.append(event(OutputItemEvent, type="response.output_item.done", output_index=index, item=current))
        return out

    def open_item(self, item: MessageItem | ReasoningItem) -> list[dict[str, str]]:
        """The events that close the open item and open ``item`` (a message or a reasoning item)."""
        out = self.close_current()
        self.reply.output.append(item)
        self.current = item
        index = len(self.reply.output) - 1
        shown = item.model_copy(update={"content": []} if isinstance(item, MessageItem) else {"summary": []})
        out.append(self.event(OutputItemEvent, type="response.output_item.added", output_index=index, item=shown))
        if isinstance(item, MessageItem):
            out.append(self.event(ContentPartEvent, type="response.content_part.added", item_id=item.id,
                                  output_index=index, content_index=0,
                                  part=OutputText(type="output_text", text="", annotations=[], logprobs=[])))
        else:
            out.append(self.event(SummaryPartEvent, type="response.reasoning_summary_part.added", item_id=item.id,
                                  output_index=index, summary_index=0, part=SummaryText(type="summary_text", text="")))
        return out


#: the reply's status -> the event that ends its stream (the API has no event for a cancelled response: one cut
#: short ends as incomplete ones do)
_FINAL = {"completed": "response.completed", "incomplete": "response.incomplete", "cancelled": "response.incomplete"}


async def _stream(turn: Turn, reply: Reply, request: Request, running: _Running,
                  on_done: Callable[[], None], numbered: _Events) -> AsyncGenerator[dict[str, str], None]:
    """The documented event order, each event with its ``sequence_number``."""
    record = record_of(request)
    event = numbered.make
    yield event(ResponseEvent, type="response.created", response=reply.body())
    yield event(ResponseEvent, type="response.in_progress", response=reply.body())
    items = _Items(reply, numbered)
    events = turn.aevents(record)
    try:
        async for ev in events:
            if ev.result is None:
                for e in items.step(ev):
                    yield e
                continue
            items.held.add(ev)
            for e in items.close_current():
                yield e
            fill_record(record, ev.result)
            reply.finish(ev.result)
            on_done()
            yield event(ResponseEvent, type=_FINAL.get(reply.status, "response.completed"), response=reply.body())
            return
    except (ModeldError, ApiError) as exc:
        err = api_error(exc)
        record.error = err.code or "error"
        reply.status = "failed"
        reply.error = ResponseError(code=err.code or "server_error", message=err.message)
        # the stream's error event, then the failed response. The event also carries the error as an
        # object, as OpenAI's own error events do: the SDKs raise on it rather than end as if all went well
        yield event(ErrorEvent, type="error", code=reply.error.code, message=err.message, param=err.param,
                    error=error_body(err).error)
        yield event(ResponseEvent, type="response.failed", response=reply.body())
    finally:
        await close_events(events)
        running.turns.pop(reply.id, None)
