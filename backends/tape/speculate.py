"""Prompt-lookup speculative decoding: drafts copied from the tape, and how long they may be.

A coding agent's replies repeat what it was shown: an edited function, a file
rewritten with one line changed, a diff's context lines. When the last few
tokens of the tape occurred before, the tokens that followed them then are a
good guess for what follows now. ``PromptLookup`` proposes that continuation as
a *draft*; the decode loop (``backends.tape.session``) evaluates the pending
token and the draft in ONE batched forward with the distribution kept after
every position, samples each position in turn with the pass's own sampler, and
keeps the draft only as far as the sampled tokens agree with it.

Why this is exact, for greedy and sampled decoding alike: every emitted token
is drawn by the same sampler (grammar, top-k/top-p, temperature, seed) from the
distribution after the tokens actually emitted before it — a draft token is used
only once the sampler has produced that very token. With a point-mass draft this
is the standard speculative-sampling rule (accept with probability p(draft),
else a token from the rest of p), so the output distribution is unchanged; the
random draws happen in the same order as without a draft, so a seeded pass gives
the same tokens either way, up to the engine's numerics (a batch may round its
last bits differently from one-token steps).

The draft length adapts (``DraftPolicy``) to what a check costs on this engine
and machine (``CheckTiming``, measured across the model's decode passes) and to
how often this pass's recent drafts were kept: it drafts only when the expected
tokens per second beat a plain step by ``MIN_GAIN``, so free prose — where
matches are chance — costs at most an occasional probe.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

__all__ = ["CheckTiming", "DraftPolicy", "PromptLookup", "SpeculationStats"]

#: n-gram sizes matched, longest first: a longer match predicts better
NGRAM_SIZES = (4, 3, 2)
#: the longest draft checked at once
MAX_DRAFT = 16
#: prior chance a draft token is kept, per n-gram size (as PRIOR_KEPT / PRIOR_TRIES), until checks tell:
#: 0.9, 0.5 and 0.35. A copy soon matches 4 tokens and goes on; prose matches 2 or 3 tokens by
#: chance ("of the", "in the middle"), and a check costs 1.6-3 plain steps on both engines here, so
#: short matches draft only after they were seen kept (with 0.8 / 0.7 priors prose on OpenVINO
#: drafted 16-23 tokens and kept none: 6-12% slower)
PRIOR_TRIES = 4.0
PRIOR_KEPT = {4: 3.6, 3: 2.0, 2: 1.4}
#: a draft must promise this many times a plain step's tokens per second: the estimates are noisy,
#: and a marginal win is not worth a likely loss
MIN_GAIN = 1.1
#: how fast old checks fade from the keep rate (per check)
DECAY = 0.8
#: a check's extra row, in plain steps, until two row counts were timed
PRIOR_ROW_COST = 0.25
#: timed checks the cost fit uses
CHECK_SAMPLES = 32
#: when drafting does not pay, a one-token draft is still tried after this many plain steps
PROBE_EVERY = 64


class PromptLookup:
    """Drafts for the tape's continuation from the most recent earlier occurrence of its last n-gram.

    The index maps each n-gram to the position after its latest occurrence; it
    is built once over the prompt and extended as tokens are appended, so a
    lookup costs a few dict probes however long the context is.
    """

    def __init__(self, tokens: list[int]) -> None:
        self.tape = list(tokens)
        self._index: dict[tuple[int, ...], int] = {}
        #: n-grams ending before this position are in the index
        self._indexed = 0

    def extend(self, tokens: list[int]) -> None:
        self.tape.extend(tokens)

    def _index_until(self, end: int) -> None:
        tape, index = self.tape, self._index
        for e in range(self._indexed, end):
            for n in NGRAM_SIZES:
                if e + 1 >= n:
                    index[tuple(tape[e + 1 - n : e + 1])] = e + 1
        self._indexed = max(self._indexed, end)

    def propose(self, limit: int) -> tuple[list[int], int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the tape's last n-gram, and n."""
        tape = self.tape
        end = len(tape)
        if limit <= 0 or end < 2:
            return [], 0
        # every n-gram but the ones ending at the last token: those would find themselves
        self._index_until(end - 1)
        for n in NGRAM_SIZES:
            if end < n:
                continue
            # the tape only grows (rejected draft tokens never enter it), so an entry
            # always points at a real continuation before the end
            start = self._index.get(tuple(tape[end - n :]))
            if start is not None:
                return tape[start : min(start + limit, end)], n
        return [], 0


