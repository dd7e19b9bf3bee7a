"""One decode pass: how an engine steps it (``DecodeSteps``) and what the loop both engines share keeps while it
runs (``DecodePass``): the tokens produced, the one sampled and not yet evaluated, speculation's drafts, the
output pipeline's chunks and the log probabilities they carry. ``TapeSession._stream`` drives it and yields."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

from contract.types import DecodeConfig, FinishReason, StreamChunk, TokenLogprob

from .logprobs import token_logprob
from .output import OutputPipeline, PerToken
from .speculate import DraftPolicy, PromptLookup, SpeculationStats, draft_limit

if TYPE_CHECKING:
    import numpy as np

    from .model import TapeModel

__all__ = ["DecodePass", "DecodeSteps", "Emitted", "LogitsSteps"]

#: a token a verified draft gave: the token, its chunks, whether the KV holds it (in output order)
Emitted = tuple[int, list[StreamChunk], bool]


class DecodeSteps(Protocol):
    """How one decode pass samples and steps its engine (the rest of the loop is shared)."""

    def start(self) -> None:
        """Make the distribution after the last resident token available."""
        ...

    def sample(self) -> int:
        """The next token from the current distribution (constraints applied)."""
        ...

    def feed(self, token: int) -> None:
        """Evaluate a sampled token into the KV and append it to the tape."""
        ...

    def is_end(self, token: int) -> bool:
        """Whether the token ends generation (EOS/EOT); it is not evaluated."""
        ...

    def piece(self, token: int) -> bytes:
        """What the token adds to the output text (control tokens add nothing)."""
        ...

    def settle(self, token: int) -> None:
        """On close: evaluate a token already handed out, so the tape equals the KV; never raises."""
        ...

    def verify(self, tokens: list[int]) -> None:
        """Evaluate ``tokens`` (a sampled token and a draft) in one batch, appending them to the tape.

        The distribution after each of them is kept for ``sample_row``.
        """
        ...

    def sample_row(self, i: int) -> int:
        """The next token after ``tokens[i]`` of the last ``verify``, from that row's distribution."""
        ...

    def token_logprob(self, token: int, row: int | None, k: int) -> TokenLogprob:
        """``token``'s log probability and the ``k`` likeliest tokens, under the model's own distribution at the last
        ``sample`` (None) or ``sample_row(row)`` (``DecodeConfig.logprobs``)."""
        ...

    def rollback(self, n: int) -> None:
        """Drop the last ``n`` tokens (a rejected draft) from the KV and the tape."""
        ...

    def close(self) -> None:
        """Release per-pass resources."""
        ...


class LogitsSteps(ABC):
    """Steps whose engine computes the logits in this process: a sampled token's log probability is a log-softmax
    of the row it was drawn from (``logprobs.token_logprob``)."""

    @abstractmethod
    def logits(self, row: int | None) -> np.ndarray:
        """The raw logits over the vocabulary that the last ``sample`` (None) or ``sample_row(row)`` drew from."""

    @abstractmethod
    def piece(self, token: int) -> bytes: ...

    def token_logprob(self, token: int, row: int | None, k: int) -> TokenLogprob:
        return token_logprob(self.logits(row), token, k, self.piece)


