"""One OpenVINO decode pass: numpy sampling over the stored logits, llguidance masks when constrained."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from contract.types import DecodeConfig

from ..tape.decoding import LogitsSteps
from .guidance import TokenGuide

if TYPE_CHECKING:
    from .model import OpenVINOLoadedModel


class Sampler:
    """llama.cpp's order: penalties, then greedy, or top-k, top-p on the softmax, min-p and temperature.

    The penalties' window (``DecodeConfig.penalties``) starts with the prompt's tail
    (``start``) and takes in each token sampled (``accept``), as llama.cpp's chain does.
    """

    def __init__(self, cfg: DecodeConfig) -> None:
        self.temperature = cfg.temperature or 0.0
        self.top_k = cfg.top_k or 0
        self.top_p = cfg.top_p if cfg.top_p is not None else 1.0
        self.min_p = cfg.min_p or 0.0
        self.rng = np.random.default_rng(None if cfg.seed is None else cfg.seed % 2**64)
        self.penalties = cfg.penalties()
        self.window: deque[int] = deque(maxlen=self.penalties[0] if self.penalties else 0)

    def start(self, tape: list[int]) -> None:
        if self.penalties is not None:
            self.window.extend(tape[-self.penalties[0] :])

    def accept(self, token: int) -> None:
        if self.penalties is not None:
            self.window.append(token)

    def penalised(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` with the repetition, frequency and presence penalties over the window applied (a sampler
        made with penalties)."""
        assert self.penalties is not None
        _, repeat, freq, present = self.penalties
        tokens, counts = np.unique(np.fromiter(self.window, dtype=np.int64, count=len(self.window)), return_counts=True)
        x = logits.astype(np.float32, copy=True)
        seen = x[tokens]
        seen = np.where(seen <= 0, seen * repeat, seen / repeat)
        x[tokens] = seen - counts * freq - present
        return x

    def __call__(self, logits: np.ndarray) -> int:
        if self.penalties is not None and self.window:
            logits = self.penalised(logits)
        if self.temperature <= 0.0:
            return int(np.argmax(logits))
        x = logits.astype(np.float64)
        candidates = np.arange(x.shape[0])
        if 0 < self.top_k < x.shape[0]:
            candidates = np.argpartition(-x, self.top_k - 1)[: self.top_k]
        order = candidates[np.argsort(-x[candidates], kind="stable")]
        vals = x[order]
        if self.top_p < 1.0:
            p = np.exp(vals - vals[0])
            p /= p.sum()
            cut = int(np.searchsorted(np.cumsum(p), self.top_p)) + 1
            order, vals = order[:cut], vals[:cut]
        if self.min_p > 0.0:
            # keep tokens at least min_p as likely as the top one (before temperature, as llama.cpp)
            keep = int(np.count_nonzero(vals - vals[0] >= np.log(self.min_p)))
            order, vals = order[:keep], vals[:keep]
        p = np.exp((vals - vals[0]) / self.temperature)
        p /= p.sum()
        return int(order[self.rng.choice(len(order), p=p)])


class OpenVINOSteps(LogitsSteps):
    """DecodeSteps on the paged graph: numpy sampling over the stored logits."""

    def __init__(self, m: OpenVINOLoadedModel, sample: Sampler, guide: TokenGuide | None) -> None:
        self._m = m
        self._sample = sample
        self._guide = guide
        self._logits: np.ndarray | None = None
        #: the rows of the last draft check (``verify``) and the tape length before it
        self._rows: np.ndarray | None = None
        self._base = 0

    def start(self) -> None:
        self._logits = self._m.logits_at_end()
        self._sample.start(self._m.res.tokens)

    def sample(self) -> int:
        assert self._logits is not None, "start() comes first"
        return self._sample_from(self._logits)

    def _sample_from(self, logits: np.ndarray) -> int:
        if self._guide is None:
            token = self._sample(logits)
        else:
            token = self._sample(self._guide.mask(logits))
            self._guide.accept(token)
        self._sample.accept(token)
        return token

    def feed(self, token: int) -> None:
        self._logits = self._m.step(token)

    def is_end(self, token: int) -> bool:
        return token in self._m.vocab.eog

    def piece(self, token: int) -> bytes:
        return self._m.vocab.text_pieces[token]

    def settle(self, token: int) -> None:
        try:
            self._m.step(token)
        except Exception:
            # The graph step failed mid-way: the pools may hold a partial update, so
            # nothing resident can be trusted any more.
            self._m.clear_kv()

    def verify(self, tokens: list[int]) -> None:
        self._base = len(self._m.res.tokens)
        self._rows = self._m.verify(tokens)

    def sample_row(self, i: int) -> int:
        assert self._rows is not None, "verify() comes first"
        return self._sample_from(self._rows[i])

    def logits(self, row: int | None) -> np.ndarray:
        logits = self._logits if row is None else None if self._rows is None else self._rows[row]
        assert logits is not None, "a sample comes first"
        return logits[: len(self._m.vocab.text_pieces)]  # (the graph's rows may be padded past the vocabulary)

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        # row i is the distribution after the verified batch's token i, at tape length base + i + 1
        row = len(self._m.res.tokens) - n - self._base - 1
        rows = self._rows
        self._m.rollback(n, rows[row] if rows is not None and 0 <= row < len(rows) else None)

    def close(self) -> None:
        self._logits = None
        self._rows = None
