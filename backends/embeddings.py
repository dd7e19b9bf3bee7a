"""The embedding side slot: embeddings without touching the generation slot.

A coding agent calls ``embed`` while its chat session holds the daemon's one
generation slot. ``Llama.embed`` wipes the KV of the instance it runs on, and an
OpenVINO LLM pipeline cannot embed at all, so embeddings get their own small
model in their own *side slot*:

* it never evicts, reloads or decodes into the generation model, so the chat KV
  stays exactly as it was;
* its resident bytes are estimated *before* loading and offered to
  ``budget_check(bytes_needed)``, which raises ``InsufficientMemory`` (with the
  numbers) when the daemon's memory budget cannot hold both models — nothing is
  evicted silently;
* it shows in ``status()`` and is unloaded by ``maybe_unload_idle()`` after
  ``idle_unload_s`` without use.

Two engines, one per backend library:

* ``LlamaEmbedder`` — ``llama_cpp.Llama(path, embedding=True)`` with the pooling
  the GGUF declares, ``n_ctx = n_batch = n_ubatch =`` the model's training window
  (an encoder must see a whole sequence in one micro-batch);
* ``OpenVINOEmbedder`` — ``openvino_genai.TextEmbeddingPipeline`` over an IR
  directory with the pooling its config declares, ``normalize=True`` and
  ``max_length =`` the model's window.

The default model (a request without ``path``) is the all-MiniLM-L6-v2 that
``make setup`` prepares for that backend (``backends.embed_prepare``).

Which models can embed (UnsupportedFeature otherwise):

* GGUF: the header must declare ``<arch>.pooling_type`` MEAN (1), CLS (2) or
  LAST (3) — what llama.cpp's converter writes for sentence-embedding models. A
  model without a pooling type is accepted only when it is a non-causal encoder
  (``<arch>.attention.causal = false``), pooled by MEAN. A chat/causal model that
  declares no pooling is refused: mean-pooled decoder states are not sentence
  embeddings, and silently serving them would look like it works. RANK (4,
  rerankers) and NONE (0, per-token outputs) are refused too.
* IR: the model must have an output named ``last_hidden_state`` (what
  TextEmbeddingPipeline pools); a text-generation IR (``logits`` output or
  ``beam_idx`` input) is refused. An encoder exported with more than one output
  is a ModelLoadFailed naming the fix (re-export with the single output).

Unreadable, missing or corrupt files are ModelLoadFailed, as is a ``digest``
that does not match the file.

Inputs longer than the model's window raise ContextOverflow (with the index,
token count and window) unless the request sets ``truncate``; then each long
input is cut to the window, keeping the model's trailing special token (``[SEP]``),
as sentence-transformers does, and ``embed_with_info`` reports which inputs were
cut (``EmbedResult`` has no field for it yet).

Vectors are L2-normalised float lists; a ``texts`` request fills ``vectors`` (in
input order), a ``text`` request fills ``vector``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from contract.errors import (
    BackendMismatch,
    ContextOverflow,
    InsufficientMemory,
    Internal,
    InvalidArgument,
    ModeldError,
    ModelLoadFailed,
    UnsupportedFeature,
)
from contract.types import Config, EmbedRequest, EmbedResult

from .bundled import model_cache_dir
from .digest import file_digest, files_digest
from .embed_prepare import EMBED_MODEL_NAME, IR_MARKER_FILE, default_embedding_gguf, default_embedding_ir

__all__ = [
    "DEFAULT_IDLE_UNLOAD_S",
    "EmbedInfo",
    "EmbeddingEngine",
    "EmbeddingPlan",
    "EmbeddingSlot",
    "EngineFactory",
    "LlamaEmbedder",
    "OpenVINOEmbedder",
    "l2_normalize",
]

log = logging.getLogger(__name__)

DEFAULT_IDLE_UNLOAD_S = 300.0
_MIB = 1024 * 1024

# llama.h: enum llama_pooling_type
_POOL_NONE, _POOL_MEAN, _POOL_CLS, _POOL_LAST, _POOL_RANK = 0, 1, 2, 3, 4
_POOLING_NAMES = {_POOL_MEAN: "mean", _POOL_CLS: "cls", _POOL_LAST: "last"}


# --- the engine seam -----------------------------------------------------------------------------
@dataclass(frozen=True)
class EmbeddingPlan:
    """What a factory learnt about a model before loading it (headers and files only)."""

    backend: str
    path: Path
    model_name: str
    digest: str
    window: int  # max tokens per input, special tokens included
    pooling: str  # "mean" | "cls" | "last"
    resident_bytes: int  # estimate of the loaded model's memory: weights + buffers
    dims: int = 0  # 0 when only loading tells
    num_threads: int = 0
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.backend, os.path.realpath(self.path), self.window, self.num_threads)


class EmbeddingEngine(Protocol):
    plan: EmbeddingPlan
    dims: int

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens each input takes in the model, special tokens included, without truncation."""
        ...

    def embed(self, texts: Sequence[str], counts: Sequence[int]) -> np.ndarray:
        """Pooled vectors [len(texts), dims] in input order; inputs longer than the window are cut to it.

        ``counts`` is what ``count_tokens`` just returned for the same texts.
        """
        ...

    def close(self) -> None: ...


