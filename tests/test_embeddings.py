"""The embedding side slot on real models, both engines.

The prepared all-MiniLM-L6-v2 (GGUF for llama.cpp, IR for OpenVINO) is checked
against sentence-transformers' own normalised output. The reference runs in a
subprocess (``python -m benchmarks.embed --reference``; another interpreter
with ``MODELD_REFERENCE_PYTHON``) so torch never loads into the test process. If
the prepared models are missing the module fixture runs the preparation, as
``make setup`` does; nothing is skipped.

Each engine is loaded once per module; tests that need their own lifecycle
(idle unload, budget refusal, model change, bad models) use their own slot.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest

from backends.bundled import bundled_gguf_path
from backends.embed_prepare import default_embedding_gguf, default_embedding_ir
from backends.embeddings import l2_normalize
from backends.llama.embedder import LlamaEmbedder
from backends.openvino.embedder import OpenVINOEmbedder
from contract.errors import (
    BackendMismatch,
    ContextOverflow,
    InsufficientMemory,
    InvalidArgument,
    ModelLoadFailed,
    UnsupportedFeature,
)
from contract.types import Config, EmbedRequest
from modeld.embedding_slot import EmbeddingSlot

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("llama", "openvino")
FACTORIES = {"llama": LlamaEmbedder, "openvino": OpenVINOEmbedder}

#: ≥ 20 varied inputs: code, prose, unicode, short and paragraph-long (all < 256 tokens,
#: so sentence-transformers' own 256-token truncation never applies)
TEXTS: list[str] = [
    "def add(a, b):\n    return a + b",
    "How do I reverse a linked list in place?",
    "The quick brown fox jumps over the lazy dog.",
    "SELECT name, COUNT(*) FROM users GROUP BY name HAVING COUNT(*) > 1;",
    "Ünïcödé façade naïve café — 日本語のテキスト 🚀",
    "for (let i = 0; i < items.length; i++) { total += items[i].price; }",
    "Fix the flaky test: the socket closes before the reply arrives.",
    "git rebase --onto main feature~3 feature",
    'fn main() { println!("hello, world"); }',
    "El rápido zorro marrón salta sobre el perro perezoso.",
    "Пример текста на русском языке для проверки.",
    "中文句子用于测试嵌入模型的多语言能力。",
    "TypeError: 'NoneType' object is not subscriptable",
    "a",
    "🙂🙃🚀✨",
    "   leading and trailing whitespace   ",
    "MiXeD CaSe ShOuTiNg AND numbers 1234567890 3.14159",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n        self.items.append(x)\n",
    '<div class="card"><h1>Title</h1><p>Body &amp; more</p></div>',
    '{"name": "modeld", "version": "0.1.0", "tags": ["llm", "daemon"]}',
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    (
        "A coding agent calls the daemon hundreds of times per task with a large stable prefix "
        "(the system prompt, the tools and a map of the repository) and a small volatile suffix "
        "such as a diff, the output of a failing test or the user's next turn. Keeping the prefix's "
        "key-value cache hot means that a warm turn only has to prefill what changed, which turns "
        "a multi-second wait into a fraction of a second on a laptop without a GPU."
    ),
    "x = [i * i for i in range(10) if i % 2 == 0]  # squares of even numbers",
    "Ελληνικά: η γρήγορη καφέ αλεπού",
]

#: (query, code): for each query the matching snippet must be the nearest
PAIRS: list[tuple[str, str]] = [
    ("reverse a string", "def reverse(s):\n    return s[::-1]"),
    ("read a JSON file from disk", "with open(path) as f:\n    data = json.load(f)"),
    ("compute the factorial of a number recursively", "def fact(n):\n    return 1 if n <= 1 else n * fact(n - 1)"),
    ("send an HTTP GET request and fail on errors", "resp = requests.get(url, timeout=10)\nresp.raise_for_status()"),
    ("sort a list of users by their age", "users.sort(key=lambda u: u.age)"),
]

#: far beyond the 512-token window (every "wordNNN" is several word pieces)
LONG_TEXT = " ".join(f"word{i} apple banana" for i in range(400))


# --- fixtures ------------------------------------------------------------------------------------
def _prepared() -> tuple[Path, Path]:
    try:
        return default_embedding_gguf(), default_embedding_ir()
    except FileNotFoundError:
        # what `make setup` runs; a failure here fails the module, it never skips it
        res = subprocess.run(
            [sys.executable, "-m", "backends.embed_prepare"], cwd=ROOT, capture_output=True, text=True, timeout=900
        )
        assert res.returncode == 0, f"embedding preparation failed:\n{res.stdout}\n{res.stderr}"
        return default_embedding_gguf(), default_embedding_ir()


@pytest.fixture(scope="module")
def prepared() -> tuple[Path, Path]:
    return _prepared()


@pytest.fixture(scope="module")
def reference(prepared: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    """sentence-transformers' vectors for every text the tests compare, from one subprocess."""
    texts = TEXTS + [q for q, _ in PAIRS] + [c for _, c in PAIRS] + [LONG_TEXT]
    tmp = tmp_path_factory.mktemp("st-reference")
    src, dst = tmp / "texts.json", tmp / "vectors.npy"
    src.write_text(json.dumps(texts))
    python = os.environ.get("MODELD_REFERENCE_PYTHON") or sys.executable
    # max_seq_length 512 = the model's window: the same as sentence-transformers' default (256)
    # for every text here except LONG_TEXT, whose truncated form the truncation test compares
    res = subprocess.run(
        [python, "-m", "benchmarks.embed", "--reference", str(src), str(dst), "--max-seq-length", "512"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    assert res.returncode == 0, (
        "the sentence-transformers reference failed (it needs torch==2.13.0, transformers and "
        f"sentence-transformers, the dev extra):\n{res.stderr[-3000:]}"
    )
    vectors = np.load(dst)
    return dict(zip(texts, vectors, strict=True))


@pytest.fixture(scope="module")
def slots(prepared: tuple[Path, Path]) -> Iterator[dict[str, EmbeddingSlot]]:
    made = {name: EmbeddingSlot(FACTORIES[name]) for name in ENGINES}
    yield made
    for slot in made.values():
        slot.close()


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _vectors(slot: EmbeddingSlot, texts: list[str], **kw: object) -> np.ndarray:
    res = slot.embed(EmbedRequest(texts=texts, **kw))  # type: ignore[arg-type]
    return np.asarray(res.vectors)


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(l2_normalize(a) * l2_normalize(b), axis=-1)


# --- acceptance: agreement with sentence-transformers --------------------------------------------
def test_cosine_against_sentence_transformers(
    engine: str, slots: dict[str, EmbeddingSlot], reference: dict[str, np.ndarray]
) -> None:
    slot = slots[engine]
    counts = slot.embed_with_info(EmbedRequest(texts=TEXTS))[1].tokens
    assert max(counts) <= 256, "the corpus must stay inside sentence-transformers' own truncation"
    got = _vectors(slot, TEXTS)
    ref = np.stack([reference[t] for t in TEXTS])
    cos = _cos(got, ref)
    print(f"\n{engine}: min cosine vs sentence-transformers over {len(TEXTS)} texts = {cos.min():.6f}")
    assert len(TEXTS) >= 20
    assert got.shape == (len(TEXTS), 384)
    assert cos.min() >= 0.99, {t: float(c) for t, c in zip(TEXTS, cos, strict=True) if c < 0.99}
    # single-text requests give the same vectors as the batch
    for i in (0, 4, len(TEXTS) - 1):
        single = slot.embed(EmbedRequest(text=TEXTS[i]))
        assert single.vectors == [] and len(single.vector) == 384
        assert _cos(np.asarray(single.vector), got[i]) > 0.9999


def test_semantic_sanity_query_code_pairs(engine: str, slots: dict[str, EmbeddingSlot]) -> None:
    queries = _vectors(slots[engine], [q for q, _ in PAIRS])
    codes = _vectors(slots[engine], [c for _, c in PAIRS])
    sims = queries @ codes.T
    nearest = sims.argmax(axis=1)
    assert list(nearest) == list(range(len(PAIRS))), np.round(sims, 3)


def test_vectors_are_normalised_and_batch_order_is_kept(engine: str, slots: dict[str, EmbeddingSlot]) -> None:
    slot = slots[engine]
    texts = TEXTS[:12]
    forward = _vectors(slot, texts)
    backward = _vectors(slot, texts[::-1])
    np.testing.assert_allclose(np.linalg.norm(forward, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(backward[::-1], forward, atol=2e-3)
    # a batch larger than one decode / one pipeline call, with duplicates and mixed lengths
    big = (texts + [LONG_TEXT[:2000]]) * 5
    many = _vectors(slot, big)
    assert many.shape == (len(big), 384)
    for i, t in enumerate(big):
        j = (texts + [LONG_TEXT[:2000]]).index(t)
        ref = forward[j] if j < len(texts) else many[len(texts)]
        assert _cos(many[i], ref) > 0.999, (i, t[:40])
    res = slot.embed(EmbedRequest(texts=texts))
    assert res.dims == 384 and res.vector == [] and len(res.vectors) == len(texts)
    assert res.model_name == "all-MiniLM-L6-v2" and res.digest.startswith("sha256:")


# --- window: overflow and truncation -------------------------------------------------------------
def test_context_overflow_unless_truncate(
    engine: str, slots: dict[str, EmbeddingSlot], reference: dict[str, np.ndarray]
) -> None:
    slot = slots[engine]
    with pytest.raises(ContextOverflow) as exc:
        slot.embed(EmbedRequest(texts=["short", LONG_TEXT]))
    details = exc.value.details
    assert details["index"] == 1 and details["window"] == 512 and details["tokens"] > 512
    assert "512" in exc.value.message and "truncate" in exc.value.message
    with pytest.raises(ContextOverflow):
        slot.embed(EmbedRequest(text=LONG_TEXT))

    res, info = slot.embed_with_info(EmbedRequest(texts=["short", LONG_TEXT], truncate=True))
    assert info.truncated == [1] and info.window == 512 and info.tokens[1] > 512
    # cut to the window with [SEP] kept: what sentence-transformers computes at max_seq_length 512
    cos = float(_cos(np.asarray(res.vectors[1]), reference[LONG_TEXT]))
    print(f"\n{engine}: truncated long text, cosine vs sentence-transformers(max_seq_length=512) = {cos:.6f}")
    assert cos >= 0.99
    single = slot.embed(EmbedRequest(text=LONG_TEXT, truncate=True))
    assert _cos(np.asarray(single.vector), np.asarray(res.vectors[1])) > 0.9999


# --- the side slot never touches a generation model -------------------------------------------
def test_generation_kv_is_not_disturbed(slots: dict[str, EmbeddingSlot]) -> None:
    from backends.llama import open_llama

    chat_path = bundled_gguf_path()
    # logits_all: this llama-cpp-python writes ``scores`` only then (else the rows stay as numpy allocated them,
    # and two unwritten rows compare equal by chance or not at all)
    chat = open_llama(chat_path, n_ctx=256, n_batch=256, logits_all=True)
    control = open_llama(chat_path, n_ctx=256, n_batch=256, logits_all=True)
    try:
        prompt = chat.tokenize(b"<|im_start|>user\nWrite a haiku about caches.<|im_end|>\n<|im_start|>assistant\n")
        nxt = chat.tokenize(b" Warm", add_bos=False)[:1]
        chat.eval(prompt)
        before = chat.n_tokens
        for slot in slots.values():  # loads (if needed) and runs both engines in between
            slot.embed(EmbedRequest(texts=TEXTS))
        assert chat.n_tokens == before
        chat.eval(nxt)
        control.eval(prompt)
        control.eval(nxt)
        last = control.scores[control.n_tokens - 1]
        assert np.isfinite(last).all() and last.std() > 1.0  # written logits, not an allocation's zeros
        np.testing.assert_allclose(chat.scores[chat.n_tokens - 1], last, atol=1e-4)
    finally:
        chat.close()
        control.close()


def test_status_reports_the_side_slot(engine: str, slots: dict[str, EmbeddingSlot]) -> None:
    slot = slots[engine]
    slot.embed(EmbedRequest(text="status probe"))
    st = slot.status()
    assert st["loaded"] is True and st["backend"] == engine
    assert st["model_name"] == "all-MiniLM-L6-v2" and st["dims"] == 384 and st["window"] == 512
    assert st["pooling"] == "mean" and st["digest"].startswith("sha256:")
    assert st["resident_bytes"] > 40 * 1024 * 1024 and st["resident_bytes"] == slot.resident_bytes()
    assert st["last_used"] is not None and st["idle_unload_s"] == 300.0
    assert Path(st["path"]) == (default_embedding_gguf() if engine == "llama" else default_embedding_ir())


def test_concurrent_callers_get_their_own_vectors(slots: dict[str, EmbeddingSlot]) -> None:
    slot = slots["llama"]
    expected = {t: np.asarray(slot.embed(EmbedRequest(text=t)).vector) for t in TEXTS[:6]}
    errors: list[BaseException] = []

    def worker(text: str) -> None:
        try:
            for _ in range(5):
                got = np.asarray(slot.embed(EmbedRequest(text=text)).vector)
                assert _cos(got, expected[text]) > 0.99999
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in TEXTS[:6]]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors


# --- lifecycle: budget, idle unload, model change -------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_idle_unload_and_reload(engine: str, prepared: tuple[Path, Path]) -> None:
    clock = FakeClock()
    slot = EmbeddingSlot(FACTORIES[engine], idle_unload_s=10, clock=clock)
    try:
        assert slot.maybe_unload_idle() is False  # nothing loaded
        first = slot.embed(EmbedRequest(text="idle test")).vector
        clock.t += 5
        assert slot.maybe_unload_idle() is False and slot.status()["loaded"] is True
        clock.t += 6
        assert slot.maybe_unload_idle() is True
        st = slot.status()
        assert st["loaded"] is False and st["resident_bytes"] == 0 and slot.resident_bytes() == 0
        again = slot.embed(EmbedRequest(text="idle test")).vector
        assert slot.status()["loads"] == 2
        assert _cos(np.asarray(first), np.asarray(again)) > 0.99999
    finally:
        slot.close()


def test_budget_refusal_names_the_numbers(engine: str, prepared: tuple[Path, Path]) -> None:
    asked: list[int] = []

    def refuse(needed: int) -> None:
        asked.append(needed)
        raise InsufficientMemory(
            f"the embedding model needs {needed} bytes, 1000 are free", needed_bytes=needed, available_bytes=1000
        )

    slot = EmbeddingSlot(FACTORIES[engine], budget_check=refuse)
    try:
        with pytest.raises(InsufficientMemory) as exc:
            slot.embed(EmbedRequest(text="no room"))
        assert asked and asked[0] > 40 * 1024 * 1024  # at least the weights
        assert exc.value.details["needed_bytes"] == asked[0]
        assert slot.status()["loaded"] is False
    finally:
        slot.close()

    granted: list[int] = []
    ok = EmbeddingSlot(FACTORIES[engine], budget_check=granted.append)
    try:
        ok.embed(EmbedRequest(text="room"))
        assert granted == [ok.resident_bytes()]
        ok.embed(EmbedRequest(text="again"))
        assert len(granted) == 1  # no second load for the same model
    finally:
        ok.close()


def test_model_change_reloads(tmp_path: Path, prepared: tuple[Path, Path]) -> None:
    other = tmp_path / "other-embedder.gguf"
    shutil.copyfile(prepared[0], other)
    slot = EmbeddingSlot(LlamaEmbedder)
    try:
        a = slot.embed(EmbedRequest(text="model change"))
        b = slot.embed(EmbedRequest(text="model change", path=str(other), model_name="mine"))
        st = slot.status()
        assert st["loads"] == 2 and st["path"] == str(other) and b.model_name == "mine"
        assert a.digest == b.digest  # same bytes
        assert _cos(np.asarray(a.vector), np.asarray(b.vector)) > 0.99999
        slot.embed(EmbedRequest(text="model change", path=str(other)))
        assert slot.status()["loads"] == 2  # reused
        assert slot.embed(EmbedRequest(text="x", path=str(other))).model_name == "other-embedder"
    finally:
        slot.close()


# --- refusals -------------------------------------------------------------------------------------
def _header_gguf(path: Path, arch: str, *, pooling: int | None = None, causal: bool | None = None) -> Path:
    """A GGUF with only a header (no tensors): enough for the checks made before loading."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    if pooling is not None:
        w.add_uint32(f"{arch}.pooling_type", pooling)
    if causal is not None:
        w.add_causal_attention(causal)
    w.add_tokenizer_model("gpt2" if arch == "llama" else "bert")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_llama_refusals(tmp_path: Path, prepared: tuple[Path, Path]) -> None:
    slot = EmbeddingSlot(LlamaEmbedder)
    try:
        # a real chat model: no pooling declared, causal -> not an embedding model
        with pytest.raises(UnsupportedFeature, match="not an embedding model"):
            slot.embed(EmbedRequest(text="x", path=str(bundled_gguf_path())))
        with pytest.raises(UnsupportedFeature, match="declares no pooling"):
            slot.embed(EmbedRequest(text="x", path=str(_header_gguf(tmp_path / "chat.gguf", "llama"))))
        with pytest.raises(UnsupportedFeature, match="reranker"):
            slot.embed(EmbedRequest(text="x", path=str(_header_gguf(tmp_path / "rank.gguf", "bert", pooling=4))))
        with pytest.raises(ModelLoadFailed, match="not found"):
            slot.embed(EmbedRequest(text="x", path=str(tmp_path / "missing.gguf")))
        junk = tmp_path / "junk.gguf"
        junk.write_bytes(b"not a gguf at all")
        with pytest.raises(ModelLoadFailed, match="not a GGUF"):
            slot.embed(EmbedRequest(text="x", path=str(junk)))
        # an encoder header that declares mean pooling but has no weights: llama.cpp refuses it
        hollow = _header_gguf(tmp_path / "hollow.gguf", "bert", pooling=1, causal=False)
        with pytest.raises(ModelLoadFailed):
            slot.embed(EmbedRequest(text="x", path=str(hollow)))
        assert slot.status()["loaded"] is False
        with pytest.raises(ModelLoadFailed, match="digest"):
            slot.embed(EmbedRequest(text="x", digest="sha256:" + "0" * 64))
        with pytest.raises(BackendMismatch):
            slot.embed(EmbedRequest(text="x", type="openvino"))
        with pytest.raises(InvalidArgument):
            slot.embed(EmbedRequest())
        with pytest.raises(InvalidArgument):
            slot.embed(EmbedRequest(text="a", texts=["b"]))
        with pytest.raises(InvalidArgument, match="window"):
            slot.embed(EmbedRequest(text="x", config=Config(num_ctx=4096)))
        # after all that, the default model still serves
        assert len(slot.embed(EmbedRequest(text="still fine", type="llama")).vector) == 384
    finally:
        slot.close()


def _ir_with_outputs(dst: Path, ir: Path, outputs: list[str], *, beam_idx: bool = False) -> Path:
    """A tiny IR directory (real tokenizer files, a toy model with the given output names)."""
    import openvino as ov
    from openvino import opset13 as ops

    dst.mkdir()
    for name in ("openvino_tokenizer.xml", "openvino_tokenizer.bin"):
        shutil.copyfile(ir / name, dst / name)
    ids = ops.parameter([-1, -1], ov.Type.i64, name="input_ids")
    params = [ids]
    hidden = ops.unsqueeze(ops.convert(ids, ov.Type.f32), ops.constant(np.array([2], dtype=np.int64)))
    if beam_idx:
        params.append(ops.parameter([-1], ov.Type.i32, name="beam_idx"))
    results = []
    for name in outputs:
        res = ops.result(ops.multiply(hidden, ops.constant(np.ones((1, 1, 8), dtype=np.float32))))
        res.output(0).get_tensor().set_names({name})
        results.append(res)
    ov.save_model(ov.Model(results, params, "toy"), dst / "openvino_model.xml")
    return dst


def test_openvino_refusals(tmp_path: Path, prepared: tuple[Path, Path]) -> None:
    ir = prepared[1]
    slot = EmbeddingSlot(OpenVINOEmbedder)
    try:
        with pytest.raises(UnsupportedFeature, match="text-generation"):
            slot.embed(
                EmbedRequest(text="x", path=str(_ir_with_outputs(tmp_path / "llm", ir, ["logits"], beam_idx=True)))
            )
        with pytest.raises(UnsupportedFeature, match="last_hidden_state"):
            slot.embed(EmbedRequest(text="x", path=str(_ir_with_outputs(tmp_path / "other", ir, ["features"]))))
        two = _ir_with_outputs(tmp_path / "two", ir, ["last_hidden_state", "pooler_output"])
        with pytest.raises(ModelLoadFailed, match="exactly one"):
            slot.embed(EmbedRequest(text="x", path=str(two)))
        (tmp_path / "empty").mkdir()
        with pytest.raises(ModelLoadFailed, match="missing"):
            slot.embed(EmbedRequest(text="x", path=str(tmp_path / "empty")))
        with pytest.raises(ModelLoadFailed, match="not found"):
            slot.embed(EmbedRequest(text="x", path=str(tmp_path / "nowhere")))
        broken = tmp_path / "broken"
        shutil.copytree(ir, broken)
        (broken / "openvino_model.xml").write_text("<net>truncated")
        with pytest.raises(ModelLoadFailed):
            slot.embed(EmbedRequest(text="x", path=str(broken)))
        with pytest.raises(BackendMismatch):
            slot.embed(EmbedRequest(text="x", type="llama"))
        assert slot.status()["loaded"] is False
        assert len(slot.embed(EmbedRequest(text="still fine", type="openvino")).vector) == 384
    finally:
        slot.close()


def test_prepare_is_idempotent(prepared: tuple[Path, Path]) -> None:
    gguf_path, ir = prepared
    before = (gguf_path.stat().st_mtime_ns, (ir / "openvino_model.bin").stat().st_mtime_ns)
    res = subprocess.run(
        [sys.executable, "-m", "backends.embed_prepare"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [str(gguf_path), str(ir)]
    assert (gguf_path.stat().st_mtime_ns, (ir / "openvino_model.bin").stat().st_mtime_ns) == before
    marker = json.loads((ir / "modeld_embedding.json").read_text())
    assert marker["pooling"] == "mean" and marker["normalize"] is True and marker["max_length"] == 512
