"""The one Session over a ``TapeModel``: ensure_prefix, prefill_suffix, decode, snapshot, restore.

Both engines keep the invariant ``Resident.tokens == what the KV holds`` and
differ only in how they tokenize, compute and sample. ``TapeSession`` holds
the single implementation of the Session contract over that invariant: the
manifest gate, token-LCP reuse and rollback on a failed prefill, suffix
rendering with token-level reconciliation, the decode loop (pending-token
evaluation, cancel on close, epochs, finish reasons, usage), and the checks
before a restore. The engine supplies a ``DecodeSteps`` per decode pass and its
state bytes (see ``backends.tape.model.TapeModel``).

Over ~400 lines on purpose: the Session's five operations keep one invariant, and each one's
rollback rests on the others' bookkeeping (tape, epochs, pending token), so they stay one class.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any

from contract import interrupt
from contract.errors import Cancelled, InvalidArgument, ManifestMismatch, SessionClosed, UnsupportedFeature
from contract.manifest import ContextManifest, common_prefix_len, token_hash
from contract.types import (
    ChatMessage,
    ContextReport,
    DecodeConfig,
    ImageInput,
    PositionRange,
    PrefixInput,
    PrefixStatus,
    SessionSnapshot,
    StreamChunk,
    SuffixInput,
    SuffixStatus,
    TokenCount,
    TokenLogprob,
    check_conversation,
    first_covered,
    positions_covered,
)

from ..image_tokens import is_image_token
from ..resident import PrefixPlan, Resident, check_manifest_names, check_token_ids
from .cache import MIN_GAIN_TOKENS, SAVE_MIN_TOKENS, cache_key, restore_best, save_before_discard, save_tape
from .conversation import template_messages
from .decoding import DecodePass, DecodeSteps
from .images import ImageEncoder, Segments, marked_text, new_marker, split_marked
from .logprobs import token_logprob
from .miss import Held, message_keys, prefix_miss, suffix_miss
from .model import BOS_POLICIES, RowsFn, StatesFn, TapeModel, parse_tools, render_prefix, with_tools
from .model import stable_text as stable_render
from .output import OutputPipeline, ends_inside_thinking, resolve_protocols
from .state import check_restorable
from .toolformats import parameter_types

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("modeld.session")

#: how many trailing resident tokens are decoded to see whether the prompt opened <think>
_PROMPT_TAIL_TOKENS = 8


def _set_kv(m: TapeModel, tokens: list[int], keep: int, rows: RowsFn | None = None,
            states: StatesFn | None = None) -> int:
    """``m.set_kv``: afterwards the KV holds exactly the context (whatever was kept past it is gone)."""
    try:
        return m.set_kv(tokens, keep, rows, states)
    finally:
        m.res.live_len = None


class _Scores:
    """A scored suffix's log probabilities (``SuffixInput.logprobs``), filled from the prefill's rows: the row
    after position p scores the token at p + 1."""

    def __init__(self, m: TapeModel, target: list[int], start: int, k: int,
                 ranges: list[PositionRange]) -> None:
        self._m, self._target, self._start, self._k = m, target, start, k
        self._wanted = positions_covered(ranges, start, len(target))
        #: one per suffix token (``target[start:]``); None until a row scores it, for position 0, and outside the
        #: ranges
        self.out: list[TokenLogprob | None] = [None] * (len(target) - start)

    def first_row(self) -> int:
        """The first position whose row is needed: the one before the first scored token (none before 0)."""
        return max(self._start + first_covered(self._wanted) - 1, 0)

    def rows(self, first: int, logits: np.ndarray) -> None:
        def piece(token: int) -> bytes:
            return self._m.token_bytes([token])[0]

        for i in range(logits.shape[0]):
            at = first + i + 1  # the position this row scores
            if self._start <= at < len(self._target) and self._wanted[at - self._start]:
                self.out[at - self._start] = token_logprob(logits[i], self._target[at], self._k, piece)


class _Readouts:
    """Concept readouts (``SuffixInput.readouts``, ``DecodeConfig.readouts``) of the tokens from ``start`` on,
    filled from the prefill's chunks."""

    def __init__(self, m: TapeModel, target: list[int], start: int, ranges: list[PositionRange] | None = None) -> None:
        check_readouts(m)
        self._start = start
        self._wanted = positions_covered(ranges or [], start, len(target))
        #: one per token from ``start``: [n_layers][n_concepts] ([] outside the ranges)
        self.out: list[list[list[float]]] = [[] for _ in range(len(target) - start)]

    def first(self) -> int:
        """The first position whose readout is asked for: computed again from there."""
        return self._start + first_covered(self._wanted)

    def states(self, first: int, values: np.ndarray) -> None:
        for i in range(values.shape[0]):
            at = first + i
            if at >= self._start and at - self._start < len(self.out) and self._wanted[at - self._start]:
                self.out[at - self._start] = values[i].tolist()


