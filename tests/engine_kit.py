"""The engine conformance kit: what every engine behind the daemon's Backend seam is run against.

An ``Engine`` names one implementation (the llama.cpp engine, the OpenVINO
engine, the contract's memory reference) with the few facts the scenarios in
``tests/test_engines.py`` need and cannot learn through the seam: how its
stable prefix tokenizes (to predict a token-LCP reuse), how to read its token
tape, and which documented differences the reference has (it reuses all or
nothing, renders no template, and lets several session handles live at once).
Everything else a scenario observes goes through ``Backend``, ``LoadedModel``
and ``Session`` exactly as the daemon drives them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from contract.interfaces import Backend, LoadedModel, Session
from contract.manifest import ContextManifest
from contract.types import Config, DecodeConfig, OpenSessionRequest, PrefixInput, StreamChunk, SuffixInput
from harness.prompts import EDIT_CONTINUATION

NUM_CTX = 2048
#: a fixed draft cost table (``MODELD_DRAFT_COSTS``) for tests that assert drafting: checks a little dearer than a
#: step per row, as a quiet machine measures them; a table timed at load would make the drafts hang on how busy
#: the machine was then (on a loaded one the policy may draft nothing)
CHEAP_CHECKS = json.dumps([round(1.0 + 0.15 * r, 2) for r in range(16)])
#: the suite's table for every other model and daemon (``tests/conftest.py``): a check of r rows dearer than r
#: steps, so a draft never pays and no greedy answer depends on drafts (on an engine whose rows are not exact, a
#: draft can move a near-tie: which one, on a measured table, would hang on the CPU and how busy it was)
DEAR_CHECKS = json.dumps([1.0] + [r + 0.5 for r in range(2, 17)])
PARAGRAPH = (
    "The repository contains a daemon that keeps one language model resident and serves a persistent "
    "session over a local socket. Agents send a stable prefix with the system prompt, the tool list and "
    "a map of the repository, followed by a small volatile suffix such as a diff or failing test output. "
)
LONG_PREFIX = "You are a careful coding assistant.\n" + PARAGRAPH * 4
QUESTION = "Which component keeps the model resident?"
@dataclass
class Engine:
    """One implementation under test, and what the scenarios must know about it."""

    name: str
    backend: Backend
    path: str
    #: the resident token tape of a loaded model (what the KV holds)
    tape: Callable[[Any], list[int]]
    #: the tokens a stable prefix text becomes on this model (without tools)
    prefix_tokens: Callable[[Any, str], list[int]]
    #: the engine's own check that its KV holds exactly the tape
    kv_matches_tape: Callable[[Any], bool]
    #: reuse is the token longest-common-prefix (the reference reuses all or nothing)
    partial_reuse: bool = True
    #: a model template decides tools (the reference takes any tools text)
    renders_templates: bool = True
    #: opening a session retires the older handles of the one KV (the reference keeps them)
    one_driver: bool = True
    #: decoding on from a tape continues the answer a model gives (the reference seeds
    #: each pass's word stream from the whole tape instead)
    continues_answers: bool = True
    #: the largest token id + 1 (a snapshot naming a larger id is foreign)
    vocab_size: int = 256
    #: decode speculates with prompt-lookup drafts (``DecodeConfig.speculative``)
    speculates: bool = True
    #: the distribution after the last resident token, as the engine computed it (None: no logits)
    last_logits: Callable[[Any], Any] | None = None
    #: it masks decode steps (structured output, forced tool calls); False: it refuses them (a remote server)
    constrains: bool = True
    #: the model's weights are in this process (False: a remote server holds them, ``resident_bytes`` is 0)
    holds_weights: bool = True
    #: the KV is a server's prefix cache, which every model loaded on the server shares and which outlives a load:
    #: a freshly loaded model finds there what another computed under the same manifest
    shared_cache: bool = False
    #: the options a load passes (``Config.options``: a remote engine's server)
    options: dict[str, str] = field(default_factory=dict)

    def load(self, num_ctx: int = NUM_CTX) -> LoadedModel:
        return self.backend.load(OpenSessionRequest(path=self.path, config=Config(num_ctx=num_ctx, options=self.options)),
                                 lambda _f: None)


#: on CPU both engines compute a batch of rows with other kernels than a one-token step: logits
#: differ by up to ~0.75 (measured, llama.cpp and OpenVINO, AVX2 and AVX-512); two tokens whose
#: logits are closer than this are a near-tie either path may break its own way
NEAR_TIE = 1.5


#: this run's mark on the profiles of an engine whose KV is a server's: the server's prefix cache outlives a run
#: (``MODELD_TEST_VLLM_PORT`` reuses one), and a "cold" prefix must be one no earlier run sent under its manifest
RUN_MARK = uuid.uuid4().hex[:8]


def manifest(model: LoadedModel, profile: str, **over: str) -> ContextManifest:
    defaults = model.manifest_defaults()
    if defaults.backend == "vllm":
        profile = f"{profile}-{RUN_MARK}"
    return defaults.model_copy(update={"profile": profile, **over})


def decode(session: Session, n: int, **cfg: Any) -> tuple[list[int], str, StreamChunk]:
    """Token ids, text and the final chunk of one decode pass (greedy unless ``cfg`` says otherwise)."""
    chunks = list(session.decode(DecodeConfig(max_tokens=n, return_token_ids=True, **cfg)))
    assert chunks[-1].done
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1]


def check_exact_rows(session: Session, man: ContextManifest, n: int = 240, *, reuse_only: bool = False) -> None:
    """What a model whose rows are exact (``rows_exact``) answers, on an edit past 512 keys.

    A seeded sampled pass drafts by default and draws what it draws without drafts; a greedy answer
    with drafts is the plain one token for token; the next turn resends the answer and asks on, reusing
    the decoded tokens (with ``exact_reuse`` too), and answers as it does after a cold prefill (which
    is what stays resident). ``reuse_only``: the drafted greedy answer and the next turn alone (for a
    load that differs from one already checked only in what it reuses).
    """
    asked = 0  # the suffix's tokens before the answer

    def edit(tokens: int = n, **cfg: Any) -> tuple[list[int], str, StreamChunk]:
        nonlocal asked
        prefix = session.ensure_prefix(PrefixInput(text=LONG_PREFIX * 2, manifest=man)).prefix_tokens
        session.prefill_suffix(SuffixInput(text="Hello.", render=False, manifest=man))  # the edit is prefilled anew
        session.prefill_suffix(SuffixInput(text=EDIT_CONTINUATION, render=False, manifest=man))
        resident = session.explain_context().resident_tokens
        assert resident > 512
        asked = resident - prefix
        return decode(session, tokens, **cfg)

    if not reuse_only:
        # sampled: a shorter pass, drafts and what it draws are all it is asked for
        sampled = {spec: edit(96, temperature=0.7, top_k=40, seed=11, speculative=spec) for spec in (False, None)}
        drafted = sampled[None][2].usage
        assert drafted is not None and drafted.drafted_tokens > 0
        assert sampled[None][0] == sampled[False][0]
        plain, _, plain_final = edit(speculative=False)
        assert plain_final.usage is not None and plain_final.usage.drafted_tokens == 0
    spec, text, final = edit(speculative=True)
    assert final.usage is not None and final.usage.accepted_tokens > 0.5 * final.usage.drafted_tokens > 20
    assert len(spec) > 150 and (reuse_only or spec == plain)
    # the answer was decoded one token at a time or kept from checks: reused all the same
    follow = SuffixInput(text=EDIT_CONTINUATION + text + "\n```\nWhat changed?", render=False, manifest=man)
    reused = session.prefill_suffix(follow).reused_tokens
    assert reused > asked + len(spec) // 2
    warm = decode(session, 48, speculative=False)[0]
    session.ensure_prefix(PrefixInput(text="Something else entirely.", manifest=man))  # nothing of it stays
    session.ensure_prefix(PrefixInput(text=LONG_PREFIX * 2, manifest=man))
    assert session.prefill_suffix(follow).reused_tokens < reused
    assert decode(session, 48, speculative=False)[0] == warm


def quick_timing(monkeypatch: Any) -> None:
    """A test of the draft costs' timing (that it runs while idle, is kept, is read again), not of its figures:
    one timed round, on the shortest long context (17 s of a test's time on llama.cpp with the full timing)."""
    from backends.tape import draft_costs

    monkeypatch.setattr(draft_costs, "REPS", 1)
    monkeypatch.setattr(draft_costs, "LONG_CONTEXT_TOKENS", draft_costs.MIN_LONG_CONTEXT_TOKENS)


def forbid_measuring(monkeypatch: Any) -> None:
    """Make a load that measures its draft check costs fail: it is expected to read the kept table."""
    from backends.tape import draft_costs

    def measured_again(_m: object, **_kw: object) -> None:
        raise AssertionError("measured again")

    monkeypatch.setattr(draft_costs, "measure", measured_again)


def take(stream: Generator[StreamChunk, None, None], n: int) -> list[int]:
    """The token ids of a decode stream until at least ``n`` arrived; then the stream is closed (a cancel)."""
    got: list[int] = []
    for chunk in stream:
        got += chunk.token_ids
        if len(got) >= n:
            break
    stream.close()
    return got


def greedy(session: Session, n: int = 16) -> list[int]:
    """Greedy tokens as the daemon decodes them by default: with prompt-lookup drafts, whose lengths
    follow the tape alone, so the same tape gives the same batches, hence the same tokens (warm and
    cold, restored and uninterrupted)."""
    return decode(session, n)[0]


def turn(session: Session, man: ContextManifest, prefix: str, suffix: str, n: int = 16, **cfg: Any) -> list[int]:
    """A prefix, a suffix and ``n`` tokens decoded (greedy, as the daemon decodes by default, unless ``cfg``)."""
    session.ensure_prefix(PrefixInput(text=prefix, manifest=man))
    session.prefill_suffix(SuffixInput(text=suffix, manifest=man))
    return decode(session, n, **cfg)[0]


def openvino_precision() -> str:
    """What OpenVINO's CPU plugin computes in by default here ("f32", or "bf16" on a CPU with bf16 instructions, as
    the daemon does): figures compared across two of its graphs part further in bf16."""
    import openvino as ov

    from backends.openvino.native import type_name

    return type_name(ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT"))
