"""The engine conformance kit (``tests/engine_kit.py``) run against every engine behind the Backend seam.

llama.cpp and OpenVINO run real inference on the bundled model; the memory
reference runs the same scenarios where the contract says the same thing, and
the kit names each documented difference (``Engine`` flags). One model per
engine is loaded for the module; every scenario starts with its own
ensure_prefix, so the shared KV never couples scenarios to their order.
Engine-specific behaviour (parity with each library's own generate loop, shape
buckets, GGUF conversion, grammar engines) stays in the engines' own test files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from contract import interrupt
from contract.errors import (
    BackendMismatch,
    ContextOverflow,
    InvalidArgument,
    ManifestMismatch,
    OffsetDrift,
    SessionClosed,
    SnapshotRejected,
    UnsupportedFeature,
)
from contract.interfaces import LoadedModel, Session
from contract.manifest import ContextManifest, common_prefix_len
from contract.types import (
    DecodeConfig,
    OpenSessionRequest,
    PositionRange,
    PrefixInput,
    SessionSnapshot,
    StreamChunk,
    StructuredOutputConfig,
    SuffixInput,
)
from harness.fixtures import WEATHER_TOOL
from harness.prompts import EDIT_CONTINUATION
from tests.engine_kit import (
    CHEAP_CHECKS,
    LONG_PREFIX,
    NEAR_TIE,
    NUM_CTX,
    QUESTION,
    RUN_MARK,
    Engine,
    decode,
    forbid_measuring,
    greedy,
    manifest,
    quick_timing,
    take,
    turn,
)


def _memory() -> Engine:
    from backends.memory import MemoryBackend

    return Engine(
        name="memory",
        backend=MemoryBackend(),
        path="/models/reference",
        tape=lambda m: list(m.resident.live),
        prefix_tokens=lambda _m, text: list(text.encode()),
        kv_matches_tape=lambda m: len(m.resident.tokens) <= m.num_ctx,
        partial_reuse=False,
        renders_templates=False,
        one_driver=False,
        continues_answers=False,
        speculates=False,
    )


def _llama_logits(m: Any) -> Any:
    import llama_cpp
    import numpy as np

    row = llama_cpp.llama_get_logits_ith(m.llm.ctx, -1)
    return np.ctypeslib.as_array(row, shape=(m.vocab_size,)).copy()


def _llama() -> Engine:
    pytest.importorskip("llama_cpp")
    from backends.bundled import bundled_gguf_path
    from backends.llama import LlamaBackend
    from backends.tape.model import render_prefix

    return Engine(
        name="llama",
        backend=LlamaBackend(),
        path=str(bundled_gguf_path()),
        tape=lambda m: list(m.res.live),
        prefix_tokens=lambda m, text: m.tokenize(render_prefix(m.template, text, None)),
        kv_matches_tape=lambda m: m.llm.n_tokens == len(m.res.tokens) and m.kv_pos_max() == len(m.res.tokens) - 1,
        vocab_size=49152,
        last_logits=_llama_logits,
    )


def _openvino() -> Engine:
    pytest.importorskip("openvino_genai")
    from backends.bundled import bundled_gguf_path
    from backends.openvino import OpenVINOBackend
    from backends.tape.model import render_prefix

    return Engine(
        name="openvino",
        backend=OpenVINOBackend(),
        path=str(bundled_gguf_path()),  # the IR prepared by `make setup` is found by the GGUF's digest
        tape=lambda m: list(m.res.live),
        prefix_tokens=lambda m, text: m.tokenize(render_prefix(m.template, text, None)),
        # the pools hold the tape's K/V; at most the tape was computed exactly by prefill
        kv_matches_tape=lambda m: len(m.res.tokens) <= m.num_ctx and m.exact_len <= len(m.res.tokens),
        vocab_size=49152,
        last_logits=lambda m: m.logits_at_end().copy(),
    )


def _gemma() -> Engine:
    """llama.cpp on Gemma 3 270M Q4_K_M: sliding-window attention (512 tokens on 15 of 18 layers), a K-quant,
    a 262k vocabulary and the template its vocabulary selects (its file has none)."""
    engine = _llama()
    from backends.bundled import gemma_gguf_path

    return dataclasses.replace(engine, name="gemma", path=str(gemma_gguf_path()), vocab_size=262_144)


def _vllm(url: str) -> Engine:
    """The vLLM engine over a vLLM CPU server on the bundled model (``vllm_url``): the KV is the server's, which
    samples on its own and hands back tokens with their figures (no logits row here, no drafts)."""
    from backends.bundled import bundled_gguf_path
    from backends.tape.model import render_prefix
    from backends.vllm import VLLMBackend

    return Engine(
        name="vllm",
        backend=VLLMBackend(),
        path=str(bundled_gguf_path()),
        tape=lambda m: list(m.res.live),
        prefix_tokens=lambda m, text: m.tokenize(render_prefix(m.template, text, None)),
        kv_matches_tape=lambda m: len(m.res.tokens) <= m.num_ctx,  # (the server's KV: nothing to compare here)
        vocab_size=49152,
        speculates=False,
        constrains=False,
        holds_weights=False,
        shared_cache=True,
        options={"engine_url": url},
    )


ENGINES = {"memory": _memory, "llama": _llama, "openvino": _openvino, "gemma": _gemma}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("memory"),
        pytest.param("llama", marks=pytest.mark.llama),
        pytest.param("openvino", marks=pytest.mark.openvino),
        pytest.param("gemma", marks=pytest.mark.llama),
        pytest.param("vllm", marks=pytest.mark.vllm),
    ],
)
def engine(request: pytest.FixtureRequest) -> Engine:
    if request.param == "vllm":
        return _vllm(request.getfixturevalue("vllm_url"))
    return ENGINES[request.param]()


@pytest.fixture(scope="module")
def model(engine: Engine) -> Iterator[LoadedModel]:
    m = engine.load()
    yield m
    m.close()


@pytest.fixture
def session(model: LoadedModel) -> Iterator[Session]:
    s = model.open_session()
    yield s
    s.close()


def _refused_and_serving(engine: Engine, model: LoadedModel, session: Session, call: Any) -> None:
    """What an engine does not serve (``Engine.constrains``) is refused with the
    contract's typed error, the tape and the session untouched: it decodes on."""
    before, tape = session.explain_context(), engine.tape(model)
    with pytest.raises(UnsupportedFeature):
        call()
    assert session.explain_context() == before and engine.tape(model) == tape
    assert greedy(session, 4)


