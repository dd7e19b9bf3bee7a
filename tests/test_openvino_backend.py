"""The OpenVINO backend against the real bundled model (SmolLM2-135M Q4_1, converted to IR).

The GGUF is converted once per module into a private model cache (this also
exercises ``backends.openvino.prepare``), and the IR is compiled once with the backend
defaults: INFERENCE_PRECISION_HINT = the device default (bf16 on AMX CPUs, f32
elsewhere; the test reads the resolved value) and KV_CACHE_PRECISION f16 (stored as bf16
under a bf16 hint), paged attention, 512-token prefill chunks. Every
test starts with its own ensure_prefix, usually under its own manifest profile,
so the shared KV never couples tests to their order.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ov = pytest.importorskip("openvino")
ov_genai = pytest.importorskip("openvino_genai")

from backends.bundled import bundled_gguf_path, model_cache_dir  # noqa: E402
from backends.openvino import BACKEND_NAME, OpenVINOBackend, OpenVINOLoadedModel  # noqa: E402
from backends.openvino.graph import (  # noqa: E402
    BATCH_GRAPH_MAX_WEIGHTS,
    EXACT_STEP_ROWS,
    MIN_PREFILL_ROWS,
    bucket,
    wants_batch_graph,
)
from backends.openvino.model import STATE_MAGIC  # noqa: E402
from backends.openvino.native import map_errors  # noqa: E402
from backends.openvino.prepare import (  # noqa: E402
    IR_FILES,
    MARKER_FILE,
    ConversionError,
    check_convertible,
    is_complete_ir,
    prepare_ir,
)
from backends.tape.draft_costs import FIXED_ENV, cost_key  # noqa: E402
from backends.tape.session import TapeSession  # noqa: E402
from backends.tape.state import unpack_state  # noqa: E402
from contract import interrupt  # noqa: E402
from contract.errors import (  # noqa: E402
    BackendMismatch,
    Cancelled,
    InsufficientMemory,
    Internal,
    InvalidArgument,
    ModeldError,
    ModelLoadFailed,
    SessionClosed,
    SnapshotRejected,
    UnsupportedFeature,
)
from contract.manifest import ContextManifest, common_prefix_len  # noqa: E402
from contract.types import (  # noqa: E402
    Config,
    DecodeConfig,
    OpenSessionRequest,
    PrefixInput,
    SessionSnapshot,
    StructuredOutputConfig,
    SuffixInput,
)
from harness.fixtures import WEATHER_TOOL, tool_gguf, truncated_gguf  # noqa: E402
from tests.engine_kit import CHEAP_CHECKS, LONG_PREFIX, NUM_CTX, PARAGRAPH, check_exact_rows, decode  # noqa: E402

pytestmark = pytest.mark.openvino

#: the model cache as the other modules see it (``cache_dir`` points this module's loads elsewhere)
SHARED_CACHE = model_cache_dir()



# --- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private model cache: conversions in this module never touch the developer's cache."""
    path = tmp_path_factory.mktemp("ov-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MODELD_MODEL_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def ir_dir(cache_dir: Path) -> Path:
    return prepare_ir(bundled_gguf_path(), cache_dir=cache_dir)


@pytest.fixture(scope="module")
def backend() -> OpenVINOBackend:
    return OpenVINOBackend()


@pytest.fixture(scope="module")
def model(backend: OpenVINOBackend, ir_dir: Path) -> Iterator[OpenVINOLoadedModel]:
    m = backend.load(OpenSessionRequest(path=str(ir_dir), config=Config(num_ctx=NUM_CTX)), lambda _f: None)
    yield m
    m.close()


@pytest.fixture
def session(model: OpenVINOLoadedModel) -> TapeSession:
    return model.open_session()


def manifest(m: OpenVINOLoadedModel, profile: str = "", **over: str) -> ContextManifest:
    return m.manifest_defaults().model_copy(update={"profile": profile, **over})


def greedy(s: TapeSession, n: int = 24, **cfg: Any) -> list[int]:
    return decode(s, n, **cfg)[0]


def turn(s: TapeSession, man: ContextManifest, prefix: str, suffix: str, n: int = 24) -> list[int]:
    s.ensure_prefix(PrefixInput(text=prefix, manifest=man))
    s.prefill_suffix(SuffixInput(text=suffix, manifest=man))
    return greedy(s, n)


# --- conversion ---------------------------------------------------------------------------------------
def test_prepare_is_complete_and_idempotent(ir_dir: Path, cache_dir: Path) -> None:
    assert is_complete_ir(ir_dir)
    for name in (*IR_FILES, "config.json", MARKER_FILE):
        assert (ir_dir / name).is_file(), name
    assert ir_dir.parent == cache_dir / "ov"
    assert not [p for p in ir_dir.parent.iterdir() if p.name.startswith(".tmp-")]
    mtime = (ir_dir / "openvino_model.bin").stat().st_mtime_ns
    assert prepare_ir(bundled_gguf_path(), cache_dir=cache_dir) == ir_dir
    assert (ir_dir / "openvino_model.bin").stat().st_mtime_ns == mtime  # not converted again
    cfg = json.loads((ir_dir / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 8192 and cfg["num_key_value_heads"] == 3


def test_check_convertible_refuses_unsupported(ir_dir: Path) -> None:
    from backends.gguf_file import read_gguf

    facts = read_gguf(bundled_gguf_path())
    check_convertible(facts)
    from dataclasses import replace

    with pytest.raises(ConversionError, match="architecture 'gemma'"):
        check_convertible(replace(facts, architecture="gemma"))
    with pytest.raises(ConversionError, match="Q5_K"):
        check_convertible(replace(facts, tensor_types=frozenset({"Q5_K", "F32"})))


# --- parity with openvino-genai -------------------------------------------------------------------------------
def test_greedy_parity_with_genai_pipeline(model: OpenVINOLoadedModel, session: TapeSession) -> None:
    """32 greedy tokens equal openvino-genai's own LLMPipeline, token for token.

    Both run the same IR through the same paged-attention kernels at the same
    precisions: INFERENCE_PRECISION_HINT = the backend's resolved value (bf16 on
    this AMX CPU, f32 elsewhere) and KV_CACHE_PRECISION = f16 (the CPU plugin
    stores it as bf16 under a bf16 hint, on both sides). GenAI prefills the
    rendered prompt in one chunk; the session prefills the prefix and then the
    suffix. Paged-attention prefill is split-invariant for chunks of at least
    MIN_PREFILL_ROWS tokens, and shorter ones run padded to that
    (test_prefill_is_split_invariant), so the real two-chunk path is compared,
    not a special case.
    """
    man = manifest(model, "parity")
    session.ensure_prefix(PrefixInput(text="You are a knowledgeable history teacher.", manifest=man))
    session.prefill_suffix(
        SuffixInput(text="Write a long essay about the history of the Roman Empire.", manifest=man)
    )
    prompt_ids = list(model.res.tokens)
    # GenAI decodes one token a step; a draft's check runs other kernels (it may break a near-tie
    # the other way under bf16), so the one-step path is what is compared
    ours = greedy(session, 32, speculative=False)

    pipe = ov_genai.LLMPipeline(
        str(model.ir),
        "CPU",
        INFERENCE_PRECISION_HINT=model.inference_precision,
        KV_CACHE_PRECISION=model.options.kv_precision,
    )
    res = pipe.generate(ov.Tensor(np.array([prompt_ids], np.int64)), max_new_tokens=32, do_sample=False)
    theirs = [int(t) for t in res.tokens[0]]
    del pipe
    assert len(ours) == 32, "the prompt is chosen so the model writes past 32 tokens"
    assert ours == theirs


#: how far the logits (of ~33 in magnitude) may move when the same tokens are prefilled in other
#: chunks. On the CPUs this was run on the paged kernels gave bit-identical numbers (AVX-512 with
#: and without AMX); another ISA's kernels may round differently, so the suite asserts what holds
#: everywhere — the same greedy token and close logits — and bit-identity only for a literal replay.
SPLIT_LOGIT_TOLERANCE = 0.05


def test_prefill_is_split_invariant(model: OpenVINOLoadedModel) -> None:
    """The property exact reuse rests on: where a prefill chunk starts does not change the result.

    Checked on the engine directly: the logits after 300 tokens, prefilled in one
    chunk and in assorted splits — pieces of 1, 2 and 3 tokens included, which
    run padded to a bucket of MIN_PREFILL_ROWS rows — pick the same token and
    agree within SPLIT_LOGIT_TOLERANCE; replaying a split gives the same bits.
    """
    man = manifest(model, "split")
    s = model.open_session()
    s.ensure_prefix(PrefixInput(text=LONG_PREFIX + PARAGRAPH * 2, manifest=man))
    tokens = list(model.res.tokens)[:300]
    assert len(tokens) == 300
    model.set_kv(tokens, 0)
    one_shot = model.logits_at_end().copy()

    def split(cuts: list[int]) -> np.ndarray:
        model.set_kv(tokens[: cuts[0]], 0)
        for a, b in zip(cuts, [*cuts[1:], 300], strict=True):
            assert model.set_kv(tokens[:b], a) == a
        return model.logits_at_end().copy()

    for cuts in ([150], [8, 16, 299 - 8], [37, 200, 213], [256], [1, 2, 4, 150, 151, 299]):
        logits = split(cuts)
        assert int(np.argmax(logits)) == int(np.argmax(one_shot)), cuts
        assert float(np.max(np.abs(logits - one_shot))) <= SPLIT_LOGIT_TOLERANCE, cuts
        assert np.array_equal(split(cuts), logits), cuts  # the same split replayed: the same bits
    model.clear_kv()  # the tape no longer matches the session's prefix bookkeeping


def test_a_cancel_stops_a_prefill_chunk_part_way(model: OpenVINOLoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk under way is cancelled, not run to its end (one past 7k tokens takes seconds): the tape is the
    chunks before it, the engine serves on at any shape, and the same prefill run again computes the same bits
    as one never cancelled."""
    man = manifest(model, "abort")
    model.open_session().ensure_prefix(PrefixInput(text=LONG_PREFIX + PARAGRAPH * 2, manifest=man))
    tokens = (list(model.res.tokens) * 8)[:1536]  # a full chunk (512) after 1,024: far over 10 ms on any CPU
    model.set_kv(tokens[:1024], 0)
    model.set_kv(tokens, 1024)
    reference = model.logits_at_end().copy()
    model.set_kv(tokens[:1030], 1024)  # the last run at another shape: the cancelled one reshapes as it goes
    model.set_kv(tokens[:1024], 1024)

    event = threading.Event()
    original = OpenVINOLoadedModel._infer_abortable
    seen: list[str] = []

    def cancelled_as_it_runs(self: OpenVINOLoadedModel, req: Any, ev: threading.Event) -> None:
        threading.Timer(0.01, event.set).start()  # the client leaves with the chunk under way
        try:
            original(self, req, ev)
        except Cancelled:
            seen.append("cancelled")
            raise
        seen.append("finished")

    monkeypatch.setattr(OpenVINOLoadedModel, "_infer_abortable", cancelled_as_it_runs)
    with interrupt.interruptible(event), pytest.raises(Cancelled):
        model.set_kv(tokens, 1024)
    assert seen == ["cancelled"]  # stopped inside the inference, not at the check after it
    assert list(model.res.tokens) == tokens[:1024]
    monkeypatch.undo()
    # it serves on at other shapes (a request cancelled part-way refused its next one: it is replaced)
    model.set_kv(tokens[:1030], 1024)
    model.step(tokens[1030])
    assert model.set_kv(tokens, 1024) == 1024
    assert np.array_equal(model.logits_at_end(), reference)
    model.clear_kv()


def _engine_trace(m: OpenVINOLoadedModel, tokens: list[int]) -> list[np.ndarray]:
    """Logits along a speculative decode's path on the engine: a prefill, two steps, a 6-token check,
    a rollback of 4 of it, a step after the kept rows, a 15-token check, and a 1-token warm tail."""
    m.set_kv(tokens[:200], 0)
    out = [m.logits_at_end().copy()]
    out += [m.step(t).copy() for t in tokens[200:202]]
    out.append(m.verify(tokens[202:208]))
    m.rollback(4)
    out.append(m.step(tokens[204]).copy())
    out.append(m.verify(tokens[205:220]))
    m.set_kv(tokens[:221], 220)
    out.append(m.logits_at_end().copy())
    m.clear_kv()
    return out


def test_batch_graph_rule() -> None:
    assert wants_batch_graph(True, 92 * 1024 * 1024)  # the bundled model
    assert wants_batch_graph(True, BATCH_GRAPH_MAX_WEIGHTS)
    assert not wants_batch_graph(True, BATCH_GRAPH_MAX_WEIGHTS + 1)  # too big to copy for ~4.5 ms a change
    assert not wants_batch_graph(False, 92 * 1024 * 1024)  # never drafts: its row count never changes mid-decode
    assert not wants_batch_graph(True, 0)
    assert wants_batch_graph(True, 92 * 1024 * 1024, "CPU") and not wants_batch_graph(True, 92 * 1024 * 1024, "GPU.0")


def test_batch_graph_takes_prefills_and_checks_and_computes_what_one_graph_does(
    model: OpenVINOLoadedModel, backend: OpenVINOBackend, ir_dir: Path
) -> None:
    """The bundled model drafts and is small, so it is compiled twice over one set of block pools:
    decode steps run on one graph, prefill chunks and checks on the other (the shapes each request
    last ran show it), and the numbers are those of a model compiled once (no drafts, one graph),
    bit for bit, along a speculative decode's path. The copy is counted in resident_bytes and in
    describe's plan, and its cost table is kept apart."""
    req = OpenSessionRequest(path=str(ir_dir), config=Config(num_ctx=NUM_CTX))
    single = OpenVINOBackend(speculative=False)
    one = single.load(req, lambda _f: None)
    try:
        assert model.batch_graph and not one.batch_graph
        assert model.runtime_identity() == one.runtime_identity()  # the same numbers: KV and snapshots carry over
        assert cost_key(model) != cost_key(one)
        copy = 2 * model.shape.weights_bytes
        assert model.resident_bytes() - one.resident_bytes() == copy
        assert backend.describe(req).overhead_bytes - single.describe(req).overhead_bytes == copy
        assert backend.model_facts(req).overhead.fixed_bytes - single.model_facts(req).overhead.fixed_bytes == copy

        tokens = model.tokenize(LONG_PREFIX + PARAGRAPH)[:240]
        assert len(tokens) == 240
        model.clear_kv()
        two_graphs = _engine_trace(model, tokens)
        assert np.array_equal(two_graphs[-1], _engine_trace(model, tokens)[-1])  # replayed: the same bits
        for a, b in zip(two_graphs, _engine_trace(one, tokens), strict=True):
            assert np.array_equal(a, b)
        model.set_kv(tokens[:40], 0)
        model.step(tokens[40])
        steps, batch = model.step_req, model.batch_req
        assert steps is not batch and one.step_req is one.batch_req
        assert list(steps.get_tensor("input_ids").shape) == [model.step_rows]
        assert list(batch.get_tensor("input_ids").shape) == [bucket(40)]
        model.verify(tokens[41:44])
        assert list(steps.get_tensor("input_ids").shape) == [model.step_rows]
        assert list(batch.get_tensor("input_ids").shape) == [model.check_rows(3)]
        model.clear_kv()
    finally:
        one.close()


# --- reuse -------------------------------------------------------------------------------------------


def test_short_edited_tail_is_exact(model: OpenVINOLoadedModel, session: TapeSession) -> None:
    """A 1-2 token edit recomputes only those tokens (padded), and answers exactly as cold."""
    man = manifest(model, "short-edit")
    session.ensure_prefix(PrefixInput(text=LONG_PREFIX + "Mode: fast", manifest=man))
    st = session.ensure_prefix(PrefixInput(text=LONG_PREFIX + "Mode: slow", manifest=man))
    assert 0 < st.prefilled_tokens < MIN_PREFILL_ROWS // 4
    assert st.reused_tokens == st.prefix_tokens - st.prefilled_tokens
    session.prefill_suffix(SuffixInput(text="Which mode?", manifest=man))
    warm = greedy(session, 16)
    assert turn(session, manifest(model, "short-edit-cold"), LONG_PREFIX + "Mode: slow", "Which mode?", 16) == warm


def test_shape_buckets() -> None:
    assert [bucket(n) for n in (1, 15, 16, 17, 113, 256, 257, 320, 321, 1024, 1025, 4000)] == [
        16, 16, 16, 32, 128, 256, 320, 320, 384, 1024, 1280, 4096,
    ]


def test_suffix_reuse_is_the_exact_lcp(backend: OpenVINOBackend, ir_dir: Path) -> None:
    """With small (32-token) chunks, a long shared suffix start is reused to the token and stays exact."""
    m = backend.load(
        OpenSessionRequest(path=str(ir_dir), config=Config(num_ctx=1024, num_batch=32)), lambda _f: None
    )
    try:
        s = m.open_session()
        man = manifest(m, "lcp")
        shared = PARAGRAPH * 2
        q1, q2 = shared + "Question: what is kept resident?", shared + "Question: what is sent as the suffix?"
        s.ensure_prefix(PrefixInput(text="You are terse.", manifest=man))
        s.prefill_suffix(SuffixInput(text=q1, manifest=man))
        q1_end = len(m.res.tokens)
        # decoded tokens are reused when a later prompt repeats them (the default, see docs/engines.md); these 8 follow
        # q1's end, past where q2 parts from q1, so the reuse below stops inside q1 (lcp < q1_end)
        greedy(s, 8)
        p = m.res.prefix_len
        previous = list(m.res.tokens)
        st = s.prefill_suffix(SuffixInput(text=q2, manifest=man))
        target = list(m.res.tokens)
        lcp = common_prefix_len(previous, target)
        assert p + 32 < lcp < q1_end and len(target) - lcp >= 8
        assert st.reused_tokens == lcp - p
        assert st.suffix_tokens == len(target) - p
        warm = greedy(s, 16)

        cold_man = manifest(m, "lcp-cold")
        assert s.ensure_prefix(PrefixInput(text="You are terse.", manifest=cold_man)).reused_tokens == 0
        s.prefill_suffix(SuffixInput(text=q2, manifest=cold_man))
        assert m.res.tokens == target
        assert greedy(s, 16) == warm
    finally:
        m.close()


def test_f32_precision_is_exact_too(ir_dir: Path) -> None:
    """CPUs without bf16 default to f32: the same guarantees hold there, with an f32 cache as well (the engine
    option ``inference_precision`` asks for it on any CPU, and enters the runtime identity)."""
    b = OpenVINOBackend()
    m = b.load(OpenSessionRequest(path=str(ir_dir), config=Config(
        num_ctx=1024, kv_cache_type="f32", options={"inference_precision": "f32"})), lambda _f: None)
    try:
        assert (m.inference_precision, m.kv_precision, m.kv_bytes_per_token) == ("f32", "f32", 2 * 23040)
        assert m.runtime_identity()["inference_precision"] == "f32"
        s = m.open_session()
        man = manifest(m, "f32")
        first, edited = LONG_PREFIX + "Current file: a.py, line 1.", LONG_PREFIX + "Current file: src/b.py, line 200."
        turn(s, man, first, "Fix it.", 4)
        st = s.ensure_prefix(PrefixInput(text=edited, manifest=man))
        assert 0 < st.reused_tokens < st.prefix_tokens
        s.prefill_suffix(SuffixInput(text="Fix it.", manifest=man))
        warm = greedy(s, 16)
        assert turn(s, manifest(m, "f32-cold"), edited, "Fix it.", 16) == warm
    finally:
        m.close()
    with pytest.raises(UnsupportedFeature, match="f32"):
        OpenVINOBackend().load(OpenSessionRequest(path=str(ir_dir), config=Config(
            kv_cache_type="f32", options={"inference_precision": "bf16"})), lambda _f: None)


# --- decode ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("exact_reuse", [False, True], ids=["reuse", "exact_reuse"])
def test_exact_decode_makes_drafts_and_reuse_exact(
    model: OpenVINOLoadedModel, ir_dir: Path, exact_reuse: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``exact_decode`` pads every decode step to the fewest rows that take a prefill's kernels on this
    CPU (measured at load) and every check to at least as many: a decoded token's logits are a
    prefill's bit for bit, the answer with drafts is the plain one token for token (a seeded sampled
    one too, which then drafts by default), and a warm turn reusing the answer answers as a cold
    prefill (``exact_reuse`` then has nothing to recompute). The context passes 512 keys."""
    cfg = Config(num_ctx=NUM_CTX, exact_decode=True, exact_reuse=exact_reuse)
    monkeypatch.setenv(FIXED_ENV, CHEAP_CHECKS)  # drafting asserted: a fixed table, not one timed on a busy machine
    m = OpenVINOBackend().load(OpenSessionRequest(path=str(ir_dir), config=cfg), lambda _f: None)
    try:
        assert m.rows_exact and m.runtime_identity()["exact_decode"] is True
        assert not model.rows_exact and model.runtime_identity()["exact_decode"] is False
        assert m.runtime_identity() != model.runtime_identity()  # KV and snapshots of one never serve the other
        assert model.step_rows == 1 and m.step_rows in (*EXACT_STEP_ROWS, MIN_PREFILL_ROWS)
        assert all(m.check_rows(n) >= m.step_rows for n in range(1, 17))
        s = m.open_session()
        check_exact_rows(s, m.manifest_defaults(), reuse_only=exact_reuse)
        # the last decoded token, recomputed as a prefill chunk: the same bits
        n = len(m.res.tokens)
        stepped = m.logits_at_end().copy()
        assert m.set_kv(list(m.res.tokens), n - 1) == n - 1
        assert np.array_equal(m.logits_at_end(), stepped)
        snap = s.snapshot()
        # a snapshot of the exact decode is refused by a model decoding the default way
        with pytest.raises(SnapshotRejected, match="exact_decode"):
            model.open_session().restore(snap.model_copy(update={"manifest": model.manifest_defaults()}))
    finally:
        m.close()


# --- snapshots (the engine half; what every engine does is in tests/test_engines.py) -------------------------
def _snapshot_after_suffix(model: OpenVINOLoadedModel, s: TapeSession, profile: str) -> SessionSnapshot:
    man = manifest(model, profile)
    s.ensure_prefix(PrefixInput(text=LONG_PREFIX, manifest=man))
    s.prefill_suffix(SuffixInput(text="What does the agent send as the suffix?", manifest=man))
    return s.snapshot()


def test_snapshot_is_the_used_blocks_under_a_checked_header(model: OpenVINOLoadedModel, session: TapeSession) -> None:
    snap = _snapshot_after_suffix(model, session, "snap")
    reference = greedy(session, 12)
    assert snap.state_kind == "kv" and snap.backend == BACKEND_NAME
    header, body = unpack_state(STATE_MAGIC, snap.state, "an OpenVINO snapshot")
    assert header["n_tokens"] == snap.resident_tokens and len(header["pools"]) == 60
    per_token = model.kv_bytes_per_token
    assert per_token == 30 * 3 * 2 * 64 * 2
    blocks = -(-snap.resident_tokens // model.block_size)
    logits_bytes = 4 * model.vocab.size * len(header["logits"])
    assert len(snap.state) - logits_bytes <= per_token * blocks * model.block_size + 8192  # header slack
    turn(session, manifest(model, "other"), "You are a pirate.", "Say hello.", 8)
    before = list(model.res.tokens)
    other_runtime = dict(header, runtime=dict(header["runtime"], kv_precision="f32"))
    head = json.dumps(other_runtime, sort_keys=True, separators=(",", ":")).encode()
    rebuilt = snap.state[:16] + len(head).to_bytes(4, "little") + head + body
    with pytest.raises(SnapshotRejected, match="kv_precision"):
        session.restore(snap.model_copy(update={"state": rebuilt, "state_digest": "sha256:" + hashlib.sha256(rebuilt).hexdigest()}))
    assert model.res.tokens == before
    session.restore(snap)
    assert greedy(session, 12) == reference  # the stored logits: no recompute, bit for bit


def test_replay_snapshot_reprefills(model: OpenVINOLoadedModel, session: TapeSession) -> None:
    snap = _snapshot_after_suffix(model, session, "replay")
    reference = greedy(session, 12)
    replay = snap.model_copy(
        update={"state": b"", "state_kind": "replay", "state_digest": "sha256:" + hashlib.sha256(b"").hexdigest()}
    )
    turn(session, manifest(model, "other"), "You are a pirate.", "Say hello.", 4)
    session.restore(replay)
    assert model.res.tokens == snap.resident_token_ids
    assert greedy(session, 12) == reference


def test_tool_template_renders_tools_and_tool_turns(backend: OpenVINOBackend) -> None:
    """A tool-capable template (same weights, see harness/fixtures.py) gets tools, tool turns and thinking flags.

    Its IR is the one the daemon tests load (the shared model cache): a fixture's conversion, not the
    developer's models, and made once a run rather than once more here."""
    ir = prepare_ir(tool_gguf(), cache_dir=SHARED_CACHE)
    m = backend.load(OpenSessionRequest(path=str(ir), config=Config(num_ctx=1024)), lambda _f: None)
    try:
        assert m.template is not None and m.template.supports_tools
        s = m.open_session()
        man = manifest(m, "tools")
        tools = json.dumps([WEATHER_TOOL])
        st = s.ensure_prefix(PrefixInput(text="You are a weather bot.", manifest=man, tools=tools))
        prefix_text = m.prompt_text(m.res.tokens)
        assert "<tools>" in prefix_text and "get_weather" in prefix_text
        assert s.ensure_prefix(PrefixInput(text="You are a weather bot.", manifest=man, tools=tools)).reused_tokens == (
            st.prefix_tokens
        )
        s.prefill_suffix(SuffixInput(text='{"temp": 21}', role="tool", enable_thinking=False, manifest=man))
        suffix_text = m.prompt_text(m.res.tokens[m.res.prefix_len :])
        assert "<tool_response>" in suffix_text and suffix_text.endswith("<think>\n\n</think>\n\n")
        chunks = list(s.decode(DecodeConfig(max_tokens=16, parser_protocols=["hermes"])))
        assert chunks[-1].done
    finally:
        m.close()


# --- refusals and bad input -------------------------------------------------------------------------------
def test_bad_paths_fail_to_load(backend: OpenVINOBackend, tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    empty_dir = tmp_path / "ir"
    empty_dir.mkdir()
    (empty_dir / "openvino_tokenizer.xml").write_text("<net/>")
    for path in (str(tmp_path / "missing.gguf"), str(empty_dir), str(text), ""):
        req = OpenSessionRequest(path=path)
        with pytest.raises(ModelLoadFailed):
            backend.load(req, lambda _f: None)
        with pytest.raises(ModelLoadFailed):
            backend.describe(req)


def test_garbage_ir_fails_to_load(backend: OpenVINOBackend, tmp_path: Path) -> None:
    """OpenVINO's own RuntimeError for an unreadable graph arrives as ModelLoadFailed, with its reason."""
    for name in IR_FILES:
        (tmp_path / name).write_text("<net>not really</net>")
    with pytest.raises(ModelLoadFailed) as info:
        backend.load(OpenSessionRequest(path=str(tmp_path)), lambda _f: None)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "Exception from" not in info.value.message


def test_truncated_gguf_fails_to_load(backend: OpenVINOBackend, tmp_path: Path) -> None:
    bad = truncated_gguf(bundled_gguf_path(), tmp_path / "cut.gguf", 0.3)
    with pytest.raises(ModelLoadFailed):
        backend.load(OpenSessionRequest(path=str(bad)), lambda _f: None)


def test_backend_mismatch_and_unsupported_config(backend: OpenVINOBackend, ir_dir: Path) -> None:
    with pytest.raises(BackendMismatch):
        backend.load(OpenSessionRequest(path=str(ir_dir), type="llama"), lambda _f: None)
    with pytest.raises(BackendMismatch):
        backend.describe(OpenSessionRequest(path=str(ir_dir), type="llama"))
    with pytest.raises(UnsupportedFeature):
        backend.load(OpenSessionRequest(path=str(ir_dir), config=Config(kv_cache_type="q8_0")), lambda _f: None)
    with pytest.raises(InvalidArgument):
        backend.load(OpenSessionRequest(path=str(ir_dir), config=Config(num_ctx=100_000)), lambda _f: None)
    with pytest.raises(ModelLoadFailed):
        backend.load(OpenSessionRequest(path=str(ir_dir), digest="sha256:" + "1" * 64), lambda _f: None)
    for options, why in (({"extra_bufts": False}, "extra_bufts: not an option it takes"),
                         ({"inference_precision": "f8"}, "inference_precision: Input should be 'bf16', 'f16' or 'f32'")):
        for ask in (backend.describe, lambda r: backend.load(r, lambda _f: None)):
            with pytest.raises(InvalidArgument, match=f"refused by OpenVINO: {why}.*its options: inference_precision"):
                ask(OpenSessionRequest(path=str(ir_dir), config=Config(options=options)))
    assert [o.name for o in backend.describe(OpenSessionRequest(path=str(ir_dir))).engine_options] == [
        "inference_precision"]


# --- structured output ------------------------------------------------------------------------------
JSON_QUESTION = "Describe the file src/modeld/slot.py as a JSON object with path, lines and kind."
FILE_SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string", "maxLength": 30},
        "lines": {"type": "integer", "minimum": 1, "maximum": 5000},
        "kind": {"enum": ["module", "test", "config"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["path", "lines", "kind", "tags"],
    "additionalProperties": False,
}


def constrained(s: TapeSession, so: StructuredOutputConfig, n: int = 80, **cfg: Any) -> tuple[str, list[int], str]:
    ids, text, final = decode(s, n, structured_output=so, **cfg)
    return text, ids, final.finish_reason


@pytest.mark.parametrize(
    "so",
    [
        StructuredOutputConfig(json_schema=json.dumps(FILE_SCHEMA)),
        StructuredOutputConfig(regex=r"(yes|no)\. [A-Z][a-z]+ [a-z]+\."),
    ],
    ids=["json_schema", "regex"],
)
def test_structured_output_parity_with_genai(model: OpenVINOLoadedModel, session: TapeSession, so: StructuredOutputConfig) -> None:
    """Constrained greedy output equals GenAI's own StructuredOutputConfig (XGrammar), token for token.

    Same IR, same precisions and one-token steps as test_greedy_parity_with_genai_pipeline; the
    session masks with llguidance, GenAI with XGrammar: for a schema and a regex
    both allow exactly the tokens that keep the output in the language, so the
    greedy choice is the same at every step. (For GBNF the two engines' grammar
    dialects differ; see test_grammar_output_follows_the_grammar.)
    """
    man = manifest(model, "structured-parity")
    session.ensure_prefix(PrefixInput(text="You are a concise assistant that answers in JSON when asked.", manifest=man))
    session.prefill_suffix(SuffixInput(text=JSON_QUESTION, manifest=man))
    prompt_ids = list(model.res.tokens)
    text, ours, finish = constrained(session, so, speculative=False)  # one token a step, as GenAI
    assert finish == "stop"

    pipe = ov_genai.LLMPipeline(
        str(model.ir),
        "CPU",
        INFERENCE_PRECISION_HINT=model.inference_precision,
        KV_CACHE_PRECISION=model.options.kv_precision,
    )
    gc = ov_genai.GenerationConfig()
    gc.max_new_tokens = 80
    gc.do_sample = False
    gc.structured_output_config = ov_genai.StructuredOutputConfig(**{k: v for k, v in so.model_dump().items() if v})
    res = pipe.generate(ov.Tensor(np.array([prompt_ids], np.int64)), gc)
    theirs = [int(t) for t in res.tokens[0]]
    del pipe
    assert theirs[-1] in model.vocab.eog  # GenAI returns the end token; the stream reports it as "stop"
    assert ours == theirs[:-1]
    if so.json_schema:
        obj = json.loads(text)
        assert set(obj) == set(FILE_SCHEMA["required"])  # type: ignore[arg-type]
        assert obj["kind"] in ("module", "test", "config") and 1 <= obj["lines"] <= 5000
        assert len(obj["path"]) <= 30 and len(obj["tags"]) <= 2
    else:
        import re

        assert re.fullmatch(r"(yes|no)\. [A-Z][a-z]+ [a-z]+\.", text), text


def test_grammar_output_follows_the_grammar(model: OpenVINOLoadedModel, session: TapeSession) -> None:
    """GBNF (the llama backend's dialect) and Lark both constrain; sampling too; the KV stays equal to the tape."""
    import re

    man = manifest(model, "grammar")
    gbnf = 'root ::= "The answer is " [0-9]+ ("." | "!")'
    lark = 'start: "Verdict: " ("pass" | "fail") " after " /[0-9]{1,3}/ " runs"'
    for grammar, pattern in ((gbnf, r"The answer is [0-9]+[.!]"), (lark, r"Verdict: (pass|fail) after [0-9]{1,3} runs")):
        for cfg in ({}, {"temperature": 1.5, "seed": 7}):
            session.ensure_prefix(PrefixInput(text="You are terse.", manifest=man))
            session.prefill_suffix(SuffixInput(text="How many tests passed? Answer in one line.", manifest=man))
            base = list(model.res.tokens)
            text, ids, finish = constrained(session, StructuredOutputConfig(grammar=grammar), 40, **cfg)
            assert re.fullmatch(pattern, text), (grammar, cfg, text)
            assert finish == "stop"
            assert model.res.tokens == base + ids


def test_constraint_and_stop_and_length(model: OpenVINOLoadedModel, session: TapeSession) -> None:
    """A stop string still cuts constrained output; max_tokens ends it with "length" mid-language."""
    man = manifest(model, "grammar-stop")
    so = StructuredOutputConfig(grammar='root ::= "alpha beta gamma delta"')
    session.ensure_prefix(PrefixInput(text="You are terse.", manifest=man))
    session.prefill_suffix(SuffixInput(text="Say four words.", manifest=man))
    text, _, finish = constrained(session, so, 40)
    assert (text, finish) == ("alpha beta gamma delta", "stop")
    session.prefill_suffix(SuffixInput(text="Say four words.", manifest=man))
    chunks = list(session.decode(DecodeConfig(max_tokens=40, stop=[" gamma"], structured_output=so)))
    assert "".join(c.text for c in chunks) == "alpha beta" and chunks[-1].finish_reason == "stop"
    session.prefill_suffix(SuffixInput(text="Say four words.", manifest=man))
    chunks = list(session.decode(DecodeConfig(max_tokens=2, structured_output=so)))
    assert chunks[-1].finish_reason == "length" and "alpha beta gamma delta".startswith("".join(c.text for c in chunks))


@pytest.mark.parametrize(
    ("so", "error", "match"),
    [
        (StructuredOutputConfig(json_schema="{not json"), InvalidArgument, "not valid JSON"),
        (StructuredOutputConfig(json_schema="[1, 2]"), InvalidArgument, "JSON object"),
        (StructuredOutputConfig(json_schema='{"type": "wat"}'), InvalidArgument, "wat"),
        (StructuredOutputConfig(json_schema='{"type": "array", "uniqueItems": true}'), UnsupportedFeature, "uniqueItems"),
        (StructuredOutputConfig(json_schema='{"$ref": "#/nowhere"}'), InvalidArgument, "nowhere"),
        (StructuredOutputConfig(regex="(unclosed"), InvalidArgument, "regex"),
        (StructuredOutputConfig(grammar="root ::= ("), InvalidArgument, "grammar"),
        (StructuredOutputConfig(grammar='root ::= "a" missing'), InvalidArgument, "missing"),
    ],
    ids=["schema-not-json", "schema-not-object", "schema-bad-type", "schema-unenforceable", "schema-bad-ref",
         "bad-regex", "bad-gbnf", "gbnf-undefined-rule"],
)
def test_bad_constraints_are_refused_and_the_session_keeps_serving(
    model: OpenVINOLoadedModel, session: TapeSession, so: StructuredOutputConfig, error: type[ModeldError], match: str
) -> None:
    man = manifest(model, "bad-constraints")
    session.ensure_prefix(PrefixInput(text="You are terse.", manifest=man))
    session.prefill_suffix(SuffixInput(text="Give me JSON.", manifest=man))
    before = list(model.res.tokens)
    with pytest.raises(error, match=match):
        session.decode(DecodeConfig(structured_output=so))
    assert model.res.tokens == before  # refused before anything ran
    assert greedy(session, 4)


# --- describe ---------------------------------------------------------------------------------------------
def test_describe_reads_metadata_without_side_effects(
    backend: OpenVINOBackend, ir_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = backend.describe(OpenSessionRequest(path=str(ir_dir), config=Config(num_ctx=100_000)))
    assert info.model_max_context == 8192 and info.effective_context == 8192 and info.clamped
    assert (info.n_layer, info.n_head_kv, info.head_dim) == (30, 3, 64)
    assert info.kv_bytes_per_token == 30 * 3 * 2 * 64 * 2
    assert info.runtime_name == "openvino" and info.runtime_digest.startswith("openvino==")
    assert info.devices and info.devices[0].id == "CPU" and info.runtime_system_info
    assert info.supports_gpu_offload == any(d.kind == "gpu" for d in info.devices)
    f32 = backend.describe(OpenSessionRequest(path=str(ir_dir), config=Config(kv_cache_type="f32")))
    assert f32.kv_bytes_per_token == 2 * info.kv_bytes_per_token and f32.effective_context == 4096

    # a GGUF that was never converted: facts from its header, nothing written
    empty_cache = tmp_path / "cache"
    monkeypatch.setenv("MODELD_MODEL_CACHE", str(empty_cache))
    g = backend.describe(OpenSessionRequest(path=str(bundled_gguf_path())))
    assert (g.model_max_context, g.n_layer, g.n_head_kv) == (8192, 30, 3)
    assert g.digest.startswith("sha256:b179")
    assert not (empty_cache / "ov").exists()


def test_describe_ir_without_config_reads_the_graph(backend: OpenVINOBackend, ir_dir: Path, tmp_path: Path) -> None:
    for name in IR_FILES:
        (tmp_path / name).symlink_to(ir_dir / name)
    info = backend.describe(OpenSessionRequest(path=str(tmp_path), config=Config(num_ctx=1024)))
    assert (info.n_layer, info.n_head_kv, info.head_dim) == (30, 3, 64)
    assert info.model_max_context == 0 and info.effective_context == 1024  # the IR does not say


def test_prepare_entry_point_prints_the_ir_dir(ir_dir: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "backends.openvino.prepare"],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(ir_dir)  # MODELD_MODEL_CACHE points at this module's cache


def test_load_from_gguf_uses_the_prepared_ir(backend: OpenVINOBackend, ir_dir: Path) -> None:
    progress: list[float] = []
    m = backend.load(OpenSessionRequest(path=str(bundled_gguf_path()), config=Config(num_ctx=512)), progress.append)
    try:
        assert m.ir == ir_dir  # the module cache (MODELD_MODEL_CACHE) already holds it
        assert progress[0] == 0.0 and progress[-1] == 1.0 and progress == sorted(progress)
        d = m.manifest_defaults().identity()
        assert d["backend"] == "openvino" and d["model_digest"] == m.digest
        assert m.digest == json.loads((ir_dir / MARKER_FILE).read_text())["source_digest"]
        assert d["template_digest"] == "sha256:" + hashlib.sha256(m.template.source.encode()).hexdigest()  # type: ignore[union-attr]
        assert d["bos_policy"] == "none" and d["prompt_format"] == "chatml"
    finally:
        m.close()
    with pytest.raises(SessionClosed):
        m.open_session()
    assert m.resident_bytes() == 0


def test_manifest_defaults_track_numerics(model: OpenVINOLoadedModel) -> None:
    ident = model.runtime_identity()
    assert ident["kv_precision"] in ("f16", "bf16") and ident["num_ctx"] == NUM_CTX
    assert "prefill_chunk" not in ident  # split-invariant: not a numeric setting
    assert ident["inference_precision"] in ("bf16", "f32", "f16")
    assert model.manifest_defaults().runtime_digest.startswith("sha256:")


# --- error mapping -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("exc", "loading", "expected"),
    [
        (RuntimeError("Exception from src/x.cpp:1:\nsomething broke"), False, Internal),
        (RuntimeError("Exception from src/x.cpp:1:\nsomething broke"), True, ModelLoadFailed),
        (RuntimeError("Minja failed to apply chat template"), False, InvalidArgument),
        (RuntimeError("std::bad_alloc"), False, InsufficientMemory),
        (MemoryError(), False, InsufficientMemory),
        (OSError("disk"), True, ModelLoadFailed),
        (OSError("disk"), False, Internal),
        (FileNotFoundError("gone"), True, ModelLoadFailed),
        (ConversionError("gemma"), True, ModelLoadFailed),
        (ValueError("bad"), False, InvalidArgument),
        (ValueError("bad"), True, ModelLoadFailed),
        (SnapshotRejected("kept"), False, SnapshotRejected),
    ],
)
def test_map_errors(exc: BaseException, loading: bool, expected: type[ModeldError]) -> None:
    with pytest.raises(expected) as info, map_errors("act", loading=loading):
        raise exc
    assert not isinstance(exc, ModeldError) or info.value is exc
    if not isinstance(exc, ModeldError):
        assert info.value.__cause__ is exc
        assert "Exception from" not in info.value.message



def test_a_text_longer_than_the_tokenizers_own_cut_is_tokenized_whole(model: OpenVINOLoadedModel) -> None:
    """The converted tokenizer cuts every encoding at the GGUF's context length (8,192 here), whatever its
    arguments say; the model encodes a longer text in pieces cut where no token spans the cut."""
    block = "def handler_{i}(request):\n    return request.body.decode('utf-8') + 'ok {i}'\n"
    one = "".join(block.format(i=i) for i in range(20))
    text = one * 40  # ~12k tokens
    assert len(model.encode_once(text)) == model.encode_limit <= 8192  # what a single encode gives
    tokens = model.tokenize(text)
    assert tokens == model.tokenize(one) * 40 and len(tokens) > model.encode_limit


def test_the_numpy_sampler_penalises_as_llama_cpp_does() -> None:
    """llama.cpp's penalties: a repeated token's logit divided by the repeat penalty (multiplied where
    it is negative), less the frequency penalty per occurrence and the presence penalty once; the
    window is the last n tokens, prompt tail first."""
    from backends.openvino.sampling import Sampler

    s = Sampler(DecodeConfig(temperature=0.0, repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0,
                             repeat_last_n=3))
    s.start([9, 1, 1, 2])  # the window keeps the last three: 1, 1, 2
    logits = np.array([0.0, 4.0, -3.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 8.0], dtype=np.float32)
    out = s.penalised(logits)
    assert out[1] == pytest.approx(4.0 / 2 - 2 * 0.5 - 1.0) and out[2] == pytest.approx(-3.0 * 2 - 0.5 - 1.0)
    assert out[9] == 8.0 and out[3] == 5.0  # 9 left the window
    assert s(logits) == 9
    s.accept(9)  # the window now holds 1, 2, 9
    assert s(logits) == 3 and s.penalised(logits)[1] == pytest.approx(4.0 / 2 - 0.5 - 1.0)
