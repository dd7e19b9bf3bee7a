"""The tokens API's request and reply models (llama-server's field names)."""

from __future__ import annotations

from pydantic import Field

from contract.messages import MAX_DETOKENIZE_TOKENS
from contract.types import MAX_TEXT_CHARS, TokenId

from ..core import Loose, Shape


class TokenizeIn(Loose):
    content: str = Field(max_length=MAX_TEXT_CHARS)
    add_special: bool = False
    #: llama-server's; only the default (parsed, as a prompt is) is served
    parse_special: bool = True
    #: llama-server's; refused when set
    with_pieces: bool = False
    model: str = ""


class TokenizeOut(Shape):
    tokens: list[int]


class DetokenizeIn(Loose):
    tokens: list[TokenId] = Field(max_length=MAX_DETOKENIZE_TOKENS)
    model: str = ""


class DetokenizeOut(Shape):
    content: str
