"""The llama.cpp backend against the real bundled model (SmolLM2-135M, Q4_1).

The model is loaded once per module (num_ctx 2048); tests that need another
configuration load their own small instance. Every test starts with its own
ensure_prefix, so the shared KV never couples tests to their order.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2
import pytest

pytest.importorskip("llama_cpp")

from backends.bundled import bundled_gguf_path  # noqa: E402
from backends.llama import LlamaBackend, LlamaLoadedModel, open_llama  # noqa: E402
from backends.llama import probe as rows_probe  # noqa: E402
from backends.llama.model import STATE_MAGIC  # noqa: E402
from backends.llama.native import map_errors  # noqa: E402
from backends.llama.probe import RowsProbe  # noqa: E402
from backends.tape.draft_costs import FIXED_ENV  # noqa: E402
from backends.tape.session import TapeSession  # noqa: E402
from backends.tape.state import frame_state, unpack_state  # noqa: E402
from contract.errors import (  # noqa: E402
    BackendMismatch,
    ContextOverflow,
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
    StreamChunk,
    StructuredOutputConfig,
    SuffixInput,
)
from harness.fixtures import WEATHER_TOOL, tool_gguf, truncated_gguf  # noqa: E402
from tests.engine_kit import CHEAP_CHECKS, check_exact_rows  # noqa: E402

pytestmark = pytest.mark.llama

NUM_CTX = 2048
SYSTEM = (
    "You are a concise senior software engineer helping with a Python repository. "
    "The repository has a package named modeld with modules slot.py, server.py and blobs.py. "
    "Answer questions about caching, concurrency and testing with short, precise sentences. "
    "Prefer concrete examples over general advice, and mention file names when relevant."
)
QUESTION = "Explain in detail how a hash map handles collisions."


@pytest.fixture(scope="module")
def backend() -> LlamaBackend:
    return LlamaBackend()


@pytest.fixture(scope="module")
def model_path() -> Path:
    return bundled_gguf_path()


@pytest.fixture(scope="module")
def model(backend: LlamaBackend, model_path: Path) -> Iterator[LlamaLoadedModel]:
    m = backend.load(OpenSessionRequest(path=str(model_path), config=Config(num_ctx=NUM_CTX)), lambda f: None)
    yield m
    m.close()


@pytest.fixture(scope="module")
def manifest(model: LlamaLoadedModel) -> ContextManifest:
    return model.manifest_defaults()


@pytest.fixture
def session(model: LlamaLoadedModel) -> Iterator[TapeSession]:
    s = model.open_session()
    yield s
    s.close()


def greedy(session: TapeSession, n: int, **kw: object) -> tuple[list[int], str, StreamChunk]:
    chunks = list(session.decode(DecodeConfig(max_tokens=n, return_token_ids=True, **kw)))  # type: ignore[arg-type]
    ids = [t for c in chunks for t in c.token_ids]
    return ids, "".join(c.text for c in chunks), chunks[-1]


def turn(session: TapeSession, manifest: ContextManifest, system: str, user: str) -> None:
    session.ensure_prefix(PrefixInput(text=system, manifest=manifest))
    session.prefill_suffix(SuffixInput(text=user, manifest=manifest))


def kv_consistent(model: LlamaLoadedModel) -> bool:
    return model.llm.n_tokens == len(model.res.tokens) and model.kv_pos_max() == len(model.res.tokens) - 1


# --- load, describe, bad paths ---------------------------------------------------------------------
def test_load_reports_progress_and_identity(backend: LlamaBackend, model_path: Path) -> None:
    seen: list[float] = []
    m = backend.load(OpenSessionRequest(path=str(model_path), config=Config(num_ctx=256)), seen.append)
    try:
        assert seen[0] == 0.0 and seen[-1] == 1.0
        assert seen == sorted(seen) and len(seen) > 3  # real per-tensor progress, not just 0 and 1
        assert m.num_ctx == 256
        assert m.digest == "sha256:" + hashlib.sha256(model_path.read_bytes()).hexdigest()
        d = m.manifest_defaults().identity()
        assert d["backend"] == "llama" and d["prompt_format"] == "chatml" and d["model_digest"] == m.digest
        assert d["bos_policy"] == "none"  # SmolLM2: add_bos_token = false
        assert m.resident_bytes() > 90_000_000
    finally:
        m.close()


def test_an_engine_option_reaches_the_load_and_its_identity(backend: LlamaBackend, model_path: Path) -> None:
    """``Config.options`` as llama.cpp's entry declares them: ``extra_bufts`` off is the load's and enters the runtime
    identity (on is not forced here: this build's AMX matrix product crashes the process on AMX CPUs)."""
    m = backend.load(OpenSessionRequest(path=str(model_path), config=Config(num_ctx=256, options={
        "extra_bufts": "false"})), lambda f: None)
    try:
        assert m.runtime_identity()["extra_bufts"] is False and m.config.options == {"extra_bufts": "false"}
    finally:
        m.close()
    req = OpenSessionRequest(path=str(model_path))
    assert [(o.name, o.type) for o in backend.describe(req).engine_options] == [("extra_bufts", "boolean"),
                                                                               ("mmproj", "string")]
    with pytest.raises(InvalidArgument, match="extra_bufts=true contradicts the layout asked for"):
        backend.describe(req.model_copy(update={"config": Config(flash_attn=True, kv_cache_type="q8_0",
                                                                 options={"extra_bufts": True})}))
    for options, why in (({"inference_precision": "f32"}, "inference_precision: not an option it takes"),
                         ({"extra_bufts": "maybe"}, "extra_bufts: Input should be a valid boolean")):
        with pytest.raises(InvalidArgument, match=f"refused by llama.cpp: {why}.*its options: extra_bufts"):
            backend.load(req.model_copy(update={"config": Config(options=options)}), lambda f: None)


WATCH_THE_IMPORT = """
import os, sys
seen = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "llama_cpp":
            seen.append(os.environ.get("GOMP_SPINCOUNT"))
        return None
sys.meta_path.insert(0, Watch())
from backends.llama import LlamaBackend  # the package is light: its backend loads llama.cpp
print(seen[0])
"""


@pytest.mark.parametrize(("given", "seen"), [(None, "3000"), ("50", "50")])
def test_llama_threads_spin_briefly_at_a_barrier_unless_the_user_says(given: str | None, seen: str) -> None:
    """libgomp reads GOMP_SPINCOUNT when llama.cpp's library loads: the value must be set before that import."""
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if given is not None:
        env["GOMP_SPINCOUNT"] = given
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", WATCH_THE_IMPORT], env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [seen]


def test_default_num_ctx_is_explicit(backend: LlamaBackend, model_path: Path) -> None:
    m = backend.load(OpenSessionRequest(path=str(model_path)), lambda f: None)
    try:
        assert m.num_ctx == 4096 and m.llm.n_ctx() == 4096  # never llama.cpp's n_ctx=0 (= 8192 here)
    finally:
        m.close()


def test_the_served_bundled_model_is_the_bundled_one_with_a_longer_context(backend: LlamaBackend, tmp_path: Path) -> None:
    """``serve`` preloads a copy whose RoPE base is raised for a 4x window; every other byte is the bundled file's."""
    from backends.bundled import EXTENDED_CONTEXT, served_bundled_gguf
    from backends.gguf_file import gguf_scalars

    src, ext = bundled_gguf_path(), served_bundled_gguf(tmp_path)
    assert served_bundled_gguf(tmp_path) == ext  # written once
    import numpy as np

    a, b = np.fromfile(src, dtype=np.uint8), np.fromfile(ext, dtype=np.uint8)
    assert a.shape == b.shape
    differ = np.flatnonzero(a != b)
    assert 0 < len(differ) <= 8 and differ.max() < 4096  # two header values
    facts = gguf_scalars(ext)
    assert facts["llama.context_length"] == EXTENDED_CONTEXT == 32768
    assert abs(facts["llama.rope.freq_base"] - 100_000 * 4 ** (64 / 62)) < 1.0
    info = backend.describe(OpenSessionRequest(path=str(ext), config=Config(num_ctx=1024)))
    assert info.model_max_context == 32768


def test_describe_reads_metadata_only(backend: LlamaBackend, model_path: Path) -> None:
    info = backend.describe(OpenSessionRequest(path=str(model_path), config=Config(num_ctx=1024)))
    assert info.model_max_context == 8192
    assert (info.n_layer, info.n_head_kv, info.head_dim) == (30, 3, 64)
    assert info.kv_bytes_per_token == 30 * 3 * (64 + 64) * 2
    assert info.effective_context == 1024
    assert info.required_bytes == info.weights_bytes + info.kv_bytes_per_token * 1024
    assert info.runtime_name == "llama.cpp" and "0.3.36" in info.runtime_digest
    assert "CPU" in info.runtime_system_info and info.device_kind == "cpu"
    q8 = backend.describe(
        OpenSessionRequest(path=str(model_path), config=Config(kv_cache_type="q8_0", flash_attn=True))
    )
    assert q8.kv_bytes_per_token == 30 * 3 * 128 * 34 // 32 and q8.effective_context == 4096


def test_bad_model_files(backend: LlamaBackend, model_path: Path, tmp_path: Path) -> None:
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_text("this is not a model")
    truncated = truncated_gguf(model_path, tmp_path / "half.gguf", 0.5)
    cut_header = truncated_gguf(model_path, tmp_path / "head.gguf", 0.0005)
    for path, needle in [
        (tmp_path / "missing.gguf", "not found"),
        (not_gguf, "not a GGUF"),
        (truncated, "not within the file bounds"),  # llama.cpp's own reason is quoted
        (cut_header, "truncated"),
    ]:
        with pytest.raises(ModelLoadFailed, match=needle):
            backend.load(OpenSessionRequest(path=str(path), config=Config(num_ctx=256)), lambda f: None)
    with pytest.raises(ModelLoadFailed, match="digest"):
        backend.load(OpenSessionRequest(path=str(model_path), digest="sha256:00", config=Config(num_ctx=256)), lambda f: None)


def test_backend_mismatch_and_invalid_config(backend: LlamaBackend, model_path: Path) -> None:
    with pytest.raises(BackendMismatch):
        backend.load(OpenSessionRequest(path=str(model_path), type="openvino"), lambda f: None)
    with pytest.raises(BackendMismatch):
        backend.describe(OpenSessionRequest(path=str(model_path), type="openvino"))
    with pytest.raises(InvalidArgument, match="flash_attn"):
        backend.load(OpenSessionRequest(path=str(model_path), config=Config(kv_cache_type="q4_0")), lambda f: None)
    with pytest.raises(InvalidArgument, match="training context"):
        backend.load(OpenSessionRequest(path=str(model_path), config=Config(num_ctx=100_000)), lambda f: None)
    # exact decoding is the layout whose rows are exact; a request without it is refused, not re-laid out
    for layout in ({}, {"flash_attn": True}, {"flash_attn": True, "kv_cache_type": "f16"},
                   {"flash_attn": True, "kv_cache_type": "q8_0", "num_gpu_layers": -1}):
        with pytest.raises(UnsupportedFeature, match="exact_decode on llama.cpp needs .* flash_attn=true"):
            backend.load(OpenSessionRequest(path=str(model_path), config=Config(exact_decode=True, **layout)),
                         lambda f: None)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (ValueError("bad"), InvalidArgument),
        (RuntimeError("llama_decode returned 1"), ContextOverflow),
        (RuntimeError("llama_decode returned -3"), Internal),
        (OSError("disk"), Internal),
        (TypeError("ctypes"), Internal),
        (MemoryError(), InsufficientMemory),
        (jinja2.TemplateError("tpl"), InvalidArgument),
    ],
)
def test_foreign_exceptions_are_mapped(exc: BaseException, expected: type[ModeldError]) -> None:
    with pytest.raises(expected) as info, map_errors("op"):
        raise exc
    assert info.value.__cause__ is exc
    with pytest.raises(ModelLoadFailed), map_errors("load", loading=True):
        raise ValueError("Failed to load model")