def check_readouts(m: TapeModel) -> None:
    """UnsupportedFeature unless the daemon serves a readout manifest."""
    if m.readouts is None:
        raise UnsupportedFeature("this daemon serves no readout manifest: start it with --readouts FILE")


def _encoder(m: TapeModel) -> ImageEncoder:
    """The model's image encoder; UnsupportedFeature naming the model when it reads text only."""
    if m.image_encoder is None:
        raise UnsupportedFeature("this model reads text only: it has no image encoder (serve a vision model with "
                                 "its projector: modeld serve --mmproj FILE)", capability="vision")
    return m.image_encoder


def _segments(m: TapeModel, text: str, marker: str, images: Sequence[ImageInput]) -> Segments:
    """Rendered ``text`` cut at its image markers (``images.split_marked``); the text alone without images."""
    if not images:
        return [text]
    _encoder(m)
    return split_marked(text, marker, images)


def _encode(m: TapeModel, segments: Segments, bos_policy: str | None = None) -> list[int]:
    """The tokens of ``segments``, each image its block, BOS per policy first (as ``TapeModel.tokenize``)."""
    out: list[int] = []
    for i, seg in enumerate(segments):
        if isinstance(seg, str):
            out += m.tokenize(seg, bos_policy=bos_policy if i == 0 else None)
        else:
            out += _encoder(m).block(seg).tokens
    return out


def _marked(messages: list[ChatMessage]) -> tuple[list[ChatMessage], list[ImageInput], str]:
    """The messages with a marker where each image sits in their content, the images in order, and the marker."""
    if not any(msg.images for msg in messages):
        return messages, [], ""
    marker = new_marker()
    images: list[ImageInput] = []
    out = []
    for msg in messages:
        if msg.images:
            images += msg.images
            msg = msg.model_copy(update={"content": marked_text(msg.content or "", msg.images, marker), "images": []})
        out.append(msg)
    return out, images, marker


def _cold(m: TapeModel, stable: list[int], text: str | Segments) -> list[int]:
    """``stable`` + the tokens of ``text`` (its segments: text pieces and images' blocks, in order): the request's own
    cold tokens, whatever the KV held before. Reuse is then the token LCP of this list with the tape.

    A model's reply is not always the tokenizer's own spelling of its text (a grammar or sampling can pick
    "g"+"et" where the tokenizer writes "get"); a conversation that resends it reuses the KV up to the first such
    token and computes the rest, as it would cold. Keeping the held tokens that spell the same bytes instead (what
    this once did) changed a prompt's tokens with what the slot held before: a held lone "<" kept where a cold
    prompt has "<|im_end|>", a held " " kept where a cold one has " [" — and the answer with them.
    """
    segments = [text] if isinstance(text, str) else text
    return stable + [t for seg in segments for t in _encode(m, [seg])]


def _held(m: TapeModel) -> Held:
    """What the session holds now, for the miss report of the operation about to change it."""
    res = m.res
    return Held(list(res.tokens), res.manifest or res.partial, partial=res.manifest is None,
                stable_text=res.stable_text, tools=res.tools, messages=res.messages)


def _settle_context(m: TapeModel) -> None:
    """Drop KV kept past the context (see ``Resident.live``) before decoding or exporting it."""
    if m.res.live_len is not None:
        live = list(m.res.live)
        _set_kv(m, live, len(live))