# --- warm reuse -------------------------------------------------------------------------------------
def test_warm_turn_equals_cold(engine: Engine, model: LoadedModel, session: Session) -> None:
    man = manifest(model, "warm-cold")
    cold_st = session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
    assert cold_st.reused_tokens == 0 and cold_st.prefilled_tokens == cold_st.prefix_tokens > 200
    session.prefill_suffix(SuffixInput(text=QUESTION, manifest=man))
    first = greedy(session)
    other = turn(session, man, LONG_PREFIX, "Summarise the design in one sentence.")

    warm_st = session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
    assert warm_st.reused_tokens == warm_st.prefix_tokens == cold_st.prefix_tokens
    assert warm_st.prefilled_tokens == 0 and warm_st.dropped_tokens > 0
    session.prefill_suffix(SuffixInput(text=QUESTION, manifest=man))
    assert greedy(session) == first
    session.prefill_suffix(SuffixInput(text="Summarise the design in one sentence.", manifest=man))
    assert greedy(session) == other

    fresh = engine.load()  # a cold model computes the same turn from nothing (a server's cache kept what it had)
    try:
        cold = fresh.open_session()
        assert cold.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man)).reused_tokens == 0 or engine.shared_cache
        cold.prefill_suffix(SuffixInput(text=QUESTION, manifest=man))
        assert greedy(cold) == first
    finally:
        fresh.close()


def test_a_scored_suffix_is_computed_again_and_scored_token_by_token(
    engine: Engine, model: LoadedModel, session: Session
) -> None:
    """Prefill-only scoring through the seam (``SuffixInput.logprobs``): every suffix token's log probability given
    all before it (the stable prefix's last token scores the first) and the likeliest tokens there, from rows
    computed now: a resident suffix is prefilled again, with no miss reported, and the tape is what a plain prefill
    leaves; the session decodes on from it."""
    man = manifest(model, "scoring")
    k = 3
    session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
    plain = session.prefill_suffix(SuffixInput(text=QUESTION, manifest=man))
    tape = list(engine.tape(model))
    st = session.prefill_suffix(SuffixInput(text=QUESTION, manifest=man, logprobs=k))
    assert list(engine.tape(model)) == tape and engine.kv_matches_tape(model)
    assert st.suffix_tokens == plain.suffix_tokens == len(st.logprobs) > 3 and st.reused_tokens == 0
    assert st.prefilled_tokens == st.suffix_tokens and st.miss is None and not plain.logprobs
    scored = [lp for lp in st.logprobs if lp is not None]
    assert [lp.token_id for lp in scored] == tape[st.prefix_tokens:]  # (none null: the prefix comes before)
    for lp in scored:
        tops = [t.logprob for t in lp.top]
        assert len(tops) == (1 if engine.name == "memory" else k) and tops == sorted(tops, reverse=True)
        assert tops[0] >= lp.logprob and lp.logprob <= 0.0
        assert any(t.token_id == lp.token_id for t in lp.top) == (lp.logprob >= tops[-1])
    with pytest.raises(ValueError):  # more alternatives than any API gives: refused where the input is made
        SuffixInput(text=QUESTION, manifest=man, logprobs=21)
    reply = list(session.decode(DecodeConfig(max_tokens=4)))
    assert reply[-1].usage is not None and reply[-1].usage.completion_tokens > 0


def test_a_scored_suffix_scores_its_ranges_only_and_computes_from_the_first(
    engine: Engine, model: LoadedModel, session: Session
) -> None:
    """``logprobs_ranges`` (salience's position ranges, absolute): only the suffix tokens they cover are scored, and
    only from the row before the first of them is computed again; what comes before is reused. The figures are the
    ones a whole scoring gives (another batch: within what a batch's kernels part by). A range outside the suffix,
    ranges without ``logprobs``, and an empty range are refused, and nothing changes."""
    man = manifest(model, "scoring-ranges")
    session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
    whole = session.prefill_suffix(SuffixInput(text=QUESTION, manifest=man, logprobs=0))
    p, n = whole.prefix_tokens, whole.suffix_tokens
    assert n > 8
    tape = list(engine.tape(model))
    ranges = [PositionRange(start=p + n - 5, end=p + n - 3), PositionRange(start=p + n - 1, end=p + n)]
    st = session.prefill_suffix(SuffixInput(text=QUESTION, manifest=man, logprobs=0, logprobs_ranges=ranges))
    assert list(engine.tape(model)) == tape and engine.kv_matches_tape(model)
    assert [i for i, lp in enumerate(st.logprobs) if lp is not None] == [n - 5, n - 4, n - 1]
    assert st.reused_tokens == n - 6 and st.prefilled_tokens == 6 and st.miss is None
    for i in (n - 5, n - 4, n - 1):
        got, want = st.logprobs[i], whole.logprobs[i]
        assert got is not None and want is not None and got.token_id == want.token_id == tape[p + i]
        assert got.logprob == pytest.approx(want.logprob, abs=0.75)  # (measured: up to 0.28 between kernels)
    for bad in ([PositionRange(start=p - 1, end=p + 1)], [PositionRange(start=p + n - 1, end=p + n + 1)]):
        with pytest.raises(InvalidArgument, match="not within the suffix"):
            session.prefill_suffix(SuffixInput(text=QUESTION, manifest=man, logprobs=0, logprobs_ranges=bad))
        assert list(engine.tape(model)) == tape and engine.kv_matches_tape(model)
    with pytest.raises(InvalidArgument, match="give logprobs too"):
        SuffixInput(text=QUESTION, manifest=man, logprobs_ranges=ranges)
    with pytest.raises(InvalidArgument, match="ends after it starts"):
        PositionRange(start=p, end=p)
    with pytest.raises(UnsupportedFeature, match="read"):  # no manifest served: a decode's readouts refused
        list(session.decode(DecodeConfig(max_tokens=2, readouts=True)))


