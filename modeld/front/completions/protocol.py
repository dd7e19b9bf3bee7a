"""The legacy completions API's request and reply models (OpenAI's ``/v1/completions``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from contract.types import MAX_TOP_LOGPROBS, TokenId

from ..core import Shape
from ..openai.protocol import SamplingRequest, Usage


class CompletionRequest(SamplingRequest):
    model: str = ""
    #: text, token ids, or a list of one of either (one slot decodes one reply: a list of several is refused)
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    #: fill-in-the-middle: refused (no template or model here declares its infill tokens)
    suffix: str | None = None
    #: OpenAI's default for this API is 16
    max_tokens: int | None = Field(16, ge=0)
    best_of: int | None = Field(None, ge=1)
    #: each reply token's log probability, and the k likeliest tokens at its step (0: the token's own only); with
    #: ``echo``, the prompt's tokens too (scoring: ``max_tokens: 0`` scores the prompt and decodes nothing)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    #: the prompt before the reply in ``text``
    echo: bool = False


# --- replies (declared in /openapi.json; ``make fuzz`` checks every reply against them) --------------------------
class CompletionLogprobs(Shape):
    """OpenAI's legacy shape: per token its text, its log probability, the likeliest tokens at its step (text to
    log probability) and where its text starts in ``text``. An echoed prompt's first token has nothing before it
    to be scored by: null there."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Shape):
    text: str
    index: int
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "content_filter"] | None


class Completion(Shape):
    """A completion (``stream: true``: ``text_completion`` chunks instead, the last with the finish reason)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
