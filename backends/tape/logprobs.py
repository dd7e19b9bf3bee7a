"""Log probabilities of a decode's sampled tokens (``DecodeConfig.logprobs``), from one row of an engine's logits.

The distribution is the model's own: a log-softmax of the raw logits, before penalties, grammar masks and the
sampler's cuts, as OpenAI and llama.cpp's server report it. A sampled token a grammar forced still reports what
the model gave it. Computed in float64 from the engine's float32 row.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from contract.types import TokenLogprob, TopLogprob

__all__ = ["token_logprob"]


def token_logprob(logits: np.ndarray, token: int, k: int, piece: Callable[[int], bytes]) -> TokenLogprob:
    """``token``'s log probability under ``logits`` (one row over the vocabulary) and the ``k`` likeliest tokens
    there, likeliest first; ``piece`` gives a token's bytes."""
    x = np.asarray(logits, dtype=np.float64)
    peak = float(x.max())
    log_total = peak + math.log(float(np.exp(x - peak).sum()))

    def one(t: int) -> TopLogprob:
        b = piece(t)
        return TopLogprob(token_id=t, token=b.decode("utf-8", "replace"), bytes=list(b), logprob=float(x[t]) - log_total)

    top: list[TopLogprob] = []
    if k > 0:
        k = min(k, x.shape[0])
        idx = np.argpartition(-x, k - 1)[:k]
        top = [one(int(t)) for t in idx[np.argsort(-x[idx], kind="stable")]]
    chosen = one(token)
    return TokenLogprob(token_id=chosen.token_id, token=chosen.token, bytes=chosen.bytes, logprob=chosen.logprob,
                        top=top)