class CheckTiming:
    """What a plain step and a check of ``rows`` rows cost on this engine and machine, as measured.

    One per loaded model (``TapeModelBase.draft_timing``): the costs belong to the
    engine, the weights and the CPU, not to one answer, so a pass starts from what
    earlier passes timed, and its first draft can be sized before it has timed a
    check of its own.
    """

    def __init__(self) -> None:
        #: seconds of a plain step (a moving average; None until one was timed)
        self.step_s: float | None = None
        self._checks: deque[tuple[int, float]] = deque(maxlen=CHECK_SAMPLES)
        #: check seconds = c0 + c1 * rows, fitted to ``_checks`` (None: fewer than two row counts)
        self._fit: tuple[float, float] | None = None

    def plain_step(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds

    def checked(self, rows: int, seconds: float) -> None:
        self._checks.append((rows, seconds))
        self._refit()

    def check_cost(self, rows: int) -> float:
        """Seconds a check of ``rows`` rows is expected to take (a plain step must have been timed)."""
        assert self.step_s is not None
        if self._fit is not None:
            c0, c1 = self._fit
            return max(c0 + c1 * rows, self.step_s)
        if self._checks:
            # one row count seen so far: its mean, and another row costing PRIOR_ROW_COST steps
            seen, mean = self._checks[-1][0], sum(t for _, t in self._checks) / len(self._checks)
            return max(mean + PRIOR_ROW_COST * self.step_s * (rows - seen), self.step_s)
        return self.step_s * (1.0 + PRIOR_ROW_COST * rows)

    def _refit(self) -> None:
        """A least-squares line through the timed checks, once two row counts were seen."""
        xs = np.array([r for r, _ in self._checks], float)
        if len(set(xs.tolist())) < 2:
            self._fit = None
            return
        ys = np.array([t for _, t in self._checks], float)
        c1, c0 = np.polyfit(xs, ys, 1)
        self._fit = (float(c0), max(float(c1), 0.0))


class DraftPolicy:
    """When to draft and how long, from what a draft's check costs here and how often drafts are kept.

    A plain step yields one token in ``step_s``. A check of ``k`` draft tokens runs
    ``k + 1`` rows in ``c0 + c1 * (k + 1)`` seconds (``CheckTiming``, fitted to the
    checks this model ran: an engine's batch kernels cost per row very differently
    from its one-token step, e.g. ~0.6 of a step per row on llama.cpp here) and
    yields the kept tokens plus one. With ``p`` the chance a draft token is kept
    (per n-gram size, recent checks of this pass weighing most, from priors that
    trust a long match and doubt a short one), ``k`` tokens keep
    ``p (1 - p^k) / (1 - p)`` on average. The policy drafts the ``k`` that yields
    the most tokens per second, and only when that beats a plain step by ``MIN_GAIN``; when
    nothing pays it still probes a one-token draft every ``PROBE_EVERY`` tokens,
    so it notices when a copy starts.
    """

    def __init__(self, timing: CheckTiming | None = None) -> None:
        self.timing = timing if timing is not None else CheckTiming()
        #: per n-gram size: decayed counts of kept draft tokens and of draft tokens tried
        self._kept = {n: PRIOR_KEPT[n] for n in NGRAM_SIZES}
        self._tried = dict.fromkeys(NGRAM_SIZES, PRIOR_TRIES)
        self._since_draft = 0

    @property
    def step_s(self) -> float | None:
        return self.timing.step_s

    def keep_rate(self, n: int) -> float:
        return self._kept[n] / self._tried[n]

    def check_cost(self, rows: int) -> float:
        """Seconds a check of ``rows`` rows is expected to take."""
        return self.timing.check_cost(rows)

    def plan(self, available: int, n: int) -> int:
        """How many of the ``available`` draft tokens (found by an ``n``-gram) to check now; 0: a plain step."""
        if self.step_s is None or available <= 0:
            return 0
        p = min(self.keep_rate(n), 0.999)
        best_k, best_rate = 0, MIN_GAIN / self.step_s
        for k in range(1, min(available, MAX_DRAFT) + 1):
            kept = p * (1 - p**k) / (1 - p)
            rate = (kept + 1) / self.check_cost(k + 1)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0 and self._since_draft >= PROBE_EVERY:
            best_k = 1  # a probe: is the answer copying now?
        return best_k

    def plain_step(self, seconds: float) -> None:
        self.timing.plain_step(seconds)
        self._since_draft += 1

    def checked(self, n: int, drafted: int, kept: int, seconds: float) -> None:
        self.timing.checked(drafted + 1, seconds)
        tried = kept + (1 if kept < drafted else 0)  # tokens compared until the first mismatch
        self._kept[n] = DECAY * self._kept[n] + kept
        self._tried[n] = DECAY * self._tried[n] + tried
        self._since_draft = 0


@dataclass
class SpeculationStats:
    """Draft tokens evaluated and accepted in one decode pass (reported in ``Usage``)."""

    drafted: int = 0
    accepted: int = 0