def test_appends_at_an_offset(engine: Engine, model: LoadedModel, session: Session) -> None:
    """A client that keeps its own view of the session appends token ids (or raw text) at the resident length it
    was told; a view that drifted is refused with both lengths and changes nothing; ``truncating`` rewinds to the
    offset exactly, as a cold prefill of the same tokens; bad ids are refused before anything is appended."""
    man = manifest(model, "offsets")
    session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
    asked = session.prefill_suffix(SuffixInput(text=QUESTION, manifest=man))
    prompt = list(engine.tape(model))
    assert asked.resident_tokens == len(prompt)
    chunks = list(session.decode(DecodeConfig(max_tokens=6, return_token_ids=True)))
    usage = chunks[-1].usage
    assert usage is not None and usage.resident_tokens == session.explain_context().resident_tokens
    answered = list(engine.tape(model))
    assert len(answered) == usage.resident_tokens and answered[: len(prompt)] == prompt

    more = session.tokenize(" Then what?")
    st = session.prefill_suffix(SuffixInput(tokens=more, offset=len(answered), manifest=man))
    assert engine.tape(model) == answered + more and st.resident_tokens == len(answered) + len(more)
    assert st.prefilled_tokens == len(more) and st.reused_tokens == len(answered) - st.prefix_tokens
    # a stale view (the length before that append), one past the end, one short without truncating: refused
    for stale in (len(answered), len(answered) + len(more) + 1, len(prompt)):
        with pytest.raises(OffsetDrift) as drift:
            session.prefill_suffix(SuffixInput(tokens=more, offset=stale, manifest=man))
        assert drift.value.details == {"offset": stale, "resident_tokens": len(answered) + len(more)}
        assert engine.tape(model) == answered + more and engine.kv_matches_tape(model)
    with pytest.raises(InvalidArgument):  # an id the model does not have: nothing appended
        session.prefill_suffix(SuffixInput(tokens=[0, engine.vocab_size], offset=len(answered) + len(more),
                                           manifest=man))
    assert engine.tape(model) == answered + more
    with pytest.raises(ValueError):  # no id at all: refused where the input is made (the wire says InvalidArgument)
        SuffixInput(tokens=[-1], offset=len(answered) + len(more), manifest=man)
    with pytest.raises(InvalidArgument):  # the stable prefix changes through ensure_prefix only
        session.prefill_suffix(SuffixInput(tokens=more, offset=1, truncating=True, manifest=man))
    # truncating: back to the prompt, then another question, as raw text; the KV up to the offset is kept
    st = session.prefill_suffix(SuffixInput(text=" Why?", render=False, offset=len(prompt), truncating=True,
                                            manifest=man))
    rewound = list(engine.tape(model))
    assert rewound[: len(prompt)] == prompt and rewound[len(prompt):] == session.tokenize(" Why?")
    assert st.prefilled_tokens == len(rewound) - len(prompt) and engine.kv_matches_tape(model)
    warm = greedy(session)
    fresh = engine.load()  # the same calls from nothing, without the reply and the append rewound: alike
    try:  # (split alike too: where a prefill's chunks start moves a K-quant's numbers)
        cold = fresh.open_session()
        cold.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
        cold.prefill_suffix(SuffixInput(text=QUESTION, manifest=man))
        cold.prefill_suffix(SuffixInput(text=" Why?", render=False, offset=len(prompt), manifest=man))
        assert engine.tape(fresh) == rewound
        assert greedy(cold) == warm
    finally:
        fresh.close()


def test_the_same_suffix_again_is_resident(engine: Engine, model: LoadedModel, session: Session) -> None:
    man = manifest(model, "suffix-again")
    session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
    st = session.prefill_suffix(SuffixInput(text=QUESTION, manifest=man))
    answer = greedy(session)
    again = session.prefill_suffix(SuffixInput(text=QUESTION, manifest=man))
    if engine.partial_reuse:
        assert again.reused_tokens == again.suffix_tokens == st.suffix_tokens
    assert again.resident_tokens == st.resident_tokens
    assert greedy(session) == answer  # logits are recomputed where the engine holds none


def test_manifest_gate_forces_recompute(model: LoadedModel, session: Session) -> None:
    man = manifest(model, "gate")
    session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
    assert session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man)).reused_tokens > 0
    flipped_bos = "add" if man.bos_policy == "none" else "none"
    for field in ("template_digest", "runtime_digest", "bos_policy", "profile"):
        # (a value of this run's: a server's cache keeps what earlier runs computed under a manifest)
        other = man.model_copy(update={field: flipped_bos if field == "bos_policy" else f"something-else-{RUN_MARK}"})
        st = session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=other))
        assert st.reused_tokens == 0 and st.prefilled_tokens == st.prefix_tokens, field
        session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))  # back, recomputed again