def _prefix_text(m: TapeModel, prefix: PrefixInput) -> str:
    """The stable prefix as prompt text: its system turn and tools through the model's template, or the text as it
    is (``render=False``)."""
    if not prefix.render:
        return prefix.text
    return render_prefix(m.template, prefix.text, parse_tools(prefix.tools), m.tool_format)


def _target(
    m: TapeModel, stable: list[int], stable_text: str, tools_json: str, bos_policy: str, suffix: SuffixInput,
) -> tuple[list[int], int]:
    """The tokens ``suffix`` after the stable prefix ``stable`` comes to, and how much of it stays the prefix.

    """
    if suffix.tokens:
        return stable + check_token_ids(suffix.tokens, m.vocab_size), len(stable)
    tpl = m.template
    if suffix.messages and tpl is None:
        raise UnsupportedFeature("the model has no chat template to render messages with; send the suffix as text")
    if not suffix.render or tpl is None:
        return _cold(m, stable, suffix.text), len(stable)
    system_text, tools = with_tools(tpl, stable_text, parse_tools(tools_json), m.tool_format)
    system = {"role": "system", "content": system_text}
    extra: dict[str, Any] = {}
    if suffix.enable_thinking is not None:
        extra["enable_thinking"] = suffix.enable_thinking
    prefix_text = stable_render(tpl, system_text, tools)
    messages, images, marker = _marked(suffix.messages)
    if messages:
        conversation = template_messages(tpl, system_text, messages, m.tool_format)
    else:
        conversation = [system, {"role": suffix.role, "content": suffix.text}]
    full = tpl.render(conversation, tools, generation=True, **extra)
    if full.startswith(prefix_text):
        return _cold(m, stable, _segments(m, full[len(prefix_text) :], marker, images)), len(stable)
    # Not prefix-stable: the stable part renders differently once a turn follows.
    # Reconcile by tokens: whatever of the old prefix still matches stays resident.
    target = _encode(m, _segments(m, full, marker, images), bos_policy)
    return target, min(len(stable), common_prefix_len(stable, target))


