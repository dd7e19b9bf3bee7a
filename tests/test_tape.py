"""Unit tests of the tape layer (backends/tape): TapeSession over a toy engine, and the snapshot framing.

The toy engine is a real ``TapeModelBase`` subclass whose "KV" is a list it
really keeps (one entry per evaluated token) and whose next token is a
function of the tape, so the session's bookkeeping — LCP reuse, rollback of a
failed prefill, suffix reconciliation, the decode loop's settle-on-close,
epochs and finish reasons, the restore preamble — is checked without an engine
library. The engines run the same layer on real models in tests/test_engines.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import pytest

from backends.resident import check_model_type
from backends.tape import draft_costs as costs_mod
from backends.tape.decoding import DecodeSteps
from backends.tape.loading import check_load, finish_load
from backends.tape.model import RowsFn, StatesFn, TapeModelBase, check_digest, resolve_num_ctx, wants_bos, with_bos
from backends.tape.session import TapeSession
from backends.tape.speculate import (
    MATCH_CLASSES,
    MAX_DRAFT,
    PROBE_EVERY,
    CheckCosts,
    DraftPolicy,
    PromptLookup,
    match_class,
)
from backends.tape.state import frame_state, header_diffs, pack_state, state_buffer, unpack_state
from contract import interrupt
from contract.errors import (
    BackendMismatch,
    Cancelled,
    ContextOverflow,
    Internal,
    InvalidArgument,
    ManifestMismatch,
    ModelLoadFailed,
    SessionClosed,
    SnapshotRejected,
    UnsupportedFeature,
)
from contract.types import (
    Config,
    DecodeConfig,
    OpenSessionRequest,
    PrefixInput,
    SessionSnapshot,
    StreamChunk,
    SuffixInput,
)

MAGIC = b"TOY-TAPE-STATE1\0"
END = 0  # the toy vocabulary's end-of-generation token


class ToyTemplate:
    """A ChatML-like template; ``stable=False`` renders the system turn differently once a turn follows."""

    digest = "sha256:toy"
    prompt_format = "chatml"
    supports_tools = True
    source = "{{ toy }}"

    def __init__(self, stable: bool = True) -> None:
        self.stable = stable

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None, *, generation: bool, **extra: Any) -> str:
        out = ""
        for i, msg in enumerate(messages):
            tag = msg["role"] if self.stable or len(messages) == 1 or i else "sys"
            out += f"<{tag}>{msg['content']}</>"
        if tools:
            out = f"[{len(tools)} tools]" + out
        return out + ("<assistant>" if generation else "")


class ToySteps:
    """Greedy "sampling": the next token is the last one + 1 (+2 after a decoded count in ``twists``), or END.

    ``verify`` computes every row's next token the same way, so a speculative pass
    must produce exactly what one-token steps produce.
    """

    def __init__(self, m: ToyModel, cfg: DecodeConfig) -> None:
        self._m = m
        self.closed = False
        self._ahead: list[tuple[int, int]] = []
        self._rng = np.random.default_rng(cfg.seed) if cfg.temperature else None

    def start(self) -> None:
        self._m.starts += 1

    def _next(self, last: int, decoded: int) -> int:
        m = self._m
        if m.stop_after is not None and decoded >= m.stop_after:
            return END
        # "sampling": a seeded draw per sampled token, as an engine's sampler draws
        jitter = int(self._rng.integers(0, 4) == 0) if self._rng is not None else 0
        return 32 + (last + 1 + (decoded in m.twists) + jitter) % 90

    def sample(self) -> int:
        return self._next(self._m.res.tokens[-1], self._m.decoded)

    def feed(self, token: int) -> None:
        self._m.evaluate([token])
        self._m.decoded += 1

    def verify(self, tokens: list[int]) -> None:
        m = self._m
        self._ahead = [(t, m.decoded + i + 1) for i, t in enumerate(tokens)]
        m.evaluate(tokens)
        m.decoded += len(tokens)
        m.verifies.append(list(tokens))

    def sample_row(self, i: int) -> int:
        return self._next(*self._ahead[i])  # drawn when sampled, as an engine's sampler draws

    def rollback(self, n: int) -> None:
        m = self._m
        if n > 0:
            del m.kv[-n:]
            del m.res.tokens[-n:]
            m.decoded -= n

    def is_end(self, token: int) -> bool:
        return token == END

    def piece(self, token: int) -> bytes:
        return bytes([token])

    def settle(self, token: int) -> None:
        self.feed(token)

    def close(self) -> None:
        self.closed = True


class ToyModel(TapeModelBase):
    backend_name = "toy"

    def __init__(self, num_ctx: int = 64, template: ToyTemplate | None = None,
                 digest: str = "sha256:toymodel") -> None:
        super().__init__(
            path="/toy",
            digest=digest,
            config=Config(),
            num_ctx=num_ctx,
            resident_bytes=1000,
            template=template if template is not None else ToyTemplate(),
            bos_id=1,
            adds_bos=False,
        )
        self.kv: list[int] = []  # what the toy engine has really evaluated
        self.fail_after: int | None = None  # evaluate raises after this many KV entries
        self.stop_after: int | None = None
        self.decoded = 0
        #: decoded counts after which the next token skips one (a draft then goes wrong)
        self.twists: set[int] = set()
        #: the batches speculative decoding verified
        self.verifies: list[list[int]] = []
        self.starts = 0
        self.released = False

    def evaluate(self, tokens: list[int]) -> None:
        for t in tokens:
            if self.fail_after is not None and len(self.kv) >= self.fail_after:
                raise RuntimeError("engine failed mid-prefill")
            self.kv.append(t)
            self.res.tokens.append(t)

    # --- TapeModelBase ------------------------------------------------------------------
    def engine_version(self) -> str:
        return "toy-1"

    def runtime_identity(self) -> dict[str, Any]:
        return {"num_ctx": self.num_ctx}

    @property
    def vocab_size(self) -> int:
        return 128

    def errors(self, action: str) -> AbstractContextManager[None]:
        @contextlib.contextmanager
        def mapped() -> Iterator[None]:
            try:
                yield
            except RuntimeError as exc:
                raise Internal(f"{action}: {exc}") from exc

        return mapped()

    def _release(self) -> None:
        self.released = True

    def _encode(self, text: str) -> list[int]:
        return [min(ord(c), 127) for c in text]

    def prompt_text(self, tokens: list[int]) -> str:
        return "".join(chr(t) for t in tokens)

    def token_bytes(self, tokens: list[int]) -> list[bytes]:
        return [bytes([t]) for t in tokens]

    def set_kv(self, tokens: list[int], keep: int, rows: RowsFn | None = None, states: StatesFn | None = None) -> int:
        if states is not None:
            raise UnsupportedFeature("the toy engine has no residual stream to read out")
        self.epoch += 1
        keep = min(keep, len(tokens), len(self.res.tokens))
        del self.kv[keep:]
        self.res.tokens = list(tokens[:keep])
        extends_exact = self.exact_len >= keep
        self.exact_len = min(self.exact_len, keep)
        self.evaluate(tokens[keep:])
        if rows is not None and keep < len(tokens):  # the toy's belief: the next token is the last one + 1
            logits = np.zeros((len(tokens) - keep, 128), np.float32)
            for i, t in enumerate(tokens[keep:]):
                logits[i, 32 + (t + 1) % 90] = 10.0
            rows(keep, logits)
        if extends_exact:  # a prefill computes what a cold prefill computes
            self.exact_len = len(self.res.tokens)
        return keep

    def clear_kv(self) -> None:
        self.epoch += 1
        self.exact_len = 0
        self.kv.clear()
        self.res.clear()

    def decode_steps(self, cfg: DecodeConfig) -> DecodeSteps:
        if cfg.structured_output.is_set():
            raise InvalidArgument("the toy engine takes no constraints")
        return ToySteps(self, cfg)

    def export_state(self) -> tuple[bytes, str]:
        return frame_state(MAGIC, {"n_tokens": len(self.kv)}, bytes(self.kv)), "kv"

    def import_state(self, snap: SessionSnapshot, *, backup: bool = True) -> None:
        header, body = unpack_state(MAGIC, snap.state, "a toy snapshot")
        if header_diffs(header, {"n_tokens": snap.resident_tokens}):
            raise SnapshotRejected("toy header disagrees")
        self.epoch += 1
        self.kv = list(body)
        self.res.tokens = list(body)


class EagerPolicy(DraftPolicy):
    """Drafts whatever the lookup finds (up to 6 tokens), so every mechanics test drafts at every chance."""

    def plan(self, available: int, n: int, context: int = 0) -> int:
        return min(available, 6)


@pytest.fixture(autouse=True)
def eager_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The session's speculation mechanics are tested here; the policy's choices in its own tests."""
    monkeypatch.setattr("backends.tape.decoding.DraftPolicy", EagerPolicy)