# --- parity and warm reuse ----------------------------------------------------------------------------
def test_greedy_parity_with_llama_cpp_python(model: LlamaLoadedModel, manifest: ContextManifest, session: TapeSession) -> None:
    turn(session, manifest, SYSTEM, QUESTION)
    prompt = list(model.res.tokens)
    ids, text, last = greedy(session, 24)
    assert len(ids) >= 16 and last.done and last.usage is not None
    assert last.usage.prompt_tokens == len(prompt) and last.usage.completion_tokens == len(ids)
    # The reference: llama-cpp-python's own greedy loop on the same token ids, in
    # a separate instance built with the same context settings.
    ref = open_llama(model.path, **model.options.llama_kwargs())
    try:
        ref_ids: list[int] = []
        for tok in ref.generate(prompt, temp=0.0):
            if ref.token_eos() == tok or len(ref_ids) == len(ids):
                break
            ref_ids.append(tok)
        assert ref_ids == ids
        out = ref.create_completion(prompt, temperature=0.0, max_tokens=len(ids))
        assert out["choices"][0]["text"] == text  # type: ignore[index]
    finally:
        ref.close()


def test_suffix_reuses_previous_answer_and_raw_continuation(model: LlamaLoadedModel, manifest: ContextManifest, session: TapeSession) -> None:
    turn(session, manifest, SYSTEM, QUESTION)
    greedy(session, 12)
    tape = list(model.res.tokens)
    after_prefix = tape[model.res.prefix_len :]
    continuation = model.llm.detokenize(after_prefix, special=True).decode() + "<|im_end|>\n<|im_start|>user\nShorter?<|im_end|>\n"
    expected = common_prefix_len(after_prefix, model.tokenize(continuation))
    st = session.prefill_suffix(SuffixInput(text=continuation, manifest=manifest, render=False))
    assert st.reused_tokens == expected and expected >= len(after_prefix) - 1
    assert st.resident_tokens == st.prefix_tokens + st.suffix_tokens
    ids, _, last = greedy(session, 4)
    assert last.usage is not None and last.usage.completion_tokens == len(ids)


