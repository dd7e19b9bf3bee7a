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
and machine (``CheckCosts``, measured once per model and machine and fixed, so
drafts follow the tape alone) and to how often this pass's recent drafts were
kept: it drafts only when the expected tokens per step beat a plain step by
``MIN_GAIN``, so free prose — where matches are chance — costs at most an
occasional probe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..image_tokens import is_image_token

__all__ = ["CheckCosts", "DraftPolicy", "PromptLookup", "SpeculationStats", "draft_limit", "match_class"]

#: n-gram sizes looked up, longest first: a longer match predicts better
NGRAM_SIZES = (4, 3, 2)
#: the longest draft checked at once (with the pending token, 16 rows: a shape engines compile)
MAX_DRAFT = 15
#: how far back a match is followed past its n-gram (``PromptLookup.propose``), and the classes of
#: match length a pass keeps its own keep rate for: a match of ``m`` tokens is in the class of the
#: largest entry <= m. A 2- or 3-token match is the whole n-gram; a 4-gram match that goes on back
#: 5, 8 or 16 tokens is ever more surely a copy under way
MATCH_CLASSES = (2, 3, 4, 5, 8, 16)
#: prior chance a draft token is kept, per match class (weighing PRIOR_TRIES tokens), until checks
#: tell. Measured over the bundled model's answers on both engines (edits, continuations, prose):
#: drafts from a 2-, 3- and bare 4-token match kept ~0.6-0.8 of the tokens tried, from 8 tokens or
#: more 0.94-0.98. Prose matches 2 or 3 tokens by chance ("of the", "in the middle") and a check
#: costs 1.2-8 plain steps here, so short matches draft only after they were seen kept (with 0.8 /
#: 0.7 priors prose on OpenVINO drafted 16-23 tokens and kept none: 6-12% slower). One n-gram rate
#: for every 4-gram match let a bare 4-gram's miss early in an answer stop the drafts of the long
#: copies after it (llama.cpp: three prose answers that repeat themselves ran at 0.97 where drafts
#: by match class ran them at 1.2-1.4)
PRIOR_KEEP = {2: 0.35, 3: 0.5, 4: 0.75, 5: 0.8, 8: 0.9, 16: 0.95}
PRIOR_TRIES = 4.0
#: a draft must promise this many times a plain step's tokens per second: the estimates are noisy,
#: and a marginal win is not worth a likely loss
MIN_GAIN = 1.1
#: how fast old checks fade from the keep rate (per check)
DECAY = 0.8
#: a check's extra row, in plain steps, while a model's costs are not measured
PRIOR_ROW_COST = 0.25
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
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the tape's last n-gram,
        and how many tokens that occurrence matches the tape's end by (the n-gram's ``n``, followed
        back to at most ``MATCH_CLASSES[-1]``); ``([], 0)`` when nothing matches. Where the
        occurrence is closer to the end than ``limit``, the tape is repeating itself, and the draft
        goes on repeating it."""
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
                matched = n
                while (
                    matched < MATCH_CLASSES[-1]
                    and start > matched
                    and tape[start - matched - 1] == tape[end - matched - 1]
                ):
                    matched += 1
                draft = tape[start : min(start + limit, end)]
                # a source within ``limit`` of the end repeats with period end - start: so does the draft
                # (a loop of a few tokens, a row of separators)
                period = end - start
                while len(draft) < limit:
                    draft.append(draft[len(draft) - period])
                # an image's positions are no tokens to decode: a draft stops before one
                cut = next((i for i, t in enumerate(draft) if is_image_token(t)), len(draft))
                return (draft[:cut], matched) if cut else ([], 0)
        return [], 0


def draft_limit(max_tokens: int, produced: int, num_ctx: int, context: int) -> int:
    """The longest draft after ``produced`` tokens of ``max_tokens``, with ``context`` tokens resident
    in a window of ``num_ctx``: it never passes max_tokens nor fills the context (the pending token
    and the one sampled after the draft need their places)."""
    return min(MAX_DRAFT, max_tokens - produced - 1, num_ctx - context - 2)


def match_class(matched: int) -> int:
    """The class (``MATCH_CLASSES``) of a match of ``matched`` tokens."""
    return max((c for c in MATCH_CLASSES if c <= matched), default=MATCH_CLASSES[0])


class CheckCosts:
    """What a check of ``rows`` rows costs on this engine and machine, in plain one-token steps,
    at a given length of context.

    One table per loaded model (``TapeModelBase.draft_costs``), measured once
    (``backends.tape.draft_costs``) and fixed from then on: the policy's choices
    then depend on the tape alone, so the same tape gives the same drafts, the
    same batches and the same numbers — a warm answer equals a cold one, and a
    restarted daemon answers as before, also with speculation on. Costs timed as
    the model decodes would follow the machine's noise into the answers.

    What a check costs against a step changes with the context: a step's
    attention over the context is one row, a check's is one per row, and an
    engine may take a slower attention kernel for several rows than for one.
    Measured here (in steps, 16-row check): OpenVINO 1.6 at 64 tokens, 2.2 at
    2,000, 2.7 at 4,000; llama.cpp 7.4 to 7.0 (flat) in its default layout, 7.8 to
    13.6 with flash attention over a q8_0 cache. So a table has ``costs`` (at a
    short context) and ``growth``: plain steps added per 1,000 tokens of context,
    per row count, from a second measurement at a longer context. Growth is never
    below 0: a check is not assumed to get cheaper than it was measured, and
    past the longer measurement it is extrapolated linearly.

    And what changing the row count costs: ``switch``, in plain steps, paid by the
    evaluation after every change (a check after a step, a step after a check).
    OpenVINO's CPU plugin prepares every node of the graph again when an input's
    shape changes: ~5 ms a change here, against a ~8-10 ms step, so a lone check
    costs its rows plus ~1.2 steps of changing shape twice. The costs themselves
    are what a check costs after one of the same size (``draft_costs`` times both).
    """

    __slots__ = ("_costs", "_growth", "_switch")

    def __init__(self, costs: Sequence[float], growth: Sequence[float] | None = None, switch: float = 0.0) -> None:
        size = MAX_DRAFT + 1
        if len(costs) != size or any(not c > 0 for c in costs):
            raise ValueError(f"a cost table has {size} positive entries (rows 1..{size})")
        growth = [0.0] * size if growth is None else list(growth)
        if len(growth) != size or any(not 0 <= g < float("inf") for g in growth):
            raise ValueError(f"a cost table's growth has {size} entries >= 0 (rows 1..{size})")
        if not 0 <= switch < float("inf"):
            raise ValueError(f"a cost table's switch is a number of steps >= 0, not {switch!r}")
        #: costs[r - 1]: a check of r rows at a short context (costs[0] is the plain step itself: 1.0)
        self._costs = tuple(float(c) for c in costs)
        #: growth[r - 1]: what a check of r rows adds per 1,000 tokens of context (growth[0]: 0)
        self._growth = tuple(float(g) for g in growth)
        #: what the evaluation after a change of row count loses, in plain steps
        self._switch = float(switch)

    @classmethod
    def from_points(
        cls,
        points: dict[int, float],
        padded: Callable[[int], int],
        longer: dict[int, float] | None = None,
        tokens: int = 0,
        switch: float = 0.0,
    ) -> CheckCosts:
        """The table from costs timed at a few row counts: ``padded(r)`` is the row count a check
        of ``r`` rows really runs with (an engine padding to compiled shapes rounds up), and
        counts between two timed ones are interpolated. A check is taken to cost at least a
        plain step, and more rows never less than fewer (timing noise could say otherwise).
        ``longer``: the same rows timed with ``tokens`` more tokens of context; the growth.
        ``switch``: what a change of row count costs (below 0, timing noise, is 0)."""
        short = cls._interpolated(points, padded)
        switch = max(0.0, switch)
        if not longer or tokens <= 0:
            return cls(short, switch=switch)
        long = cls._interpolated(longer, padded)
        growth = [max(0.0, (b - a) * 1000 / tokens) for a, b in zip(short, long, strict=True)]
        growth[0] = 0.0  # a plain step is the unit at every context
        return cls(short, growth, switch)

    @staticmethod
    def _interpolated(points: dict[int, float], padded: Callable[[int], int]) -> list[float]:
        xs = sorted(points)
        ys = np.maximum.accumulate(np.maximum([points[x] for x in xs], 1.0))
        return [float(np.interp(padded(r) if r > 1 else 1, xs, ys)) for r in range(1, MAX_DRAFT + 2)]

    @classmethod
    def prior(cls) -> CheckCosts:
        """Used until a model's costs were measured: every extra row costs ``PRIOR_ROW_COST`` steps."""
        return cls([1.0 + PRIOR_ROW_COST * (r - 1) for r in range(1, MAX_DRAFT + 2)])

    def cost(self, rows: int, context: int = 0) -> float:
        """A check of ``rows`` rows (1..MAX_DRAFT + 1) after ``context`` tokens, in plain steps."""
        return self._costs[rows - 1] + self._growth[rows - 1] * context / 1000

    def table(self) -> list[float]:
        return list(self._costs)

    def growth(self) -> list[float]:
        return list(self._growth)

    def switch(self) -> float:
        """What the evaluation after a change of row count loses, in plain steps."""
        return self._switch

    def _key(self) -> tuple[tuple[float, ...], tuple[float, ...], float]:
        return self._costs, self._growth, self._switch

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CheckCosts) and other._key() == self._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        text = ", ".join(f"{r}: {c:.2f}" for r, c in enumerate(self._costs, 1))
        if any(self._growth):
            text += f"; per 1,000 tokens of context: {', '.join(f'+{g:.2f}' for g in self._growth[1:])}"
        if self._switch:
            text += f"; a change of row count: {self._switch:.2f}"
        return f"CheckCosts({text})"