@pytest.fixture
def model() -> ToyModel:
    return ToyModel()


def tape_equals_kv(m: ToyModel) -> bool:
    return m.res.tokens == m.kv


def prefix(m: ToyModel, text: str, **manifest: str) -> PrefixInput:
    return PrefixInput(text=text, manifest=m.manifest_defaults().model_copy(update=manifest))


def suffix(m: ToyModel, text: str, **kw: Any) -> SuffixInput:
    return SuffixInput(text=text, manifest=m.manifest_defaults(), **kw)


# --- ensure_prefix ---------------------------------------------------------------------------------------
def test_prefix_reuse_is_the_token_lcp(model: ToyModel) -> None:
    s = model.open_session()
    first = s.ensure_prefix(prefix(model, "stable system text"))
    assert first.reused_tokens == 0 and first.prefilled_tokens == first.prefix_tokens == len("<system>stable system text</>")
    edited = s.ensure_prefix(prefix(model, "stable system edit"))
    assert edited.reused_tokens == len("<system>stable system ")
    assert edited.prefilled_tokens == len("edit</>") and tape_equals_kv(model)
    other = s.ensure_prefix(prefix(model, "stable system edit", profile="another agent"))
    assert other.reused_tokens == 0  # the manifest gate: another identity reuses nothing


def test_a_failed_prefill_leaves_nothing_half_computed(model: ToyModel) -> None:
    s = model.open_session()
    s.ensure_prefix(prefix(model, "abc"))
    model.fail_after = 12
    with pytest.raises(Internal, match="mid-prefill"):
        s.ensure_prefix(prefix(model, "a much longer system prompt"))
    assert model.res.tokens == [] and model.kv == [] and model.res.manifest is None
    model.fail_after = None
    assert s.ensure_prefix(prefix(model, "abc")).reused_tokens == 0


def test_a_failed_suffix_rolls_back_to_the_stable_prefix(model: ToyModel) -> None:
    s = model.open_session()
    st = s.ensure_prefix(prefix(model, "sys"))
    model.fail_after = st.prefix_tokens + 3
    with pytest.raises(Internal):
        s.prefill_suffix(suffix(model, "a user turn"))
    assert model.res.tokens == model.kv and len(model.kv) == st.prefix_tokens == model.res.prefix_len


def test_a_scored_suffix_scores_each_token_by_the_row_before_it(model: ToyModel) -> None:
    """``SuffixInput.logprobs``: the row after position p scores the token at p + 1 (the toy believes each token is
    the last one + 1): three believed tokens near certain, an unbelieved one not, with the believed one its top; a
    resident suffix scored again is computed again."""
    s = model.open_session()
    s.ensure_prefix(prefix(model, "sys"))
    believed = [model.res.tokens[-1]]
    for _ in range(3):
        believed.append(32 + (believed[-1] + 1) % 90)
    text = "".join(map(chr, believed[1:])) + "z"
    for _ in range(2):
        st = s.prefill_suffix(suffix(model, text, render=False, logprobs=1))
        assert st.prefilled_tokens == 4 and st.reused_tokens == 0 and tape_equals_kv(model)
        lps = [lp for lp in st.logprobs if lp is not None]
        assert len(lps) == 4 and [lp.token_id for lp in lps] == [*believed[1:], ord("z")]
        assert all(lp.logprob > -0.01 for lp in lps[:3]) and lps[3].logprob < -9
        assert lps[3].top[0].token_id == 32 + (believed[-1] + 1) % 90


def test_forks_take_turns_on_the_kv_and_a_switch_s_work_is_counted(model: ToyModel) -> None:
    """``TapeSession.fork``: the fork's context is the source's head, and the two take turns on the one KV. With no
    workspace cache a switch computes the tail it lacks; the next prefill's status counts it (prefilled, not
    reused), even when a ``count_tokens`` made the switch; the tape equals the KV after every switch."""
    s = model.open_session()
    s.ensure_prefix(prefix(model, "sys"))
    at = s.prefill_suffix(suffix(model, "shared part", render=False)).resident_tokens
    s.prefill_suffix(SuffixInput(text=" source tail", render=False, offset=at, manifest=model.manifest_defaults()))
    whole = s.explain_context().resident_tokens
    f = s.fork(at)
    assert (f.explain_context().resident_tokens, s.explain_context().resident_tokens) == (at, whole)
    st = f.prefill_suffix(SuffixInput(text="!", render=False, offset=at, manifest=model.manifest_defaults()))
    assert (st.prefilled_tokens, st.resident_tokens) == (1, at + 1) and tape_equals_kv(model)
    assert s.explain_context().resident_tokens == whole  # parked, untouched
    s.count_tokens(prefix(model, "sys"), SuffixInput(text="?", render=False, offset=whole,
                                                     manifest=model.manifest_defaults()))
    assert tape_equals_kv(model) and len(model.kv) == whole  # the count switched the KV back
    st = s.prefill_suffix(SuffixInput(text="?", render=False, offset=whole, manifest=model.manifest_defaults()))
    tail = whole - at
    assert (st.prefilled_tokens, st.resident_tokens) == (tail + 1, whole + 1)
    assert st.reused_tokens == st.suffix_tokens - tail - 1 and st.cached_tokens == 0
    with pytest.raises(InvalidArgument):
        s.fork(model.res.prefix_len - 1)  # inside the stable prefix
    f.close()
    with pytest.raises(SessionClosed):
        f.prefill_suffix(suffix(model, "x"))


def test_prefix_checks_before_any_change(model: ToyModel) -> None:
    s = model.open_session()
    s.ensure_prefix(prefix(model, "sys"))
    tape = list(model.res.tokens)
    for bad, error in [
        (prefix(model, "x" * 100), ContextOverflow),
        (prefix(model, "sys", bos_policy="maybe"), InvalidArgument),
        (prefix(model, "sys", backend="llama"), ManifestMismatch),
        (PrefixInput(text="sys", tools="[1", manifest=model.manifest_defaults()), InvalidArgument),
    ]:
        with pytest.raises(error):
            s.ensure_prefix(bad)
        assert model.res.tokens == tape and tape_equals_kv(model)


# --- prefill_suffix ---------------------------------------------------------------------------------------
def test_suffix_renders_through_the_template_after_the_prefix(model: ToyModel) -> None:
    s = model.open_session()
    s.ensure_prefix(prefix(model, "sys"))
    st = s.prefill_suffix(suffix(model, "hi"))
    assert model.prompt_text(model.res.tokens) == "<system>sys</><user>hi</><assistant>"
    assert st.suffix_tokens == len("<user>hi</><assistant>") and st.reused_tokens == 0
    again = s.prefill_suffix(suffix(model, "hi there"))
    assert again.reused_tokens == len("<user>hi")  # the token LCP of the suffix
    s.prefill_suffix(suffix(model, "<tool>raw</>", render=False))
    assert model.prompt_text(model.res.tokens).endswith("</><tool>raw</>") and tape_equals_kv(model)
    with pytest.raises(ManifestMismatch):
        model.open_session().prefill_suffix(SuffixInput(text="x", manifest=model.manifest_defaults().model_copy(update={"profile": "p"})))


