"""A row's log probabilities and its k likeliest tokens (``backends.tape.logprobs``) against the plain computation:
a float64 log-softmax of the whole row and a full sort of it."""

from __future__ import annotations

import numpy as np
import pytest

from backends.tape.logprobs import token_logprob

VOCAB = 4096


def _piece(token: int) -> bytes:
    return f"<{token}>".encode()


def _reference(row: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    x = row.astype(np.float64)
    logp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
    order = np.lexsort((np.arange(x.shape[0]), -x))[:k]  # largest first, the lower id first on a tie
    return float(logp[token]), [(int(t), float(logp[t])) for t in order]


def _rows() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    flat = rng.standard_normal(VOCAB).astype(np.float32)
    spread = (rng.standard_normal(VOCAB) * 6).astype(np.float32)
    peaked = np.full(VOCAB, -80.0, dtype=np.float32)  # fewer than k tokens near the peak: the whole row is searched
    peaked[[5, 900, 3000]] = [12.0, 3.0, -30.0]
    tied = np.zeros(VOCAB, dtype=np.float32)  # every token ties
    tied[17] = 1.0
    return [flat, spread, peaked, tied]


@pytest.mark.parametrize("k", [0, 1, 5, 20])
@pytest.mark.parametrize("which", range(4))
def test_a_rows_figures_are_the_whole_rows_log_softmax_and_its_sorted_top(which: int, k: int) -> None:
    row = _rows()[which]
    for token in (0, 5, 17, VOCAB - 1):
        got = token_logprob(row, token, k, _piece)
        want, top = _reference(row, token, k)
        assert got.token_id == token and got.bytes == list(_piece(token))
        assert got.logprob == pytest.approx(want, abs=1e-9)
        assert [t.token_id for t in got.top] == [t for t, _ in top]
        assert [t.logprob for t in got.top] == pytest.approx([lp for _, lp in top], abs=1e-9)
        assert [t.token for t in got.top] == [f"<{t}>" for t, _ in top]