class DecodePass:
    """What one decode pass keeps while it runs (the loop, in ``TapeSession._stream``, yields its chunks)."""

    def __init__(self, m: TapeModel, cfg: DecodeConfig, steps: DecodeSteps, pipeline: OutputPipeline) -> None:
        self.m, self.cfg, self.steps, self.pipeline = m, cfg, steps, pipeline
        self.start = time.perf_counter()
        self.prompt_tokens = len(m.res.tokens)
        m.res.reply_from = self.prompt_tokens  # what the loop appends is the reply
        # no limit: until the end of generation or the context's end (a pass never decodes more than that)
        self.max_tokens = cfg.max_tokens if cfg.max_tokens is not None else m.num_ctx
        self.produced = 0
        self.first_ms = 0.0
        self.finish: FinishReason = ""
        #: the token sampled and handed out, not evaluated yet (``settle`` evaluates it on the way out)
        self.pending: int | None = None
        # By default only greedy passes speculate: a batch rounds differently from a one-token step, so a
        # seeded sampled pass would part from what the same seed gave without drafts wherever its draw
        # falls near a boundary between two tokens, and a sampled pass has a boundary at every token.
        # Where the engine's rows are exact (``rows_exact``) a batch rounds as a step does: sampled too. Asked for
        # log probabilities, a pass drafts by default on exact rows only, so it reports a step's figures.
        default = m.speculative and (m.rows_exact or not (cfg.temperature or cfg.logprobs is not None))
        self.speculate = default if cfg.speculative is None else cfg.speculative
        self.lookup: PromptLookup | None = None
        self.policy = DraftPolicy(m.draft_costs)
        self.stats = SpeculationStats()
        self.markers = m.marker_pieces(pipeline.markers) if pipeline.markers else {}
        #: with ``cfg.logprobs``: the sampled tokens' log probabilities whose output is not sent yet
        self.held: list[TokenLogprob] = []
        #: with ``cfg.logprobs``: the end-of-generation token that ended the pass, which the reply's text does not hold
        self.ended: TokenLogprob | None = None
        #: with ``cfg.return_token_ids``: a chunk per token, its text once the output released it
        self.per_token = PerToken() if cfg.return_token_ids else None

    def ended_by(self, token: int, row: int | None) -> TokenLogprob | None:
        """The end token's log probability (its text empty: it writes none), with ``cfg.logprobs`` asked."""
        if self.cfg.logprobs is None:
            return None
        lp = self.steps.token_logprob(token, row, self.cfg.logprobs)
        # (the same token among the likeliest reads the same: a scorer compares the two texts)
        top = [a.model_copy(update={"token": "", "bytes": []}) if a.token_id == token else a for a in lp.top]
        return lp.model_copy(update={"token": "", "bytes": [], "top": top})

    def output(self, token: int, row: int | None) -> tuple[list[StreamChunk], bool]:
        """A sampled token (from the last ``sample``, or from ``sample_row(row)``) through the output
        pipeline: its chunks (none: nothing to send yet), and whether a stop string ended the answer there.
        A control token the format reads is fed as its text."""
        cfg, steps = self.cfg, self.steps
        lp = steps.token_logprob(token, row, cfg.logprobs) if cfg.logprobs is not None else None
        fed = self.markers.get(token) or steps.piece(token)
        delta = self.pipeline.feed_bytes(fed)
        if self.per_token is not None:
            return self.per_token.add(token, fed, lp, delta), delta.stopped
        if lp is not None:
            self.held.append(lp)
        if not delta:
            return [], delta.stopped
        chunk = delta.chunk()
        if self.held:
            chunk.logprobs = self.held.copy()
            self.held.clear()
        return [chunk], delta.stopped

    def evaluate(self, tok: int) -> list[Emitted] | None:
        """Evaluate the pending token ``tok``: alone (None), or with a draft looked up in the tape, whose rows are
        sampled in order and kept as far as they agree with it (the rest rolled back): the tokens they gave."""
        m, steps = self.m, self.steps
        draft: list[int] = []
        matched = 0
        if self.speculate and not self.finish:
            if self.lookup is None:
                self.lookup = PromptLookup(m.res.tokens)
            self.lookup.extend([tok])
            limit = draft_limit(self.max_tokens, self.produced, m.num_ctx, len(m.res.tokens))
            draft, matched = self.lookup.propose(limit)
            draft = draft[: self.policy.plan(len(draft), matched, len(m.res.tokens))]
        with m.errors("decode"):
            if draft:
                steps.verify([tok, *draft])
            else:
                steps.feed(tok)
                self.policy.plain_step()
        return self._accept(draft, matched) if draft else None

    def _accept(self, draft: list[int], matched: int) -> list[Emitted]:
        m, steps = self.m, self.steps
        emitted: list[Emitted] = []
        accepted = 0
        for i in range(len(draft) + 1):
            with m.errors("decode"):
                token = steps.sample_row(i)
            if steps.is_end(token):
                self.finish = "stop"
                self.ended = self.ended_by(token, i)
                break
            self.produced += 1
            outs, stopped = self.output(token, i)
            if stopped:
                self.finish = "stop"
            in_kv = i < len(draft) and token == draft[i]
            emitted.append((token, outs, in_kv))
            if not in_kv:
                break  # the first token the draft did not foresee: evaluated next
            accepted += 1
            if self.finish or self.produced >= self.max_tokens:
                break
        with m.errors("decode"):
            steps.rollback(len(draft) - accepted)
        assert self.lookup is not None
        self.lookup.extend(draft[:accepted])
        self.policy.checked(matched, len(draft), accepted)
        self.stats.drafted += len(draft)
        self.stats.accepted += accepted
        m.drafts.drafted += len(draft)
        m.drafts.accepted += accepted
        return emitted

    def next_token(self) -> list[StreamChunk] | None:
        """Sample the next token and hand it out (it becomes ``pending``): its chunks; None when the pass ended
        first (``finish`` says why: a stop, its length, the context's end, the end of generation)."""
        if self.finish:
            return None
        if self.produced >= self.max_tokens:
            self.finish = "length"
            return None
        if len(self.m.res.tokens) >= self.m.num_ctx:
            self.finish = "context_full"  # the next token could not be evaluated
            return None
        with self.m.errors("decode"):
            token = self.steps.sample()
        if not self.first_ms:
            self.first_ms = (time.perf_counter() - self.start) * 1000
        if self.steps.is_end(token):
            self.finish = "stop"
            self.ended = self.ended_by(token, None)
            return None
        self.produced += 1
        self.pending = token
        outs, stopped = self.output(token, None)
        if stopped:
            self.finish = "stop"
        return outs

    def tail(self) -> list[StreamChunk]:
        """What the output pipeline still held when the pass ended."""
        tail = self.pipeline.finish()
        if self.per_token is not None:
            return list(self.per_token.flush(tail))
        if not tail:
            return []
        chunk = tail.chunk()
        chunk.logprobs = self.held.copy()
        self.held.clear()
        return [chunk]

    def final(self) -> StreamChunk:
        """The pass's final chunk: why it ended, its usage and timing, what speculation did."""
        if self.pipeline.tool_call_count and self.finish == "stop":
            self.finish = "tool_calls"
        final = StreamChunk.final(self.finish, self.prompt_tokens, self.produced, self.first_ms, self.start,
                                  drafted=self.stats.drafted, accepted=self.stats.accepted)
        final.stop_sequence = self.pipeline.stop_sequence
        final.logprobs = self.held  # (tokens whose output was nothing at all)
        final.end_logprob = self.ended
        return final