def test_edited_prefix_reuses_the_token_lcp(engine: Engine, model: LoadedModel, session: Session) -> None:
    man = manifest(model, "edit")
    first = LONG_PREFIX + "Current file: src/server.py, opened at line 12 of 480."
    edited = LONG_PREFIX + "Current file: tests/test_server.py, opened at line 7 of 95."
    session.ensure_prefix(PrefixInput(text=first, manifest=man))
    session.prefill_suffix(SuffixInput(text="Fix the bug.", manifest=man))
    greedy(session, 4)
    before = len(engine.tape(model))
    st = session.ensure_prefix(PrefixInput(text=edited, manifest=man))
    target = engine.prefix_tokens(model, edited)
    lcp = common_prefix_len(engine.prefix_tokens(model, first), target) if engine.partial_reuse else 0
    assert 0 < lcp < len(target) or not engine.partial_reuse
    assert st.reused_tokens == lcp and st.prefilled_tokens == len(target) - lcp
    assert st.dropped_tokens == before - lcp
    assert engine.tape(model) == target and engine.kv_matches_tape(model)
    # the edited prefix answers exactly as a cold run of it does
    session.prefill_suffix(SuffixInput(text="Fix the bug.", manifest=man))
    warm = greedy(session)
    assert turn(session, manifest(model, "edit-cold"), edited, "Fix the bug.") == warm


# --- refusals leave the resident context untouched ------------------------------------------------------
def test_refused_inputs_change_nothing(engine: Engine, model: LoadedModel, session: Session) -> None:
    man = manifest(model, "refusals")
    session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
    session.prefill_suffix(SuffixInput(text="Short question?", manifest=man))
    before, tape = session.explain_context(), engine.tape(model)
    refusals: list[tuple[type[Exception], object]] = [
        (ManifestMismatch, SuffixInput(text="x", manifest=man.model_copy(update={"runtime_digest": "sha256:other"}))),
        (ContextOverflow, SuffixInput(text="word " * NUM_CTX, manifest=man)),
        (ContextOverflow, PrefixInput(text="word " * (NUM_CTX + 10), manifest=man)),
        (ManifestMismatch, PrefixInput(text="x", manifest=man.model_copy(update={"model_digest": "sha256:1"}))),
        (ManifestMismatch, PrefixInput(text="x", manifest=man.model_copy(update={"backend": "elsewhere"}))),
    ]
    if engine.renders_templates:
        refusals += [
            (InvalidArgument, PrefixInput(text="sys", manifest=man, tools="{not json")),
            (InvalidArgument, PrefixInput(text="sys", manifest=man.model_copy(update={"bos_policy": "sometimes"}))),
        ]
    for error, request in refusals:
        with pytest.raises(error):
            if isinstance(request, PrefixInput):
                session.ensure_prefix(request)
            else:
                assert isinstance(request, SuffixInput)
                session.prefill_suffix(request)
        assert session.explain_context() == before, request
        assert engine.tape(model) == tape and engine.kv_matches_tape(model), request
    with pytest.raises(UnsupportedFeature):
        session.decode(DecodeConfig(parser_protocols=["smoke-signals"]))
    assert greedy(session, 4)  # and the session keeps serving


def test_tools_reach_a_template_that_does_not_render_them(engine: Engine, model: LoadedModel, session: Session) -> None:
    """The bundled ChatML renders no tools: they go in the generic block of the system turn, never dropped."""
    if not engine.renders_templates:
        pytest.skip("the reference renders no template")
    man = manifest(model, "generic-tools")
    st = session.ensure_prefix(PrefixInput(text="You are a weather bot.", manifest=man, tools=json.dumps([WEATHER_TOOL])))
    prompt = model.prompt_text(engine.tape(model))  # type: ignore[attr-defined]
    assert prompt.count("You are a weather bot.") == 1 and '"name": "get_weather"' in prompt
    assert "<tool_call>" in prompt and "</tools>" in prompt and st.prefix_tokens == len(engine.tape(model))
    # counted before any prefill, the prompt with a conversation after it is what the session then holds
    count = session.count_tokens(PrefixInput(text="You are a weather bot.", manifest=man, tools=json.dumps([WEATHER_TOOL])),
                                 SuffixInput(text="Weather in Paris?", manifest=man))
    session.prefill_suffix(SuffixInput(text="Weather in Paris?", manifest=man))
    assert count.prompt_tokens == len(engine.tape(model)) and count.resident_tokens == st.prefix_tokens
    assert count.num_ctx == model.num_ctx


def test_a_forced_call_holds_its_arguments_to_the_tool_schema(engine: Engine, model: LoadedModel, session: Session) -> None:
    """``tool_call``: one call to a named tool, its arguments closed to the declared properties and
    spelled as ``json.dumps`` writes them (how the call is rendered back into the next prompt); a
    schema the grammar cannot hold (a remote ``$ref``) leaves that tool's arguments any JSON object."""
    if not engine.renders_templates:
        pytest.skip("the reference constrains no output")
    man = manifest(model, "forced-call")
    session.ensure_prefix(PrefixInput(text="You are a weather bot.", manifest=man, tools=json.dumps([WEATHER_TOOL])))
    session.prefill_suffix(SuffixInput(text="Weather in Paris?", manifest=man))
    schema = json.dumps(WEATHER_TOOL["function"]["parameters"])  # type: ignore[index]
    remote = json.dumps({"type": "object", "properties": {"q": {"$ref": "https://example.invalid/q.json"}}})
    if not engine.constrains:
        _refused_and_serving(engine, model, session, lambda: decode(
            session, 8, temperature=0.0, structured_output=StructuredOutputConfig(tool_call={"get_weather": schema})))
        return
    for tools in ({"get_weather": schema}, {"get_weather": schema, "lookup": remote}):
        session.prefill_suffix(SuffixInput(text="Weather in Paris?", manifest=man))
        chunks = list(session.decode(DecodeConfig(max_tokens=80, temperature=0.0, return_token_ids=True,
                                                  structured_output=StructuredOutputConfig(tool_call=tools))))
        text = model.prompt_text([t for c in chunks for t in c.token_ids])  # type: ignore[attr-defined]
        calls = [call for c in chunks for call in c.tool_calls]
        assert chunks[-1].finish_reason == "tool_calls", text
        head, _, rest = text.partition('"arguments": ')
        assert head == '<tool_call>\n{"name": "get_weather", ' or head == '<tool_call>\n{"name": "lookup", ', text
        args = json.loads(rest.removesuffix("}\n</tool_call>"))
        assert rest == json.dumps(args) + "}\n</tool_call>", text  # json.dumps's spelling
        if head.endswith('"get_weather", '):
            assert set(args) <= {"city"}, args  # closed: no key the tool does not declare
        assert len(calls) == 1 and calls[0].function.name == head.split('"')[3]
        assert json.loads(calls[0].function.arguments) == args


