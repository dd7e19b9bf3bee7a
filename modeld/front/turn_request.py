"""A request in the serving core's neutral form (``TurnRequest``), and what each API builds it from: its messages
(``prompt_message``, ``prompt_call``, ``turn_messages``), its function tools (``PromptTool``), the decode options
it sets (``decode_options``, read back by ``given``); ``Loose``, the base of every API's request models.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from contract.errors import InvalidArgument
from contract.types import ChatMessage, DecodeConfig, ToolCall, ToolCallFunction
from runtime.chat import chat_messages, valid_message

from .errors import api_error
from .images import ImageRef

__all__ = ["Loose", "PromptFunction", "PromptTool", "TurnRequest", "decode_options", "given", "prompt_call",
           "prompt_message", "turn_messages"]


class Loose(BaseModel):
    """A request part of any API: the fields the front reads are typed; unknown fields are accepted (clients
    send many, and each API grows)."""

    model_config = ConfigDict(extra="allow", strict=True)


class PromptFunction(BaseModel):
    """A function a tool offers, as the chat template renders it (OpenAI's chat shape)."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    #: the JSON schema of its arguments (None: the client gave none)
    parameters: dict[str, Any] | None = None


class PromptTool(BaseModel):
    """A tool of a turn, in OpenAI's chat shape: every API's tools become these (``TurnRequest.tools``)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: PromptFunction


@dataclass
class TurnRequest:
    """A request in the neutral form: what ``runtime.Chat`` takes, and the model name the client sent."""

    #: the messages (roles system, user, assistant, tool), leading system ones first; ``turn_messages`` makes them
    messages: list[ChatMessage]
    #: the function tools the template renders into the prompt
    tools: list[PromptTool] = field(default_factory=list)
    #: the ``DecodeConfig`` fields the client set (its ``model_fields_set``; checked when the turn reads them, a
    #: value refused there being the 400): ``decode_options`` makes them
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    model: str = ""
    #: the template's reasoning switch (None: the template's default)
    enable_thinking: bool | None = None
    #: whose conversation it is (``SuffixInput.conversation``): from the request's headers (``conversation_of``)
    conversation: str = ""
    #: a raw completion's prompt (text, or token ids) instead of ``messages`` and ``tools``: no template
    prompt: str | list[int] | None = None
    #: score the raw prompt's tokens, with this many alternatives each (``Chat.begin_prompt(score=…)``)
    score: int | None = None
    #: the images the messages carried, in order (``images.read_images`` checks them in ``Serving.begin``)
    images: list[ImageRef] = field(default_factory=list)
    #: who sent it, as status shows the turn (``OpenSessionRequest.client``): the route and the client's address
    client: str = ""


def decode_options(**fields: Any) -> DecodeConfig:
    """The ``DecodeConfig`` fields a request sets (``TurnRequest.decode``), as they are: ``runtime.Chat`` checks
    them when the turn reads them (``given``), and its refusal is the request's 400."""
    return DecodeConfig.model_construct(**fields)


def given(options: DecodeConfig, *more: DecodeConfig) -> dict[str, Any]:
    """The fields ``options`` sets, then each of ``more``'s over them, by name: a turn's keywords."""
    out = {name: getattr(options, name) for name in options.model_fields_set}
    for m in more:
        out.update(given(m))
    return out


def prompt_message(index: int, **fields: Any) -> ChatMessage:
    """Message ``index`` of a turn (``TurnRequest.messages``), built by an API from its request: a field no message
    can hold (a bad role, an oversized text) is the 400 naming ``messages[index]``."""
    try:
        return valid_message(**fields)
    except InvalidArgument as exc:
        raise api_error(InvalidArgument(f"messages[{index}]: {exc.message}", index=index, **exc.details)) from None


def prompt_call(call_id: str, name: str, arguments: str | object) -> ToolCall:
    """An assistant's tool call as a prompt renders it: arguments that are not text yet are written as JSON."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=call_id, type="function", function=ToolCallFunction(name=name, arguments=text))


def turn_messages(raw: Iterable[Mapping[str, Any] | ChatMessage]) -> list[ChatMessage]:
    """An API's messages, in OpenAI's chat shape, as ``TurnRequest.messages``: a message no template could take
    (a bad role, an oversized text) is the 400 the serving core would answer for it, naming the message."""
    try:
        return chat_messages(raw)
    except InvalidArgument as exc:
        raise api_error(exc) from None