def test_a_template_that_is_not_prefix_stable_is_reconciled_by_tokens() -> None:
    m = ToyModel(template=ToyTemplate(stable=False))
    s = m.open_session()
    st = s.ensure_prefix(prefix(m, "sys"))
    s.prefill_suffix(suffix(m, "hi"))
    # the system turn now renders as <sys>…: only the common part of the old prefix stays "stable"
    assert m.prompt_text(m.res.tokens) == "<sys>sys</><user>hi</><assistant>"
    assert m.res.prefix_len == len("<sys") < st.prefix_tokens and tape_equals_kv(m)


def test_suffix_overflow_changes_nothing(model: ToyModel) -> None:
    s = model.open_session()
    s.ensure_prefix(prefix(model, "sys"))
    s.prefill_suffix(suffix(model, "hi"))
    tape = list(model.res.tokens)
    with pytest.raises(ContextOverflow):
        s.prefill_suffix(suffix(model, "y" * 64))
    assert model.res.tokens == tape and tape_equals_kv(model)


def test_a_prefix_hit_keeps_the_previous_turn_for_the_next_suffix(model: ToyModel) -> None:
    s = model.open_session()
    s.ensure_prefix(prefix(model, "sys"))
    first = s.prefill_suffix(suffix(model, "hi"))
    turn = list(model.res.tokens)
    hit = s.ensure_prefix(prefix(model, "sys"))
    # the contract's view: the context is the prefix again, the turn was dropped ...
    assert hit.resident_tokens == hit.prefix_tokens and hit.dropped_tokens == first.suffix_tokens
    assert s.explain_context().resident_tokens == hit.prefix_tokens
    # ... but its KV was kept, so resending it costs nothing
    assert model.kv == turn
    again = s.prefill_suffix(suffix(model, "hi"))
    assert again.reused_tokens == again.suffix_tokens and again.prefilled_tokens == 0
    # a decode right after a hit runs on the prefix alone: the kept turn is dropped first
    s.ensure_prefix(prefix(model, "sys"))
    chunks = list(s.decode(DecodeConfig(max_tokens=3)))
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == hit.prefix_tokens
    assert tape_equals_kv(model) and model.res.live == model.res.tokens


def test_a_conversation_resent_with_one_more_message_reuses_the_history(model: ToyModel) -> None:
    from contract.types import ChatMessage

    big = ToyModel(num_ctx=400)
    s = big.open_session()
    s.ensure_prefix(prefix(big, "sys"))
    history = [ChatMessage(role="user", content="q1")]
    st = s.prefill_suffix(SuffixInput(messages=history, manifest=big.manifest_defaults()))
    assert st.reused_tokens == 0
    chunks = list(s.decode(DecodeConfig(max_tokens=4)))
    reply = "".join(c.text for c in chunks)
    history += [ChatMessage(role="assistant", content=reply), ChatMessage(role="user", content="q2")]
    s.ensure_prefix(prefix(big, "sys"))
    nxt = s.prefill_suffix(SuffixInput(messages=history, manifest=big.manifest_defaults()))
    # everything up to the end of the reply the model decoded is reused
    assert nxt.reused_tokens == st.suffix_tokens + len(reply)
    assert nxt.prefilled_tokens == len("</><user>q2</><assistant>")
    assert big.prompt_text(big.res.tokens).endswith(f"<assistant>{reply}</><user>q2</><assistant>")


@pytest.mark.parametrize("exact", [False, True])
def test_decoded_tokens_are_reused_unless_exact(exact: bool) -> None:
    m = ToyModel(num_ctx=400)
    m.config = Config(exact_reuse=exact)
    s = m.open_session()
    s.ensure_prefix(prefix(m, "sys"))
    turn = s.prefill_suffix(suffix(m, "hi"))
    list(s.decode(DecodeConfig(max_tokens=4)))
    assert m.exact_len == turn.resident_tokens  # the 4 decoded tokens came from one-token steps
    s.ensure_prefix(prefix(m, "sys"))
    tail = m.prompt_text(m.res.tokens[m.res.prefix_len :])
    again = s.prefill_suffix(SuffixInput(text=tail, render=False, manifest=m.manifest_defaults()))
    assert again.suffix_tokens == turn.suffix_tokens + 4
    assert (again.reused_tokens, again.prefilled_tokens) == ((turn.suffix_tokens, 4) if exact else (turn.suffix_tokens + 4, 0))
    assert tape_equals_kv(m)
    # the reuse rule is part of the runtime identity: KV of one is never reused under the other
    assert Config(exact_reuse=exact) == m.config
    other = ToyModel()
    other.config = Config(exact_reuse=not exact)
    assert other.manifest_defaults().runtime_digest != m.manifest_defaults().runtime_digest


# --- decode ----------------------------------------------------------------------------------------------------
def _decoded(s: TapeSession, **cfg: Any) -> tuple[str, str]:
    chunks = list(s.decode(DecodeConfig(**cfg)))
    return "".join(c.text for c in chunks), chunks[-1].finish_reason


def test_finish_reasons_and_usage(model: ToyModel) -> None:
    s = model.open_session()
    s.ensure_prefix(prefix(model, "sys"))
    s.prefill_suffix(suffix(model, "hi"))
    prompt = len(model.res.tokens)
    chunks = list(s.decode(DecodeConfig(max_tokens=5)))
    final = chunks[-1]
    assert final.finish_reason == "length" and final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (prompt, 5)
    assert len(model.res.tokens) == prompt + 5 and tape_equals_kv(model)  # the last token was settled
    model.stop_after = model.decoded + 2
    assert _decoded(s, max_tokens=10)[1] == "stop"  # END is not evaluated
    assert model.res.tokens[-1] != END and tape_equals_kv(model)
    model.stop_after = None
    text, reason = _decoded(s, max_tokens=200)
    assert reason == "context_full" and len(model.res.tokens) == model.num_ctx and tape_equals_kv(model)
    assert text


def test_stop_strings_cut_the_text(model: ToyModel) -> None:
    s = model.open_session()
    s.ensure_prefix(prefix(model, "sys"))
    s.prefill_suffix(suffix(model, "hi"))
    full, _ = _decoded(s, max_tokens=8)
    s.prefill_suffix(suffix(model, "hi"))
    cut, reason = _decoded(s, max_tokens=8, stop=[full[3:5]])
    assert reason == "stop" and cut == full[:3]


def test_closing_a_stream_settles_the_token_handed_out(model: ToyModel) -> None:
    s = model.open_session()
    s.ensure_prefix(prefix(model, "sys"))
    s.prefill_suffix(suffix(model, "hi"))
    prompt = list(model.res.tokens)
    stream = s.decode(DecodeConfig(max_tokens=50, return_token_ids=True))
    got = next(stream).token_ids + next(stream).token_ids
    stream.close()
    assert model.res.tokens == prompt + got and tape_equals_kv(model)


def test_a_newer_operation_ends_an_abandoned_stream(model: ToyModel) -> None:
    s = model.open_session()
    s.ensure_prefix(prefix(model, "sys"))
    s.prefill_suffix(suffix(model, "hi"))
    stream = s.decode(DecodeConfig(max_tokens=50))
    next(stream)
    st = s.ensure_prefix(prefix(model, "sys"))
    assert list(stream) == []  # the stream stopped: nothing was written after the context
    assert model.res.live == model.res.tokens[: st.prefix_tokens] and model.res.tokens == model.kv


