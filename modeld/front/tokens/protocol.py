"""The tokens API's request and reply models (llama-server's field names, and vLLM's beside them)."""

from __future__ import annotations

from pydantic import Field, model_validator

from contract.messages import MAX_DETOKENIZE_TOKENS
from contract.types import MAX_TEXT_CHARS, TokenId

from ..core import Loose, Shape


class TokenizeIn(Loose):
    #: the text (llama-server's name; vLLM's is ``prompt``: one of the two)
    content: str | None = Field(None, max_length=MAX_TEXT_CHARS)
    prompt: str | None = Field(None, max_length=MAX_TEXT_CHARS)
    #: the model's BOS first, where the model adds one (llama-server's name; vLLM's is ``add_special_tokens``)
    add_special: bool = False
    add_special_tokens: bool | None = None
    #: llama-server's; only the default (parsed, as a prompt is) is served
    parse_special: bool = True
    #: llama-server's; refused when set
    with_pieces: bool = False
    model: str = ""

    @model_validator(mode="after")
    def _one_text(self) -> TokenizeIn:
        if (self.content is None) == (self.prompt is None):
            raise ValueError("give the text as content (or as prompt), one of them")
        return self

    @property
    def text(self) -> str:
        return self.content if self.content is not None else self.prompt or ""

    @property
    def special(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else self.add_special


class TokenizeOut(Shape):
    tokens: list[int]
    #: vLLM's: how many
    count: int


class DetokenizeIn(Loose):
    tokens: list[TokenId] = Field(max_length=MAX_DETOKENIZE_TOKENS)
    model: str = ""


class DetokenizeOut(Shape):
    content: str
    #: vLLM's name for the same text
    prompt: str


class TokenizerInfo(Shape):
    """vLLM's ``GET /tokenizer_info``, as evaluation harnesses read it to tokenize on the server: the context
    length. The special tokens' texts are not among what the daemon reports of a model: null."""

    model_max_length: int
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
