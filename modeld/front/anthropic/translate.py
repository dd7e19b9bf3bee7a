"""The Anthropic Messages API: a request to the serving core's neutral turn (``core.TurnRequest``), and a turn's result
to the API's reply."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from contract.types import ChatMessage, ToolCall
from runtime.chat import ChatResult

from ..core import (
    PromptFunction,
    PromptTool,
    Serving,
    TurnRequest,
    decode_options,
    given,
    miss_field,
    prompt_call,
    prompt_message,
)
from ..errors import ApiError
from ..images import ImageRef, joined
from ..openai.translate import call_schemas, tool_choice_options
from .protocol import (
    BILLING_HEADER,
    STOP_REASONS,
    Block,
    CountTokensRequest,
    MessageOut,
    MessagesRequest,
    MessageUsage,
    TextOut,
    ThinkingOut,
    Tool,
    ToolUseOut,
)

log = logging.getLogger("modeld.http")


# --- request mapping -------------------------------------------------------------------------------
def _text_of_blocks(blocks: list[Block], where: str, *, allow: tuple[str, ...] = ("text",),
                    images: list[ImageRef] | None = None) -> str:
    """Blocks as text; ``image`` blocks go to ``images`` where a turn may carry them (checked, and refused by a
    model that reads text only, in ``Serving.begin``)."""
    parts: list[str | ImageRef] = []
    for i, b in enumerate(blocks):
        if b.type in allow and b.text is not None:
            parts.append(b.text)
        elif b.type == "image" and images is not None:
            images.append(image_of(b, f"{where}[{i}]"))
            parts.append(images[-1])
        else:
            raise ApiError(400, f"{where}[{i}] is a {b.type!r} block, which this daemon does not read here",
                           code="unsupported_content", param=where)
    return joined(parts, "\n\n")


def image_of(block: Block, where: str) -> ImageRef:
    """An ``image`` block's source: ``base64`` data with its media type, or a ``url`` (fetched only under
    ``--allow-image-urls``: ``images.read_images``)."""
    src = block.source if isinstance(block.source, dict) else {}
    if src.get("type") == "base64" and isinstance(src.get("data"), str):
        return ImageRef(where, data=src["data"], media_type=str(src.get("media_type") or ""))
    if src.get("type") == "url" and isinstance(src.get("url"), str):
        return ImageRef(where, url=src["url"])
    raise ApiError(400, f"{where}: an image block needs a source of type base64 (media_type, data) or url",
                   code="invalid_image", param=f"{where}.source")


def system_text(system: str | list[Block] | None, *, keep_billing_header: bool) -> str:
    """The stable prefix: the system text, blocks joined by a blank line, the billing header left out."""
    if system is None or isinstance(system, str):
        text = system or ""
        if not keep_billing_header and text.startswith(BILLING_HEADER):
            return ""
        return text
    kept = [b for b in system if keep_billing_header or b.type != "text" or not (b.text or "").startswith(BILLING_HEADER)]
    return _text_of_blocks(kept, "system")


def _tool_result_text(block: Block, where: str, images: list[ImageRef]) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = _text_of_blocks(content, f"{where}.content", images=images)
    return f"Error: {text}" if block.is_error else text


def _messages(req: MessagesRequest | CountTokensRequest, serving: Serving, images: list[ImageRef]) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    system = system_text(req.system, keep_billing_header=serving.settings.keep_billing_header)
    if system:
        out.append(prompt_message(len(out), role="system", content=system))
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append(prompt_message(len(out), role=m.role, content=m.content))
            continue
        if m.role == "assistant":
            texts: list[str] = []
            calls: list[ToolCall] = []
            reasoning = ""
            for j, b in enumerate(m.content):
                if b.type == "text":
                    texts.append(b.text or "")
                elif b.type == "tool_use":
                    if not b.id or not b.name:
                        raise ApiError(400, f"{where}[{j}]: a tool_use block needs an id and a name", param=where)
                    calls.append(prompt_call(b.id, b.name, b.input if b.input is not None else {}))
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
            content = "".join(texts) or (None if calls or reasoning else "")
            out.append(prompt_message(len(out), role="assistant", content=content, tool_calls=calls,
                                      reasoning=reasoning))
            continue
        # a user (or system) turn: tool results first, as the calls they answer precede them, then its text
        parts: list[str | ImageRef] = []
        for j, b in enumerate(m.content):
            if b.type == "tool_result":
                if not b.tool_use_id:
                    raise ApiError(400, f"{where}[{j}]: a tool_result block needs a tool_use_id", param=where)
                out.append(prompt_message(len(out), role="tool", tool_call_id=b.tool_use_id,
                                          content=_tool_result_text(b, f"{where}[{j}]", images)))
            elif b.type == "text":
                parts.append(b.text or "")
            elif b.type == "image":
                images.append(image_of(b, f"{where}[{j}]"))
                parts.append(images[-1])
            else:
                raise ApiError(400, f"{where}[{j}] is a {b.type!r} block, which this daemon does not read here",
                               code="unsupported_content", param=where)
        if parts:
            out.append(prompt_message(len(out), role=m.role, content=joined(parts, "\n\n")))
    return out


def _tools(tools: list[Tool] | None) -> list[PromptTool]:
    out = []
    for t in tools or []:
        if t.type not in (None, "custom"):
            log.info("the server tool %r (%s) is not run by this daemon; left out of the prompt", t.name, t.type)
            continue
        out.append(PromptTool(function=PromptFunction(
            name=t.name, description=t.description or None,
            parameters=t.input_schema or {"type": "object", "properties": {}})))
    return out


def _thinking(req: MessagesRequest | CountTokensRequest) -> bool | None:
    if req.thinking is None:
        return None
    return req.thinking.type != "disabled"


def turn_request(req: MessagesRequest | CountTokensRequest, serving: Serving) -> TurnRequest:
    tools = _tools(req.tools)
    decode = decode_options()
    if isinstance(req, MessagesRequest):
        decode = decode_options(**{name: getattr(req, name) for name in ("max_tokens", "temperature", "top_p", "top_k")
                                   if getattr(req, name) is not None})
        if req.stop_sequences:
            decode.stop = list(req.stop_sequences)
    choice = req.tool_choice
    if choice is not None:
        names = call_schemas(tools)
        plain = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
        if choice.type == "tool" and not choice.name:
            raise ApiError(400, "tool_choice of type 'tool' needs a name", param="tool_choice.name")
        decode = decode_options(**given(decode, tool_choice_options(plain, choice.name if choice.type == "tool" else None,
                                                                    names)))
    images: list[ImageRef] = []
    messages = _messages(req, serving, images)
    return TurnRequest(messages=messages, tools=tools, decode=decode, model=req.model,
                       enable_thinking=_thinking(req), images=images)


# --- replies ---------------------------------------------------------------------------------------
def usage_of(result: ChatResult) -> MessageUsage:
    u = result.usage
    return MessageUsage(input_tokens=u.prompt_tokens - u.reused_tokens, cache_creation_input_tokens=0,
                        cache_read_input_tokens=u.reused_tokens, output_tokens=u.completion_tokens, **miss_field(u))


def stop_reason(result: ChatResult) -> str:
    if result.stop_sequence:
        return "stop_sequence"
    return STOP_REASONS.get(result.finish_reason, "end_turn")


def tool_id(call_id: str) -> str:
    return call_id if call_id.startswith("toolu_") else f"toolu_{uuid.uuid4().hex[:24]}"


def _input_of(arguments: str) -> Any:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {"arguments": arguments}  # the model's text as it wrote it, never lost
    return value if isinstance(value, dict) else {"value": value}


def message_body(result: ChatResult, model: str, msg_id: str, serving: Serving) -> MessageOut:
    content: list[TextOut | ThinkingOut | ToolUseOut] = []
    msg = result.message
    if msg.reasoning:
        content.append(ThinkingOut(type="thinking", thinking=msg.reasoning, signature=serving.sealer.sign(msg.reasoning)))
    if msg.content:
        content.append(TextOut(type="text", text=msg.content))
    for call in msg.tool_calls:
        content.append(ToolUseOut(type="tool_use", id=tool_id(call.id), name=call.function.name,
                                  input=_input_of(call.function.arguments)))
    return MessageOut(id=msg_id, type="message", role="assistant", model=model, content=content,
                      stop_reason=stop_reason(result), stop_sequence=result.stop_sequence or None,
                      usage=usage_of(result))