class EngineFactory(Protocol):
    """What ``EmbeddingSlot`` needs of an engine class (``LlamaEmbedder`` / ``OpenVINOEmbedder``)."""

    backend: str

    def default_path(self) -> Path: ...

    def plan_for(self, path: Path, config: Config) -> EmbeddingPlan: ...

    def __call__(self, plan: EmbeddingPlan) -> EmbeddingEngine: ...


def l2_normalize(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (a zero row stays zero)."""
    v = np.asarray(vectors, dtype=np.float64)
    norms = np.linalg.norm(v, axis=-1, keepdims=True)
    out: np.ndarray = np.divide(v, norms, out=np.zeros_like(v), where=norms > 0)
    return out


def _resolve_default(factory: Any) -> Path:
    try:
        return Path(factory.default_path())
    except FileNotFoundError as exc:
        raise ModelLoadFailed(str(exc)) from exc


def _threads(config: Config) -> int:
    return int(config.num_threads or 0)


def _window(native: int, config: Config, path: Path) -> int:
    if native <= 0:
        native = 512
    if config.num_ctx and config.num_ctx > native:
        raise InvalidArgument(
            f"num_ctx {config.num_ctx} exceeds the embedding model's window of {native} tokens",
            num_ctx=config.num_ctx,
            window=native,
            path=str(path),
        )
    return int(config.num_ctx or native)


def _check_digest(path: Path, expected: str, actual: str) -> None:
    if expected and expected != actual:
        raise ModelLoadFailed(
            f"{path} has digest {actual}, the request expects {expected}",
            path=str(path),
            expected=expected,
            actual=actual,
        )


# --- llama.cpp -----------------------------------------------------------------------------------
class LlamaEmbedder:
    """An embedding GGUF served by llama-cpp-python in its own ``Llama`` instance."""

    backend: ClassVar[str] = "llama"

    # --- factory side (classmethods: no model loaded) ---
    @classmethod
    def default_path(cls) -> Path:
        return default_embedding_gguf()

    @classmethod
    def plan_for(cls, path: Path, config: Config) -> EmbeddingPlan:
        from .gguf_file import is_gguf, read_gguf

        if not path.is_file():
            raise ModelLoadFailed(f"embedding model not found: {path}", path=str(path))
        if not is_gguf(path):
            raise ModelLoadFailed(f"{path} is not a GGUF file", path=str(path))
        try:
            facts = read_gguf(path)
        except ValueError as exc:
            raise ModelLoadFailed(str(exc), path=str(path)) from exc
        arch = facts.architecture
        causal = facts.raw.get(f"{arch}.attention.causal")
        pooling = facts.pooling_type
        if pooling == -1:
            if causal is False:
                pooling = _POOL_MEAN  # an encoder without a declared pooling: mean, like sentence-transformers
            else:
                raise UnsupportedFeature(
                    f"{path.name} ({arch}) declares no pooling type: it is not an embedding model "
                    "(a chat model's mean-pooled states are not sentence embeddings); use an embedding GGUF",
                    path=str(path),
                    architecture=arch,
                )
        if pooling not in _POOLING_NAMES:
            kind = {_POOL_NONE: "per-token outputs (pooling NONE)", _POOL_RANK: "a reranker (pooling RANK)"}
            raise UnsupportedFeature(
                f"{path.name} declares {kind.get(pooling, f'pooling type {pooling}')}, not sentence embeddings",
                path=str(path),
                pooling_type=pooling,
            )
        window = _window(facts.n_ctx_train, config, path)
        digest = file_digest(path, model_cache_dir())
        return EmbeddingPlan(
            backend=cls.backend,
            path=path,
            model_name=_name_for(path),
            digest=digest,
            window=window,
            pooling=_POOLING_NAMES[pooling],
            resident_bytes=cls.estimate_bytes(
                file_bytes=facts.file_bytes,
                n_embd=facts.n_embd,
                n_layer=facts.n_layer,
                n_head=facts.n_head,
                n_ctx=window,
                n_ff=int(facts.raw.get(f"{arch}.feed_forward_length", 4 * facts.n_embd) or 0),
                n_embd_kv=facts.n_head_kv * facts.head_dim_k,
                n_vocab=facts.n_vocab,
                causal=causal is not False,
            ),
            dims=facts.n_embd,
            num_threads=_threads(config),
            details={"architecture": arch, "pooling_type": pooling, "n_ctx_train": facts.n_ctx_train},
        )

    @staticmethod
    def estimate_bytes(
        *,
        file_bytes: int,
        n_embd: int,
        n_layer: int,
        n_head: int,
        n_ctx: int,
        n_ff: int,
        n_embd_kv: int,
        n_vocab: int,
        causal: bool,
    ) -> int:
        """Resident bytes of an embedding ``Llama`` at window ``n_ctx``, from the GGUF header.

        * weights twice: the mapped file plus the copy llama.cpp repacks for the CPU's
          extra buffer types (AMX / AVX-512 repack: 20 of MiniLM's 42 MiB);
        * the output buffer, reserved for ``n_seq_max`` (= min(n_ctx, 256)) outputs of
          ``n_vocab`` floats even when the model has no LM head, plus the per-token embeddings;
        * the compute buffer for one full-window micro-batch: attention scores
          (n_head x n_ctx x n_ctx f32), FFN and n_embd-wide intermediates;
        * the KV cache if the model is causal (an encoder keeps none);
        * a fixed 32 MiB for the tokenizer, allocator and Python objects.

        MiniLM-L6 f16 at 512: estimate 178 MiB; measured RSS growth after a 32 x 512-token
        batch 161 MiB with the repack on (llama.cpp reports 42 mapped + 20 repacked + 30 output
        + 18 compute) and 133 MiB with it off (``open_llama``'s AMX workaround on this CPU).
        """
        n_seq_max = min(n_ctx, 256)
        outputs = n_seq_max * n_vocab * 4 + n_ctx * n_embd * 4 * 2
        compute = n_head * n_ctx * n_ctx * 4 + n_ctx * (n_ff * 4 * 2 + n_embd * 4 * 12)
        kv = (n_layer * n_ctx * n_embd_kv * 2 * 2) if causal else 0
        return int(2 * file_bytes + outputs + compute + kv + 32 * _MIB)

    # --- engine side ---
    def __init__(self, plan: EmbeddingPlan) -> None:
        import llama_cpp

        self.plan = plan
        self._llama_cpp = llama_cpp
        pooling = {"mean": _POOL_MEAN, "cls": _POOL_CLS, "last": _POOL_LAST}[plan.pooling]
        kwargs: dict[str, Any] = dict(
            model_path=str(plan.path),
            embedding=True,
            pooling_type=pooling,
            n_ctx=plan.window,
            n_batch=plan.window,
            n_ubatch=plan.window,
            # Flash attention: packing many inputs into one micro-batch makes the attention
            # n_tokens x n_tokens (masked per sequence); without FA a full 512-token batch of
            # short texts ran ~3x slower per text than one text at a time (measured, 2 cores).
            flash_attn=True,
            n_gpu_layers=0,
            verbose=False,
        )
        if plan.num_threads:
            kwargs.update(n_threads=plan.num_threads, n_threads_batch=plan.num_threads)
        from .llama import open_llama  # this build's AMX workaround and llama.cpp log capture

        self._llm: Any = None
        try:
            self._llm = open_llama(kwargs.pop("model_path"), **kwargs)
        except (OSError, ValueError, RuntimeError, TypeError, AssertionError) as exc:
            raise ModelLoadFailed(
                f"llama.cpp could not load {plan.path}: {type(exc).__name__}: {exc}", path=str(plan.path)
            ) from exc
        try:
            self.dims = int(self._llm.n_embd())
            # the special tokens the tokenizer wraps every input in, e.g. [CLS] ... [SEP]
            empty = self._llm.tokenize(b"", add_bos=True, special=False)
            bos = int(self._llm.token_bos())
            self._n_lead = 1 if empty and empty[0] == bos else 0
            self._trailing = [int(t) for t in empty[self._n_lead :]]
            self._last: tuple[list[str], list[list[int]]] = ([], [])
            if len(empty) >= plan.window:
                raise ModelLoadFailed(f"{plan.path}: window {plan.window} cannot hold the special tokens")
        except BaseException:
            self._llm.close()
            raise

    def _tokens(self, text: str) -> list[int]:
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=True, special=False))

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        toks = [self._tokens(t) for t in texts]
        self._last = (list(texts), toks)  # embed() of the same texts reuses the tokens
        return [len(t) for t in toks]

    def _fit(self, toks: list[int]) -> list[int]:
        w = self.plan.window
        if len(toks) <= w:
            return toks
        tail = self._trailing if toks[len(toks) - len(self._trailing) :] == self._trailing else []
        return toks[: w - len(tail)] + tail

    def embed(self, texts: Sequence[str], counts: Sequence[int] = ()) -> np.ndarray:
        """Packs as many inputs into one decode as the window and the sequence limit allow."""
        last_texts, last_toks = self._last
        all_toks = last_toks if last_texts == list(texts) else [self._tokens(t) for t in texts]
        self._last = ([], [])
        lc = self._llama_cpp
        llm = self._llm
        ctx, batch = llm._ctx, llm._batch  # the same objects Llama.embed uses (it only takes strings)
        n_batch = self.plan.window
        n_seq_max = int(llm.context_params.n_seq_max) or 1
        out = np.empty((len(texts), self.dims), dtype=np.float32)
        pending: list[int] = []
        used = 0

        def flush() -> None:
            ctx.kv_cache_clear()
            try:
                ctx.decode(batch)
            finally:
                batch.reset()
            for seq, idx in enumerate(pending):
                ptr = lc.llama_get_embeddings_seq(ctx.ctx, seq)
                if not ptr:
                    raise RuntimeError(f"llama.cpp returned no pooled embedding for sequence {seq}")
                out[idx] = np.ctypeslib.as_array(ptr, shape=(self.dims,))

        try:
            batch.reset()
            for i, raw_toks in enumerate(all_toks):
                toks = self._fit(raw_toks)
                if pending and (used + len(toks) > n_batch or len(pending) >= n_seq_max):
                    flush()
                    pending, used = [], 0
                batch.add_sequence(toks, len(pending), True)
                pending.append(i)
                used += len(toks)
            if pending:
                flush()
        finally:
            ctx.kv_cache_clear()
            llm.reset()
        return out

    def close(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is not None:
            self._llm = None
            llm.close()


# --- OpenVINO ------------------------------------------------------------------------------------
_OV_REQUIRED = ("openvino_model.xml", "openvino_model.bin", "openvino_tokenizer.xml", "openvino_tokenizer.bin")


class OpenVINOEmbedder:
    """An embedding IR directory served by ``openvino_genai.TextEmbeddingPipeline`` on CPU."""

    backend: ClassVar[str] = "openvino"
    #: The pipeline pads one call's inputs to the longest, and its activations grow with
    #: inputs x padded length (attention scores: x n_head x length). Inputs are sorted by
    #: length and split into calls of at most ``max_batch`` inputs and ``max_padded_tokens``
    #: padded tokens, which bounds the activation memory whatever the request holds.
    max_batch: ClassVar[int] = 32
    max_padded_tokens: ClassVar[int] = 4096

    @classmethod
    def default_path(cls) -> Path:
        return default_embedding_ir()

    @staticmethod
    def _read_json(path: Path) -> dict[str, Any]:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    @classmethod
    def plan_for(cls, path: Path, config: Config) -> EmbeddingPlan:
        ir = path.parent if path.is_file() and path.suffix == ".xml" else path
        if not ir.is_dir():
            raise ModelLoadFailed(f"embedding IR directory not found: {path}", path=str(path))
        missing = [f for f in _OV_REQUIRED if not (ir / f).is_file()]
        if missing:
            raise ModelLoadFailed(f"{ir} is not an OpenVINO embedding IR: missing {missing}", path=str(ir))
        try:
            import openvino as ov

            model = ov.Core().read_model(str(ir / "openvino_model.xml"))
            inputs = [set(p.get_names()) for p in model.inputs]
            outputs = [set(p.get_names()) for p in model.outputs]
            hidden = None
            for p in model.outputs:
                if "last_hidden_state" in p.get_names():
                    hidden = p.get_partial_shape()
        except ModeldError:
            raise
        except Exception as exc:  # openvino raises RuntimeError subclasses for unreadable IR
            raise ModelLoadFailed(f"OpenVINO could not read {ir}: {type(exc).__name__}: {exc}", path=str(ir)) from exc
        flat_in = set().union(*inputs) if inputs else set()
        flat_out = set().union(*outputs) if outputs else set()
        if "beam_idx" in flat_in or "logits" in flat_out:
            raise UnsupportedFeature(f"{ir} is a text-generation IR, not an embedding model", path=str(ir))
        if "last_hidden_state" not in flat_out:
            raise UnsupportedFeature(
                f"{ir} has no 'last_hidden_state' output (outputs {sorted(flat_out)}): not an embedding encoder",
                path=str(ir),
            )
        if len(outputs) != 1:
            raise ModelLoadFailed(
                f"{ir} has {len(outputs)} outputs; TextEmbeddingPipeline needs exactly one, 'last_hidden_state' "
                "(re-export the encoder returning only last_hidden_state, as backends.embed_prepare does)",
                path=str(ir),
            )
        marker = cls._read_json(ir / IR_MARKER_FILE)
        hf = cls._read_json(ir / "config.json")
        pooling = str(marker.get("pooling") or cls._st_pooling(ir) or "mean")
        if pooling not in ("mean", "cls", "last"):
            raise UnsupportedFeature(f"{ir}: pooling {pooling!r} is not supported", path=str(ir))
        native = int(marker.get("max_length") or hf.get("max_position_embeddings") or 512)
        window = _window(native, config, ir)
        dims = int(marker.get("dims") or hf.get("hidden_size") or 0)
        if not dims and hidden is not None and hidden.rank.is_static and hidden[-1].is_static:
            dims = int(hidden[-1].get_length())
        bin_files = sorted(ir.glob("*.bin"))
        weights = sum(f.stat().st_size for f in bin_files)
        n_layer = int(hf.get("num_hidden_layers") or 12)
        n_head = int(hf.get("num_attention_heads") or 12)
        n_ff = int(hf.get("intermediate_size") or 4 * (dims or 768))
        digest = files_digest(
            [
                ir / f
                for f in (
                    "openvino_model.xml",
                    "openvino_model.bin",
                    "openvino_tokenizer.xml",
                    "openvino_tokenizer.bin",
                )
            ],
            model_cache_dir(),
        )
        return EmbeddingPlan(
            backend=cls.backend,
            path=ir,
            model_name=str(marker.get("model_name") or _name_for(ir)),
            digest=digest,
            window=window,
            pooling=pooling,
            resident_bytes=cls.estimate_bytes(weights, dims or 768, n_layer, n_head, n_ff, window),
            dims=dims,
            num_threads=_threads(config),
            details={"max_length": native},
        )

    @staticmethod
    def _st_pooling(ir: Path) -> str:
        cfg = OpenVINOEmbedder._read_json(ir / "1_Pooling" / "config.json")
        if cfg.get("pooling_mode_mean_tokens"):
            return "mean"
        if cfg.get("pooling_mode_cls_token"):
            return "cls"
        if cfg.get("pooling_mode_lasttoken"):
            return "last"
        return ""

    @classmethod
    def estimate_bytes(cls, weights: int, n_embd: int, n_layer: int, n_head: int, n_ff: int, n_ctx: int) -> int:
        """Resident bytes of the compiled IR: weights twice (f16 in the file, unpacked for the CPU
        kernels), one call's activations at the padded-token cap (attention scores
        n_head x tokens x n_ctx f32, FFN and n_embd-wide intermediates) and a fixed 96 MiB for the
        CPU plugin and tokenizer. MiniLM-L6: estimate 376 MiB; measured RSS growth 216 MiB
        after 32 inputs of 512 tokens."""
        tokens = max(cls.max_padded_tokens, n_ctx)
        activations = n_head * tokens * n_ctx * 4 + tokens * (n_ff * 4 * 2 + n_embd * 4 * 8)
        return int(2 * weights + activations + 96 * _MIB)

    def __init__(self, plan: EmbeddingPlan) -> None:
        import openvino_genai as og

        self.plan = plan
        kind = og.TextEmbeddingPipeline.PoolingType
        cfg = og.TextEmbeddingPipeline.Config()
        cfg.pooling_type = {"mean": kind.MEAN, "cls": kind.CLS, "last": kind.LAST_TOKEN}[plan.pooling]
        cfg.normalize = True
        cfg.max_length = plan.window
        props: dict[str, Any] = {}
        if plan.num_threads:
            props["INFERENCE_NUM_THREADS"] = plan.num_threads
        try:
            self._pipe = og.TextEmbeddingPipeline(str(plan.path), "CPU", cfg, **props)
            self._tok = og.Tokenizer(str(plan.path))
            probe = self._pipe.embed_documents(["a"])
        except Exception as exc:  # openvino raises RuntimeError subclasses
            raise ModelLoadFailed(
                f"OpenVINO could not load {plan.path}: {type(exc).__name__}: {exc}", path=str(plan.path)
            ) from exc
        self.dims = len(probe[0])

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        counts: list[int] = []
        for start in range(0, len(texts), self.max_batch):
            part = list(texts[start : start + self.max_batch])
            enc = self._tok.encode(part, truncation=False)
            counts.extend(int(n) for n in np.asarray(enc.attention_mask.data).sum(axis=1))
        return counts

    def _calls(self, counts: Sequence[int]) -> list[list[int]]:
        """Input indices grouped into pipeline calls, shortest first (see ``max_padded_tokens``)."""
        order = sorted(range(len(counts)), key=lambda i: counts[i])
        calls: list[list[int]] = []
        cur: list[int] = []
        for i in order:
            longest = min(counts[i], self.plan.window)  # sorted: the newest is the longest
            if cur and (len(cur) >= self.max_batch or (len(cur) + 1) * longest > self.max_padded_tokens):
                calls.append(cur)
                cur = []
            cur.append(i)
        if cur:
            calls.append(cur)
        return calls

    def embed(self, texts: Sequence[str], counts: Sequence[int]) -> np.ndarray:
        out = np.empty((len(texts), self.dims), dtype=np.float32)
        for idx in self._calls(counts):
            vecs = self._pipe.embed_documents([texts[i] for i in idx])
            out[idx] = np.asarray(vecs, dtype=np.float32)
        return out

    def close(self) -> None:
        self._pipe = None
        self._tok = None


def _name_for(path: Path) -> str:
    name = path.name
    for suffix in (".gguf", "-ov"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    if name.endswith((".f16", ".f32")):
        name = name[:-4]
    return name or EMBED_MODEL_NAME


# --- the side slot -------------------------------------------------------------------------------
@dataclass(frozen=True)
class EmbedInfo:
    """What ``embed_with_info`` adds to an ``EmbedResult``: tokens per input and which were cut."""

    tokens: list[int]
    truncated: list[int]  # indices of inputs cut to the window
    window: int
    loaded_now: bool  # this call loaded the model
    seconds: float


class EmbeddingSlot:
    """One embedding model, loaded on demand next to (never instead of) the generation model.

    ``engine_factory`` is an engine class (``LlamaEmbedder`` / ``OpenVINOEmbedder``) or
    anything with the same ``backend``, ``default_path()``, ``plan_for(path, config)`` and
    ``__call__(plan)``. ``budget_check(bytes_needed)`` is called before every load with the
    new model's estimated resident bytes (the previous embedding model, if any, has been
    released by then) and raises ``InsufficientMemory`` to refuse it.
    """

    def __init__(
        self,
        engine_factory: Any,
        idle_unload_s: float = DEFAULT_IDLE_UNLOAD_S,
        budget_check: Callable[[int], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._factory = engine_factory
        self.idle_unload_s = float(idle_unload_s)
        self._budget_check = budget_check
        self._clock = clock
        self._lock = threading.Lock()  # serialises loads, embeds and unloads
        self._state_lock = threading.Lock()  # guards the fields status() reads
        self._engine: EmbeddingEngine | None = None
        self._last_used_mono: float | None = None
        self._last_used_wall: float | None = None
        self._loads = 0
        self._embeds = 0
        self._last_error = ""
        self._closed = False

    @property
    def backend(self) -> str:
        return str(self._factory.backend)

    # --- embedding ---
    def embed(self, req: EmbedRequest) -> EmbedResult:
        return self.embed_with_info(req)[0]

    def embed_with_info(self, req: EmbedRequest) -> tuple[EmbedResult, EmbedInfo]:
        if req.type not in ("", self.backend):
            raise BackendMismatch(
                f"embedding model type {req.type!r} is not served by the {self.backend} backend", type=req.type
            )
        if req.texts and req.text:
            raise InvalidArgument("give either text or texts, not both")
        if not req.texts and not req.text:
            raise InvalidArgument("nothing to embed: text is empty and texts is empty")
        texts = req.inputs()
        t0 = time.perf_counter()
        with self._lock:
            if self._closed:
                raise ModelLoadFailed("the embedding slot is closed")
            engine, loaded_now = self._ensure(req)
            plan = engine.plan
            _check_digest(plan.path, req.digest, plan.digest)
            try:
                counts = engine.count_tokens(texts)
                over = [i for i, n in enumerate(counts) if n > plan.window]
                if over and not req.truncate:
                    first = over[0]
                    raise ContextOverflow(
                        f"input {first} has {counts[first]} tokens; the embedding model's window is "
                        f"{plan.window}; shorten it or set truncate to cut it to the window",
                        index=first,
                        tokens=counts[first],
                        window=plan.window,
                        over=over[:64],
                    )
                raw = engine.embed(texts, counts)
            except ModeldError:
                raise
            except Exception as exc:
                raise Internal(f"embedding failed: {type(exc).__name__}: {exc}") from exc
            finally:
                self._touch()
            if not np.all(np.isfinite(raw)):
                raise Internal("the embedding model produced non-finite values", model=plan.model_name)
            vectors = l2_normalize(raw)
            with self._state_lock:
                self._embeds += len(texts)
        if over:
            log.info("embed: truncated inputs %s to the %d-token window", over[:16], plan.window)
        dims = int(vectors.shape[1]) if vectors.ndim == 2 else 0
        result = EmbedResult(
            model_name=req.model_name or plan.model_name,
            digest=plan.digest,
            dims=dims,
        )
        if req.texts:
            result.vectors = vectors.tolist()
        else:
            result.vector = vectors[0].tolist()
        info = EmbedInfo(
            tokens=counts, truncated=over, window=plan.window, loaded_now=loaded_now, seconds=time.perf_counter() - t0
        )
        return result, info

    def _ensure(self, req: EmbedRequest) -> tuple[EmbeddingEngine, bool]:
        path = Path(req.path) if req.path else _resolve_default(self._factory)
        current = self._engine
        if current is not None and os.path.realpath(path) == os.path.realpath(current.plan.path):
            # same model: reuse unless the request asks for another window or thread count
            if not req.config.num_ctx or req.config.num_ctx == current.plan.window:
                if not req.config.num_threads or req.config.num_threads == current.plan.num_threads:
                    return current, False
        plan = self._factory.plan_for(path, req.config)
        _check_digest(plan.path, req.digest, plan.digest)
        if current is not None and current.plan.key == plan.key:
            return current, False
        self._unload_locked()
        if self._budget_check is not None:
            verdict = self._budget_check(plan.resident_bytes)  # raises InsufficientMemory to refuse
            if verdict is False:
                raise InsufficientMemory(
                    f"the embedding model {plan.model_name} needs ~{plan.resident_bytes} bytes, "
                    "which the memory budget cannot hold next to the generation model",
                    needed_bytes=plan.resident_bytes,
                    model=plan.model_name,
                )
        try:
            engine = self._factory(plan)
        except ModeldError as exc:
            with self._state_lock:
                self._last_error = str(exc)
            raise
        except MemoryError as exc:
            raise InsufficientMemory(
                f"out of memory loading the embedding model {plan.path}", needed_bytes=plan.resident_bytes
            ) from exc
        except Exception as exc:
            with self._state_lock:
                self._last_error = str(exc)
            raise ModelLoadFailed(
                f"could not load the embedding model {plan.path}: {type(exc).__name__}: {exc}", path=str(plan.path)
            ) from exc
        with self._state_lock:
            self._engine = engine
            self._loads += 1
            self._last_error = ""
        self._touch()
        return engine, True

    def _touch(self) -> None:
        with self._state_lock:
            self._last_used_mono = self._clock()
            self._last_used_wall = time.time()

    # --- lifecycle ---
    def status(self) -> dict[str, Any]:
        """A snapshot for the daemon's status; never waits for a running embed."""
        with self._state_lock:
            eng = self._engine
            plan = eng.plan if eng is not None else None
            idle = (self._clock() - self._last_used_mono) if (eng is not None and self._last_used_mono) else None
            return {
                "backend": self.backend,
                "loaded": eng is not None,
                "model_name": plan.model_name if plan else "",
                "path": str(plan.path) if plan else "",
                "digest": plan.digest if plan else "",
                "dims": int(eng.dims) if eng is not None else 0,
                "window": plan.window if plan else 0,
                "pooling": plan.pooling if plan else "",
                "resident_bytes": plan.resident_bytes if plan else 0,
                "last_used": self._last_used_wall,
                "idle_s": round(idle, 3) if idle is not None else None,
                "idle_unload_s": self.idle_unload_s,
                "loads": self._loads,
                "embedded_inputs": self._embeds,
                "last_error": self._last_error,
            }

    def resident_bytes(self) -> int:
        """Estimated bytes the loaded embedding model holds (0 when none): for the memory budget."""
        with self._state_lock:
            return self._engine.plan.resident_bytes if self._engine is not None else 0

    def maybe_unload_idle(self, now: float | None = None) -> bool:
        """Unload the model if unused for ``idle_unload_s``; True if it did. Never waits for a running embed."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            with self._state_lock:
                if self._engine is None or self._last_used_mono is None:
                    return False
                t = self._clock() if now is None else now
                if t - self._last_used_mono < self.idle_unload_s:
                    return False
            self._unload_locked()
            return True
        finally:
            self._lock.release()

    def unload(self) -> bool:
        with self._lock:
            return self._unload_locked()

    def _unload_locked(self) -> bool:
        with self._state_lock:
            eng, self._engine = self._engine, None
        if eng is None:
            return False
        try:
            eng.close()
        except Exception:  # noqa: BLE001 - releasing must not fail the caller
            log.exception("closing the embedding engine failed")
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._unload_locked()