class TapeSession:
    """A Session over a TapeModel's persistent KV.

    A session is bound to the model's session generation: opening a newer
    session on the model retires it (there is one KV to drive).
    """

    def __init__(self, model: TapeModel, generation: int, parked: Resident | None = None) -> None:
        self._m = model
        self._gen = generation
        self._closed = False
        #: this session's context while another session of the model (a fork, or the session it forked from) holds
        #: the KV; None while this one's is resident
        self._parked = parked
        #: what switching to this session's context took: (tokens the workspace cache restored, tokens computed,
        #: milliseconds), counted into the status of this session's next prefill
        self._switched: tuple[int, int, float] = (0, 0, 0.0)

    @property
    def model(self) -> TapeModel:
        return self._m

    def _live(self, *, switch: bool = True) -> TapeModel:
        m = self._m
        if self._closed or m.closed:
            raise SessionClosed()
        if m.session_gen != self._gen:
            raise SessionClosed("a newer session was opened on this model")
        m.drop_idle_save()  # the tape is about to change or be read: not the finished turn's any more
        if switch and self._parked is not None:
            self._switch_in(m, self._parked)
        return m

    def _switch_in(self, m: TapeModel, view: Resident) -> None:
        """Make this session's context the resident one: park the holder's, then bring the KV to this tape.

        The KV keeps what the two tapes share (a fork's whole context, at first); the rest comes from the workspace
        cache, where the holder's tape is saved first, so switching back and forth between forks restores KV
        instead of prefilling it again. Only what no entry covers is computed (a cache that is off, or evicted it).
        """
        other = m.view_holder
        if other is not None and other is not self and not other._closed and other._parked is None:
            other._parked = copy.deepcopy(m.res)
        m.view_holder = None  # nobody's until the KV holds this context
        m.epoch += 1  # an open stream of the other session must not touch the KV any more
        t0 = time.perf_counter()
        res, target = m.res, view.tokens
        under = res.manifest or res.partial
        same = under is not None and view.manifest is not None and view.manifest.compatible_with(under)
        keep = m.reusable(common_prefix_len(res.tokens, target)) if same else 0
        restored = 0
        if keep < len(target) and view.manifest is not None:
            have = keep
            if restore_best(m, view.manifest, target, keep, count_miss=False):
                keep = m.reusable(common_prefix_len(m.res.tokens, target))
                restored = max(0, keep - have)
        if keep < len(m.res.tokens) or keep < len(target):
            if len(m.res.tokens) - keep > MIN_GAIN_TOKENS:
                save_tape(m)  # the parked context comes back from the cache, whatever its length
            try:
                with m.errors("switching to a fork: prefill"), interrupt.prefilling(keep, len(target)):
                    kept = _set_kv(m, target, keep)
            except Cancelled:
                m.res.keep_partial(view.manifest or ContextManifest())
                raise
            except BaseException:
                m.clear_kv()
                raise
            keep = min(keep, kept)
        m.res.take_view(view)
        self._parked = None
        m.view_holder = self
        r, c, ms = self._switched  # (a count_tokens or a decode that switched hands its figures on)
        self._switched = (r + restored, c + len(target) - keep, ms + (time.perf_counter() - t0) * 1000)
        log.info("switched to a forked context of %d tokens: %d restored from the workspace cache, %d computed",
                 len(target), restored, len(target) - keep)

    def _count_switch(self, status: PrefixStatus | SuffixStatus) -> None:
        """Add what switching to this context took to this prefill's status (and so to ``/metrics``).

        A fork's context past the stable prefix is suffix: a suffix's status moves what the switch computed or
        restored there from reused to prefilled or cached. A prefix's status only adds the work (the switched
        tail is not part of the prefix it counts)."""
        restored, computed, ms = self._switched
        self._switched = (0, 0, 0.0)
        status.prefill_ms += ms
        status.prefilled_tokens += computed
        if isinstance(status, SuffixStatus):
            status.reused_tokens = max(0, status.reused_tokens - computed)
            status.cached_tokens = min(status.reused_tokens, status.cached_tokens + restored)

    def fork(self, at_position: int) -> TapeSession:
        """A session on this one's first ``at_position`` tokens (``Session.fork``); it takes the KV at its first
        operation (``_switch_in``), and this session takes it back at its next."""
        m = self._live(switch=False)
        base = self._parked if self._parked is not None else m.res
        return TapeSession(m, self._gen, parked=base.fork(at_position))

    def _check_manifest(self, m: TapeModel, manifest: ContextManifest) -> None:
        check_manifest_names(manifest, m.backend_name, m.digest)
        if manifest.bos_policy not in BOS_POLICIES:
            raise InvalidArgument(f"bos_policy {manifest.bos_policy!r} is not one of {BOS_POLICIES}")

    def tokenize(self, text: str, *, add_special: bool = False) -> list[int]:
        """``text`` in the model's tokens, special tokens parsed; BOS first under the model's own policy when asked."""
        m = self._live(switch=False)
        with m.errors("tokenize"):
            return m.tokenize(text, bos_policy="model" if add_special else None)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Token ids as the text they spell, special tokens as their text."""
        m = self._live(switch=False)
        ids = check_token_ids(tokens, m.vocab_size)
        with m.errors("detokenize"):
            return m.prompt_text(ids)

    def explain_context(self) -> ContextReport:
        m = self._m
        closed = self._closed or m.closed or m.session_gen != self._gen
        return (self._parked or m.res).report(closed)

    def close(self) -> None:
        self._closed = True
        self._parked = None

    # --- shared steps ------------------------------------------------------------------------
    def _suffix_target(self, m: TapeModel, suffix: SuffixInput) -> tuple[list[int], int]:
        """The token list the KV must hold after the suffix, and its stable-prefix length."""
        res = m.res
        if suffix.offset is not None:
            if suffix.tokens:
                raw = check_token_ids(suffix.tokens, m.vocab_size)
            elif suffix.images:
                marker = new_marker()
                raw = _encode(m, _segments(m, marked_text(suffix.text, suffix.images, marker), marker, suffix.images))
            else:
                raw = m.tokenize(suffix.text)
            return res.append_at(suffix.offset, suffix.truncating, raw)
        bos_policy = res.manifest.bos_policy if res.manifest is not None else ""
        stable = res.tokens[: res.prefix_len]
        return _target(m, stable, res.stable_text, res.tools, bos_policy, suffix)

    def _output_pipeline(self, m: TapeModel, cfg: DecodeConfig) -> OutputPipeline:
        """Stops, thinking split and tool parsing for one decode pass (call inside ``m.errors``)."""
        if not m.res.live:
            raise InvalidArgument("nothing is resident: call ensure_prefix first")
        split, fmt = resolve_protocols(
            cfg.parser_protocols,
            cfg.reasoning_format or m.config.reasoning_format,
            has_tools=bool(m.res.tools),
            model_format=m.tool_format,
        )
        return OutputPipeline(
            stops=cfg.stop,
            split_thinking=split,
            start_in_thinking=split and ends_inside_thinking(m.prompt_text(m.res.live[-_PROMPT_TAIL_TOKENS:])),
            tool_format=fmt,
            parameter_types=parameter_types(parse_tools(m.res.tools)) if fmt is not None else None,
        )

    # --- Session ---------------------------------------------------------------------------------
    def ensure_prefix(self, prefix: PrefixInput) -> PrefixStatus:
        m = self._live()
        self._check_manifest(m, prefix.manifest)
        t0 = time.perf_counter()
        with m.errors("ensure_prefix"):
            rendered = _prefix_text(m, prefix)
            t_render = time.perf_counter()
            tokens = m.tokenize(rendered, bos_policy=prefix.manifest.bos_policy)
            t_tokens = time.perf_counter()
            plan = m.res.plan_prefix(prefix.manifest, tokens)  # ContextOverflow before any change
        held, key = _held(m), cache_key(m, prefix.manifest)
        seen = m.seen.longest(key, tokens)
        cached = 0
        restored: list[int] | None = None
        if m.reusable(plan.keep) < len(tokens) and restore_best(
            m, prefix.manifest, tokens, m.reusable(plan.keep), count_miss=True
        ):
            # A workspace switched back: the cache held more of this prefix than the tape.
            restored = list(m.res.tokens)
            dropped = plan.dropped
            plan = m.res.plan_prefix(prefix.manifest, tokens)
            plan.dropped = dropped
            cached = m.reusable(plan.keep)
        full_hit = m.reusable(plan.keep) == len(tokens)
        if full_hit and len(m.res.tokens) > len(tokens):
            # The whole prefix is resident and more after it: keep that KV (the previous
            # turn and reply) so a suffix resending it reuses it; the context is the prefix.
            m.epoch += 1  # an open stream must not write after the prefix any more
            kept = len(tokens)
        else:
            if not cached:
                save_before_discard(m, m.reusable(plan.keep))
            # the tape becomes a stable prefix (nobody's conversation once it is committed); while it is computed, the
            # conversation that will follow it (a remote engine sends the prefill where that conversation goes)
            m.res.conversation = prefix.conversation
            m.res.computing = prefix.manifest
            try:
                # the daemon's heartbeats carry how far this prefill has come
                with m.errors("ensure_prefix: prefill"), interrupt.prefilling(m.reusable(plan.keep), len(tokens),
                                                                                stable=True):
                    kept = m.set_kv(tokens, m.reusable(plan.keep))
            except Cancelled:
                # The engines leave the tape equal to the chunks the KV completed: a cancelled prefill (a client
                # gone, an agent's retry) keeps them for the next request with the same head.
                m.res.keep_partial(prefix.manifest)
                m.seen.note(key, m.res.tokens)
                raise
            except BaseException:
                m.clear_kv()  # a prefill that failed is not trusted
                raise
        m.res.commit_prefix(prefix.manifest, tokens, prefix.text, prefix.tools, keep_tail=full_hit)
        if kept != plan.keep:
            plan = PrefixPlan(keep=kept, tail=tokens[kept:], dropped=plan.dropped + max(0, plan.keep - kept))
        if len(plan.tail) >= SAVE_MIN_TOKENS:
            save_tape(m, conversation="")  # the end of a freshly computed stable prefix (nobody's own): a save point
        m.seen.note(key, tokens)
        status = m.res.prefix_status(plan, (time.perf_counter() - t0) * 1000, min(cached, kept))
        status.render_ms, status.tokenize_ms = (t_render - t0) * 1000, (t_tokens - t_render) * 1000
        status.miss = prefix_miss(held, prefix.manifest, tokens, prefix.text, prefix.tools, reused=plan.keep,
                                  seen=seen, restored=restored, token_bytes=m.token_bytes,
                                  last_manifest=m.seen.last_manifest)
        m.seen.last_manifest = prefix.manifest
        self._count_switch(status)
        return status

    def prefill_suffix(self, suffix: SuffixInput) -> SuffixStatus:
        m = self._live()
        res = m.res
        t0 = time.perf_counter()
        if res.manifest is None:
            raise ManifestMismatch("no prefix is resident: call ensure_prefix first")
        check_conversation(suffix.messages)  # a suffix built without validation is checked here too
        tokenized = m.tokenize_s
        with m.errors("prefill_suffix"):
            target, prefix_len = self._suffix_target(m, suffix)
            res.check_suffix(suffix.manifest, len(target) - res.prefix_len)
        prepared_ms, tokenize_ms = (time.perf_counter() - t0) * 1000, (m.tokenize_s - tokenized) * 1000
        # the LCP runs over everything the KV holds: the previous turn and reply included
        keep = m.reusable(common_prefix_len(res.tokens, target))
        held, key = _held(m), cache_key(m, res.manifest)
        seen = m.seen.longest(key, target)
        cached = 0
        restored: list[int] | None = None
        scores = (_Scores(m, target, prefix_len, suffix.logprobs, suffix.logprobs_ranges)
                  if suffix.logprobs is not None else None)
        readouts = _Readouts(m, target, prefix_len, suffix.readout_ranges) if suffix.readouts else None
        if readouts is not None:
            keep = min(keep, readouts.first())  # the suffix's own readouts come from computing it now
        if scores is not None:
            keep = min(keep, scores.first_row())  # its scores come from the rows computed now
        if scores is None and readouts is None and keep < len(target) and m.cache is not None:
            # another conversation under the same stable prefix may be in the cache
            context = (res.manifest, res.prefix_len, res.stable_text, res.tools, res.stable_token_hash)
            covered = restore_best(m, res.manifest, target, keep, count_miss=False)
            res.manifest, res.prefix_len, res.stable_text, res.tools, res.stable_token_hash = context
            if covered:
                if suffix.offset is not None:  # an append counts against the tape, which the restore replaced
                    with m.errors("prefill_suffix"):
                        target, prefix_len = self._suffix_target(m, suffix)
                        res.check_suffix(suffix.manifest, len(target) - res.prefix_len)
                seen = m.seen.longest(key, target)
            keep = m.reusable(common_prefix_len(res.tokens, target))
            if covered:
                cached = keep
                restored = list(res.tokens)
        if not cached:
            save_before_discard(m, keep)
        res.conversation = suffix.conversation  # whose the prefill is (a remote engine routes by it)
        try:
            with m.errors("prefill_suffix: prefill"), interrupt.prefilling(keep, len(target)):
                kept = _set_kv(m, target, keep, scores.rows if scores is not None else None,
                               readouts.states if readouts is not None else None)
        except Cancelled:
            # The chunks the KV completed stay (the tape equals them), for the next request with the same head;
            # the context is the stable prefix again, which a decode sees (``Resident.live``).
            m.seen.note(key, res.tokens)
            res.messages = res.reply_from = None
            res.conversation = suffix.conversation  # what the KV completed past the prefix is this one's
            if len(res.tokens) >= prefix_len:
                res.prefix_len = prefix_len
                res.live_len = prefix_len
            else:
                m.clear_kv()
            raise
        except BaseException:
            # Back to the stable prefix when it survived (the tape equals what the KV
            # completed); a damaged prefix is dropped so the next turn re-ensures it.
            res.messages = res.reply_from = None
            res.conversation = ""
            if len(res.tokens) >= prefix_len:
                try:
                    _set_kv(m, res.tokens[:prefix_len], prefix_len)
                    res.prefix_len = prefix_len
                except Exception:
                    m.clear_kv()
            else:
                m.clear_kv()
            raise
        # On success the KV holds all of ``target``, so its stable part is intact even
        # when the engine could not keep a tail and everything was recomputed.
        res.prefix_len = prefix_len
        reused = max(0, kept - prefix_len)
        from_cache = max(0, min(cached, kept) - prefix_len)
        m.seen.note(key, target)
        if suffix.offset is None:
            new_messages = message_keys(suffix)
            res.messages = new_messages
        else:  # an append at an offset extends whatever the tape held: no conversation keys describe it
            new_messages = []
            res.messages = None
        res.reply_from = None
        res.conversation = suffix.conversation
        status = res.suffix_status(len(target) - prefix_len, reused, (time.perf_counter() - t0) * 1000, from_cache)
        status.image_tokens = sum(1 for t in target[prefix_len:] if is_image_token(t))
        status.context_token_hash = token_hash(target)
        status.render_ms, status.tokenize_ms = max(0.0, prepared_ms - tokenize_ms), tokenize_ms
        status.miss = suffix_miss(held, target, new_messages, prefix_len=prefix_len, reused=kept, seen=seen,
                                  restored=restored, token_bytes=m.token_bytes)
        if scores is not None:  # (what it prefilled again it was asked to: no miss)
            status.logprobs, status.miss = scores.out, None
        if readouts is not None:
            status.readouts, status.miss = readouts.out, None
        self._count_switch(status)
        return status

    def count_tokens(self, prefix: PrefixInput, suffix: SuffixInput) -> TokenCount:
        """What ensure_prefix(prefix) + prefill_suffix(suffix) would leave resident; the KV is untouched."""
        m = self._live()
        self._check_manifest(m, prefix.manifest)
        check_conversation(suffix.messages)
        res = m.res
        if suffix.offset is not None:  # an append counts against the tape as it is
            with m.errors("count_tokens"):
                appended, _ = self._suffix_target(m, suffix)
            return TokenCount(prompt_tokens=len(appended), prefix_tokens=res.prefix_len, num_ctx=m.num_ctx,
                              resident_tokens=m.reusable(common_prefix_len(res.tokens, appended)))
        with m.errors("count_tokens"):
            rendered = _prefix_text(m, prefix)
            stable = m.tokenize(rendered, bos_policy=prefix.manifest.bos_policy)
            compatible = res.manifest is not None and prefix.manifest.compatible_with(res.manifest)
            resident = res.tokens if compatible else []
            target, _ = _target(m, stable, prefix.text, prefix.tools, prefix.manifest.bos_policy, suffix)
        return TokenCount(
            prompt_tokens=len(target),
            prefix_tokens=len(stable),
            num_ctx=m.num_ctx,
            resident_tokens=m.reusable(common_prefix_len(resident, target)),
        )

    def decode(self, cfg: DecodeConfig) -> Generator[StreamChunk, None, None]:
        """Stream chunks; closing the generator cancels within one token (see ``_stream``)."""
        m = self._live()
        if cfg.readouts:
            check_readouts(m)
        with m.errors("decode"):
            pipeline = self._output_pipeline(m, cfg)
            steps = m.decode_steps(cfg)
            _settle_context(m)
        m.epoch += 1  # an older stream must not touch the KV any more
        return self._stream(m, cfg, steps, pipeline, m.epoch)

    @staticmethod
    def _read_out(m: TapeModel, tokens: list[int], start: int) -> list[list[list[float]]]:
        """The readouts of ``tokens`` from ``start`` on (a decode's, once it ended), which the KV then holds:
        computed again in one batch, as a prefill reads a suffix's, so the KV after it is what a prefill of the
        reply would leave."""
        readouts = _Readouts(m, tokens, start)
        with m.errors("decode: readouts"):
            _set_kv(m, tokens, start, None, readouts.states)
        return readouts.out

    def snapshot(self) -> SessionSnapshot:
        m = self._live()
        with m.errors("snapshot"):
            _settle_context(m)
            state, kind = m.export_state()
        return m.res.snapshot(m.backend_name, state, kind)

    def restore(self, snap: SessionSnapshot) -> None:
        """Every check that needs no engine runs first; the engine then refuses or replaces the KV."""
        m = self._live()
        m.res.validate_snapshot(snap, m.backend_name, m.digest)
        check_restorable(snap, m.backend_name, m.vocab_size)
        m.import_state(snap)
        m.res.adopt_snapshot(snap)

    def _stream(
        self, m: TapeModel, cfg: DecodeConfig, steps: DecodeSteps, pipeline: OutputPipeline, epoch: int
    ) -> Generator[StreamChunk, None, None]:
        """The decode loop both engines share; closing the generator cancels within one engine step.

        A sampled token is yielded first and evaluated when the stream resumes, so a
        chunk reaches the client one engine step earlier; on close ``settle``
        evaluates it, keeping the tape equal to the KV. The reply's last token is
        settled after the final chunk went out (its end is known before the step).
        Any operation that changes
        the KV bumps ``m.epoch``; a stream that sees another epoch stops touching it.

        With speculation (``backends.tape.speculate``) the pending token is evaluated
        together with a draft looked up in the tape; the rows are sampled in order
        and the draft is kept as far as the samples agree with it, the rest rolled
        back before any of the step's chunks is yielded. Closed in the middle of a
        step's chunks, the stream drops the kept draft tokens not handed out yet.
        """
        p = DecodePass(m, cfg, steps, pipeline)

        def still_ours() -> bool:
            return bool(m.epoch == epoch and not m.closed and not self._closed)

        try:
            if not still_ours():
                return  # the KV changed between decode() and the first chunk
            with m.errors("decode"):
                steps.start()
            epoch = m.epoch  # start() may have recomputed the last token
            while True:
                if not still_ours():
                    p.pending = None
                    return  # another operation took the KV; this stream is over
                # an engine step: progress, whether or not it hands out text (the output may hold a tool call or
                # a possible stop string back for many steps, and the daemon's wedge watch reads the beats); a
                # cancel ends the decode here, within one step, even while the output has handed out nothing for
                # many steps (its caller, which looks between chunks, would wait for the next chunk)
                if interrupt.stopped():
                    return
                interrupt.decoded(p.produced)  # (status: how far the reply came)
                if p.pending is not None and (p.finish or p.produced >= p.max_tokens):
                    # the reply is complete: its end goes out first and its last token is evaluated after it (the
                    # ``settle`` on the way out), so the client does not wait for a step whose output nobody reads
                    p.finish = p.finish or "length"
                    break
                if p.pending is not None:
                    tok, p.pending = p.pending, None
                    emitted = p.evaluate(tok)
                    if emitted is not None:  # with a draft: the tokens the rows gave, in output order
                        for j, (token, outs, in_kv) in enumerate(emitted):
                            for out in outs:
                                try:
                                    yield out
                                except GeneratorExit:
                                    # closed here: keep exactly what was handed out, as plain decoding does
                                    spill = sum(1 for e in emitted[j + 1 :] if e[2])
                                    if spill and still_ours():
                                        steps.rollback(spill)
                                    p.pending = None if in_kv else token
                                    raise
                        last_token, _, last_in_kv = emitted[-1] if emitted else (0, None, True)
                        p.pending = None if last_in_kv else last_token
                        continue
                handed = p.next_token()
                if handed is None:
                    break
                for out in handed:
                    yield out
            yield from p.tail()
            final = p.final()
            if cfg.readouts and still_ours():
                # the last sampled token (not evaluated yet) is computed with the rest
                last: list[int] = [] if p.pending is None else [p.pending]
                p.pending = None
                final.readouts = self._read_out(m, list(m.res.tokens) + last, p.prompt_tokens)
            yield final
        finally:
            if p.pending is not None and still_ours():
                steps.settle(p.pending)
            steps.close()
            if still_ours():
                m.turn_ended()
