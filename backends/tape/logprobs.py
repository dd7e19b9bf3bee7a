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


#: how far below a row's largest logit the first search for its top k looks (widened until k tokens are found):
#: the k likeliest are among the tokens at or above the k-th largest, so any margin that holds k or more tokens
#: holds them all, and one that is a few units wide holds a few dozen of a vocabulary, not the whole of it
_TOP_MARGINS = (8.0, 32.0)
#: the most candidates sorted whole; more are cut to the k-th largest value first
_SORTED_AT_MOST = 256


def token_logprob(logits: np.ndarray, token: int, k: int, piece: Callable[[int], bytes]) -> TokenLogprob:
    """``token``'s log probability under ``logits`` (one row over the vocabulary) and the ``k`` likeliest tokens
    there, likeliest first (the lower id first on a tie); ``piece`` gives a token's bytes."""
    row = np.asarray(logits)
    peak = float(row.max())
    shifted = np.subtract(row, peak, dtype=np.float64)  # exp in float64 without a second copy of the row
    np.exp(shifted, out=shifted)
    log_total = peak + math.log(float(shifted.sum()))

    def one(t: int) -> TopLogprob:
        b = piece(t)
        return TopLogprob(token_id=t, token=b.decode("utf-8", "replace"), bytes=list(b),
                          logprob=float(row[t]) - log_total)

    top = [one(t) for t in top_tokens(row, peak, k)] if k > 0 else []
    chosen = one(token)
    return TokenLogprob(token_id=chosen.token_id, token=chosen.token, bytes=chosen.bytes, logprob=chosen.logprob,
                        top=top)


def top_tokens(row: np.ndarray, peak: float, k: int) -> list[int]:
    """The ids of ``row``'s ``k`` largest values, largest first, the lower id first on a tie. A selection over the
    tokens near the peak (``_TOP_MARGINS``): a partition of the whole vocabulary costs ~10x as much per row, which
    a scored prompt pays on every token."""
    k = min(k, row.shape[0])
    for margin in _TOP_MARGINS:
        near = np.flatnonzero(row >= peak - margin)
        if near.size >= k:
            break
    else:  # a row this peaked is rare: the whole of it is partitioned for its k-th largest value
        near = np.flatnonzero(row >= np.partition(row, -k)[-k])
    if near.size > _SORTED_AT_MOST:  # a flat row: what ties with or beats the k-th largest, before the sort
        values = row[near]
        near = near[values >= np.partition(values, -k)[-k]]
    order = np.lexsort((near, -row[near].astype(np.float64)))[:k]
    return [int(t) for t in near[order]]