def test_a_cancel_ends_a_decode_whose_output_is_held_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode that hands out nothing for many steps (a tool call or a possible stop string held back) still
    stops within one step of its cancel: the daemon's caller looks for the cancel between chunks, and would
    wait for a chunk that never comes while the decode writes up to its limit for nobody."""
    from backends.tape.output import Delta, OutputPipeline

    monkeypatch.setattr(OutputPipeline, "feed_bytes", lambda self, data: Delta())  # everything held back
    model = ToyModel(num_ctx=1024)
    s = model.open_session()
    s.ensure_prefix(prefix(model, "sys"))
    s.prefill_suffix(suffix(model, "hi"))
    prompt = len(model.res.tokens)
    cancel = threading.Event()
    evaluate = model.evaluate

    def evaluating(tokens: list[int]) -> None:  # a decode step; the cancel arrives while the decode runs
        evaluate(tokens)
        if model.decoded >= 5:
            cancel.set()

    model.evaluate = evaluating  # type: ignore[method-assign]
    with interrupt.interruptible(cancel):
        chunks = list(s.decode(DecodeConfig(max_tokens=400, speculative=False)))
    assert chunks == []  # no final chunk: the daemon's handler ends a cancelled stream with "cancelled"
    assert model.decoded <= 7, model.decoded  # it stopped within a step of the cancel (and settled the token it
    # had sampled), not at its 400-token limit
    assert len(model.res.tokens) - prompt <= 7 and tape_equals_kv(model)


# --- speculative decoding (prompt lookup) ---------------------------------------------------------------
def _shown(model: ToyModel, n: int) -> str:
    """What plain decoding writes after a turn: the text a later turn shows the model again."""
    s = model.open_session()
    s.ensure_prefix(prefix(model, "sys"))
    s.prefill_suffix(suffix(model, "hi"))
    return "".join(c.text for c in s.decode(DecodeConfig(max_tokens=n, speculative=False)))


def _run(model: ToyModel, text: str, **cfg: Any) -> tuple[list[int], StreamChunk]:
    s = model.open_session()
    s.ensure_prefix(prefix(model, "sys"))
    s.prefill_suffix(suffix(model, "hi"))  # the same turn opener: its continuation is in the prompt
    s.prefill_suffix(suffix(model, text + "hi"))
    chunks = list(s.decode(DecodeConfig(return_token_ids=True, **cfg)))
    return [t for c in chunks for t in c.token_ids], chunks[-1]


@pytest.mark.parametrize("twists", [set(), {5, 23, 24, 60}])
def test_speculation_gives_exactly_the_plain_output(twists: set[int]) -> None:
    model = ToyModel(num_ctx=1024)
    shown = _shown(model, 80)
    model.twists = twists
    model.decoded = 0
    plain, plain_final = _run(model, shown, max_tokens=70, speculative=False)
    plain_tape = list(model.res.tokens)
    assert not model.verifies
    model.decoded = 0
    spec, final = _run(model, shown, max_tokens=70, speculative=True)
    assert spec == plain and len(spec) == 70
    assert model.res.tokens == plain_tape and tape_equals_kv(model)
    assert final.finish_reason == plain_final.finish_reason == "length"
    assert final.usage is not None and final.usage.completion_tokens == 70
    # drafts were checked in batches, most of them kept; a twist costs one rejected draft
    assert model.verifies and final.usage.drafted_tokens >= final.usage.accepted_tokens > (25 if twists else 50)
    if twists:
        assert final.usage.accepted_tokens < final.usage.drafted_tokens


def test_the_model_shows_its_check_costs_and_counts_every_pass_s_drafts() -> None:
    model = ToyModel(num_ctx=1024)
    model.draft_costs = LLAMA_LIKE
    shown = _shown(model, 80)
    before = model.speculation()
    assert (before.enabled, before.measured, before.drafted_tokens, before.accepted_tokens) == (True, False, 0, 0)
    assert before.check_costs == {str(r): round(LLAMA_LIKE.cost(r), 2) for r in (2, 4, 8, 16)}
    assert before.check_growth_per_1k == 0.0
    model.twists = {5, 23}
    usages = []
    for spec in (True, False, True):
        _, final = _run(model, shown, max_tokens=70, speculative=spec)
        assert final.usage is not None
        usages.append(final.usage)
    after = model.speculation()
    # the totals are every pass's usage added up: a plain pass adds nothing, a rejected draft counts as drafted
    assert after.drafted_tokens == sum(u.drafted_tokens for u in usages) > after.accepted_tokens
    assert after.accepted_tokens == sum(u.accepted_tokens for u in usages) > 0
    assert usages[1].drafted_tokens == 0
    model.speculative = False
    assert not model.speculation().enabled


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_seeded_sampling_is_the_same_with_and_without_speculation(seed: int) -> None:
    """Each token is drawn from its own row in the same order: exact numerics give the same tokens."""
    model = ToyModel(num_ctx=1024)
    shown = _shown(model, 80)
    runs = []
    for spec in (False, True):
        model.decoded = 0
        ids, final = _run(model, shown, max_tokens=70, temperature=0.8, seed=seed, speculative=spec)
        runs.append((ids, list(model.res.tokens), final.usage))
        assert tape_equals_kv(model)
    (plain, plain_tape, _), (spec_ids, spec_tape, usage) = runs
    assert spec_ids == plain and spec_tape == plain_tape
    assert usage is not None and usage.drafted_tokens > usage.accepted_tokens > 0  # drafts kept and rejected


def test_speculation_stops_where_plain_decoding_stops() -> None:
    model = ToyModel(num_ctx=1024)
    shown = _shown(model, 80)
    for cfg in ({"max_tokens": 9}, {"max_tokens": 60}):
        model.decoded = 0
        plain, _ = _run(model, shown, speculative=False, **cfg)
        tape = list(model.res.tokens)
        model.decoded = 0
        spec, final = _run(model, shown, speculative=True, **cfg)
        assert spec == plain and model.res.tokens == tape and tape_equals_kv(model)
    # END inside a draft: it ends the output and is never evaluated
    model.decoded, model.stop_after = 0, 17
    spec, final = _run(model, shown, max_tokens=60, speculative=True)
    assert final.finish_reason == "stop" and len(spec) == 17
    assert model.res.tokens[-1] == spec[-1] and tape_equals_kv(model)
    # a stop string inside a draft cuts the text where plain decoding cuts it
    model.stop_after = None
    model.decoded = 0
    s = model.open_session()
    s.ensure_prefix(prefix(model, "sys"))
    s.prefill_suffix(suffix(model, shown + "hi"))
    text = "".join(c.text for c in s.decode(DecodeConfig(max_tokens=60, stop=[shown[12:15]], speculative=True)))
    assert text == shown[:12] and tape_equals_kv(model) and model.verifies


def test_speculation_never_overfills_the_context() -> None:
    model = ToyModel(num_ctx=160)
    shown = _shown(model, 60)
    model.decoded = 0
    spec, final = _run(model, shown, max_tokens=500, speculative=True)
    assert final.finish_reason == "context_full" and len(model.res.tokens) == model.num_ctx
    assert tape_equals_kv(model) and model.verifies


def test_closing_a_speculative_stream_leaves_the_tape_equal_to_the_kv() -> None:
    model = ToyModel(num_ctx=1024)
    shown = _shown(model, 80)
    s = model.open_session()
    s.ensure_prefix(prefix(model, "sys"))
    s.prefill_suffix(suffix(model, shown + "hi"))
    prompt = list(model.res.tokens)
    stream = s.decode(DecodeConfig(max_tokens=60, return_token_ids=True, speculative=True))
    got: list[int] = []
    while not model.verifies:
        got += next(stream).token_ids
    got += next(stream).token_ids  # a chunk of the verified step
    stream.close()
    # the tape holds what was handed out, as after plain decoding: kept draft tokens not handed out are dropped
    assert model.res.tokens == prompt + got and tape_equals_kv(model)


def test_the_daemon_default_and_the_decode_option() -> None:
    model = ToyModel(num_ctx=1024)
    shown = _shown(model, 80)
    model.speculative = False
    model.decoded = 0
    _, final = _run(model, shown, max_tokens=40)
    assert not model.verifies and final.usage is not None and final.usage.drafted_tokens == 0
    _, final = _run(model, shown, max_tokens=40, speculative=True)  # the request wins
    assert model.verifies and final.usage is not None and final.usage.accepted_tokens > 0


def test_prompt_lookup_drafts_from_the_latest_longest_match() -> None:
    look = PromptLookup([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 2, 3])
    assert look.propose(3) == ([4, 5, 6], 2)  # "1 2 3" is not the suffix; "2 3" last seen before "4 5 6"
    assert look.propose(0) == ([], 0) and PromptLookup([5]).propose(4) == ([], 0)
    look.extend([4])
    assert look.propose(6) == ([5, 6, 7, 2, 3, 4], 3)  # the longer match wins
    # a source closer to the end than the draft is long: the tape repeats itself, and so does the draft
    assert look.propose(10) == ([5, 6, 7, 2, 3, 4, 5, 6, 7, 2], 3)
    assert PromptLookup([9, 1, 2, 3, 1, 2, 3]).propose(7) == ([1, 2, 3, 1, 2, 3, 1], 3)
    assert PromptLookup([1, 2, 3, 4]).propose(4) == ([], 0)  # no earlier occurrence: no draft
    look = PromptLookup([7, 8, 7, 8, 7, 8])
    assert look.propose(2) == ([7, 8], 4)


def test_prompt_lookup_says_how_long_the_match_runs_back() -> None:
    # a 4-gram match is followed back: here 6 tokens agree before the draft's source and the tape's end
    look = PromptLookup([5, 1, 2, 3, 4, 5, 6, 7, 9, 0, 2, 3, 4, 5, 6, 7])
    assert look.propose(2) == ([9, 0], 6)
    # ... up to the last match class, however long the copy
    copy = list(range(100, 140))
    assert PromptLookup(copy + [1] + copy).propose(3) == ([1, 100, 101], MATCH_CLASSES[-1])
    assert [match_class(m) for m in (2, 3, 4, 5, 7, 8, 15, 16)] == [2, 3, 4, 5, 5, 8, 8, 16]


def _ov_padded(rows: int) -> int:
    """OpenVINO's check shapes (``backends.openvino.graph.verify_rows``, not imported: no engine here)."""
    return 4 if rows <= 4 else 8 if rows <= 8 else 16


