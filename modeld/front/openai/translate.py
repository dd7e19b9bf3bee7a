"""The OpenAI API (chat completions, models, embeddings): a request to the serving core's neutral turn
(``core.TurnRequest``), and a turn's result to the API's reply."""

from __future__ import annotations

import json
import uuid
from typing import Any

from contract.types import ChatMessage, DecodeConfig, StructuredOutputConfig, TokenLogprob, ToolCallDelta
from runtime.chat import ChatResult

from ..core import (
    PromptFunction,
    PromptTool,
    TurnRequest,
    decode_options,
    given,
    miss_field,
    prompt_call,
    prompt_message,
)
from ..errors import ApiError
from ..images import ImageRef, image_url_ref, joined
from .protocol import (
    ChatCompletionRequest,
    ChoiceLogprobs,
    CompletionTokensDetails,
    ContentPart,
    FunctionCallOut,
    FunctionPiece,
    NamedToolChoice,
    PromptTokensDetails,
    SamplingRequest,
    TokenLogprobOut,
    ToolCallOut,
    ToolCallPiece,
    TopLogprobOut,
    Usage,
)


# --- request mapping -------------------------------------------------------------------------------
def text_of(content: str | list[ContentPart] | None, where: str, images: list[ImageRef]) -> str | None:
    """Message content as text: text (and refusal) parts joined; ``image_url`` parts go to ``images`` (checked,
    and refused by a model that reads text only, in ``Serving.begin``); any other part is refused."""
    if content is None or isinstance(content, str):
        return content
    parts: list[str | ImageRef] = []
    for i, part in enumerate(content):
        if part.type in ("text", "input_text", "output_text") and part.text is not None:
            parts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            parts.append(part.refusal)
        elif part.type == "image_url":
            images.append(image_url_ref(part.image_url, f"{where}.content[{i}]"))
            parts.append(images[-1])
        else:
            raise ApiError(400, f"{where}.content[{i}] is a {part.type!r} part, which this daemon does not read",
                           code="unsupported_content", param=f"{where}.content")
    return joined(parts)


def _messages(req: ChatCompletionRequest, images: list[ImageRef]) -> list[ChatMessage]:
    out = []
    for i, m in enumerate(req.messages):
        content = text_of(m.content, f"messages[{i}]", images)
        out.append(prompt_message(
            i, role="system" if m.role == "developer" else m.role,
            content="" if content is None and m.role == "tool" else content,
            tool_calls=[prompt_call(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []],
            tool_call_id=m.tool_call_id or "", name=m.name if m.name and m.role == "tool" else "",
            reasoning=m.reasoning_content or ""))
    return out


def _tools(req: ChatCompletionRequest) -> list[PromptTool]:
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.type != "function" or t.function is None:
            raise ApiError(400, f"tools[{i}] has type {t.type!r}; chat completions take function tools",
                           param=f"tools[{i}].type")
        tools.append(PromptTool(function=PromptFunction.model_validate(t.function.model_dump(exclude_none=True))))
    return tools


def call_schemas(tools: list[PromptTool]) -> dict[str, str]:
    """Each function tool's name and the JSON schema of its arguments, as a forced call holds them."""
    return {t.function.name: json.dumps(t.function.parameters or {}) for t in tools}


def tool_choice_options(choice: str | None, forced: str | None, schemas: dict[str, str]) -> DecodeConfig:
    """Decode options for a tool choice: ``choice`` auto/none/required, or ``forced`` (one function's
    name); ``schemas`` holds each tool's arguments schema (``call_schemas``)."""
    names = list(schemas)
    if choice == "none":
        return decode_options(parser_protocols=[])
    if choice in (None, "auto") and forced is None:
        return decode_options()
    if not names:
        raise ApiError(400, "tool_choice forces a call but no tools were given", param="tool_choice")
    if forced is not None:
        if forced not in names:
            raise ApiError(400, f"tool_choice names {forced!r}, which is not among the tools", param="tool_choice")
        names = [forced]
    return decode_options(structured_output=StructuredOutputConfig(tool_call={n: schemas[n] for n in names}))


#: ``DecodeConfig`` fields the OpenAI generation APIs pass on as they are
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repeat_penalty",
                   "repeat_last_n", "seed")