def test_every_decode_step_shows_progress(model: LoadedModel, session: Session, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's wedge watch reads ``interrupt.beat``: a decode beats at each engine step, not only when it
    hands out text (a tool call or a possible stop string held back for minutes on a slow machine looked wedged)."""
    man = manifest(model, "beats")
    session.ensure_prefix(PrefixInput(text="You are a weather bot.", manifest=man))
    session.prefill_suffix(SuffixInput(text="Weather in Paris?", manifest=man))
    beats: list[float] = []
    monkeypatch.setattr(interrupt, "beat", lambda: beats.append(time.monotonic()))
    # (without drafts: a step that verifies a draft yields several tokens, and whether the policy drafts
    # depends on the check costs timed at load, which a busy machine moves)
    chunks = list(session.decode(DecodeConfig(max_tokens=12, temperature=0.0, speculative=False)))
    final = chunks[-1]
    assert final.usage is not None and final.usage.completion_tokens > 0
    assert len(beats) >= final.usage.completion_tokens, (len(beats), final.usage)


def test_decode_needs_a_resident_prompt(engine: Engine) -> None:
    m = engine.load(num_ctx=256)
    try:
        s = m.open_session()
        with pytest.raises(InvalidArgument):
            s.decode(DecodeConfig())
    finally:
        m.close()
    with pytest.raises(SessionClosed):
        s.ensure_prefix(PrefixInput(text="x", manifest=m.manifest_defaults()))
    assert m.resident_bytes() == 0


def test_backend_mismatch(engine: Engine) -> None:
    other = "openvino" if engine.name != "openvino" else "llama"
    with pytest.raises(BackendMismatch):
        engine.backend.load(OpenSessionRequest(path=engine.path, type=other), lambda _f: None)
    with pytest.raises(BackendMismatch):
        engine.backend.describe(OpenSessionRequest(path=engine.path, type=other))


# --- decoding ------------------------------------------------------------------------------------------------
def test_cancel_keeps_the_tape_equal_to_the_kv(engine: Engine, model: LoadedModel, session: Session) -> None:
    # one-token steps throughout: an answer decoded in one pass and one cancelled and decoded on
    # would batch different draft rows, and a bf16 engine rounds a batch apart from a step
    plain = {"speculative": False}
    man = manifest(model, "cancel")
    full = turn(session, man, LONG_PREFIX, "Describe the daemon.", **plain)
    session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
    session.prefill_suffix(SuffixInput(text="Describe the daemon.", manifest=man))
    prompt = engine.tape(model)
    got = take(session.decode(DecodeConfig(max_tokens=200, return_token_ids=True, **plain)), 3)
    assert got == full[: len(got)]
    # what was handed out is in the tape and the KV: decoding on continues the same answer
    assert engine.tape(model) == prompt + got and engine.kv_matches_tape(model)
    if engine.continues_answers:
        assert decode(session, len(full) - len(got), **plain)[0] == full[len(got) :]
    assert turn(session, man, LONG_PREFIX, "Describe the daemon.", **plain) == full


def test_a_newer_operation_ends_an_abandoned_stream(engine: Engine, model: LoadedModel, session: Session) -> None:
    if not engine.one_driver:
        pytest.skip("the reference has no single KV driver to hand over")
    man = manifest(model, "abandon")
    session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
    session.prefill_suffix(SuffixInput(text=QUESTION, manifest=man))
    stream = session.decode(DecodeConfig(max_tokens=50))
    next(stream)
    st = session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
    assert list(stream) == []  # the stream stops instead of writing into the new KV
    assert len(engine.tape(model)) == st.prefix_tokens and engine.kv_matches_tape(model)


def test_sampling_is_seeded(model: LoadedModel, session: Session) -> None:
    man = manifest(model, "sample")
    session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))

    def sample(**cfg: object) -> list[int]:
        session.prefill_suffix(SuffixInput(text="Tell me a story.", manifest=man))
        return decode(session, 16, **cfg)[0]

    # the first pass samples from the prefill's logits; a repeat finds the turn resident and recomputes its
    # last token by a one-token step, which rounds apart from a prefill (docs/engines.md): so two repeats,
    # computed alike, are compared
    sample(temperature=0.9, top_p=0.9, top_k=40, seed=7)
    first = sample(temperature=0.9, top_p=0.9, top_k=40, seed=7)
    assert len(first) > 0 and sample(temperature=0.9, top_p=0.9, top_k=40, seed=7) == first


def test_stop_strings_and_usage(engine: Engine, model: LoadedModel, session: Session) -> None:
    man = manifest(model, "stop")
    session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
    session.prefill_suffix(SuffixInput(text=QUESTION, manifest=man))
    ids, text, last = decode(session, 32)
    assert last.usage is not None and last.usage.completion_tokens == len(ids) > 0
    # the tape is the prompt plus every token handed out (an end-of-turn token is not kept)
    assert last.usage.prompt_tokens + last.usage.completion_tokens == len(engine.tape(model))
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    session.prefill_suffix(SuffixInput(text=QUESTION, manifest=man))
    _, cut, final = decode(session, 32, stop=[stop])
    assert final.finish_reason == "stop" and stop not in cut and text.startswith(cut)


# --- speculative decoding ---------------------------------------------------------------------------------
def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def _edit_turn(session: Session, man: ContextManifest, n: int, **cfg: Any) -> tuple[list[int], str, StreamChunk]:
    """The edit as a continuation (a short one first, so the edit's tokens are always prefilled)."""
    session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
    session.prefill_suffix(SuffixInput(text="Hello.", render=False, manifest=man))
    session.prefill_suffix(SuffixInput(text=EDIT_CONTINUATION, render=False, manifest=man))
    return decode(session, n, **cfg)


def _check_same_greedy(engine: Engine, model: LoadedModel, session: Session, man: ContextManifest,
                       plain: list[int], spec: list[int]) -> None:
    """Speculation answers as plain decoding does; where they part, plain decoding stood at a near-tie.

    The draft rows are computed in one batch, whose kernels round differently from a
    one-token step's; every emitted token is still the argmax over the emitted prefix,
    so the outputs can only part where two tokens are within the kernels' difference.
    """
    at = _first_difference(plain, spec)
    if at is None:
        assert spec == plain
        return
    _edit_turn(session, man, at, speculative=False)  # plain decoding up to the difference
    _assert_near_tie(engine, model, at, plain, spec)


def _assert_near_tie(engine: Engine, model: LoadedModel, at: int, plain: list[int], other: list[int]) -> None:
    """The resident logits (plain decoding's, before token ``at``) rank ``plain[at]`` first and
    ``other[at]`` second, within the kernels' difference."""
    assert engine.last_logits is not None
    logits = engine.last_logits(model)
    best, runner_up = np.argsort(logits)[-1], np.argsort(logits)[-2]
    assert (plain[at], other[at]) == (best, runner_up), f"token {at}: the outputs part outside the top two"
    margin = float(logits[best] - logits[runner_up])
    assert margin < NEAR_TIE, f"token {at}: outputs part where plain decoding led by {margin:.2f}"


def test_speculation_answers_like_plain_decoding_and_the_next_turn_reuses_it(
    engine: Engine, model: LoadedModel, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not engine.speculates:
        pytest.skip(f"{engine.name} does not speculate")
    from backends.tape.speculate import CheckCosts

    # drafting asserted: a fixed table, not the one the load timed (or an earlier load, on a busier machine)
    monkeypatch.setattr(model, "draft_costs", CheckCosts(json.loads(CHEAP_CHECKS)))
    man = manifest(model, "speculate")
    runs = {}
    follows = {}
    for spec in (False, True):
        ids, text, final = _edit_turn(session, man, 160, speculative=spec)
        assert engine.kv_matches_tape(model)
        # the next turn resends the reply: all of it is reused
        follows[spec] = SuffixInput(text=EDIT_CONTINUATION + text + "\n```\nDone.", render=False, manifest=man)
        st = session.prefill_suffix(follows[spec])
        assert st.reused_tokens >= len(ids) and engine.kv_matches_tape(model)
        # the next turn decodes plain on both sides: only the KV the answer left differs
        runs[spec] = (ids, final.usage, decode(session, 12, speculative=False)[0])
    (plain, plain_usage, plain_next), (spec_ids, usage, spec_next) = runs[False], runs[True]
    assert plain_usage is not None and plain_usage.drafted_tokens == 0
    # the answer copies the file: drafts from the prompt were checked and most were kept
    assert usage is not None and usage.accepted_tokens > 0.5 * usage.drafted_tokens > 10
    at = _first_difference(plain_next, spec_next) if spec_ids == plain else None
    if at is not None:
        # the KV the drafts left answers the next turn alike up to a near-tie: the answer's
        # cells were computed by a check's rows, which bf16 kernels round apart from one-token steps
        _edit_turn(session, man, 160, speculative=False)
        session.prefill_suffix(follows[False])
        if at:
            decode(session, at, speculative=False)
        _assert_near_tie(engine, model, at, plain_next, spec_next)
    _check_same_greedy(engine, model, session, man, plain, spec_ids)


#: how far a drafted token's log probability (a check's row, computed in one batch) may stand from a one-token
#: step's: the kernels round a batch apart from a step (measured up to 0.077 on llama.cpp with the bundled Q4_1
#: model, 0.0007 on OpenVINO, on an AVX-512 CPU)
DRAFT_LOGPROB_TOLERANCE = 0.25


def test_logprobs_are_the_models_distribution(
    engine: Engine, model: LoadedModel, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each sampled token streams with its log probability under the model's own distribution and the likeliest
    tokens there: greedy takes the likeliest; each figure is a log-softmax of the engine's logits at that step; the
    tokens' bytes are the reply; and drafts change nothing but the batch's rounding (a drafted token's figure is
    its check's row)."""
    from backends.tape.speculate import CheckCosts

    man = manifest(model, "logprobs")
    k = 3

    def edit(n: int, **cfg: Any) -> list[StreamChunk]:
        session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
        session.prefill_suffix(SuffixInput(text="Hello.", render=False, manifest=man))
        session.prefill_suffix(SuffixInput(text=EDIT_CONTINUATION, render=False, manifest=man))
        return list(session.decode(DecodeConfig(max_tokens=n, return_token_ids=True, **cfg)))

    chunks = edit(32, speculative=False, logprobs=k)
    ids = [t for c in chunks for t in c.token_ids]
    got = [lp for c in chunks for lp in c.logprobs]
    assert chunks[-1].usage is not None and len(ids) == chunks[-1].usage.completion_tokens > 8
    assert [lp.token_id for lp in got] == ids
    assert b"".join(bytes(lp.bytes) for lp in got).decode() == "".join(c.text for c in chunks)
    for lp in got:
        assert len(lp.top) == (1 if engine.name == "memory" else k)  # (the reference's next byte is certain)
        tops = [t.logprob for t in lp.top]
        assert tops == sorted(tops, reverse=True) and lp.logprob <= 0.0
        assert sum(math.exp(t) for t in tops) <= 1.0 + 1e-9
        assert lp.logprob == tops[0]  # greedy: the likeliest (or one as likely)
    # a fresh pass without logprobs decodes the same tokens, and its resident logits after j of them are what the
    # logprobs said of token j
    assert [t for c in edit(32, speculative=False) for t in c.token_ids] == ids
    if engine.last_logits is not None:
        for j in (1, len(ids) // 2, len(ids) - 1):
            edit(j, speculative=False)
            x = engine.last_logits(model)[: engine.vocab_size].astype(np.float64)
            log_total = float(x.max()) + math.log(float(np.exp(x - x.max()).sum()))
            assert got[j].logprob == pytest.approx(float(x[ids[j]]) - log_total, abs=1e-4), f"token {j}"
            best = np.argsort(-x, kind="stable")[:k]
            assert {t.token_id for t in got[j].top} == {int(t) for t in best}
    if engine.speculates:
        monkeypatch.setattr(model, "draft_costs", CheckCosts(json.loads(CHEAP_CHECKS)))
        # by default a pass asked for logprobs drafts only where the engine's rows are exact: a step's figures
        default = edit(32, logprobs=k)
        usage = default[-1].usage
        assert usage is not None and (usage.drafted_tokens > 0) == model.rows_exact
        if not model.rows_exact:
            assert [lp for c in default for lp in c.logprobs] == got
        # asked to draft, a drafted token's figure is its check row's
        drafted = edit(32, speculative=True, logprobs=k)
        usage = drafted[-1].usage
        assert usage is not None and usage.drafted_tokens > 0
        spec = [lp for c in drafted for lp in c.logprobs]
        same = _first_difference(ids, [lp.token_id for lp in spec])
        same = len(ids) if same is None else same  # (where they part, plain decoding stood at a near-tie)
        assert same > 0
        for a, b in zip(got[:same], spec[:same], strict=True):
            assert b.logprob == pytest.approx(a.logprob, abs=DRAFT_LOGPROB_TOLERANCE)


def test_penalties_cover_the_prompt_tail_and_the_reply(engine: Engine, model: LoadedModel, session: Session) -> None:
    """Penalties reach the engine's sampler; the window holds the prompt's tail and then each token
    the reply takes (the oldest leaving as each comes): under a penalty no logit survives, the reply repeats no
    token of its window, with drafts on or off."""
    if not engine.speculates:
        pytest.skip(f"{engine.name} samples no logits in this process")
    man = manifest(model, "penalties")
    plain = _edit_turn(session, man, 24, speculative=False)[0]
    window = 256
    for spec in (False, True):
        _edit_turn(session, man, 0)  # the prompt alone is resident
        prompt = engine.tape(model)[-window:]
        ids, _, final = decode(session, 24, speculative=spec, repeat_penalty=10.0, presence_penalty=2.0,
                               repeat_last_n=window)
        assert len(ids) == 24 and ids != plain
        for i, token in enumerate(ids):
            # the window slides: token i is chosen against the last ``window`` tokens before it, so the prompt's
            # first i tokens of its tail have left it by then
            seen = (prompt + ids[:i])[-window:]
            assert token not in seen, f"token {i} ({token}) repeats the window"
    # left out, none applies: the same greedy answer as before
    assert _edit_turn(session, man, 24, speculative=False, repeat_penalty=1.0, frequency_penalty=0.0)[0] == plain


def test_seeded_sampling_repeats_and_speculates_when_asked(
    engine: Engine, model: LoadedModel, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not engine.speculates:
        pytest.skip(f"{engine.name} does not speculate")
    from backends.tape.speculate import CheckCosts

    man = manifest(model, "speculate-sampled")
    outs = []
    for _ in range(2):
        # by default a sampled pass does not speculate: a batch rounds differently from a one-token
        # step, so drafts would make a seed's answer drift from what it gave without them
        ids, _, final = _edit_turn(session, man, 80, temperature=0.7, top_k=40, seed=11)
        outs.append(ids)
        assert engine.kv_matches_tape(model) and final.usage is not None and final.usage.drafted_tokens == 0
    assert outs[0] == outs[1]  # a seed gives the same answer every time
    # asked for, it speculates (each token drawn from its row in order: exact on exact numerics,
    # tests/test_tape.py), and the tape stays the KV's; drafting asserted: checks priced as a quiet machine's
    monkeypatch.setattr(model, "draft_costs", CheckCosts(json.loads(CHEAP_CHECKS)))
    _, _, final = _edit_turn(session, man, 80, temperature=0.7, top_k=40, seed=11, speculative=True)
    assert engine.kv_matches_tape(model) and final.usage is not None and final.usage.drafted_tokens > 0


def test_draft_costs_are_timed_when_idle_and_kept_for_the_next_load(
    engine: Engine, model: LoadedModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The policy's cost table is timed once per model and machine, while the model is idle (never in the load);
    a reload drafts as before and times nothing."""
    if not engine.speculates:
        pytest.skip(f"{engine.name} does not speculate")
    from backends.tape import draft_costs

    # whatever the timing gives is kept: a busy machine's table is refused as implausible (tests/test_tape.py),
    # which is not what this test is about
    monkeypatch.setattr(draft_costs, "plausible", lambda costs: True)
    monkeypatch.delenv(draft_costs.FIXED_ENV)  # the timing is the subject: not the suite's fixed table
    # its own table: another test timing the same model on another worker keeps its own in the shared model cache
    monkeypatch.setattr(draft_costs, "table_dir", lambda: tmp_path)
    quick_timing(monkeypatch)
    first = engine.load()
    try:
        first.idle_work()  # times the checks where no table is kept (an earlier load's is read at load)
        costs = first.draft_costs  # type: ignore[attr-defined]
        assert first.draft_costs_measured and not first.idle_pending()  # type: ignore[attr-defined]
        key = draft_costs.cost_key(first)  # type: ignore[arg-type]
    finally:
        first.close()
    # kept under the model's key, in plain steps, more rows never cheaper
    entry = json.loads((tmp_path / draft_costs.FILE_NAME).read_text())[key]
    assert costs.table() == entry["costs"] and costs.growth() == entry["growth"] and costs.switch() == entry["switch"]
    assert costs.cost(1) == 1.0 and costs.table() == sorted(costs.table())
    # and how they grow with the context, measured after LONG_CONTEXT_TOKENS (never shrinking)
    assert costs.growth()[0] == 0.0 and min(costs.growth()) >= 0.0

    forbid_measuring(monkeypatch)
    again = engine.load()
    try:
        assert again.draft_costs == costs and not again.idle_pending()  # type: ignore[attr-defined]
    finally:
        again.close()


def test_closing_a_speculating_stream_keeps_what_was_handed_out(
    engine: Engine, model: LoadedModel, session: Session
) -> None:
    if not engine.speculates:
        pytest.skip(f"{engine.name} does not speculate")
    man = manifest(model, "speculate-cancel")
    full = _edit_turn(session, man, 90, speculative=True)[0]
    _edit_turn(session, man, 0)
    prompt = engine.tape(model)
    got = take(session.decode(DecodeConfig(max_tokens=90, return_token_ids=True, speculative=True)), 40)
    assert got == full[: len(got)]
    # what was handed out is in the tape and the KV, drafts kept past it are not
    assert engine.tape(model) == prompt + got and engine.kv_matches_tape(model)


def test_explain_context_from_another_thread(engine: Engine, model: LoadedModel, session: Session) -> None:
    man = manifest(model, "thread")
    session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
    session.prefill_suffix(SuffixInput(text="Describe the daemon.", manifest=man))
    errors: list[BaseException] = []
    seen: list[int] = []
    stop = threading.Event()

    def poll() -> None:
        try:
            while not stop.is_set():
                rep = session.explain_context()
                assert rep.resident_tokens >= rep.prefix_tokens
                assert model.resident_bytes() > 0 or not engine.holds_weights
                seen.append(rep.resident_tokens)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=poll)
    t.start()
    try:
        greedy(session, 16)
    finally:
        stop.set()
        t.join()
    assert not errors and seen


# --- sessions and snapshots --------------------------------------------------------------------------------------
def test_a_closed_session_keeps_the_kv_warm(engine: Engine, model: LoadedModel) -> None:
    man = manifest(model, "sessions")
    first = model.open_session()
    first.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
    first.close()
    with pytest.raises(SessionClosed):
        first.prefill_suffix(SuffixInput(text="x", manifest=man))
    second = model.open_session()
    st = second.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
    assert st.reused_tokens == st.prefix_tokens and st.prefilled_tokens == 0
    third = model.open_session()
    if engine.one_driver:  # one KV, one driver: the older handle is retired
        with pytest.raises(SessionClosed):
            second.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
        assert second.explain_context().closed
    assert not third.explain_context().closed
    third.close()


def _snapshot_after_suffix(model: LoadedModel, s: Session, profile: str) -> SessionSnapshot:
    man = manifest(model, profile)
    s.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
    s.prefill_suffix(SuffixInput(text="What does the agent send as the suffix?", manifest=man))
    return s.snapshot()


def test_snapshot_restore_continues_identically(engine: Engine, model: LoadedModel, session: Session) -> None:
    snap = _snapshot_after_suffix(model, session, "snap")
    assert snap.backend == engine.backend.name and snap.resident_tokens == len(engine.tape(model))
    assert snap.resident_token_ids == engine.tape(model)
    reference = greedy(session, 20)
    turn(session, manifest(model, "other"), "You are a pirate.", "Say hello.", 8)
    session.restore(snap)
    rep = session.explain_context()
    assert rep.resident_tokens == snap.resident_tokens and rep.prefix_tokens == snap.prefix_tokens
    assert engine.tape(model) == snap.resident_token_ids and engine.kv_matches_tape(model)
    assert greedy(session, 20) == reference
    # the restored prefix is warm for the next turn
    again = session.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=snap.manifest))
    assert again.reused_tokens == again.prefix_tokens == snap.prefix_tokens


def _redigest(snap: SessionSnapshot, state: bytes) -> SessionSnapshot:
    return snap.model_copy(update={"state": state, "state_digest": "sha256:" + hashlib.sha256(state).hexdigest()})


def test_refused_snapshots_leave_the_session_untouched(engine: Engine, model: LoadedModel, session: Session) -> None:
    snap = _snapshot_after_suffix(model, session, "refuse")
    reference = greedy(session, 12)
    session.restore(snap)
    before, tape = session.explain_context(), engine.tape(model)
    flipped = bytearray(snap.state or b"\0")  # (a remote engine's snapshot is its tokens: no state bytes)
    flipped[len(flipped) // 2] ^= 0xFF
    bad = {
        "tampered bytes": snap.model_copy(update={"state": bytes(flipped)}),
        "num_ctx": snap.model_copy(update={"num_ctx": snap.num_ctx * 2}),
        "counts": snap.model_copy(update={"resident_tokens": snap.resident_tokens + 1}),
        "prefix past the tape": snap.model_copy(update={"prefix_tokens": snap.resident_tokens + 1}),
        "other model": snap.model_copy(
            update={"manifest": snap.manifest.model_copy(update={"model_digest": "sha256:ab"})}
        ),
        "backend": snap.model_copy(update={"backend": "elsewhere"}),
        "garbage state": _redigest(snap, b"garbage" * 10),
        **({"short state": _redigest(snap, snap.state[: len(snap.state) // 3])} if snap.state else {}),
        "vocabulary": snap.model_copy(update={"resident_token_ids": snap.resident_token_ids[:-1] + [engine.vocab_size]}),
        "state kind": snap.model_copy(update={"state_kind": "mystery"}),
    }
    for name, snapshot in bad.items():
        with pytest.raises(SnapshotRejected):
            session.restore(snapshot)
        assert session.explain_context() == before, name
        assert engine.tape(model) == tape and engine.kv_matches_tape(model), name
    assert greedy(session, 12) == reference  # the KV is untouched too