#: measured on this AVX2 machine (``backends.tape.draft_costs``): a llama.cpp check of a Q4_1 model
#: costs ~0.5 of a step per row; an OpenVINO check is padded to 4, 8 or 16 rows and costs little more
LLAMA_LIKE = CheckCosts.from_points({1: 1.0, 2: 1.7, 4: 2.7, 8: 4.7, 16: 8.4}, lambda r: r)
OPENVINO_LIKE = CheckCosts.from_points({1: 1.0, 4: 1.4, 8: 1.8, 16: 2.3}, _ov_padded)


def _policy(costs: CheckCosts, keep: float, n: int = 3) -> DraftPolicy:
    """A policy over ``costs`` that has seen its drafts kept at ``keep``."""
    policy = DraftPolicy(costs)
    for i in range(40):  # one-token drafts, kept in the share ``keep``
        policy.checked(n, 1, int((i + 1) * keep) - int(i * keep))
    assert policy.keep_rate(n) == pytest.approx(keep, abs=0.15)
    return policy


def test_a_cost_table_interpolates_and_follows_the_padding() -> None:
    assert LLAMA_LIKE.cost(1) == 1.0 and LLAMA_LIKE.cost(3) == pytest.approx(2.2)
    assert LLAMA_LIKE.cost(12) == pytest.approx(6.55) and LLAMA_LIKE.cost(MAX_DRAFT + 1) == pytest.approx(8.4)
    # a padded engine: 2 to 4 rows cost what 4 do, 5 to 8 what 8 do; one row is the plain step
    assert OPENVINO_LIKE.cost(1) == 1.0
    assert OPENVINO_LIKE.cost(2) == OPENVINO_LIKE.cost(4) == pytest.approx(1.4)
    assert OPENVINO_LIKE.cost(5) == OPENVINO_LIKE.cost(8) == pytest.approx(1.8)
    assert CheckCosts(LLAMA_LIKE.table()) == LLAMA_LIKE != OPENVINO_LIKE
    # noisy timings: a check never costs less than a plain step, nor more rows less than fewer
    noisy = CheckCosts.from_points({1: 1.0, 2: 0.9, 4: 2.0, 8: 1.8, 16: 3.0}, lambda r: r)
    assert noisy.cost(2) == 1.0 and noisy.cost(8) == noisy.cost(6) == 2.0 and noisy.cost(12) == pytest.approx(2.5)
    for bad in ([1.0] * MAX_DRAFT, [1.0] * MAX_DRAFT + [0.0]):
        with pytest.raises(ValueError, match="positive entries"):
            CheckCosts(bad)
    for growth in ([0.0] * MAX_DRAFT, [0.0] * MAX_DRAFT + [-0.1], [0.0] * MAX_DRAFT + [float("nan")]):
        with pytest.raises(ValueError, match="growth"):
            CheckCosts(LLAMA_LIKE.table(), growth)
    for switch in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="switch"):
            CheckCosts(LLAMA_LIKE.table(), switch=switch)
    switching = CheckCosts(OPENVINO_LIKE.table(), switch=0.6)
    assert switching != OPENVINO_LIKE and switching.switch() == 0.6 and OPENVINO_LIKE.switch() == 0.0
    assert switching == CheckCosts(OPENVINO_LIKE.table(), None, 0.6) and hash(switching) != hash(OPENVINO_LIKE)
    assert "row count: 0.60" in repr(switching) and "row count" not in repr(OPENVINO_LIKE)
    # a switch measured below 0 is timing noise: none
    assert CheckCosts.from_points({1: 1.0, 16: 2.0}, lambda r: r, switch=-0.05).switch() == 0.0


def test_a_cost_table_grows_with_the_context_as_measured() -> None:
    # OpenVINO here: a 16-row check cost 1.6 steps after 64 tokens and 2.2 after 2,048
    longer = {1: 1.0, 4: 1.3, 8: 1.6, 16: 2.2}
    costs = CheckCosts.from_points({1: 1.0, 4: 1.1, 8: 1.2, 16: 1.6}, _ov_padded, longer, 2000)
    assert costs.cost(16) == pytest.approx(1.6) and costs.cost(16, 2000) == pytest.approx(2.2)
    assert costs.cost(16, 4000) == pytest.approx(2.8)  # past the longer measurement: extrapolated
    assert costs.cost(3, 1000) == pytest.approx(1.2) and costs.cost(1, 9000) == 1.0  # a step is the unit
    assert costs.growth()[MAX_DRAFT] == pytest.approx(0.3) and costs != OPENVINO_LIKE
    # a check measured cheaper at the longer context is not extrapolated to get cheaper still
    flat = CheckCosts.from_points({1: 1.0, 16: 7.4}, lambda r: r, {1: 1.0, 16: 7.0}, 2000)
    assert flat.cost(16, 8000) == flat.cost(16) == pytest.approx(7.4)
    assert CheckCosts(costs.table(), costs.growth()) == costs and hash(CheckCosts(costs.table(), costs.growth())) == hash(costs)
    assert "per 1,000 tokens" in repr(costs) and "per 1,000" not in repr(flat)


def test_the_draft_policy_drafts_only_what_pays() -> None:
    copying = _policy(LLAMA_LIKE, keep=1.0)
    assert copying.plan(16, 3) >= 8  # nearly every draft token kept: long drafts
    assert _policy(LLAMA_LIKE, keep=0.25).plan(16, 3) == 0  # prose: a check costs more than it keeps
    # cheap rows (a batch costs little more than a step) make even middling drafts pay
    assert _policy(OPENVINO_LIKE, keep=0.5).plan(16, 3) >= 1
    assert _policy(LLAMA_LIKE, keep=0.5).plan(16, 3) == 0
    assert copying.plan(0, 3) == 0  # nothing to draft
    # the same middling drafts after an agent's long prompt, where a check costs more: no longer
    growing = CheckCosts(OPENVINO_LIKE.table(), [0.0] + [0.3] * MAX_DRAFT)
    assert _policy(growing, keep=0.5).plan(16, 3) >= 1
    assert _policy(growing, keep=0.5).plan(16, 3, context=3000) == 0
    assert _policy(growing, keep=1.0).plan(16, 3, context=3000) >= 8  # a copy still pays


