"""The OpenAI Responses API: ``POST /v1/responses`` (stateless and stored), ``GET``/``DELETE /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel`` and ``POST /v1/responses/input_tokens``.

A request becomes the same neutral turn as a chat completion (``core``), so a
conversation renders to the same tokens whichever API carried it and Codex's
turns reuse each other as any client's do:

* ``instructions`` and leading ``system``/``developer`` messages are the stable
  prefix; ``message`` items (text parts) the turns; ``function_call`` items the
  assistant's calls (joined to the assistant message before them, as chat
  completions carry them); ``function_call_output`` the tool results;
  ``reasoning`` items the assistant's reasoning, read back from
  ``encrypted_content`` when the daemon sealed it (else from their summary).
* ``tools``: ``function`` tools as they are; a ``namespace`` tool's functions
  flattened under their own names (a call names its namespace again in the
  reply); ``custom`` (free-form) tools as a function of one string ``input``.
  Tools this daemon cannot run (``web_search``, ``file_search``,
  ``computer_use``, ``image_generation``, ``local_shell``, hosted ``mcp``, …) are
  left out of the prompt and logged, never refused.
* ``tool_choice``, ``max_output_tokens`` (a cap), ``temperature``, ``top_p``,
  ``text.format`` (``json_schema``/``json_object``), ``reasoning`` (accepted;
  the model's own reasoning comes out as a ``reasoning`` item), ``include``
  (``reasoning.encrypted_content``: a sealed blob of the reasoning),
  ``prompt_cache_key``, ``metadata``, ``parallel_tool_calls`` and the rest are
  accepted.
* ``store`` (default true) keeps the response in the data dir;
  ``previous_response_id`` continues it with only the new input: the stored
  conversation is resent to the slot, whose KV still holds it, so the turn is
  as warm as a stateless one that resends everything.

Over ~400 lines on purpose: the request's translation and the streamed event sequence walk the
same output items (message, reasoning, function calls), and the stored responses share them too.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any, Literal

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field
from sse_starlette import EventSourceResponse, ServerSentEvent

from contract.errors import ModeldError
from contract.types import StructuredOutputConfig
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
from .stored import ResponseStore

__all__ = ["ResponsesRequest", "router"]

log = logging.getLogger("modeld.http")

ENCRYPTED_REASONING = "reasoning.encrypted_content"


class TextFormat(Loose):
    type: Literal["text", "json_schema", "json_object"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class TextConfig(Loose):
    format: TextFormat | None = None


class ResponsesRequest(Loose):
    model: str = ""
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=10.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class InputTokensRequest(ResponsesRequest):
    """``POST /v1/responses/input_tokens``: what a request's input would come to."""


# --- tools -----------------------------------------------------------------------------------------
class ToolMap:
    """The request's tools as function tools, and how a call's name maps back to the tool the client gave."""

    def __init__(self, tools: list[dict[str, Any]] | None) -> None:
        self.functions: list[dict[str, Any]] = []
        #: flattened name -> (namespace or "", the name the client knows, "function" | "custom")
        self.origin: dict[str, tuple[str, str, str]] = {}
        self.dropped: list[str] = []
        for i, tool in enumerate(tools or []):
            kind = tool.get("type")
            if kind == "function":
                self._add(tool, "", f"tools[{i}]")
            elif kind == "namespace":
                inner = tool.get("tools")
                if not isinstance(inner, list):
                    raise ApiError(400, f"tools[{i}]: a namespace tool needs a list of tools", param=f"tools[{i}].tools")
                for j, t in enumerate(inner):
                    if isinstance(t, dict) and t.get("type", "function") in ("function", "custom"):
                        self._add(t, str(tool.get("name") or ""), f"tools[{i}].tools[{j}]")
            elif kind == "custom":
                self._add(tool, "", f"tools[{i}]")
            else:
                self.dropped.append(str(kind))
        if self.dropped:
            log.info("tools this daemon does not run were left out of the prompt: %s", ", ".join(self.dropped))

    def _add(self, tool: dict[str, Any], namespace: str, where: str) -> None:
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"{where} has no name", param=f"{where}.name")
        flat = name if name not in self.origin else f"{namespace}__{name}" if namespace else name
        custom = tool.get("type") == "custom"
        params: Any = ({"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
                       if custom else tool.get("parameters") or {"type": "object", "properties": {}})
        fn: dict[str, Any] = {"name": flat, "parameters": params}
        if tool.get("description"):
            fn["description"] = tool["description"]
        self.functions.append({"type": "function", "function": fn})
        self.origin[flat] = (namespace, name, "custom" if custom else "function")

    def flat_name(self, name: str, namespace: str = "") -> str:
        for flat, (ns, known, _) in self.origin.items():
            if known == name and (not namespace or ns == namespace):
                return flat
        return name


# --- input items -----------------------------------------------------------------------------------
def _part_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of content parts", param=where)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text") and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])
        else:
            raise ApiError(400, f"{where}[{i}] is a {kind!r} part; this model reads text only",
                           code="unsupported_content", param=where)
    return "".join(parts)