def sampling_options(req: SamplingRequest) -> DecodeConfig:
    """The sampling fields ``req`` set (and its stop strings), as ``DecodeConfig`` options."""
    opts = decode_options(**{name: getattr(req, name) for name in SAMPLING_FIELDS if getattr(req, name) is not None})
    if req.stop:
        opts.stop = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    return opts


def _decode(req: ChatCompletionRequest, tools: list[PromptTool]) -> DecodeConfig:
    if req.n not in (None, 1):
        raise ApiError(400, "n > 1 is not supported: one model slot decodes one reply", param="n")
    opts = sampling_options(req)
    if req.logprobs:
        opts.logprobs = req.top_logprobs or 0
    elif req.top_logprobs is not None:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    limit = req.max_completion_tokens or req.max_tokens
    if limit is not None:
        opts.max_tokens = limit
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        opts.structured_output = StructuredOutputConfig(json_schema=json.dumps({"type": "object"}))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format json_schema needs json_schema.schema (an object)",
                           param="response_format.json_schema.schema")
        opts.structured_output = StructuredOutputConfig(json_schema=json.dumps(schema))
    choice = req.tool_choice
    forced = choice.function.name if isinstance(choice, NamedToolChoice) else None
    plain = choice if isinstance(choice, str) else None
    calls = tool_choice_options(plain, forced, call_schemas(tools))
    if "structured_output" in calls.model_fields_set & opts.model_fields_set:
        raise ApiError(400, "a forced tool call and a response_format cannot be combined", param="tool_choice")
    return decode_options(**given(opts, calls))


def turn_request(req: ChatCompletionRequest) -> TurnRequest:
    tools = _tools(req)
    images: list[ImageRef] = []
    messages = _messages(req, images)
    return TurnRequest(messages=messages, tools=tools, decode=_decode(req, tools), model=req.model, images=images)


# --- replies ---------------------------------------------------------------------------------------
def tool_calls_out(calls: list[Any]) -> list[ToolCallOut]:
    """A reply message's ``tool_calls``."""
    return [ToolCallOut(id=c.id or f"call_{uuid.uuid4().hex[:24]}", type="function",
                        function=FunctionCallOut(name=c.function.name, arguments=c.function.arguments))
            for c in calls]


def usage_out(result: ChatResult) -> Usage:
    u = result.usage
    return Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.prompt_tokens + u.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=u.reused_tokens),
        # OpenAI's names for predicted-output tokens: here, speculative drafts kept and rejected
        completion_tokens_details=CompletionTokensDetails(
            accepted_prediction_tokens=u.accepted_tokens,
            rejected_prediction_tokens=u.drafted_tokens - u.accepted_tokens,
        ),
        **miss_field(u),
    )


def token_logprobs_out(items: list[TokenLogprob]) -> list[TokenLogprobOut]:
    """OpenAI's shape for tokens' log probabilities (chat completions' ``logprobs.content``, the Responses API's
    ``output_text`` ``logprobs``)."""

    return [TokenLogprobOut(token=t.token, logprob=t.logprob, bytes=t.bytes,
                            top_logprobs=[TopLogprobOut(token=a.token, logprob=a.logprob, bytes=a.bytes) for a in t.top])
            for t in items]


def logprobs_out(items: list[TokenLogprob]) -> ChoiceLogprobs:
    """``choices[].logprobs``."""
    return ChoiceLogprobs(content=token_logprobs_out(items), refusal=None)


def call_piece(piece: ToolCallDelta) -> ToolCallPiece:
    """A ``choices[0].delta.tool_calls`` entry: the first of a call carries its id, type and name."""
    if piece.id or piece.name:
        return ToolCallPiece(index=piece.index, id=piece.id or f"call_{uuid.uuid4().hex[:24]}", type="function",
                             function=FunctionPiece(name=piece.name, arguments=piece.arguments))
    return ToolCallPiece(index=piece.index, function=FunctionPiece(arguments=piece.arguments))
