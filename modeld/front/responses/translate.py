"""The OpenAI Responses API: a request to the serving core's neutral turn (``core.TurnRequest``), and a turn's result
to the API's reply."""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from contract.types import ChatMessage, DecodeConfig, StructuredOutputConfig, TokenLogprob
from runtime.chat import ChatResult

from ..core import (
    PromptFunction,
    PromptTool,
    Serving,
    decode_options,
    given,
    miss_field,
    prompt_call,
    prompt_message,
)
from ..errors import ApiError
from ..images import ImageRef, joined
from ..openai.translate import call_schemas, token_logprobs_out, tool_choice_options
from .protocol import (
    ENCRYPTED_REASONING,
    CallItem,
    CallOutputIn,
    Content,
    CustomToolCallIn,
    CustomToolCallItem,
    FunctionCallIn,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    ItemReference,
    ItemStatus,
    MessageIn,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningConfig,
    ReasoningIn,
    ReasoningItem,
    Response,
    ResponseError,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
    SummaryText,
    TextConfig,
    TextFormat,
    ToolChoiceSpec,
    ToolSpec,
)

log = logging.getLogger("modeld.http")


# --- tools -----------------------------------------------------------------------------------------
class ToolMap:
    """The request's tools as function tools, and how a call's name maps back to the tool the client gave."""

    def __init__(self, tools: list[ToolSpec] | None) -> None:
        self.functions: list[PromptTool] = []
        #: flattened name -> (namespace or "", the name the client knows, "function" | "custom")
        self.origin: dict[str, tuple[str, str, str]] = {}
        self.dropped: list[str] = []
        for i, tool in enumerate(tools or []):
            if tool.type in ("function", "custom"):
                self._add(tool, "", f"tools[{i}]")
            elif tool.type == "namespace":
                if tool.tools is None:
                    raise ApiError(400, f"tools[{i}]: a namespace tool needs a list of tools", param=f"tools[{i}].tools")
                for j, t in enumerate(tool.tools):
                    if t.type in ("function", "custom"):
                        self._add(t, tool.name or "", f"tools[{i}].tools[{j}]")
            else:
                self.dropped.append(tool.type)
        if self.dropped:
            log.info("tools this daemon does not run were left out of the prompt: %s", ", ".join(self.dropped))

    def _add(self, tool: ToolSpec, namespace: str, where: str) -> None:
        name = tool.name
        if not name:
            raise ApiError(400, f"{where} has no name", param=f"{where}.name")
        flat = name if name not in self.origin else f"{namespace}__{name}" if namespace else name
        custom = tool.type == "custom"
        params: Any = ({"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
                       if custom else tool.parameters or {"type": "object", "properties": {}})
        self.functions.append(PromptTool(function=PromptFunction(name=flat, description=tool.description or None,
                                                                 parameters=params)))
        self.origin[flat] = (namespace, name, "custom" if custom else "function")

    def flat_name(self, name: str, namespace: str | None = "") -> str:
        for flat, (ns, known, _) in self.origin.items():
            if known == name and (not namespace or ns == namespace):
                return flat
        return name


# --- input items -----------------------------------------------------------------------------------
def _part_text(content: Content, where: str, images: list[ImageRef] | None = None) -> str:
    """Content parts as text; ``input_image`` parts go to ``images`` where a turn may carry them (checked, and
    refused by a model that reads text only, in ``Serving.begin``)."""
    if isinstance(content, str):
        return content
    parts: list[str | ImageRef] = []
    for i, part in enumerate(content):
        if part.type in ("input_text", "output_text", "text", "summary_text") and part.text is not None:
            parts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            parts.append(part.refusal)
        elif part.type == "input_image" and images is not None:
            if part.file_id and not part.image_url:
                raise ApiError(400, f"{where}[{i}] names a file_id; this daemon keeps no files: send the image "
                               "inline as image_url (a data: URL)", code="invalid_image", param=f"{where}[{i}].file_id")
            if not part.image_url:
                raise ApiError(400, f"{where}[{i}] is an input_image without an image_url", param=f"{where}[{i}]")
            images.append(ImageRef(f"{where}[{i}]", url=part.image_url))
            parts.append(images[-1])
        else:
            raise ApiError(400, f"{where}[{i}] is a {part.type!r} part, which this daemon does not read here",
                           code="unsupported_content", param=where)
    return joined(parts)


def conversation(req: ResponsesRequest, tools: ToolMap, serving: Serving,
                 images: list[ImageRef]) -> list[ChatMessage]:
    """The request's input items as OpenAI-shaped messages (the stored conversation is prepended by the caller);
    their images go to ``images``."""
    out: list[ChatMessage] = []
    reasoning = ""

    def assistant() -> ChatMessage:
        """The assistant message a call or text joins: the last one, unless a tool result or a turn followed it."""
        nonlocal reasoning
        if out and out[-1].role == "assistant":
            msg = out[-1]
        else:
            msg = prompt_message(len(out), role="assistant")
            out.append(msg)
        msg.reasoning += reasoning
        reasoning = ""
        return msg

    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if reasoning and isinstance(item, MessageIn | CallOutputIn) and \
                not (isinstance(item, MessageIn) and item.role == "assistant"):
            assistant()  # a turn that was all reasoning (a reply cut inside its thinking) is still a turn
        if isinstance(item, MessageIn):
            text = _part_text(item.content, f"{where}.content", images)
            if item.role == "assistant":
                msg = assistant()
                msg.content = (msg.content or "") + text
            else:
                out.append(prompt_message(len(out), role="system" if item.role == "developer" else item.role,
                                          content=text))
        elif isinstance(item, FunctionCallIn | CustomToolCallIn):
            arguments = item.arguments if isinstance(item, FunctionCallIn) else \
                json.dumps({"input": item.input}, ensure_ascii=False)
            assistant().tool_calls.append(prompt_call(item.call_id, tools.flat_name(item.name, item.namespace),
                                                      arguments))
        elif isinstance(item, CallOutputIn):
            text = _part_text(item.output, f"{where}.output", images)
            out.append(prompt_message(len(out), role="tool", tool_call_id=item.call_id, content=text))
        elif isinstance(item, ReasoningIn):
            opened = serving.sealer.open(item.encrypted_content) if item.encrypted_content else None
            if opened is not None and isinstance(opened.get("reasoning"), str):
                reasoning += opened["reasoning"]
            elif item.summary:
                reasoning += _part_text(item.summary, f"{where}.summary")
        elif isinstance(item, ItemReference):
            raise ApiError(400, f"{where}: item references are not supported; send the item itself", param=where)
        else:
            log.info("an input item of type %r was left out of the prompt", item.type)
    if reasoning:
        assistant()
    return out


def request_options(req: ResponsesRequest, tools: ToolMap) -> DecodeConfig:
    """The ``DecodeConfig`` fields the request sets (``core.decode_options``)."""
    opts = decode_options(**{name: getattr(req, name) for name in ("temperature", "top_p")
                             if getattr(req, name) is not None})
    if req.max_output_tokens is not None:
        opts.max_tokens = req.max_output_tokens
    if req.logprobs() is not None:
        opts.logprobs = req.logprobs()
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        opts.structured_output = StructuredOutputConfig(json_schema=json.dumps({"type": "object"}))
    elif fmt is not None and fmt.type == "json_schema":
        if not isinstance(fmt.schema_, dict):
            raise ApiError(400, "text.format json_schema needs a schema (an object)", param="text.format.schema")
        opts.structured_output = StructuredOutputConfig(json_schema=json.dumps(fmt.schema_))
    choice = req.tool_choice
    names = call_schemas(tools.functions)
    if isinstance(choice, ToolChoiceSpec):
        if choice.type not in ("function", "custom") or not choice.name:
            raise ApiError(400, "tool_choice must be auto, none, required or {type: function, name}", param="tool_choice")
        calls = tool_choice_options(None, tools.flat_name(choice.name, choice.namespace), names)
    elif choice in (None, "auto", "none", "required"):
        calls = tool_choice_options(choice, None, names)
    else:
        raise ApiError(400, f"tool_choice {choice!r} is not one of auto, none, required or a named function",
                       param="tool_choice")
    if "structured_output" in calls.model_fields_set & opts.model_fields_set:
        raise ApiError(400, "a forced tool call and text.format cannot be combined", param="tool_choice")
    return decode_options(**given(opts, calls))


def thinking_of(req: ResponsesRequest) -> bool | None:
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is None:
        return None
    return effort not in ("none", "minimal")


# --- output ----------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Reply:
    """The response object of one request, built as its turn runs (streamed or not)."""

    def __init__(self, req: ResponsesRequest, tools: ToolMap, model: str, serving: Serving) -> None:
        self.id = new_id("resp")
        self.req = req
        self.tools = tools
        self.model = model
        self.serving = serving
        self.created = int(time.time())
        self.output: list[OutputItem] = []
        self.status: ResponseStatus = "in_progress"
        self.usage: ResponseUsage | None = None
        self.incomplete: IncompleteDetails | None = None
        self.error: ResponseError | None = None

    def reasoning_item(self) -> ReasoningItem:
        """A reasoning item, open (``seal_reasoning`` gives it its text)."""
        return ReasoningItem(type="reasoning", id=new_id("rs"), status="in_progress", summary=[])

    def seal_reasoning(self, item: ReasoningItem, text: str) -> None:
        item.status = "completed"
        item.summary = [SummaryText(type="summary_text", text=text)]
        if ENCRYPTED_REASONING in (self.req.include or []):
            item.encrypted_content = self.serving.sealer.seal({"reasoning": text})

    def call_item(self, name: str, arguments: str, call_id: str) -> CallItem:
        """A call as the client's tool names it (its namespace again, a custom tool's input out of the arguments)."""
        namespace, known, kind = self.tools.origin.get(name, ("", name, "function"))
        common: dict[str, Any] = {"id": new_id("fc"), "call_id": call_id or new_id("call"), "name": known,
                                  "status": "completed", **({"namespace": namespace} if namespace else {})}
        if kind != "custom":
            return FunctionCallItem(type="function_call", arguments=arguments, **common)
        try:
            given = json.loads(arguments) if arguments else {}
        except ValueError:
            given = {"input": arguments}
        value = given.get("input", "") if isinstance(given, dict) else arguments
        return CustomToolCallItem(type="custom_tool_call", input=value if isinstance(value, str) else json.dumps(value),
                                  **common)

    def finish(self, result: ChatResult) -> None:
        u = result.usage
        self.usage = ResponseUsage(
            input_tokens=u.prompt_tokens, input_tokens_details=InputTokensDetails(cached_tokens=u.reused_tokens),
            output_tokens=u.completion_tokens, output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
            total_tokens=u.prompt_tokens + u.completion_tokens, **miss_field(u))
        if result.finish_reason in ("length", "context_full"):
            self.status = "incomplete"
            self.incomplete = IncompleteDetails(reason="max_output_tokens")
        elif result.finish_reason == "cancelled":
            self.status = "cancelled"  # POST /v1/responses/{id}/cancel cut it short
        else:
            self.status = "completed"

    def body(self) -> Response:
        req = self.req
        return Response(
            id=self.id, object="response", created_at=self.created, status=self.status, model=self.model,
            output=list(self.output), usage=self.usage, error=self.error, incomplete_details=self.incomplete,
            instructions=req.instructions, previous_response_id=req.previous_response_id, tools=req.tools or [],
            tool_choice=req.tool_choice or "auto", parallel_tool_calls=req.parallel_tool_calls is not False,
            temperature=req.temperature, top_p=req.top_p, max_output_tokens=req.max_output_tokens,
            text=TextConfig(format=req.text.format if req.text and req.text.format else TextFormat(type="text")),
            reasoning=req.reasoning or ReasoningConfig(effort=None, summary=None), store=req.store,
            metadata=req.metadata or {}, output_text=self.output_text())

    def output_text(self) -> str:
        return "".join(part.text for item in self.output if isinstance(item, MessageItem) for part in item.content)

    def assistant_message(self) -> ChatMessage:
        """This reply as the assistant message a later turn resends (the stored conversation's last turn)."""
        calls, reasoning = [], ""
        for item in self.output:
            if isinstance(item, CallItem):
                arguments = item.arguments if isinstance(item, FunctionCallItem) else \
                    json.dumps({"input": item.input}, ensure_ascii=False)
                calls.append(prompt_call(item.call_id, self.tools.flat_name(item.name, item.namespace), arguments))
            elif isinstance(item, ReasoningItem):
                reasoning = "".join(s.text for s in item.summary)
        return ChatMessage(role="assistant", content=self.output_text() or (None if calls else ""), tool_calls=calls,
                           reasoning=reasoning)


def text_part(text: str, req: ResponsesRequest, logprobs: list[TokenLogprob]) -> OutputText:
    """An ``output_text`` content part; with log probabilities asked, its tokens' (every reply token's: those
    of the reasoning and of calls too)."""
    return OutputText(type="output_text", text=text, annotations=[],
                      logprobs=token_logprobs_out(logprobs) if req.logprobs() is not None else [])


def message_item(status: ItemStatus, content: list[OutputText]) -> MessageItem:
    return MessageItem(type="message", id=new_id("msg"), status=status, role="assistant", content=content)


def build_output(reply: Reply, result: ChatResult) -> None:
    msg = result.message
    if msg.reasoning:
        item = reply.reasoning_item()
        reply.seal_reasoning(item, msg.reasoning)
        reply.output.append(item)
    if msg.content:
        reply.output.append(message_item("completed", [text_part(msg.content, reply.req, result.logprobs)]))
    for call in msg.tool_calls:
        reply.output.append(reply.call_item(call.function.name, call.function.arguments, call.id))


def merge_earlier(messages: list[ChatMessage], earlier: list[ChatMessage]) -> list[ChatMessage]:
    """The stored conversation, then the new input; a leading system message stays first.

    An assistant item the new input opens with (a ``function_call`` after the stored reply) joins the
    stored reply's assistant message, as items within one request do: the conversation renders as the
    same items sent whole would.
    """
    if not earlier:
        return messages
    head = [m for m in messages[:1] if m.role == "system"]
    rest = messages[len(head):]
    if rest and earlier[-1].role == "assistant" and rest[0].role == "assistant":
        last, first = earlier[-1], rest[0]
        joined = last.model_copy(update={"content": ((last.content or "") + (first.content or "")) or None,
                                         "tool_calls": [*last.tool_calls, *first.tool_calls],
                                         "reasoning": last.reasoning + first.reasoning})
        earlier, rest = [*earlier[:-1], joined], rest[1:]
    return [*head, *earlier, *rest]