def conversation(req: ResponsesRequest, tools: ToolMap, serving: Serving) -> list[dict[str, Any]]:
    """The request's input items as OpenAI-shaped messages (the stored conversation is prepended by the caller)."""
    out: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": req.input}] \
        if isinstance(req.input, str) else req.input
    reasoning = ""

    def assistant() -> dict[str, Any]:
        """The assistant message a call or text joins: the last one, unless a tool result or a turn followed it."""
        nonlocal reasoning
        if out and out[-1]["role"] == "assistant":
            msg = out[-1]
        else:
            msg = {"role": "assistant", "content": None}
            out.append(msg)
        if reasoning:
            msg["reasoning_content"] = msg.get("reasoning_content", "") + reasoning
            reasoning = ""
        return msg

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if reasoning and kind in ("message", "function_call_output", "custom_tool_call_output") \
                and item.get("role") != "assistant":
            assistant()  # a turn that was all reasoning (a reply cut inside its thinking) is still a turn
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role must be user, assistant, system or developer", param=f"{where}.role")
            text = _part_text(item.get("content", ""), f"{where}.content")
            if role == "assistant":
                msg = assistant()
                msg["content"] = (msg["content"] or "") + text
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind in ("function_call", "custom_tool_call"):
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
                raise ApiError(400, f"{where} needs a call_id and a name", param=where)
            if kind == "custom_tool_call":
                arguments = json.dumps({"input": str(item.get("input", ""))}, ensure_ascii=False)
            else:
                arguments = str(item.get("arguments", ""))
            msg = assistant()
            msg.setdefault("tool_calls", []).append({"id": call_id, "type": "function", "function": {
                "name": tools.flat_name(name, str(item.get("namespace") or "")), "arguments": arguments}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ApiError(400, f"{where} needs a call_id", param=where)
            output = item.get("output", "")
            text = output if isinstance(output, str) else _part_text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            sealed = item.get("encrypted_content")
            opened = serving.sealer.open(sealed) if isinstance(sealed, str) else None
            if opened is not None and isinstance(opened.get("reasoning"), str):
                reasoning += opened["reasoning"]
            else:
                summary = item.get("summary") or []
                reasoning += _part_text(summary, f"{where}.summary") if summary else ""
        elif kind == "item_reference":
            raise ApiError(400, f"{where}: item references are not supported; send the item itself", param=where)
        else:
            log.info("an input item of type %r was left out of the prompt", kind)
    if reasoning:
        assistant()
    return out


def _decode(req: ResponsesRequest, tools: ToolMap) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if req.max_output_tokens is not None:
        opts["max_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p"):
        if getattr(req, name) is not None:
            opts[name] = getattr(req, name)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        opts["structured_output"] = StructuredOutputConfig(json_schema=json.dumps({"type": "object"}))
    elif fmt is not None and fmt.type == "json_schema":
        if not isinstance(fmt.schema_, dict):
            raise ApiError(400, "text.format json_schema needs a schema (an object)", param="text.format.schema")
        opts["structured_output"] = StructuredOutputConfig(json_schema=json.dumps(fmt.schema_))
    choice = req.tool_choice
    names = call_schemas(tools.functions)
    if isinstance(choice, dict):
        forced = choice.get("name")
        if choice.get("type") not in ("function", "custom") or not isinstance(forced, str):
            raise ApiError(400, "tool_choice must be auto, none, required or {type: function, name}", param="tool_choice")
        calls = tool_choice_options(None, tools.flat_name(forced, str(choice.get("namespace") or "")), names)
    elif choice in (None, "auto", "none", "required"):
        calls = tool_choice_options(choice, None, names)
    else:
        raise ApiError(400, f"tool_choice {choice!r} is not one of auto, none, required or a named function",
                       param="tool_choice")
    if "structured_output" in calls and "structured_output" in opts:
        raise ApiError(400, "a forced tool call and text.format cannot be combined", param="tool_choice")
    opts.update(calls)
    return opts


def _thinking(req: ResponsesRequest) -> bool | None:
    effort = (req.reasoning or {}).get("effort")
    if effort is None:
        return None
    return effort not in ("none", "minimal")


# --- output ----------------------------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Reply:
    """The response object of one request, built as its turn runs (streamed or not)."""

    def __init__(self, req: ResponsesRequest, tools: ToolMap, model: str, serving: Serving) -> None:
        self.id = _new_id("resp")
        self.req = req
        self.tools = tools
        self.model = model
        self.serving = serving
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.incomplete: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None

    def reasoning_item(self, text: str) -> dict[str, Any]:
        item: dict[str, Any] = {"type": "reasoning", "id": _new_id("rs"), "summary": [], "status": "in_progress"}
        if text:
            item["summary"] = [{"type": "summary_text", "text": text}]
        return item

    def seal_reasoning(self, item: dict[str, Any], text: str) -> None:
        item["status"] = "completed"
        item["summary"] = [{"type": "summary_text", "text": text}]
        if ENCRYPTED_REASONING in (self.req.include or []):
            item["encrypted_content"] = self.serving.sealer.seal({"reasoning": text})

    def call_item(self, name: str, arguments: str, call_id: str) -> dict[str, Any]:
        namespace, known, kind = self.tools.origin.get(name, ("", name, "function"))
        item: dict[str, Any] = {"id": _new_id("fc"), "call_id": call_id or _new_id("call"), "status": "completed"}
        if kind == "custom":
            try:
                given = json.loads(arguments) if arguments else {}
            except ValueError:
                given = {"input": arguments}
            value = given.get("input", "") if isinstance(given, dict) else arguments
            item.update(type="custom_tool_call", name=known, input=value if isinstance(value, str) else json.dumps(value))
        else:
            item.update(type="function_call", name=known, arguments=arguments)
        if namespace:
            item["namespace"] = namespace
        return item

    def finish(self, result: ChatResult) -> None:
        u = result.usage
        self.usage = with_miss({
            "input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.reused_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}, u)
        if result.finish_reason in ("length", "context_full"):
            self.status = "incomplete"
            self.incomplete = {"reason": "max_output_tokens"}
        elif result.finish_reason == "cancelled":
            self.status = "cancelled"  # POST /v1/responses/{id}/cancel cut it short
        else:
            self.status = "completed"

    def body(self) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": self.status,
            "model": self.model, "output": self.output, "usage": self.usage, "error": self.error,
            "incomplete_details": self.incomplete, "instructions": req.instructions,
            "previous_response_id": req.previous_response_id, "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "text": {"format": fmt}, "reasoning": req.reasoning or {"effort": None, "summary": None},
            "store": req.store, "metadata": req.metadata or {}, "output_text": self.output_text(),
        }

    def output_text(self) -> str:
        return "".join(part.get("text", "") for item in self.output if item.get("type") == "message"
                       for part in item.get("content", []))

    def assistant_message(self) -> dict[str, Any]:
        """This reply as the assistant message a later turn resends (the stored conversation's last turn)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.output_text() or None}
        calls = []
        for item in self.output:
            if item["type"] == "function_call":
                calls.append({"id": item["call_id"], "type": "function", "function": {
                    "name": self.tools.flat_name(item["name"], item.get("namespace", "")), "arguments": item["arguments"]}})
            elif item["type"] == "custom_tool_call":
                calls.append({"id": item["call_id"], "type": "function", "function": {
                    "name": self.tools.flat_name(item["name"], item.get("namespace", "")),
                    "arguments": json.dumps({"input": item["input"]}, ensure_ascii=False)}})
            elif item["type"] == "reasoning":
                msg["reasoning_content"] = "".join(s.get("text", "") for s in item.get("summary", []))
        if calls:
            msg["tool_calls"] = calls
        if msg["content"] is None and not calls:
            msg["content"] = ""
        return msg


def _message_item(text: str) -> dict[str, Any]:
    return {"type": "message", "id": _new_id("msg"), "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def build_output(reply: Reply, result: ChatResult) -> None:
    msg = result.message
    if msg.reasoning:
        item = reply.reasoning_item(msg.reasoning)
        reply.seal_reasoning(item, msg.reasoning)
        reply.output.append(item)
    if msg.content:
        reply.output.append(_message_item(msg.content))
    for call in msg.tool_calls:
        reply.output.append(reply.call_item(call.function.name, call.function.arguments, call.id))


# --- routes ----------------------------------------------------------------------------------------
class _Running:
    """Responses being generated, by id, so ``cancel`` can stop one."""

    def __init__(self) -> None:
        self.turns: dict[str, Turn] = {}


def router(serving: Serving, store: ResponseStore) -> APIRouter:
    r = APIRouter()
    running = _Running()

    def prepare(body: ResponsesRequest) -> tuple[TurnRequest, ToolMap, list[dict[str, Any]]]:
        """The turn for ``body``, its tools, and the conversation it continues (for storing)."""
        earlier: list[dict[str, Any]] = []
        tools_given = body.tools
        if body.previous_response_id:
            stored = store.get(body.previous_response_id)
            if stored is None:
                raise ApiError(404, f"no stored response {body.previous_response_id!r} (unknown, deleted or pruned)",
                               code="previous_response_not_found", param="previous_response_id")
            earlier = list(stored.get("conversation") or [])
            if tools_given is None:
                tools_given = stored.get("tools")
        tools = ToolMap(tools_given)
        messages = conversation(body, tools, serving)
        if earlier:
            # the stored instructions led the earlier turns; this request's (if any) replace them
            if body.instructions is not None and earlier and earlier[0].get("role") == "system":
                earlier = earlier[1:]
            elif body.instructions is None and earlier and earlier[0].get("role") == "system":
                messages = [earlier[0], *messages]
                earlier = earlier[1:]
        if body.instructions:
            messages = [{"role": "system", "content": body.instructions}, *messages]
        full = _merge(messages, earlier)
        if not full:
            raise ApiError(400, "input is empty", param="input")
        turn_req = TurnRequest(messages=full, tools=tools.functions, decode=_decode(body, tools), model=body.model,
                               enable_thinking=_thinking(body))
        return turn_req, tools, tools_given or []

    def keep(reply: Reply, turn_req: TurnRequest, tools_given: list[dict[str, Any]]) -> None:
        if reply.req.store:
            store.put(reply.id, {"response": reply.body(),
                                 "conversation": [*turn_req.messages, reply.assistant_message()],
                                 "tools": tools_given})

    @r.post("/v1/responses", response_model=None)
    async def create(body: ResponsesRequest, request: Request) -> JSONResponse | EventSourceResponse:
        record = record_of(request)
        record.stream = body.stream
        turn_req, tools, tools_given = prepare(body)
        turn = await serving.abegin(turn_req, request)
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
        return JSONResponse(reply.body())

    @r.post("/v1/responses/input_tokens")
    async def input_tokens(body: InputTokensRequest) -> dict[str, Any]:
        turn_req, _, _ = prepare(body)
        count = await serving.acount(turn_req)
        return {"object": "response.input_tokens", "input_tokens": count.prompt_tokens}

    @r.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict[str, Any]:
        stored = store.get(response_id)
        if stored is None:
            raise ApiError(404, f"no stored response {response_id!r}", code="not_found", param="response_id")
        out: dict[str, Any] = stored["response"]
        return out

    @r.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict[str, Any]:
        if not store.delete(response_id):
            raise ApiError(404, f"no stored response {response_id!r}", code="not_found", param="response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @r.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> dict[str, Any]:
        turn = running.turns.get(response_id)
        if turn is None:
            stored = store.get(response_id)
            if stored is None:
                raise ApiError(404, f"no response {response_id!r} is running or stored", code="not_found",
                               param="response_id")
            out: dict[str, Any] = stored["response"]
            return out  # already finished: nothing to cancel
        # the decode stops within a token; the request that runs it answers with the reply cut there
        await anyio.to_thread.run_sync(turn.cancel)
        return {"id": response_id, "object": "response", "status": "cancelled"}

    return r


def _merge(messages: list[dict[str, Any]], earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stored conversation, then the new input; a leading system message stays first.

    An assistant item the new input opens with (a ``function_call`` after the stored reply) joins the
    stored reply's assistant message, as items within one request do: the conversation renders as the
    same items sent whole would.
    """
    if not earlier:
        return messages
    head = [m for m in messages[:1] if m.get("role") == "system"]
    rest = messages[len(head):]
    if rest and earlier[-1].get("role") == "assistant" and rest[0].get("role") == "assistant":
        last, first = earlier[-1], rest[0]
        joined = {**last, "content": ((last.get("content") or "") + (first.get("content") or "")) or None}
        calls = [*(last.get("tool_calls") or []), *(first.get("tool_calls") or [])]
        if calls:
            joined["tool_calls"] = calls
        if first.get("reasoning_content"):
            joined["reasoning_content"] = (last.get("reasoning_content") or "") + first["reasoning_content"]
        earlier, rest = [*earlier[:-1], joined], rest[1:]
    return [*head, *earlier, *rest]


class _Events:
    """A stream's events, numbered (``sequence_number``) in the order they are made: the reply's and the
    keep-alives' alike."""

    def __init__(self) -> None:
        self._next = 0

    def make(self, name: str, **data: Any) -> dict[str, str]:
        self._next += 1
        return {"event": name,
                "data": json.dumps({"type": name, "sequence_number": self._next - 1, **data}, ensure_ascii=False)}


def _keepalive(turn: Turn, reply: Reply, events: _Events) -> ServerSentEvent:
    """While the prefill runs: ``response.in_progress`` again, with how far it came (``prefill``, which the SDKs
    ignore), an event that a client's idle timer counts (Codex's counts events, not comments); afterwards, while
    the reply streams, a comment (an event made here could overtake one the reply made and has not sent yet)."""
    if not turn.prefilling:
        return turn.keepalive_comment()
    progress = turn.progress()
    e = events.make("response.in_progress", response=reply.body(), **({"prefill": progress} if progress else {}))
    return ServerSentEvent(event=e["event"], data=e["data"])


async def _stream(turn: Turn, reply: Reply, request: Request, running: _Running,
                  on_done: Any, numbered: _Events) -> AsyncGenerator[dict[str, str], None]:
    """The documented event order, each event with its ``sequence_number``."""
    record = record_of(request)
    event = numbered.make

    yield event("response.created", response=reply.body())
    yield event("response.in_progress", response=reply.body())
    current: dict[str, Any] | None = None  # the item being streamed: a message, a reasoning item or a call
    text = ""
    pieces = CallPieces()

    def close_current() -> list[dict[str, str]]:
        nonlocal current, text
        out: list[dict[str, str]] = []
        if current is None:
            return out
        index = len(reply.output) - 1
        if current["type"] in ("function_call", "custom_tool_call"):
            item = reply.call_item(current["name"], text, current["call_id"])
            item["id"] = current["id"]
            if current["call_id"] not in pieces.finished:
                item["status"] = "incomplete"  # the reply ended inside the call: its arguments are cut short
            reply.output[index] = item
            if item["type"] == "function_call":
                out.append(event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 arguments=item["arguments"]))
            else:  # a custom tool's input is the text inside the arguments: it goes whole once they are
                out.append(event("response.custom_tool_call_input.delta", item_id=item["id"], output_index=index,
                                 delta=item["input"]))
                out.append(event("response.custom_tool_call_input.done", item_id=item["id"], output_index=index,
                                 input=item["input"]))
            out.append(event("response.output_item.done", output_index=index, item=item))
            current, text = None, ""
            return out
        if current["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            current["content"] = [part]
            out.append(event("response.output_text.done", item_id=current["id"], output_index=index, content_index=0,
                             text=text))
            out.append(event("response.content_part.done", item_id=current["id"], output_index=index, content_index=0,
                             part=part))
            current["status"] = "completed"
        else:
            reply.seal_reasoning(current, text)
            out.append(event("response.reasoning_summary_text.done", item_id=current["id"], output_index=index,
                             summary_index=0, text=text))
            out.append(event("response.reasoning_summary_part.done", item_id=current["id"], output_index=index,
                             summary_index=0, part={"type": "summary_text", "text": text}))
        out.append(event("response.output_item.done", output_index=index, item=current))
        current, text = None, ""
        return out

    def open_item(item: dict[str, Any]) -> list[dict[str, str]]:
        nonlocal current
        out = close_current()
        reply.output.append(item)
        current = item
        index = len(reply.output) - 1
        shown = {**item, "content": []} if item["type"] == "message" else {**item, "summary": []}
        out.append(event("response.output_item.added", output_index=index, item=shown))
        if item["type"] == "message":
            out.append(event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": []}))
        else:
            out.append(event("response.reasoning_summary_part.added", item_id=item["id"], output_index=index,
                             summary_index=0, part={"type": "summary_text", "text": ""}))
        return out

    events = turn.aevents(record)
    try:
        async for ev in events:
            if ev.result is not None:
                for e in close_current():
                    yield e
                fill_record(record, ev.result)
                reply.finish(ev.result)
                on_done()
                # (the API has no event for a cancelled response: one cut short ends as incomplete ones do)
                final = {"completed": "response.completed", "incomplete": "response.incomplete",
                         "cancelled": "response.incomplete"}.get(reply.status, "response.completed")
                yield event(final, response=reply.body())
                return
            if ev.thinking:
                if current is None or current["type"] != "reasoning":
                    for e in open_item(reply.reasoning_item("")):
                        yield e
                text += ev.thinking
                yield event("response.reasoning_summary_text.delta", item_id=current["id"] if current else "",
                            output_index=len(reply.output) - 1, summary_index=0, delta=ev.thinking)
            if ev.text:
                if current is None or current["type"] != "message":
                    for e in open_item({"type": "message", "id": _new_id("msg"), "status": "in_progress",
                                        "role": "assistant", "content": []}):
                        yield e
                text += ev.text
                yield event("response.output_text.delta", item_id=current["id"] if current else "",
                            output_index=len(reply.output) - 1, content_index=0, delta=ev.text)
            # a call's item opens at its first piece and its arguments stream as the model writes them; the next
            # item (or the end) closes it with the whole arguments
            for piece in pieces.of(ev):
                if piece.id or piece.name:
                    for e in close_current():
                        yield e
                    item = reply.call_item(piece.name, "", piece.id)
                    item["status"] = "in_progress"
                    reply.output.append(item)
                    current = {**item, "name": piece.name}  # the name as the model wrote it (call_item maps it back)
                    shown = {**item, "arguments": ""} if item["type"] == "function_call" else {**item, "input": ""}
                    yield event("response.output_item.added", output_index=len(reply.output) - 1, item=shown)
                if current is None or current["type"] not in ("function_call", "custom_tool_call"):
                    continue
                text += piece.arguments
                if piece.arguments and current["type"] == "function_call":
                    yield event("response.function_call_arguments.delta", item_id=current["id"],
                                output_index=len(reply.output) - 1, delta=piece.arguments)
    except ModeldError as exc:
        err = api_error(exc)
        record.error = err.code or "error"
        reply.status = "failed"
        reply.error = {"code": err.code or "server_error", "message": err.message}
        # the stream's error event, then the failed response. The event also carries the error as an
        # object, as OpenAI's own error events do: the SDKs raise on it rather than end as if all went well
        yield event("error", code=reply.error["code"], message=err.message, param=err.param,
                    error=err.openai()["error"])
        yield event("response.failed", response=reply.body())
    finally:
        await close_events(events)
        running.turns.pop(reply.id, None)