class DraftPolicy:
    """When to draft and how long, from what a draft's check costs here and how often drafts are kept.

    A plain step yields one token for one step of cost. A check of ``k`` draft
    tokens runs ``k + 1`` rows for ``costs.cost(k + 1, context)`` steps (``CheckCosts``:
    an engine's batch kernels cost per row very differently from its one-token
    step, e.g. ~0.5 of a step per row on llama.cpp here, and a long context makes
    some engines' checks dearer still) and yields the kept tokens plus
    one. Changing the row count costs ``costs.switch()`` on the evaluation after
    it, twice for a run of checks (into the first, out after the last): the
    first check after plain steps is charged both, and a check following a
    check nothing, so a lone check in prose is priced as what it costs and a
    copy's checks, run back to back, as theirs. With ``p`` the chance a draft
    token is kept (per class of match length, ``match_class``: recent checks of
    this pass weighing most, from priors that trust a long match and doubt a
    short one, and a miss after a short match leaving the long ones' rate
    alone), ``k`` tokens
    keep ``p (1 - p^k) / (1 - p)`` on average. The policy drafts the ``k`` that
    yields the most tokens per step, and only when that beats a plain step by
    ``MIN_GAIN``; when nothing pays it still probes a one-token draft every
    ``PROBE_EVERY`` tokens, so it notices when a copy starts.

    Every input is a count of tokens (the context's length among them) or the
    fixed cost table, never a clock: a pass's drafts are a function of its tape.
    """

    def __init__(self, costs: CheckCosts | None = None) -> None:
        self.costs = costs if costs is not None else CheckCosts.prior()
        #: per match class: decayed counts of kept draft tokens and of draft tokens tried
        self._kept = {c: PRIOR_KEEP[c] * PRIOR_TRIES for c in MATCH_CLASSES}
        self._tried = dict.fromkeys(MATCH_CLASSES, PRIOR_TRIES)
        self._since_draft = 0
        #: the last evaluation was a check (the row count changes only when a run of them ends)
        self._checking = False

    def keep_rate(self, matched: int) -> float:
        """The chance a token drafted from a match of ``matched`` tokens is kept, as this pass has seen."""
        c = match_class(matched)
        return self._kept[c] / self._tried[c]

    def plan(self, available: int, matched: int, context: int = 0) -> int:
        """How many of the ``available`` draft tokens (from a match of ``matched`` tokens,
        ``PromptLookup.propose``) to check now after ``context`` resident tokens; 0: a plain step."""
        if available <= 0:
            return 0
        p = min(self.keep_rate(matched), 0.999)
        best_k, best_rate = 0, MIN_GAIN
        switching = 0.0 if self._checking else 2 * self.costs.switch()
        for k in range(1, min(available, MAX_DRAFT) + 1):
            kept = p * (1 - p**k) / (1 - p)
            rate = (kept + 1) / (self.costs.cost(k + 1, context) + switching)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0 and self._since_draft >= PROBE_EVERY:
            best_k = 1  # a probe: is the answer copying now?
        return best_k

    def plain_step(self) -> None:
        self._since_draft += 1
        self._checking = False

    def checked(self, matched: int, drafted: int, kept: int) -> None:
        """A check of ``drafted`` tokens from a match of ``matched`` tokens kept ``kept`` of them."""
        c = match_class(matched)
        tried = kept + (1 if kept < drafted else 0)  # tokens compared until the first mismatch
        self._kept[c] = DECAY * self._kept[c] + kept
        self._tried[c] = DECAY * self._tried[c] + tried
        self._since_draft = 0
        self._checking = True


@dataclass
class SpeculationStats:
    """Draft tokens evaluated and accepted in one decode pass (reported in ``Usage``)."""

    drafted: int = 0
    accepted: int = 0