def test_the_policy_charges_a_run_of_checks_its_changes_of_row_count() -> None:
    """Into a check after plain steps and back out costs two changes of row count (OpenVINO here: ~0.6 of
    a step each); a check that follows a check changes nothing, so a copy's back-to-back checks do not pay
    them again."""
    switching = CheckCosts(OPENVINO_LIKE.table(), switch=0.6)
    for costs, lone in ((OPENVINO_LIKE, True), (switching, False)):
        policy = _policy(costs, keep=0.5)
        policy.plain_step()  # the last evaluation was a step: a check now starts a run
        assert (policy.plan(16, 3) >= 1) is lone, costs
        policy.checked(3, 1, 1)  # ... and in the middle of a run, the same drafts pay either way
        assert policy.plan(16, 3) >= 1, costs
    copying = _policy(switching, keep=1.0)
    copying.plain_step()
    assert copying.plan(16, 3) >= 8  # a copy pays for its way in and out


def test_an_unprofitable_policy_still_probes() -> None:
    policy = _policy(LLAMA_LIKE, keep=0.0)
    steps = 0
    while policy.plan(4, 2) == 0:
        policy.plain_step()
        steps += 1
    assert steps == PROBE_EVERY
    assert policy.plan(4, 2) == 1  # a one-token probe
    policy.checked(2, 1, 1)  # kept: the keep rate climbs back
    assert policy.keep_rate(2) > 0.0


def test_the_priors_trust_a_long_match_and_doubt_a_short_one() -> None:
    # OpenVINO costs as once timed mid-answer on this machine: a check of 2, 4 and 5 rows cost 1.7,
    # 2.3 and 3.0 plain steps (padded to 4, 4 and 8 rows)
    timed = CheckCosts.from_points({1: 1.0, 4: 2.3, 8: 3.0, 16: 4.0}, _ov_padded)
    for costs in (timed, OPENVINO_LIKE, LLAMA_LIKE, CheckCosts.prior()):
        policy = DraftPolicy(costs)
        assert policy.plan(8, 8) >= 2, costs  # 8 tokens matched: a copy until shown otherwise
        assert policy.plan(16, 16) >= policy.plan(16, 8), costs  # the longer the match, the longer the draft
    # a bare 4-token match drafts where rows are cheap, not where a row costs half a step
    assert DraftPolicy(OPENVINO_LIKE).plan(8, 4) >= 2 and DraftPolicy(LLAMA_LIKE).plan(8, 4) == 0
    policy = DraftPolicy(timed)
    assert policy.plan(8, 2) == 0  # "of the": prose matches 2 tokens by chance, so only evidence makes it pay
    for _ in range(3):
        policy.checked(2, 3, 3)
    assert policy.plan(8, 2) >= 1  # 2-gram drafts kept whole three times: now they pay


def test_a_short_match_missing_leaves_the_long_matches_trusted() -> None:
    """Each class of match length keeps its own rate: an answer whose first 4-gram drafts miss still
    drafts the long copies after them (one rate for every 4-gram match once stopped them for good)."""
    policy = DraftPolicy(LLAMA_LIKE)
    before = policy.plan(16, 16)
    for _ in range(3):
        policy.checked(4, 6, 0)
        policy.checked(5, 6, 1)
    assert policy.keep_rate(4) < 0.4 and policy.plan(16, 5) == 0
    assert policy.plan(16, 16) == before >= 4 and policy.keep_rate(40) == policy.keep_rate(16)
    for _ in range(3):
        policy.checked(16, 15, 0)  # ... until the long ones miss too
    assert policy.plan(16, 16) < before


def test_drafts_follow_the_tape_never_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tape gives the same drafts, the same batches and the same answer, however long steps took."""
    monkeypatch.setattr("backends.tape.decoding.DraftPolicy", DraftPolicy)  # the real policy, not the eager one
    runs = []
    for clock in (None, iter(np.cumsum(np.random.default_rng(7).exponential(0.05, 100_000)).tolist())):
        if clock is not None:
            monkeypatch.setattr("time.perf_counter", lambda c=clock: next(c))  # steps now take 0-0.5 s at random
        model = ToyModel(num_ctx=1024)
        shown = _shown(model, 80)
        model.decoded = 0
        ids, final = _run(model, shown, max_tokens=70, speculative=True)
        assert final.usage is not None
        runs.append((ids, model.verifies, final.usage.drafted_tokens, final.usage.accepted_tokens))
    assert runs[0] == runs[1]
    assert runs[0][1] and runs[0][3] > 30  # it did draft


def _fixed_measure(calls: list[str]) -> Any:
    def measure(m: Any, context: int = costs_mod.CONTEXT_TOKENS) -> tuple[dict[int, float], float]:
        if context == costs_mod.CONTEXT_TOKENS:
            calls.append(m.digest)
            return {1: 1.0, 2: 1.5, 4: 2.0, 8: 3.0, 16: 5.0}, 0.4
        calls.append(f"{m.digest} after {context}")
        return {1: 1.0, 2: 2.0, 4: 2.5, 8: 3.5, 16: 5.5}, 0.9

    return measure


def _load_costs(m: Any, cache_dir: Any) -> CheckCosts:
    """What a load drafts by once the idle slot has timed the checks: the kept table, else a new one."""
    return costs_mod.kept_costs(m, cache_dir) or costs_mod.measure_costs(m, cache_dir) or CheckCosts.prior()


def test_draft_costs_are_measured_once_per_model_and_kept_on_disk(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(costs_mod, "measure", _fixed_measure(calls))
    first = _load_costs(ToyModel(num_ctx=4096), tmp_path)
    # timed after a short context and after LONG_CONTEXT_TOKENS: how a check's cost grows with the context
    long = costs_mod.LONG_CONTEXT_TOKENS
    assert calls == ["sha256:toymodel", f"sha256:toymodel after {long}"]
    assert first.cost(2) == 1.5 and first.cost(3) == 1.75 and first.switch() == 0.4  # the short context's
    span = long - costs_mod.CONTEXT_TOKENS
    assert first.cost(2, span) == pytest.approx(2.0, abs=0.01) and first.cost(16, span) == pytest.approx(5.5, abs=0.01)
    # a restart (a new model object of the same identity) reads the table: the same drafts as before
    assert _load_costs(ToyModel(num_ctx=2048), tmp_path) == first and len(calls) == 2
    other = ToyModel(num_ctx=1024, digest="sha256:other")
    _load_costs(other, tmp_path)
    # another model is measured; a window smaller than LONG_CONTEXT_TOKENS is measured as full as it goes
    assert calls[2:] == ["sha256:other", f"sha256:other after {1024 - MAX_DRAFT - 2}"]
    assert len(json.loads((tmp_path / costs_mod.FILE_NAME).read_text())) == 2
    # a damaged file, a malformed entry or no directory at all only mean measuring again
    del calls[:]
    (tmp_path / costs_mod.FILE_NAME).write_text("{not json")
    assert _load_costs(ToyModel(num_ctx=4096), tmp_path) == first and len(calls) == 2
    key = costs_mod.cost_key(ToyModel(num_ctx=4096))
    for malformed in ([1.0, -2.0], {"costs": first.table()}, {"costs": first.table(), "growth": [-1.0] * 16},
                      {"costs": first.table(), "growth": first.growth()},  # measured before the switch was
                      {"costs": first.table(), "growth": first.growth(), "switch": "fast"}):
        (tmp_path / costs_mod.FILE_NAME).write_text(json.dumps({key: malformed}))
        del calls[:]
        assert _load_costs(ToyModel(num_ctx=4096), tmp_path) == first and len(calls) == 2
    del calls[:]
    assert _load_costs(ToyModel(num_ctx=4096), None) == first and len(calls) == 2
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert _load_costs(ToyModel(num_ctx=4096), blocked / "sub") == first and len(calls) == 4
    # a window too small for a longer measurement: the short one alone, no growth
    del calls[:]
    small = _load_costs(ToyModel(num_ctx=costs_mod.MIN_LONG_CONTEXT_TOKENS), None)
    assert calls == ["sha256:toymodel"] and small.growth() == [0.0] * (MAX_DRAFT + 1)
    # a context too small for a full draft's check keeps the prior table and measures nothing
    assert _load_costs(ToyModel(num_ctx=16), tmp_path) == CheckCosts.prior() and len(calls) == 1


class LlamaNamedToy(ToyModel):
    """Names its window as llama.cpp's runtime identity does."""

    def runtime_identity(self) -> dict[str, Any]:
        return {"n_ctx": self.num_ctx}


