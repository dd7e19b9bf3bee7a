"""To the serving core's turn, and back to the legacy completions API's shapes."""

from __future__ import annotations

from collections.abc import Sequence

from contract.types import TokenLogprob

from ..core import TurnRequest
from ..errors import ApiError
from ..openai.translate import sampling_options
from .protocol import CompletionLogprobs, CompletionRequest


def prompt_of(req: CompletionRequest) -> str | list[int]:
    """The one prompt: text or token ids (a list of one of either is that one)."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise ApiError(400, f"{len(p)} prompts in one request: one model slot decodes one reply; send them one "
                                "at a time", param="prompt")
        p = p[0]
    if not p:
        raise ApiError(400, "the prompt is empty: a completion continues at least one token", param="prompt")
    return p  # type: ignore[return-value]


def turn_request(req: CompletionRequest) -> TurnRequest:
    if req.n not in (None, 1) or req.best_of not in (None, 1):
        raise ApiError(400, "n and best_of > 1 are not supported: one model slot decodes one reply",
                       param="n" if req.n not in (None, 1) else "best_of")
    if req.suffix:
        raise ApiError(400, "suffix (fill in the middle) is not supported: send the text before the cursor as "
                            "the prompt", param="suffix", code="unsupported")
    opts = sampling_options(req)
    if req.max_tokens is not None:
        opts.max_tokens = req.max_tokens
    if req.logprobs is not None:
        opts.logprobs = req.logprobs
    score = req.logprobs if req.echo else None  # the echoed prompt's tokens are scored too
    return TurnRequest(messages=[], decode=opts, model=req.model, prompt=prompt_of(req), score=score)


def prompt_logprobs_out(echo: str, items: list[TokenLogprob | None]) -> CompletionLogprobs:
    """The legacy ``logprobs`` object for an echoed, scored prompt (``echo`` its text): a token with nothing
    before it (the first, on a model with no BOS) has null scores, and its text is what the others leave of
    ``echo``."""
    rest = "".join(t.token for t in items if t is not None)
    lead = echo[: len(echo) - len(rest)] if echo.endswith(rest) else ""
    return _legacy([t.token if t is not None else lead for t in items], items, 0)


def joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    """Two legacy ``logprobs`` objects, one after the other (the prompt's, then the reply's)."""
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)


def logprobs_out(items: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    """The legacy ``logprobs`` object for ``items``, whose text starts at ``offset`` in the choice's text."""
    return _legacy([t.token for t in items], items, offset)


def _legacy(texts: list[str], items: Sequence[TokenLogprob | None], offset: int) -> CompletionLogprobs:
    """The legacy ``logprobs`` object: each token's text (``texts``), its scores (null for a token with none) and
    where its text starts, the first at ``offset``."""
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(
        tokens=texts,
        token_logprobs=[t.logprob if t is not None else None for t in items],
        top_logprobs=[{a.token: a.logprob for a in t.top} if t is not None else None for t in items],
        text_offset=offsets,
    )
