"""A conversation's parts: messages, images, tool calls."""

from __future__ import annotations

import base64
import functools
import hashlib
from typing import Any, Literal

from pydantic import Field, StrictBytes, field_serializer, field_validator

from ..errors import InvalidArgument
from ._base import MAX_IMAGE_BYTES, MAX_SUFFIX_IMAGES, MAX_TEXT_CHARS, _Report, _Request

__all__ = ["ChatMessage", "ImageInput", "ToolCall", "ToolCallDelta", "ToolCallFunction"]


class ToolCallFunction(_Report):
    name: str = ""
    arguments: str = ""


class ToolCall(_Report):
    id: str = ""
    type: str = "function"
    function: ToolCallFunction = Field(default_factory=ToolCallFunction)


class ToolCallDelta(_Report):
    """A piece of a tool call as the model writes it, keyed by the call's ``index`` in the reply: the first piece
    of a call carries its ``id`` and ``name``; the ``arguments`` of all its pieces, joined, are the finished
    call's ``function.arguments`` exactly."""

    index: int = 0
    id: str = ""
    name: str = ""
    arguments: str = ""


class ImageInput(_Request):
    """An image in a message's text, or in a raw append: its encoded bytes (PNG, JPEG, WebP or GIF) and where it
    sits. The daemon turns it into its model's block of image tokens (a client never writes them), keyed by the
    bytes' digest: a later turn that sends the same image again reuses its KV like any other prefix."""

    #: the bytes (in JSON, as base64 text: a stored conversation keeps its images so)
    data: StrictBytes = Field(..., min_length=1, max_length=MAX_IMAGE_BYTES)
    #: the character offset in the text the image goes before (0: before all of it; the text's length: after it)
    at: int = Field(0, ge=0)

    @field_validator("data", mode="before")
    @classmethod
    def _from_base64(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return base64.b64decode(value, validate=True)
            except ValueError:
                raise ValueError("image data given as text must be base64") from None
        return value

    @field_serializer("data", when_used="json")
    def _to_base64(self, value: bytes) -> str:
        return base64.b64encode(value).decode("ascii")

    @functools.cached_property
    def digest(self) -> str:
        """The sha256 of the bytes, hex: what the image's KV is reused by."""
        return hashlib.sha256(self.data).hexdigest()


def check_images(images: list[ImageInput], text: str, where: str) -> None:
    """Each image's offset within ``text`` and in order; InvalidArgument naming the first that is not."""
    last = 0
    for i, image in enumerate(images):
        if image.at > len(text) or image.at < last:
            raise InvalidArgument(f"{where}.images[{i}] sits at {image.at}: images go in order, at offsets within "
                                  f"the text's {len(text)} characters", index=i, at=image.at)
        last = image.at


class ChatMessage(_Request):
    """One message of the conversation after the stable prefix (OpenAI's chat shape)."""

    #: "system" after the first turn is a mid-conversation instruction (the leading
    #: system messages are the stable prefix, not part of the conversation)
    role: Literal["user", "assistant", "tool", "system"]
    content: str | None = Field(None, max_length=MAX_TEXT_CHARS)
    #: the assistant's tool calls
    tool_calls: list[ToolCall] = Field(default_factory=list)
    #: a tool result: the id of the call it answers, and the tool's name
    tool_call_id: str = ""
    name: str = ""
    #: the assistant's reasoning (``<think>``), when the template renders it
    reasoning: str = ""
    #: images in a user or tool message, each at its offset in ``content`` (a model with an image encoder only:
    #: ``capabilities`` has "vision")
    images: list[ImageInput] = Field(default_factory=list, max_length=MAX_SUFFIX_IMAGES)


def check_conversation(messages: list[ChatMessage]) -> None:
    """Refuse a conversation no template could render faithfully; InvalidArgument naming the message."""
    open_calls: set[str] = set()
    for i, msg in enumerate(messages):
        where = f"messages[{i}] ({msg.role})"
        if msg.role == "assistant":
            if not msg.content and not msg.tool_calls and not msg.reasoning:
                raise InvalidArgument(f"{where} has neither content nor tool calls", index=i)
            for call in msg.tool_calls:
                if not call.function.name:
                    raise InvalidArgument(f"{where} has a tool call without a function name", index=i)
                if call.id:
                    open_calls.add(call.id)
        else:
            if msg.tool_calls:
                raise InvalidArgument(f"{where}: only assistant messages carry tool calls", index=i)
            if msg.content is None:
                raise InvalidArgument(f"{where} has no content", index=i)
        if msg.role == "tool":
            if not msg.tool_call_id:
                raise InvalidArgument(f"{where} names no tool_call_id", index=i)
            if msg.tool_call_id not in open_calls:
                raise InvalidArgument(
                    f"{where} answers tool call {msg.tool_call_id!r}, which no earlier assistant message made",
                    index=i,
                    tool_call_id=msg.tool_call_id,
                )
        elif msg.tool_call_id:
            raise InvalidArgument(f"{where}: only tool messages carry a tool_call_id", index=i)
        if msg.images:
            if msg.role not in ("user", "tool"):
                raise InvalidArgument(f"{where}: only user and tool messages carry images", index=i)
            check_images(msg.images, msg.content or "", f"messages[{i}]")