def test_a_cost_table_serves_every_window_and_a_growthless_one_is_replaced(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(costs_mod, "measure", _fixed_measure(calls))
    # the window is not part of the key, whichever name the engine gives it
    for cls in (ToyModel, LlamaNamedToy):
        assert costs_mod.cost_key(cls(num_ctx=1024)) == costs_mod.cost_key(cls(num_ctx=32768))
    # a window too small to time the longer context keeps a table with no growth ...
    small = _load_costs(ToyModel(num_ctx=costs_mod.MIN_LONG_CONTEXT_TOKENS), tmp_path)
    assert calls == ["sha256:toymodel"] and small.growth() == [0.0] * (MAX_DRAFT + 1)
    # ... which another small window reads, while a window with room measures the growth and replaces it
    assert _load_costs(ToyModel(num_ctx=costs_mod.MIN_LONG_CONTEXT_TOKENS), tmp_path) == small
    assert len(calls) == 1
    full = _load_costs(ToyModel(num_ctx=8192), tmp_path)
    assert calls[1:] == ["sha256:toymodel", f"sha256:toymodel after {costs_mod.LONG_CONTEXT_TOKENS}"]
    assert full.growth() != small.growth()
    # from then on every window, small or large, drafts by the full table and measures nothing
    for n in (costs_mod.MIN_LONG_CONTEXT_TOKENS, 2048, 32768):
        assert _load_costs(LlamaNamedToy(num_ctx=n), tmp_path) == full
    assert _load_costs(ToyModel(num_ctx=costs_mod.MIN_LONG_CONTEXT_TOKENS), tmp_path) == full
    assert len(calls) == 3


def test_measuring_draft_costs_leaves_nothing_resident(monkeypatch: pytest.MonkeyPatch) -> None:
    model = ToyModel(num_ctx=1024)
    prefilled: list[int] = []
    set_kv = model.set_kv
    monkeypatch.setattr(model, "set_kv", lambda tokens, keep: prefilled.append(len(tokens)) or set_kv(tokens, keep))
    points, _ = costs_mod.measure(model, reps=1)
    assert sorted(points) == [1, 2, 4, 8, MAX_DRAFT + 1] and points[1] == 1.0
    assert all(p > 0 for p in points.values())
    assert model.res.tokens == [] and model.kv == [] and model.exact_len == 0
    # every check was the pending token repeated, rolled back after
    assert {len(v) for v in model.verifies} == {2, 4, 8, MAX_DRAFT + 1}
    # after a longer context, as long as the window leaves room for a full draft's check
    costs_mod.measure(model, reps=1, context=700)
    costs_mod.measure(model, reps=1, context=5000)
    assert prefilled == [costs_mod.CONTEXT_TOKENS, 700, 1024 - MAX_DRAFT - 2]
    assert model.res.tokens == [] and model.kv == []


def test_measuring_draft_costs_times_a_change_of_row_count_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an engine whose evaluation costs 1 + 0.1 a row, and 2 more when the row count differs from the last
    one's (as OpenVINO prepares its graph again), a check costs its rows and the change is timed apart."""
    model = ToyModel(num_ctx=1024)
    clock = {"now": 0.0, "rows": 0}
    evaluate = model.evaluate

    def timed(tokens: list[int]) -> None:
        rows = len(tokens)
        clock["now"] += 1.0 + 0.1 * (rows - 1) + (2.0 if rows != clock["rows"] else 0.0)
        clock["rows"] = rows
        evaluate(tokens)

    monkeypatch.setattr(model, "evaluate", timed)
    monkeypatch.setattr(costs_mod.time, "perf_counter", lambda: clock["now"])
    points, switch = costs_mod.measure(model, reps=2)
    assert points == pytest.approx({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7, MAX_DRAFT + 1: 2.5})
    assert switch == pytest.approx(2.0)


def test_decode_refusals_run_before_anything(model: ToyModel) -> None:
    s = model.open_session()
    with pytest.raises(InvalidArgument, match="nothing is resident"):
        s.decode(DecodeConfig())
    s.ensure_prefix(prefix(model, "sys"))
    epoch = model.epoch
    from contract.types import StructuredOutputConfig

    with pytest.raises(InvalidArgument, match="constraints"):
        s.decode(DecodeConfig(structured_output=StructuredOutputConfig(regex="x")))
    assert model.epoch == epoch and model.starts == 0


# --- sessions, snapshots, lifecycle ----------------------------------------------------------------------------
def test_a_new_session_retires_the_old_handle(model: ToyModel) -> None:
    first = model.open_session()
    first.ensure_prefix(prefix(model, "sys"))
    second = model.open_session()
    with pytest.raises(SessionClosed, match="newer session"):
        first.ensure_prefix(prefix(model, "sys"))
    assert first.explain_context().closed and not second.explain_context().closed
    assert second.ensure_prefix(prefix(model, "sys")).prefilled_tokens == 0  # the KV stayed warm
    model.close()
    assert model.released and model.resident_bytes() == 0 and model.res.tokens == []
    with pytest.raises(SessionClosed):
        model.open_session()
    model.close()  # idempotent


def test_snapshot_restore_and_its_checks(model: ToyModel) -> None:
    s = model.open_session()
    s.ensure_prefix(prefix(model, "sys"))
    s.prefill_suffix(suffix(model, "hi"))
    snap = s.snapshot()
    assert snap.backend == "toy" and snap.resident_token_ids == model.kv
    s.ensure_prefix(prefix(model, "other", profile="p"))
    tape = list(model.res.tokens)
    for bad in [
        snap.model_copy(update={"resident_token_ids": snap.resident_token_ids[:-1] + [500]}),  # outside the vocabulary
        snap.model_copy(update={"manifest": snap.manifest.model_copy(update={"backend": "llama"})}),
        snap.model_copy(update={"backend": "llama"}),
    ]:
        with pytest.raises(SnapshotRejected):
            s.restore(bad)
        assert model.res.tokens == tape
    s.restore(snap)
    assert model.res.tokens == model.kv == snap.resident_token_ids
    assert s.explain_context().prefix_tokens == snap.prefix_tokens


def test_manifest_defaults_name_the_engine(model: ToyModel) -> None:
    m = model.manifest_defaults()
    assert (m.backend, m.backend_version, m.model_digest, m.template_digest) == ("toy", "toy-1", "sha256:toymodel", "sha256:toy")
    assert m.bos_policy == "none" and m.runtime_digest.startswith("sha256:")
    declared = ToyModel()
    declared.config = Config(prompt_template_digest="sha256:else")
    with pytest.raises(ModelLoadFailed, match="declares template"):
        declared.check_declared_template()


def test_the_load_wiring_every_engine_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    """``check_load`` refuses a request before a load; ``finish_load`` reads the kept draft costs of a
    speculating backend (timing none), hands the model its cache and default, and closes a model it refuses."""
    with pytest.raises(BackendMismatch):
        check_load(OpenSessionRequest(type="other"), "toy")
    with pytest.raises(InvalidArgument):
        check_load(OpenSessionRequest(type="toy", config=Config(chat_template="no-such-template")), "toy")
    assert check_load(OpenSessionRequest(type="toy"), "toy") is None
    kept = CheckCosts([1.0 + 0.25 * r for r in range(MAX_DRAFT + 1)])
    monkeypatch.setattr("backends.tape.loading.kept_costs", lambda m, cache_dir: kept)
    monkeypatch.delenv(costs_mod.FIXED_ENV)  # the kept table is the subject: not the suite's fixed one
    cache = object()
    plain, speculating = ToyModel(), ToyModel()
    finish_load(plain, None, False)
    assert (plain.speculative, plain.draft_costs_measured, plain.cache) == (False, False, None)
    finish_load(speculating, cache, True)  # type: ignore[arg-type]
    assert (speculating.speculative, speculating.draft_costs_measured, speculating.cache) == (True, True, cache)
    assert speculating.draft_costs is kept and not speculating.costs_pending
    declared = ToyModel()
    declared.config = Config(prompt_template_digest="sha256:else")
    with pytest.raises(ModelLoadFailed, match="declares template"):
        finish_load(declared, None, True)
    assert declared.closed and declared.cache is None


def test_draft_costs_are_timed_when_the_slot_is_idle_and_an_arrival_stops_the_timing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A load with no kept table times nothing: it drafts by the prior, pending. ``idle_work`` times the checks
    while nothing is resident; a request's arrival (the interrupt scope's event) stops it with the KV cleared
    and nothing kept, and a later idle moment times them and keeps the table for the next load."""
    monkeypatch.setenv("MODELD_MODEL_CACHE", str(tmp_path))
    monkeypatch.delenv(costs_mod.FIXED_ENV, raising=False)
    m = ToyModel(num_ctx=4096)
    finish_load(m, None, True)
    assert (m.draft_costs, m.draft_costs_measured, m.costs_pending) == (CheckCosts.prior(), False, True)
    assert m.speculation().pending and not (tmp_path / costs_mod.FILE_NAME).exists()
    # a resident tape is never evicted for it
    m.set_kv([5, 6, 7], 0)
    assert not m.idle_pending()
    m.idle_work()
    assert m.kv == [5, 6, 7] and m.costs_pending
    m.clear_kv()
    assert m.idle_pending()
    # a request arrived: the real timing stops at its next unit of work
    arrived = threading.Event()
    arrived.set()
    with pytest.raises(Cancelled), interrupt.interruptible(arrived):
        m.idle_work()
    assert m.kv == [] and m.res.tokens == [] and m.costs_pending and not m.draft_costs_measured
    assert not (tmp_path / costs_mod.FILE_NAME).exists()
    # idle again: timed to the end, kept
    calls: list[str] = []
    monkeypatch.setattr(costs_mod, "measure", _fixed_measure(calls))
    m.idle_work()
    assert len(calls) == 2 and m.draft_costs_measured and not m.costs_pending and not m.idle_pending()
    assert m.kv == [] and m.draft_costs.cost(2) == 1.5
    # the next load reads it and has nothing to do when idle
    again = ToyModel(num_ctx=4096)
    finish_load(again, None, True)
    assert again.draft_costs == m.draft_costs and again.draft_costs_measured and not again.idle_pending()
    assert len(calls) == 2
    # a timing that stays implausible (the cores were taken) keeps the prior, measured no, and is not retried
    monkeypatch.setenv("MODELD_MODEL_CACHE", str(tmp_path / "other"))
    disturbed = ToyModel(num_ctx=4096)
    finish_load(disturbed, None, True)
    monkeypatch.setattr(costs_mod, "measure", lambda m, context=0: ({1: 1.0, 2: 9.0, 4: 9.0, 8: 9.0, 16: 20.0}, 0.0))
    disturbed.idle_work()
    assert disturbed.draft_costs == CheckCosts.prior() and not disturbed.draft_costs_measured
    assert not disturbed.idle_pending()


# --- the rules ---------------------------------------------------------------------------------------------------
def test_rules() -> None:
    assert resolve_num_ctx(0, 8192, 4096) == 4096 and resolve_num_ctx(0, 2048, 4096) == 2048
    assert resolve_num_ctx(0, 0, 4096) == 4096 and resolve_num_ctx(100, 8192, 4096) == 100
    with pytest.raises(InvalidArgument, match="training context"):
        resolve_num_ctx(9000, 8192, 4096)
    assert wants_bos("", disabled=False, model_default=True) and not wants_bos("none", disabled=False, model_default=True)
    assert wants_bos("add", disabled=False, model_default=False) and not wants_bos("add", disabled=True, model_default=True)
    assert with_bos([5, 6], 1, True) == [1, 5, 6] and with_bos([1, 5], 1, True) == [1, 5] and with_bos([5], 1, False) == [5]
    with pytest.raises(BackendMismatch):
        check_model_type("openvino", "llama")
    check_model_type("", "llama")
    with pytest.raises(ModelLoadFailed, match="digest"):
        check_digest("/m", "sha256:a", "sha256:b")
    check_digest("/m", "", "sha256:b")


def test_state_framing() -> None:
    blob = frame_state(MAGIC, {"a": 1, "b": [2]}, b"body")
    header, body = unpack_state(MAGIC, blob, "a toy snapshot")
    assert header == {"a": 1, "b": [2]} and bytes(body) == b"body"
    out, start = pack_state(MAGIC, {"x": 0}, 3)
    assert len(out) == start + 3 and bytes(out[:16]) == MAGIC
    head = json.dumps({"a": 1}).encode()
    for bad, why in [
        (b"WRONG-MAGIC-XXXX" + blob[16:], "not a toy snapshot"),
        (blob[:18], "not a toy snapshot"),
        (MAGIC + len(head).to_bytes(4, "little") + head[:-2], "truncated"),
        (MAGIC + (3).to_bytes(4, "little") + b"{x}", "not valid JSON"),
        (MAGIC + (2).to_bytes(4, "little") + b"[]", "not a JSON object"),
    ]:
        with pytest.raises(SnapshotRejected, match=why):
            unpack_state(MAGIC, bad, "a toy snapshot")
    assert header_diffs({"n": 1, "k": "x"}, {"n": 2, "k": "x"}) == ["n: snapshot 1 != session 2"]
    with pytest.raises(ValueError, match="16 bytes"):
        pack_state(b"short", {})


def test_a_state_buffer_is_bytes_the_engine_fills_in_place() -> None:
    """What the engines export into: one ``bytes`` object, the framing written, the body filled through its
    address; a large one too (huge pages asked for), and every one its own object."""
    for size in (5, 8 * 2**20):
        out, start, address = state_buffer(MAGIC, {"n": size}, size)
        assert type(out) is bytes and len(out) == start + size
        body = b"x" * size
        ctypes.memmove(address + start, body, size)
        header, got = unpack_state(MAGIC, out, "a toy snapshot")
        assert header == {"n": size} and bytes(got) == body
    one, _, _ = state_buffer(MAGIC, {}, 3)
    two, _, _ = state_buffer(MAGIC, {}, 3)
    assert one is not two
    with pytest.raises(ValueError, match="16 bytes"):
        state_buffer(b"short", {}, 1)


def test_a_cost_table_measured_on_a_busy_machine_is_not_kept() -> None:
    from backends.tape.draft_costs import plausible
    from backends.tape.speculate import CheckCosts

    quiet = CheckCosts.from_points({1: 1.0, 2: 1.8, 4: 2.7, 8: 4.4, 16: 7.8}, lambda r: r)
    busy = CheckCosts.from_points({1: 1.0, 2: 9.1, 4: 9.7, 8: 19.1, 16: 36.2}, lambda r: r)  # seen under load
    assert plausible(quiet) and plausible(CheckCosts.prior()) and not plausible(busy)


def test_sampling_defaults_fill_what_a_request_leaves_unset() -> None:
    """The documented defaults (a repeat penalty over the last 64 tokens among them) fill a sampled
    request's unset fields; a greedy one stays greedy with no penalty; a GGUF's recommendation wins."""
    from backends.gguf_file import recommended_sampling
    from contract.types import DEFAULT_SAMPLING

    filled = DEFAULT_SAMPLING.fill(DecodeConfig(top_k=5))
    assert (filled.temperature, filled.top_k, filled.repeat_penalty, filled.repeat_last_n) == (0.8, 5, 1.1, 64)
    assert filled.penalties() == (64, 1.1, 0.0, 0.0)
    greedy = DEFAULT_SAMPLING.fill(DecodeConfig(temperature=0.0))
    assert greedy.repeat_penalty is None and greedy.penalties() is None
    assert DecodeConfig(temperature=0.0, presence_penalty=0.5).penalties() == (64, 1.0, 0.0, 0.5)
    assert DecodeConfig(repeat_penalty=1.3, repeat_last_n=0).penalties() is None
    found = recommended_sampling({"general.sampling.temp": 0.2, "general.sampling.penalty_repeat": 1.05,
                                  "general.sampling.penalty_last_n": 128, "general.sampling.top_k": True})
    assert found == {"temperature": 0.2, "repeat_penalty": 1.05, "repeat_last_n": 128}
    assert isinstance(found["repeat_last_n"], int)