def test_rendered_suffix_is_the_model_template(model: LlamaLoadedModel, manifest: ContextManifest, session: TapeSession) -> None:
    turn(session, manifest, SYSTEM, QUESTION)
    rendered = model.llm.detokenize(model.res.tokens, special=True).decode()
    assert rendered == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )


# --- errors that leave the resident context untouched -----------------------------------------------------


def test_regex_and_bad_grammar_are_refused(manifest: ContextManifest, session: TapeSession) -> None:
    turn(session, manifest, SYSTEM, QUESTION)
    with pytest.raises(UnsupportedFeature):
        session.decode(DecodeConfig(structured_output=StructuredOutputConfig(regex="[a-z]+")))
    with pytest.raises(InvalidArgument, match="grammar"):
        session.decode(DecodeConfig(structured_output=StructuredOutputConfig(grammar="root ::= (")))
    with pytest.raises(UnsupportedFeature):
        session.decode(DecodeConfig(parser_protocols=["smoke-signals"]))


# --- decoding details ------------------------------------------------------------------------------------------


def test_stop_string_and_utf8_streaming(model: LlamaLoadedModel, manifest: ContextManifest, session: TapeSession) -> None:
    turn(session, manifest, SYSTEM, "Say something festive.")
    answer = "祝日 🎉🎊 feliz día ✓ END tail"
    grammar = "root ::= " + json.dumps(answer, ensure_ascii=False)  # GBNF has no surrogate pairs
    chunks = list(
        session.decode(
            DecodeConfig(max_tokens=80, stop=["END"], return_token_ids=True, structured_output=StructuredOutputConfig(grammar=grammar))
        )
    )
    texts = [c.text for c in chunks if not c.done]
    assert "".join(texts) == "祝日 🎉🎊 feliz día ✓ "
    assert all("\ufffd" not in t for t in texts)
    # some tokens carried only part of a character: they produced no text of their own
    assert any(c.token_ids and not c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop"
    assert kv_consistent(model)


def test_think_block_goes_to_thinking(manifest: ContextManifest, session: TapeSession) -> None:
    turn(session, manifest, SYSTEM, QUESTION)
    grammar = "root ::= " + json.dumps("<think>buckets and chains</think>Use chaining.")
    chunks = list(session.decode(DecodeConfig(max_tokens=60, structured_output=StructuredOutputConfig(grammar=grammar))))
    assert "".join(c.thinking for c in chunks) == "buckets and chains"
    assert "".join(c.text for c in chunks) == "Use chaining."
    turn(session, manifest, SYSTEM, QUESTION)
    raw = list(
        session.decode(DecodeConfig(max_tokens=60, reasoning_format="none", structured_output=StructuredOutputConfig(grammar=grammar)))
    )
    assert "".join(c.text for c in raw).startswith("<think>")


def test_json_schema_output_validates(manifest: ContextManifest, session: TapeSession) -> None:
    turn(session, manifest, SYSTEM, "Describe a file as JSON.")
    schema = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "maxLength": 24},
            "lines": {"type": "integer"},
            "kind": {"enum": ["module", "test", "config"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            "tested": {"type": "boolean"},
        },
        "required": ["path", "lines", "kind", "tags", "tested"],
        "additionalProperties": False,
    }
    chunks = list(session.decode(DecodeConfig(max_tokens=160, structured_output=StructuredOutputConfig(json_schema=json.dumps(schema)))))
    assert chunks[-1].finish_reason == "stop"
    obj = json.loads("".join(c.text for c in chunks))
    assert set(obj) == {"path", "lines", "kind", "tags", "tested"}
    assert isinstance(obj["path"], str) and len(obj["path"]) <= 24
    assert isinstance(obj["lines"], int) and not isinstance(obj["lines"], bool)
    assert obj["kind"] in ("module", "test", "config")
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3 and all(isinstance(t, str) and len(t) <= 8 for t in obj["tags"])
    assert isinstance(obj["tested"], bool)
    # A bound the grammar converter would silently ignore is refused instead.
    bounded = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}, "required": ["n"]}
    with pytest.raises(UnsupportedFeature, match="maximum"):
        session.decode(DecodeConfig(structured_output=StructuredOutputConfig(json_schema=json.dumps(bounded))))
    # ... while a property that is merely *named* like a keyword is fine
    named = {"type": "object", "properties": {"maximum": {"type": "integer"}}, "required": ["maximum"]}
    session.decode(DecodeConfig(max_tokens=1, structured_output=StructuredOutputConfig(json_schema=json.dumps(named)))).close()
    with pytest.raises(InvalidArgument):
        session.decode(DecodeConfig(structured_output=StructuredOutputConfig(json_schema="{nope")))


def test_decode_stops_at_context_full(backend: LlamaBackend, model_path: Path, manifest: ContextManifest) -> None:
    small = backend.load(OpenSessionRequest(path=str(model_path), config=Config(num_ctx=128)), lambda f: None)
    try:
        s = small.open_session()
        with pytest.raises(InvalidArgument):
            s.decode(DecodeConfig())  # nothing resident yet
        man = small.manifest_defaults()
        s.ensure_prefix(PrefixInput(text=SYSTEM, manifest=man))
        s.prefill_suffix(SuffixInput(text="Go on.", manifest=man))
        before = len(small.res.tokens)
        # A grammar with no end: only the context size can stop it.
        endless = StructuredOutputConfig(grammar='root ::= [a-z]+ " " root')
        chunks = list(s.decode(DecodeConfig(max_tokens=500, structured_output=endless)))
        assert chunks[-1].finish_reason == "context_full"
        assert len(small.res.tokens) == 128 and kv_consistent(small)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 128 - before
    finally:
        small.close()
    with pytest.raises(SessionClosed):
        s.ensure_prefix(PrefixInput(text="x", manifest=man))


# --- the row-invariant layout: flash attention over a q8_0 KV cache ---------------------------------------------


@pytest.mark.parametrize("exact_reuse", [False, True], ids=["reuse", "exact_reuse"])
def test_a_row_invariant_layout_makes_drafts_and_reuse_exact(
    backend: LlamaBackend, model_path: Path, exact_reuse: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flash attention over a quantized cache runs every row, alone or in any batch, through the same
    kernels, so a check's rows and a prefill's compute what one-token steps compute: the answer with
    drafts is the plain one token for token, sampled ones too, and a warm turn reusing it answers as a
    cold prefill (``exact_reuse`` then has nothing to recompute). The context passes 512 keys, where a
    one-token step over an f16 cache takes another attention path."""
    cfg = Config(num_ctx=NUM_CTX, flash_attn=True, kv_cache_type="q8_0", exact_reuse=exact_reuse)
    monkeypatch.setenv(FIXED_ENV, CHEAP_CHECKS)  # drafting asserted: a fixed table, not one timed on a busy machine
    m = backend.load(OpenSessionRequest(path=str(model_path), config=cfg), lambda f: None)
    try:
        # the load's probe found this model's rows equal (Q4_1 has one kernel per row count) and said so
        assert m.probe is not None and m.probe.exact and m.probe.max_diff == 0.0 and m.rows_exact
        assert m.speculation().rows_exact and "equal bit for bit" in m.speculation().rows_probe
        assert m.res.tokens == [] and m.kv_pos_max() == -1  # the probe left nothing resident
        check_exact_rows(m.open_session(), m.manifest_defaults(), reuse_only=exact_reuse)
    finally:
        m.close()


def _fake_probe(exact: bool) -> RowsProbe:
    return RowsProbe(exact=exact, max_diff=0.0 if exact else 0.375, check_rows=16, alone_rows=4, prefill_tokens=32,
                     parted=() if exact else ("steps and check",), ms=1.0)


@pytest.mark.parametrize("exact_decode", [False, True], ids=["layout", "exact_decode"])
def test_a_failed_rows_probe_serves_inexact_or_refuses_exact_decode(
    backend: LlamaBackend, model_path: Path, monkeypatch: pytest.MonkeyPatch, exact_decode: bool
) -> None:
    """The probe's result, not the layout, decides ``rows_exact``: rows found apart serve the layout without the
    promise (sampled passes do not draft by default, ``status`` says why), and refuse a load that asked for
    exact decode, naming the model, the difference and what to do. A fake result drives both branches."""
    calls: list[int] = []

    def fake(llm: object, tokens: list[int], *args: object) -> RowsProbe:
        calls.append(len(tokens))
        return _fake_probe(False)

    monkeypatch.setattr(rows_probe, "measure", fake)
    cfg = Config(num_ctx=256, flash_attn=True, kv_cache_type="q8_0", exact_decode=exact_decode)
    req = OpenSessionRequest(path=str(model_path), config=cfg)
    if exact_decode:
        with pytest.raises(UnsupportedFeature, match="without --exact-decode") as exc:
            LlamaBackend(speculative=False).load(req, lambda f: None)
        assert str(model_path) in str(exc.value) and "0.375" in str(exc.value)
        assert exc.value.details["max_abs_diff"] == 0.375 and exc.value.details["model"] == str(model_path)
    else:
        m = LlamaBackend(speculative=False).load(req, lambda f: None)
        try:
            assert m.probe is not None and not m.rows_exact
            status = m.speculation()
            assert not status.rows_exact and "apart by up to 0.375" in status.rows_probe
            m.speculative = True  # greedy decodes draft; a sampled one does not unless it asks
            man = m.manifest_defaults()
            s = m.open_session()
            s.ensure_prefix(PrefixInput(text=SYSTEM, manifest=man))
            s.prefill_suffix(SuffixInput(text=SYSTEM, manifest=man))  # something to copy
            sampled = {"temperature": 0.7, "top_k": 1, "seed": 3}  # sampled, yet it copies as greedy does
            asked = greedy(s, 24, speculative=True, **sampled)[2]
            assert asked.usage is not None and asked.usage.drafted_tokens > 0
            s.prefill_suffix(SuffixInput(text=SYSTEM, manifest=man))
            final = greedy(s, 24, **sampled)[2]
            assert final.usage is not None and final.usage.drafted_tokens == 0
        finally:
            m.close()
    assert calls == [32]  # probed once, with the probe's tokens
    # the default layout cannot be exact: nothing is probed, nothing claimed
    monkeypatch.setattr(rows_probe, "measure", lambda *a: pytest.fail("probed the default layout"))
    m = LlamaBackend(speculative=False).load(OpenSessionRequest(path=str(model_path), config=Config(num_ctx=256)),
                                             lambda f: None)
    try:
        assert m.probe is None and not m.rows_exact and m.speculation().rows_probe == ""
    finally:
        m.close()


def test_gemma_with_exact_decode_loads_as_its_probe_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3 270M Q4_K_M mixes Q4_K, Q5_0, Q6_K and Q8_0 tensors, whose batch kernels may round apart from
    their one-row ones on a CPU: whatever the probe measures here, the load follows it (served exact, or
    refused with the difference it measured)."""
    from backends.bundled import gemma_gguf_path

    path = gemma_gguf_path()
    seen: list[RowsProbe] = []
    real = rows_probe.measure

    def spy(*args: Any) -> RowsProbe:
        seen.append(real(*args))
        return seen[-1]

    monkeypatch.setattr(rows_probe, "measure", spy)
    cfg = Config(num_ctx=1024, flash_attn=True, kv_cache_type="q8_0", exact_decode=True)
    try:
        m = LlamaBackend(speculative=False).load(OpenSessionRequest(path=str(path), config=cfg), lambda f: None)
    except UnsupportedFeature as exc:
        assert len(seen) == 1 and not seen[0].exact and seen[0].max_diff > 0 and seen[0].parted
        assert str(path) in str(exc) and f"{seen[0].max_diff:.3g}" in str(exc)
        assert exc.details["max_abs_diff"] == seen[0].max_diff
    else:
        try:
            assert len(seen) == 1 and seen[0].exact and seen[0].max_diff == 0.0
            assert m.rows_exact and m.speculation().rows_exact and m.probe == seen[0]
        finally:
            m.close()


# --- sessions and snapshots --------------------------------------------------------------------------------------


def _redigest(snap: SessionSnapshot, state: bytes) -> SessionSnapshot:
    return snap.model_copy(update={"state": state, "state_digest": "sha256:" + hashlib.sha256(state).hexdigest()})


def test_snapshot_is_per_sequence_state_under_a_checked_header(
    model: LlamaLoadedModel, manifest: ContextManifest, session: TapeSession
) -> None:
    """The engine half of snapshots; what every engine does is in tests/test_engines.py."""
    turn(session, manifest, SYSTEM, QUESTION)
    snap = session.snapshot()
    assert snap.state_kind == "kv" and snap.backend == "llama" and snap.resident_tokens == len(model.res.tokens)
    # per-sequence state: ~23 KB per token for this model (30 layers × 3 KV heads × 128 × f16)
    assert 20_000 * snap.resident_tokens < len(snap.state) < 26_000 * snap.resident_tokens
    direct, _, _ = greedy(session, 8)
    turn(session, manifest, SYSTEM, "What does blobs.py store?")
    before = list(model.res.tokens)
    header, body = unpack_state(STATE_MAGIC, snap.state, "a llama snapshot")
    blob = bytes(body)
    foreign = {
        "kv type": _redigest(snap, frame_state(STATE_MAGIC, header | {"type_k": 8, "type_v": 8}, blob)),
        "header model": _redigest(snap, frame_state(STATE_MAGIC, header | {"model_digest": "sha256:ab"}, blob)),
        "short blob": _redigest(snap, frame_state(STATE_MAGIC, header, blob[: len(blob) // 3])),
    }
    for name, bad in foreign.items():
        with pytest.raises(SnapshotRejected):
            session.restore(bad)
        assert model.res.tokens == before and kv_consistent(model), name
    session.restore(snap)
    assert kv_consistent(model) and not model.logits_live  # state bytes carry no logits
    assert greedy(session, 8)[0] == direct


# --- tools, with the tool-capable fixture template ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tool_model(backend: LlamaBackend) -> Iterator[LlamaLoadedModel]:
    m = backend.load(OpenSessionRequest(path=str(tool_gguf()), config=Config(num_ctx=1024)), lambda f: None)
    yield m
    m.close()


def test_tools_render_and_grammar_forced_call_is_parsed(tool_model: LlamaLoadedModel) -> None:
    man = tool_model.manifest_defaults()
    assert man.template_digest != "" and man.prompt_format == "chatml"
    s = tool_model.open_session()
    st = s.ensure_prefix(PrefixInput(text="You are a weather bot.", tools=json.dumps([WEATHER_TOOL]), manifest=man))
    prompt = tool_model.llm.detokenize(tool_model.res.tokens, special=True).decode()
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt and prompt.startswith("<|im_start|>system\nYou are a weather bot.")
    s.prefill_suffix(SuffixInput(text="What is the weather in Paris?", manifest=man, enable_thinking=False))
    suffix = tool_model.llm.detokenize(tool_model.res.tokens[st.prefix_tokens :], special=True).decode()
    assert suffix.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking reached the template
    grammar = (
        'root ::= "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"" '
        '[A-Z] [a-z]{1,15} "\\"}}\\n</tool_call>"'
    )
    chunks = list(s.decode(DecodeConfig(max_tokens=60, structured_output=StructuredOutputConfig(grammar=grammar))))
    calls = [c for chunk in chunks for c in chunk.tool_calls]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    args = json.loads(calls[0].function.arguments)
    assert set(args) == {"city"} and args["city"][0].isupper()
    assert "".join(c.text for c in chunks).strip() == ""
    assert chunks[-1].finish_reason == "tool_calls"
    # the tool's answer goes in as a "tool" turn, rendered by the template
    s.prefill_suffix(SuffixInput(text='{"temp_c": 18}', role="tool", manifest=man))
    suffix = tool_model.llm.detokenize(tool_model.res.tokens[st.prefix_tokens :], special=True).decode()
    assert "<tool_response>\n{\"temp_c\": 18}\n</tool_response>" in suffix
    s.close()
