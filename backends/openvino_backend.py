"""The OpenVINO backend: real inference on an OpenVINO IR whose paged KV cache we own.

Mechanism
---------
A GGUF is converted once to an IR directory (``backends.ov_prepare``); an IR
directory can also be given directly. At load the stateful LLM graph is
rewritten with OpenVINO's own ``paged_attention_transformation`` (the pass
openvino-genai's continuous-batching pipeline applies): every attention layer
becomes a PagedAttention op whose K and V block pools are *model inputs*. We
allocate those pools ourselves (``num_ctx`` tokens, 32-token blocks on CPU) and
drive the graph with one ``InferRequest``; block ``i`` holds positions
``[32i, 32i+32)``, so the block table is the identity. Next to the pools a
``contract.resident.Resident`` keeps the token tape; the invariant is::

    Resident.tokens == the tokens whose K/V are in the pools' first blocks

* Reuse: ``ensure_prefix`` renders the stable text with the model's own chat
  template (``openvino_genai.Tokenizer.apply_chat_template``), tokenizes it, lets
  ``Resident.plan_prefix`` pick the reusable length (manifest gate, then token
  LCP) and prefills only the tail, passing ``past_lens = reused``. Cutting the KV
  to n tokens costs nothing: the next step overwrites cells from n on. The
  reported reused/prefilled numbers are exactly what was run through the graph.
* Exactness. Measured on this plugin (bf16 and f32 compute, 16- and 32-bit
  cache): a paged-attention prefill is *split-invariant*: the logits after 700
  tokens are bit-identical whether they were prefilled in one chunk or in any
  split into chunks of >= 5 tokens (bf16; >= 2 with an f32 hint) — tested in
  ``test_prefill_is_split_invariant``. Shorter chunks (and every decode step)
  go through other kernels whose rounding differs (up to ~0.65 in the logits).
  So:

  - every prefill chunk runs *padded* to a bucket of at least
    ``MIN_PREFILL_ROWS`` (16) rows (below); a real row's numbers do not depend
    on the rows after it (causal attention, row-wise matmuls — checked bit for
    bit), so even a 1-token tail is computed exactly as a cold prefill computes
    it;
  - tokens produced by decode (one at a time) are never reused
    (``exact_len``); a later prompt containing them recomputes them as a chunk;
  - then warm output equals cold output bit for bit for a full prefix hit, a
    partially reused (edited) prefix and a partially reused suffix alike
    (tested), and the prefill chunk size does not enter the runtime digest.

  The stateful graph driven directly (``VariableState`` trimming) was measured
  first and dropped: its numerics depend on where a chunk starts (logits moved
  by ~1.4 of ~33), its attention for a chunk after a past costs ~4 ms/token on
  2 cores (a 128-token suffix after a 2k prefix: ~560 ms vs ~120-200 ms paged),
  and reading a variable converts the whole cache (~190 ms per 2k tokens).
* Shape buckets. The CPU plugin compiles kernels for every new chunk length
  it meets: the first 121-token chunk after a 2k prefix took ~120 ms, the same
  chunk again ~90 ms. An agent's turns all have different lengths, so nearly
  every warm turn paid that. A prefill chunk is therefore padded to a bucket
  (multiples of 16 rows up to 256, of 64 up to 1,024, then of 256) — the padding
  rows land in KV cells past the tape, which the next step overwrites — and
  the buckets a warm turn uses are compiled at load (``warm_up``, ~1 s).
* Logits: the LM head is computed for one row per step, the last real one
  (a ``sample_index`` input, as GenAI's gather-before-matmul does); the
  last-position logits of every prefill are kept per tape length, so a full
  prefix hit or a restore samples without recomputing anything.
* Decode samples in numpy (greedy argmax; top-k → top-p → temperature with a
  seeded ``numpy.random.Generator``) and feeds every sampled token back through
  the graph, so the KV always holds the tape. Closing the stream evaluates the
  token already handed out, then stops: tape and KV stay equal.
* Snapshots are the used blocks of every K/V pool, byte for byte (bf16/f16:
  23,040 B/token for SmolLM2-135M, rounded up to whole 32-token blocks), plus
  the stored logits, after a JSON header (pool names, element type, block
  layout) — no pickle, no conversion, so restore is lossless by construction and
  continues bit for bit (tested). A "replay" snapshot (token tape only) is also
  accepted: restore re-prefills it (exact except for tokens that were decoded).

Parity: greedy output equals openvino-genai's own ``LLMPipeline`` (its default
paged-attention backend, same precisions) token for token on the normal
two-chunk path (tested). What this costs versus using a GenAI pipeline: no
GenAI sampler (reimplemented here), no GenAI grammar engine (XGrammar lives
inside GenAI's C++ sampler; structured output is done with llguidance token
masks instead, see ``backends.guidance``, and equals GenAI's constrained greedy
output for a JSON schema and a regex, tested), and the paged graph comes from
``openvino._offline_transformations`` (a documented but underscore-named module).

Precision: ``INFERENCE_PRECISION_HINT`` is the device default unless the backend
is built with one (bf16 on this AMX CPU; the resolved value is recorded).
``KV_CACHE_PRECISION`` is "f16" ("" and "f16"; the CPU plugin stores it as bf16
under a bf16 hint) or "f32" (needs an f32 hint). The quantised caches (u8/u4,
the CPU default) are refused: a chunk attends to its own keys unquantised and to
its past quantised, so where a chunk starts moves the numbers — measured on 300
tokens split at 32/64 (block-aligned) and elsewhere, the final logits differed
from a one-chunk prefill by up to 0.375 (u8) and 2.0 (u4), so a warm turn would
not answer like a cold one. The cache type actually compiled, the hint, the
block size and the context size are the ``runtime_digest``.

Tools: minja (GenAI's template engine) *polyfills* tools for templates that do
not use them — it injects a generic JSON tool prompt and a ``{"tool_calls": …}``
output format the Hermes parser does not read — so rendering with and without
tools always differs. Tool support is therefore decided from the template
source (does it reference ``tools``?) and refused with UnsupportedFeature
otherwise, instead of silently changing the prompt format.

Threading: the daemon calls everything from one worker thread;
``resident_bytes()`` and ``explain_context()`` may run on another and only read
plain attributes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import struct
import threading
from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino.opset13 as ov_ops
import openvino_genai
from openvino._offline_transformations import paged_attention_transformation

from contract import interrupt
from contract.errors import (
    BackendMismatch,
    InsufficientMemory,
    Internal,
    InvalidArgument,
    ModeldError,
    ModelLoadFailed,
    SessionClosed,
    SnapshotRejected,
    UnsupportedFeature,
)
from contract.manifest import canonical_digest, common_prefix_len
from contract.resident import Resident
from contract.types import (
    Config,
    DecodeConfig,
    DeviceInfo,
    EmbedRequest,
    EmbedResult,
    ModelInfo,
    OpenSessionRequest,
    SessionSnapshot,
    StreamChunk,
)

from .bundled import model_cache_dir
from .digest import file_digest, files_digest
from .gguf_meta import is_gguf, read_gguf
from .guidance import TokenGuide, build_tokenizer, compile_grammar
from .ov_prepare import IR_FILES, ConversionError, ir_dir_for, is_complete_ir, prepare_ir
from .tape_session import Render, TapeSession, resolve_num_ctx, wants_bos, with_bos

__all__ = [
    "BACKEND_NAME",
    "DEFAULT_NUM_CTX",
    "DEFAULT_PREFILL_CHUNK",
    "MIN_PREFILL_ROWS",
    "OpenVINOBackend",
    "OpenVINOLoadedModel",
    "OpenVINOSession",
    "runtime_version",
]

BACKEND_NAME = "openvino"
DEFAULT_NUM_CTX = 4096
#: prefill chunk (Config.num_batch = 0); it bounds scratch memory and does not change numerics
DEFAULT_PREFILL_CHUNK = 512
#: the CPU plugin computes chunks of 1..4 tokens (bf16; 1 token under f32) with other kernels
#: whose rounding differs; prefill chunks are padded to at least this many rows so every
#: prompt token is computed the same way (and this is the smallest shape bucket)
MIN_PREFILL_ROWS = 16
#: (up to this many rows, round up to a multiple of this) — see "Shape buckets" above
_BUCKET_STEPS = ((256, 16), (1024, 64), (1 << 62, 256))
#: the largest bucket compiled at load: what warm turns' suffixes use
_WARM_BUCKETS_UP_TO = 256
#: Config.kv_cache_type -> KV_CACHE_PRECISION; q8_0/q4_0 are refused (see the module docstring)
KV_PRECISIONS: dict[str, str] = {"": "f16", "f16": "f16", "f32": "f32"}
_KV_BYTES = {"f16": 2, "f32": 4}
_PAGED_INPUTS = frozenset(
    {
        "input_ids",
        "position_ids",
        "past_lens",
        "subsequence_begins",
        "block_indices",
        "block_indices_begins",
        "max_context_len",
        "sample_index",
    }
)
_STATE_MAGIC = b"MODELD-OV-PKV1\0\0"
#: token texts that end a turn in common chat vocabularies (llama.cpp treats them as EOG too)
_EOG_TEXTS = (b"<|endoftext|>", b"<|im_end|>", b"<|eot_id|>", b"<|eom_id|>", b"<|end|>", b"<end_of_turn>")
_TOOLS_IN_TEMPLATE = re.compile(r"\btools\b")
#: prefill scratch per chunk token: RSS grew by the KV plus ~15 MB (512-token chunks) and
#: ~36 MB (2,048) prefilling 4,000 tokens of SmolLM2-135M; activations scale with the
#: hidden size, so this rounds up and stays an estimate for larger models
_SCRATCH_BYTES_PER_TOKEN = 32 * 1024


def runtime_version() -> str:
    return str(ov.get_version())


# --- the one place foreign exceptions become typed errors ------------------------------
def _ov_message(exc: BaseException) -> str:
    """OpenVINO's text without its "Exception from src/...cpp:N:" location lines."""
    lines = [ln.strip() for ln in str(exc).splitlines()]
    kept = [ln for ln in lines if ln and not ln.startswith("Exception from ")]
    text = " | ".join(kept) or type(exc).__name__
    return text if len(text) <= 600 else text[:600] + "…"


@contextlib.contextmanager
def _map_ov_errors(action: str, *, loading: bool = False) -> Iterator[None]:
    """Translate OpenVINO / GenAI / OS exceptions into modeld errors, most specific first.

    Typed errors pass through. While ``loading`` every failure is ModelLoadFailed
    with the cause; afterwards a template failure is the caller's input, an
    allocation failure is memory, and anything else is Internal.
    """
    try:
        yield
    except ModeldError:
        raise
    except MemoryError as exc:
        raise InsufficientMemory(f"{action}: out of memory") from exc
    except ConversionError as exc:
        raise ModelLoadFailed(f"{action}: {exc}") from exc
    except OSError as exc:
        msg = f"{action}: {type(exc).__name__}: {exc}"
        raise (ModelLoadFailed(msg) if loading else Internal(msg)) from exc
    except RuntimeError as exc:
        text = _ov_message(exc)
        msg = f"{action}: {text}"
        if loading:
            raise ModelLoadFailed(msg) from exc
        if "chat template" in text.lower() or "minja" in text.lower():
            raise InvalidArgument(f"{action}: the model's chat template failed: {text}") from exc
        if "bad_alloc" in text or "out of memory" in text.lower():
            raise InsufficientMemory(msg) from exc
        raise Internal(msg) from exc
    except (ValueError, TypeError) as exc:
        msg = f"{action}: {type(exc).__name__}: {exc}"
        raise (ModelLoadFailed(msg) if loading else InvalidArgument(msg)) from exc


# --- model facts -------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """What memory planning needs; from the GGUF header, config.json or the graph's variables."""

    n_ctx_train: int  # 0 = unknown
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    weights_bytes: int

    def kv_bytes_per_token(self, kv_precision: str) -> int:
        return self.n_layer * self.n_head_kv * 2 * self.head_dim * _KV_BYTES[kv_precision]

    def overhead_bytes(self, num_ctx: int, prefill_chunk: int) -> int:
        """Prefill scratch beyond weights and KV: an estimate, see ``_SCRATCH_BYTES_PER_TOKEN``."""
        return min(prefill_chunk, num_ctx) * _SCRATCH_BYTES_PER_TOKEN


_shape_cache: dict[tuple[str, int, int], ModelShape] = {}
_shape_lock = threading.Lock()


def _ir_weights_bytes(ir: Path) -> int:
    return sum((ir / f).stat().st_size for f in IR_FILES if f.endswith(".bin"))


def _shape_of_ir(ir: Path) -> ModelShape:
    xml = ir / "openvino_model.xml"
    cfg_path = ir / "config.json"
    st = xml.stat()
    # the directory, not the resolved xml: an IR dir of symlinks may lack config.json
    cfg_mtime = cfg_path.stat().st_mtime_ns if cfg_path.is_file() else 0
    key = (str(ir.resolve()), st.st_size, st.st_mtime_ns ^ cfg_mtime)
    with _shape_lock:
        hit = _shape_cache.get(key)
    if hit is not None:
        return hit
    weights = _ir_weights_bytes(ir)
    shape: ModelShape | None = None
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        n_head = int(cfg.get("num_attention_heads", 0) or 0)
        hidden = int(cfg.get("hidden_size", 0) or 0)
        head_dim = int(cfg.get("head_dim", 0) or (hidden // n_head if n_head else 0))
        n_layer = int(cfg.get("num_hidden_layers", 0) or 0)
        if n_layer and head_dim:
            shape = ModelShape(
                n_ctx_train=int(cfg.get("max_position_embeddings", 0) or 0),
                n_layer=n_layer,
                n_head=n_head,
                n_head_kv=int(cfg.get("num_key_value_heads", 0) or n_head),
                head_dim=head_dim,
                weights_bytes=weights,
            )
    if shape is None:
        # No config.json: the variables' declared shapes [?, n_head_kv, ?, head_dim]
        # give the KV geometry and an attention query [?, n_head, ?, head_dim] the head
        # count (read_model compiles nothing); the window is unknown.
        model = ov.Core().read_model(str(xml))
        variables = model.get_variables()
        if not variables:
            raise ModelLoadFailed(f"{xml} is not a stateful LLM graph (it has no KV variables)")
        dims = variables[0].info.data_shape
        sdpa = next((op for op in model.get_ordered_ops() if op.get_type_name() == "ScaledDotProductAttention"), None)
        q_heads = sdpa.input(0).get_partial_shape()[1] if sdpa is not None else dims[1]
        shape = ModelShape(
            n_ctx_train=0,
            n_layer=len(variables) // 2,
            n_head=int(q_heads.get_length()) if q_heads.is_static else int(dims[1].get_length()),
            n_head_kv=int(dims[1].get_length()),
            head_dim=int(dims[3].get_length()),
            weights_bytes=weights,
        )
    with _shape_lock:
        _shape_cache[key] = shape
    return shape


@dataclass(frozen=True)
class _Source:
    """A request's ``path`` resolved: the IR directory to serve (when it exists) and the identity."""

    gguf: Path | None
    ir: Path | None  # None: a GGUF whose IR is not prepared yet (describe only)
    digest: str


def _resolve_source(path: str, *, prepare: bool, progress: Callable[[str], None] | None = None) -> _Source:
    """Map a request path to an IR directory; ModelLoadFailed with the cause for anything else."""
    if not path:
        raise ModelLoadFailed("the request names no model path")
    p = Path(path)
    if p.is_dir():
        missing = [f for f in IR_FILES if not (p / f).is_file()]
        if missing:
            raise ModelLoadFailed(
                f"{path} is not an OpenVINO IR directory: missing {', '.join(missing)}", path=path
            )
        files = [p / f for f in IR_FILES]
        return _Source(gguf=None, ir=p, digest=files_digest(files, model_cache_dir()))
    if not p.exists():
        raise ModelLoadFailed(f"model path not found: {path}", path=path)
    if not p.is_file() or not is_gguf(p):
        raise ModelLoadFailed(f"{path} is neither a GGUF file nor an OpenVINO IR directory", path=path)
    digest = file_digest(p, model_cache_dir())
    ir: Path | None
    if prepare:
        ir = prepare_ir(p, digest=digest, progress=progress)
    else:
        candidate = ir_dir_for(digest)
        ir = candidate if is_complete_ir(candidate) else None
    return _Source(gguf=p, ir=ir, digest=digest)


def _shape_of_source(src: _Source) -> ModelShape:
    if src.ir is not None:
        return _shape_of_ir(src.ir)
    if src.gguf is None:
        raise Internal("a model source has neither an IR nor a GGUF")
    st = src.gguf.stat()
    key = (str(src.gguf.resolve()), st.st_size, st.st_mtime_ns)
    with _shape_lock:
        hit = _shape_cache.get(key)
    if hit is not None:
        return hit
    facts = read_gguf(src.gguf)  # ~2 s: it parses the vocabulary arrays too
    shape = ModelShape(
        n_ctx_train=facts.n_ctx_train,
        n_layer=facts.n_layer,
        n_head=facts.n_head,
        n_head_kv=facts.n_head_kv,
        head_dim=facts.head_dim_k,
        weights_bytes=facts.weights_bytes,
    )
    with _shape_lock:
        _shape_cache[key] = shape
    return shape


# --- load options ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _LoadOptions:
    num_ctx: int
    prefill_chunk: int
    num_threads: int  # 0 = OpenVINO's default
    kv_precision: str
    inference_precision: str  # "" = the device default (resolved after compiling)

    @classmethod
    def resolve(cls, cfg: Config, shape: ModelShape, inference_precision: str) -> _LoadOptions:
        num_ctx = resolve_num_ctx(cfg.num_ctx, shape.n_ctx_train, DEFAULT_NUM_CTX)
        if cfg.kv_cache_type not in KV_PRECISIONS:
            raise UnsupportedFeature(
                f"kv_cache_type {cfg.kv_cache_type!r} is not offered by the openvino backend: with its quantised "
                "paged cache a reused prefix computes different numbers than a cold one; use f16 or f32",
                kv_cache_type=cfg.kv_cache_type,
            )
        if cfg.num_gpu_layers not in (0, -1):
            raise UnsupportedFeature(
                "OpenVINO places the whole model on one device; partial GPU offload (num_gpu_layers) does not exist",
                num_gpu_layers=cfg.num_gpu_layers,
            )
        return cls(
            num_ctx=num_ctx,
            prefill_chunk=max(MIN_PREFILL_ROWS, min(cfg.num_batch or DEFAULT_PREFILL_CHUNK, num_ctx)),
            num_threads=cfg.num_threads,
            kv_precision=KV_PRECISIONS[cfg.kv_cache_type],
            inference_precision=inference_precision,
        )

    def compile_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "KV_CACHE_PRECISION": self.kv_precision,
            "PERFORMANCE_HINT": "LATENCY",
            "NUM_STREAMS": 1,
        }
        if self.inference_precision:
            cfg["INFERENCE_PRECISION_HINT"] = self.inference_precision
        if self.num_threads:
            cfg["INFERENCE_NUM_THREADS"] = self.num_threads
        return cfg


def _type_name(value: Any) -> str:
    return value.get_type_name() if isinstance(value, ov.Type) else str(value)


def _paged_model(core: ov.Core, xml: Path) -> ov.Model:
    """The stateful IR rewritten to paged attention, with the LM head fed one chosen row.

    ``paged_attention_transformation`` (the pass openvino-genai's continuous-batching
    pipeline applies) turns every SDPA + KV variable pair into a PagedAttention op
    whose K/V block pools are model inputs. The head gathers the row named by a
    new ``sample_index`` input (the last real token of a padded chunk), as GenAI
    does: without it every prefill computes [tokens, vocab] logits.
    """
    model = core.read_model(str(xml))
    if not model.get_variables():
        raise ModelLoadFailed(f"{xml} is not a stateful LLM graph (it has no KV variables)")
    paged_attention_transformation(model)
    head = model.output("logits").get_node().input_value(0).get_node()
    while head.get_type_name() in ("Convert", "Multiply", "Divide", "Tanh", "Add"):
        head = head.input_value(0).get_node()
    if head.get_type_name() == "MatMul":
        index = ov_ops.parameter([1], ov.Type.i64, name="sample_index")
        index.output(0).get_tensor().set_names({"sample_index"})
        # the paged graph lays tokens out on axis 0
        row = ov_ops.gather(head.input_value(0), index, np.array(0, np.int64))
        head.input(0).replace_source_output(row.output(0))
        model.add_parameters([index])
        model.validate_nodes_and_infer_types()
    names = {i.get_any_name() for i in model.inputs}
    missing = sorted(_PAGED_INPUTS - names)
    if missing:
        raise ModelLoadFailed(f"{xml} did not convert to paged attention: inputs {missing} are missing")
    return model


def _bucket(n: int) -> int:
    """The padded row count a prefill chunk of ``n`` tokens runs with."""
    for limit, step in _BUCKET_STEPS:
        if n <= limit:
            return max(MIN_PREFILL_ROWS, -(-n // step) * step)
    raise AssertionError("the last bucket step has no limit")


# --- the chat template -------------------------------------------------------------------------


class _Vocab:
    """Token ids ↔ bytes and the special ids, from the IR tokenizer."""

    def __init__(self, tok: openvino_genai.Tokenizer) -> None:
        by_bytes = tok.get_vocab()
        self.size = max(by_bytes.values()) + 1
        pieces = [b""] * self.size
        for piece, tid in by_bytes.items():
            pieces[tid] = bytes(piece)
        # A special token decodes to "" only when special tokens are skipped; a lone
        # byte of a multi-byte character decodes to "" either way.
        ids = [[i] for i in range(self.size)]
        skipped = tok.decode(ids, skip_special_tokens=True)
        kept = tok.decode(ids, skip_special_tokens=False)
        self.special = frozenset(i for i in range(self.size) if skipped[i] == "" and kept[i] != "")
        #: what a generated token contributes to the text (control tokens contribute nothing)
        self.text_pieces = [b"" if i in self.special else p for i, p in enumerate(pieces)]
        self.pieces = pieces
        self.bos_id = int(tok.get_bos_token_id())
        self.eos_id = int(tok.get_eos_token_id())
        eog = {self.eos_id} if self.eos_id >= 0 else set()
        eog.update(i for i in self.special if pieces[i] in _EOG_TEXTS)
        self.eog = frozenset(eog)


# --- the loaded model -------------------------------------------------------------------------
class OpenVINOLoadedModel:
    """A model compiled on an OpenVINO device with its one persistent KV (what the slot holds).

    Build it with ``OpenVINOBackend.load``. Sessions opened on it share the KV; a
    new session makes older session handles closed, since there is one KV to drive.
    """

    def __init__(
        self,
        *,
        compiled: ov.CompiledModel,
        tokenizer: openvino_genai.Tokenizer,
        ir: Path,
        digest: str,
        shape: ModelShape,
        options: _LoadOptions,
        config: Config,
        device: str,
    ) -> None:
        self.ir = ir
        self._digest = digest
        self.shape = shape
        self.options = options
        self.config = config
        self.device = device
        self._compiled = compiled
        self._req = compiled.create_infer_request()
        self.inference_precision = _type_name(compiled.get_property("INFERENCE_PRECISION_HINT"))
        self._allocate_cache(compiled, options.num_ctx)
        self.tok = tokenizer
        self.vocab = _Vocab(tokenizer)
        self.template = str(tokenizer.chat_template or "")
        self.template_digest = "sha256:" + hashlib.sha256(self.template.encode("utf-8")).hexdigest() if self.template else ""
        self.prompt_format = ("chatml" if "<|im_start|>" in self.template else "jinja") if self.template else "raw"
        self.template_uses_tools = bool(_TOOLS_IN_TEMPLATE.search(self.template))
        self._add_bos_default = self._tokenizer_adds_bos()
        self._guidance_tok: Any = None
        self.res = Resident(num_ctx=options.num_ctx)
        #: last-position logits per tape length: prefill ends and the live decode position
        self._logits: dict[int, np.ndarray] = {}
        #: the tape length whose logits entry step() created (spent by the next step)
        self._step_len: int | None = None
        #: the tape's first ``exact_len`` tokens were computed by prefill chunks (not by
        #: single-token decode steps), so they hold exactly what a cold prefill computes
        self.exact_len = 0
        self._resident_bytes = (
            shape.weights_bytes
            + self.cache_bytes
            + shape.overhead_bytes(options.num_ctx, options.prefill_chunk)
        )
        #: bumped by every operation that changes the KV; an abandoned decode stream
        #: compares it before touching the KV again
        self.epoch = 0
        self._session_gen = 0
        self.closed = False

    def _allocate_cache(self, compiled: ov.CompiledModel, num_ctx: int) -> None:
        """One K and one V block pool per layer, sized for num_ctx, owned by us.

        Block ``i`` holds positions ``[i*B, (i+1)*B)``: the block table is the
        identity, so cutting the KV to n tokens is just ``past_lens = n``.
        """
        pools = sorted(
            (i for i in compiled.inputs if i.get_any_name().startswith(("key_cache.", "value_cache."))),
            key=lambda i: (int(i.get_any_name().split(".")[1]), i.get_any_name()),
        )
        if len(pools) != 2 * self.shape.n_layer:
            raise ModelLoadFailed(f"the paged graph has {len(pools)} cache inputs; expected {2 * self.shape.n_layer}")
        dims = [[d.get_length() for d in list(p.get_partial_shape())[1:]] for p in pools]
        if any(d != dims[0] for d in dims) or len(dims[0]) != 3:
            raise ModelLoadFailed(f"unexpected paged cache layouts {dims[:2]} (a quantised cache is not supported)")
        self.block_size = int(dims[0][1])
        self.kv_precision = _type_name(pools[0].get_element_type())
        # room for the padding rows of a chunk that ends at num_ctx
        pad_room = max(_bucket(k) - k for k in range(1, self.options.prefill_chunk + 1))
        self._n_blocks = -(-(num_ctx + pad_room) // self.block_size)
        self.cache_names = [p.get_any_name() for p in pools]
        self._cache_dims = dims[0]
        self._views: list[np.ndarray] = []
        for p in pools:
            tensor = ov.Tensor(p.get_element_type(), [self._n_blocks, *dims[0]])
            self._req.set_tensor(p.get_any_name(), tensor)
            # a byte view of the pool: snapshots copy whole blocks, whatever the element type
            self._views.append(tensor.data.view(np.uint8).reshape(self._n_blocks, -1))
        self._block_bytes = int(self._views[0].shape[1])
        self.cache_bytes = self._block_bytes * self._n_blocks * len(pools)
        self.kv_bytes_per_token = self._block_bytes * len(pools) // self.block_size
        self._block_table = np.arange(self._n_blocks, dtype=np.int32)

    # --- LoadedModel ---------------------------------------------------------------------
    @property
    def digest(self) -> str:
        return self._digest

    @property
    def num_ctx(self) -> int:
        return self.options.num_ctx

    def open_session(self) -> OpenVINOSession:
        if self.closed:
            raise SessionClosed("model was unloaded")
        self._session_gen += 1
        self.epoch += 1  # an open stream of an older session must not touch the KV
        return OpenVINOSession(self, self._session_gen)

    def resident_bytes(self) -> int:
        """Weights + the preallocated KV pools + prefill scratch (a precomputed attribute)."""
        return 0 if self.closed else self._resident_bytes

    def runtime_identity(self) -> dict[str, Any]:
        """The settings that change numerics (and so KV reuse and snapshot validity).

        The prefill chunk size is not one of them: paged-attention prefill is
        split-invariant (see the module docstring and the tests).
        """
        return {
            "attention": "paged",
            "device": self.device,
            "inference_precision": self.inference_precision,
            "kv_precision": self.kv_precision,
            "block_size": self.block_size,
            "num_ctx": self.options.num_ctx,
            "num_threads": self.options.num_threads,
        }

    def manifest_defaults(self) -> dict[str, str]:
        """What a client puts in its ContextManifest for this model."""
        return {
            "backend": BACKEND_NAME,
            "backend_version": runtime_version(),
            "model_digest": self._digest,
            "prompt_format": self.prompt_format,
            "template_digest": self.template_digest,
            "runtime_digest": canonical_digest(self.runtime_identity()),
            "bos_policy": "add" if self._wants_bos("") else "none",
        }

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.epoch += 1
        self.res.clear()
        self._logits.clear()
        self._views = []
        del self._req
        del self._compiled

    # --- text ------------------------------------------------------------------------------
    def _tokenizer_adds_bos(self) -> bool:
        bos = self.vocab.bos_id
        if bos < 0:
            return False
        ids = self.tok.encode("a", add_special_tokens=True).input_ids.data[0]
        return len(ids) > 0 and int(ids[0]) == bos

    def _wants_bos(self, policy: str) -> bool:
        return wants_bos(policy, disabled=self.config.disable_bos, model_default=self._add_bos_default)

    def tokenize(self, text: str, *, bos_policy: str | None = None) -> list[int]:
        """Tokens of rendered text (special tokens parsed); BOS per policy, never doubled."""
        tokens = [int(t) for t in self.tok.encode(text, add_special_tokens=False).input_ids.data[0]] if text else []
        return with_bos(tokens, self.vocab.bos_id, bos_policy is not None and self._wants_bos(bos_policy))

    def detokenize(self, tokens: list[int]) -> str:
        return str(self.tok.decode(tokens, skip_special_tokens=False)) if tokens else ""

    def guidance_tokenizer(self) -> Any:
        """The vocabulary in llguidance's form, built on the first constrained decode (~0.2 s)."""
        if self._guidance_tok is None:
            v = self.vocab
            self._guidance_tok = build_tokenizer(
                v.pieces, special=v.special, eog=v.eog, bos_id=v.bos_id, encode=self.tokenize
            )
        return self._guidance_tok

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None, *, generation: bool, **extra: Any) -> str:
        return str(
            self.tok.apply_chat_template(
                messages, add_generation_prompt=generation, tools=tools, extra_context=extra or None
            )
        )

    # --- the KV ------------------------------------------------------------------------------
    def _infer(self, ids: list[int], past: int, *, rows: int = 0) -> np.ndarray:
        """Run ``ids`` at positions past.. with ``past`` cached tokens; a view of the last one's logits.

        With ``rows`` > len(ids) the chunk is padded (the last token repeated at its
        own position): the padding writes KV cells past the tape, which the next
        step overwrites, and changes no number of the real rows.
        """
        n = len(ids)
        width = max(n, rows)
        total = past + width
        n_blocks = -(-total // self.block_size)
        positions = np.arange(past, total, dtype=np.int64)
        positions[n:] = past + n - 1  # stays inside the model's position range
        req = self._req
        req.set_tensor("input_ids", ov.Tensor(np.asarray(ids + ids[-1:] * (width - n), np.int64)))
        req.set_tensor("position_ids", ov.Tensor(positions))
        req.set_tensor("past_lens", ov.Tensor(np.array([past], np.int32)))
        req.set_tensor("subsequence_begins", ov.Tensor(np.array([0, width], np.int32)))
        req.set_tensor("block_indices", ov.Tensor(np.ascontiguousarray(self._block_table[:n_blocks])))
        req.set_tensor("block_indices_begins", ov.Tensor(np.array([0, n_blocks], np.int32)))
        req.set_tensor("max_context_len", ov.Tensor(np.array(total, np.int32)))
        req.set_tensor("sample_index", ov.Tensor(np.array([n - 1], np.int64)))
        req.infer()
        out: np.ndarray = req.get_tensor("logits").data
        last: np.ndarray = out[-1, 0]
        return last

    def _trim(self, n: int) -> None:
        """Forget everything after the first ``n`` tokens: bookkeeping only.

        The next ``_infer`` passes ``past_lens = n`` and overwrites those cells, so
        nothing in the pools needs to change.
        """
        if n == len(self.res.tokens):
            return
        self.res.tokens = self.res.tokens[:n]
        self._logits = {k: v for k, v in self._logits.items() if k <= n}
        if self._step_len is not None and self._step_len > n:
            self._step_len = None
        self.exact_len = min(self.exact_len, n)

    def _chunks(self, start: int, end: int) -> Iterator[tuple[int, int]]:
        """Prefill chunks of at most the chunk size."""
        size = self.options.prefill_chunk
        bounds = list(range(start, end, size)) + [end]
        yield from zip(bounds[:-1], bounds[1:], strict=False)

    def reusable(self, lcp: int) -> int:
        """How much of a token LCP can be kept so the KV equals what a cold prefill computes."""
        return min(lcp, self.exact_len)

    def set_kv(self, tokens: list[int], keep: int) -> int:
        """Make the KV hold ``tokens``, reusing the first ``keep`` resident ones; returns what was kept.

        Chunks run padded to their shape bucket (see the module docstring). On
        failure the tape equals the completed chunks and the error propagates.
        """
        self.epoch += 1
        keep = min(keep, len(tokens), len(self.res.tokens))
        self._trim(keep)
        exact = self.exact_len == keep
        for a, b in self._chunks(keep, len(tokens)):
            interrupt.check("prefill")  # between chunks: a cancel costs at most one chunk
            logits = self._infer(tokens[a:b], a, rows=_bucket(b - a))
            self.res.tokens = list(tokens[:b])
            if exact:
                self.exact_len = b
        if keep < len(tokens):
            self._logits[len(tokens)] = logits.copy()
            if self._step_len == len(tokens):
                self._step_len = None  # now a prefill end, kept
        return keep

    def step(self, token: int) -> np.ndarray:
        """Evaluate one sampled token into the KV and the tape; its logits (a view)."""
        n = len(self.res.tokens)
        logits = self._infer([token], n)
        self.res.tokens.append(token)
        # Prefill ends stay (a full prefix hit or a restore samples from them); the
        # previous step's entry is spent.
        if self._step_len == n:
            self._logits.pop(n, None)
        self._logits[n + 1] = logits.copy()
        self._step_len = n + 1
        return logits

    def logits_at_end(self) -> np.ndarray:
        """The distribution after the last resident token; re-prefills the last token if none is stored."""
        n = len(self.res.tokens)
        hit = self._logits.get(n)
        if hit is not None:
            return hit
        self.set_kv(list(self.res.tokens), n - 1)
        return self._logits[n]

    def adopt_logits(self, logits: dict[int, np.ndarray], exact_len: int) -> None:
        """After a state restore: the stored logits and how much of the tape prefill computed."""
        n = len(self.res.tokens)
        self._logits = {k: v for k, v in logits.items() if 0 < k <= n}
        self._step_len = None
        self.exact_len = max(0, min(exact_len, n))

    def warm_up(self) -> None:
        """Run every warm-turn bucket, the full chunk and a decode step once, and forget them.

        The CPU plugin compiles kernels for each new shape (~20-35 ms each here),
        which would otherwise land in the turns' prefill time.
        """
        token = max(self.vocab.bos_id, 0)
        chunk = self.options.prefill_chunk
        shapes = sorted({_bucket(k) for k in range(1, min(chunk, _WARM_BUCKETS_UP_TO) + 1)} | {_bucket(chunk)})
        for rows in shapes:
            self._infer([token], 0, rows=rows)
        self._infer([token], 1)

    def clear_kv(self) -> None:
        self.epoch += 1
        self._logits.clear()
        self._step_len = None
        self.exact_len = 0
        self.res.clear()

    # --- state bytes --------------------------------------------------------------------------
    def state_header(self, n_tokens: int) -> dict[str, Any]:
        return {
            "format": 2,
            "model_digest": self._digest,
            "runtime": self.runtime_identity(),
            "n_tokens": n_tokens,
            "block_bytes": self._block_bytes,
            "pools": [[name, self.kv_precision, self._cache_dims] for name in self.cache_names],
        }

    def export_state(self) -> bytes:
        """Header + the used blocks of every K/V pool, byte for byte + the stored logits."""
        n = len(self.res.tokens)
        n_blocks = -(-n // self.block_size)
        logits = sorted(self._logits.items())
        header = self.state_header(n) | {
            "logits": [[k, int(v.shape[0])] for k, v in logits],
            "exact_len": self.exact_len,
        }
        head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        start = len(_STATE_MAGIC) + 4 + len(head)
        per_pool = n_blocks * self._block_bytes
        # One allocation, filled in place: a 2k-token snapshot is ~50 MB.
        out = bytearray(start + per_pool * len(self._views) + sum(4 * v.shape[0] for _, v in logits))
        out[:start] = _STATE_MAGIC + struct.pack("<I", len(head)) + head
        off = start
        for view in self._views:
            np.frombuffer(out, np.uint8, per_pool, off)[:] = view[:n_blocks].reshape(-1)
            off += per_pool
        for _, v in logits:
            np.frombuffer(out, np.float32, v.shape[0], off)[:] = v
            off += 4 * v.shape[0]
        return bytes(out)

    def parse_state(self, blob: bytes, n_tokens: int) -> tuple[list[np.ndarray], dict[int, np.ndarray], dict[str, Any]]:
        """Check a KV snapshot against this model without touching the KV; SnapshotRejected otherwise."""
        header, body = _unpack_state(blob)
        expected = self.state_header(n_tokens)
        diffs = [f"{k}: snapshot {header.get(k)!r} != session {v!r}" for k, v in expected.items() if header.get(k) != v]
        if diffs:
            raise SnapshotRejected("snapshot does not match this model and runtime: " + "; ".join(diffs), problems=diffs)
        logit_specs = header.get("logits", [])
        if not isinstance(logit_specs, list) or any(
            not (isinstance(x, list) and len(x) == 2 and x[1] == self.vocab.size and 0 < x[0] <= n_tokens)
            for x in logit_specs
        ):
            raise SnapshotRejected("snapshot logits entries are malformed")
        n_blocks = -(-n_tokens // self.block_size)
        per_pool = n_blocks * self._block_bytes
        need = per_pool * len(self._views) + 4 * self.vocab.size * len(logit_specs)
        if len(body) != need:
            raise SnapshotRejected(f"snapshot holds {len(body)} state bytes; its header implies {need}")
        pools = [
            np.frombuffer(body, np.uint8, per_pool, i * per_pool).reshape(n_blocks, self._block_bytes)
            for i in range(len(self._views))
        ]
        off = per_pool * len(self._views)
        logits: dict[int, np.ndarray] = {}
        for k, size in logit_specs:
            logits[int(k)] = np.frombuffer(body, np.float32, size, off).copy()
            off += 4 * size
        return pools, logits, header

    def load_state(self, pools: list[np.ndarray], tokens: list[int]) -> None:
        """Copy snapshot blocks into the pools (one array per ``cache_names``, same order)."""
        self.epoch += 1
        for view, blocks in zip(self._views, pools, strict=True):
            view[: blocks.shape[0]] = blocks
        self.res.tokens = list(tokens)


def _unpack_state(state: bytes) -> tuple[dict[str, Any], memoryview]:
    n0 = len(_STATE_MAGIC)
    if state[:n0] != _STATE_MAGIC or len(state) < n0 + 4:
        raise SnapshotRejected("state bytes are not an OpenVINO KV snapshot of this backend")
    (hlen,) = struct.unpack("<I", state[n0 : n0 + 4])
    raw = state[n0 + 4 : n0 + 4 + hlen]
    if len(raw) != hlen:
        raise SnapshotRejected("snapshot header is truncated")
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise SnapshotRejected("snapshot header is not valid JSON") from exc
    if not isinstance(header, dict):
        raise SnapshotRejected("snapshot header is not a JSON object")
    return header, memoryview(state)[n0 + 4 + hlen :]


# --- sampling ---------------------------------------------------------------------------------------
class _Sampler:
    """Greedy, or llama.cpp's order: top-k, then top-p on the softmax, then temperature."""

    def __init__(self, cfg: DecodeConfig) -> None:
        self.temperature = cfg.temperature or 0.0
        self.top_k = cfg.top_k
        self.top_p = cfg.top_p if cfg.top_p is not None else 1.0
        self.rng = np.random.default_rng(cfg.seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.temperature <= 0.0:
            return int(np.argmax(logits))
        x = logits.astype(np.float64)
        candidates = np.arange(x.shape[0])
        if 0 < self.top_k < x.shape[0]:
            candidates = np.argpartition(-x, self.top_k - 1)[: self.top_k]
        order = candidates[np.argsort(-x[candidates], kind="stable")]
        vals = x[order]
        if self.top_p < 1.0:
            p = np.exp(vals - vals[0])
            p /= p.sum()
            cut = int(np.searchsorted(np.cumsum(p), self.top_p)) + 1
            order, vals = order[:cut], vals[:cut]
        p = np.exp((vals - vals[0]) / self.temperature)
        p /= p.sum()
        return int(order[self.rng.choice(len(order), p=p)])


class _Steps:
    """DecodeSteps on the paged graph: numpy sampling over the stored logits."""

    def __init__(self, m: OpenVINOLoadedModel, sample: _Sampler, guide: TokenGuide | None) -> None:
        self._m = m
        self._sample = sample
        self._guide = guide
        self._logits: np.ndarray | None = None

    def start(self) -> None:
        self._logits = self._m.logits_at_end()

    def sample(self) -> int:
        assert self._logits is not None, "start() comes first"
        if self._guide is None:
            return self._sample(self._logits)
        token = self._sample(self._guide.mask(self._logits))
        self._guide.accept(token)
        return token

    def feed(self, token: int) -> None:
        self._logits = self._m.step(token)

    def is_end(self, token: int) -> bool:
        return token in self._m.vocab.eog

    def piece(self, token: int) -> bytes:
        return self._m.vocab.text_pieces[token]

    def settle(self, token: int) -> None:
        try:
            self._m.step(token)
        except Exception:
            # The graph step failed mid-way: the pools may hold a partial update, so
            # nothing resident can be trusted any more.
            self._m.clear_kv()

    def close(self) -> None:
        self._logits = None


# --- the session ---------------------------------------------------------------------------------
class OpenVINOSession(TapeSession):
    """A Session over an OpenVINOLoadedModel's persistent KV."""

    backend_name = BACKEND_NAME

    def _errors(self, action: str) -> AbstractContextManager[None]:
        return _map_ov_errors(action)

    def _render_prefix(self, m: OpenVINOLoadedModel, text: str, tools: list[Any] | None) -> str:
        if not m.template:
            if tools:
                raise UnsupportedFeature("the model has no chat template, so it cannot be given tools")
            return text
        if tools and not m.template_uses_tools:
            raise UnsupportedFeature(
                "the model's chat template does not render tools; refusing to drop them silently "
                "(GenAI's minja would substitute a generic tool prompt the model was not trained on)",
                template_digest=m.template_digest,
            )
        return m.render([{"role": "system", "content": text}], tools, generation=False)

    def _renderer(self, m: OpenVINOLoadedModel) -> Render | None:
        return m.render if m.template else None

    def _prompt_text(self, m: OpenVINOLoadedModel, tokens: list[int]) -> str:
        return m.detokenize(tokens)

    # --- Session -------------------------------------------------------------------------------
    def decode(self, cfg: DecodeConfig) -> Generator[StreamChunk, None, None]:
        """Stream chunks; closing the generator cancels within one token (see ``TapeSession._stream``)."""
        m = self._live()
        with _map_ov_errors("decode"):
            pipeline = self._output_pipeline(m, cfg)
        guide = None
        if cfg.structured_output.is_set():
            guide = TokenGuide(m.guidance_tokenizer(), compile_grammar(cfg.structured_output))
        return self._stream(m, cfg, _Steps(m, _Sampler(cfg), guide), pipeline, m.epoch)

    def snapshot(self) -> SessionSnapshot:
        m = self._live()
        with _map_ov_errors("snapshot"):
            blob = m.export_state()
        return m.res.snapshot(BACKEND_NAME, blob, "kv")

    def restore(self, snap: SessionSnapshot) -> None:
        m = self._live()
        res = m.res
        res.validate_snapshot(snap, BACKEND_NAME, m.digest)
        if snap.manifest.backend and snap.manifest.backend != BACKEND_NAME:
            raise SnapshotRejected(f"snapshot manifest names backend {snap.manifest.backend!r}")
        if any(not 0 <= t < m.vocab.size for t in snap.resident_token_ids):
            raise SnapshotRejected("snapshot token ids are outside this model's vocabulary")
        tokens = list(snap.resident_token_ids)
        if snap.state_kind == "replay":
            self._restore_replay(m, snap, tokens)
            return
        if snap.state_kind != "kv":
            raise SnapshotRejected(f"state_kind {snap.state_kind!r} is not restorable by the openvino backend")
        pools, logits, header = m.parse_state(snap.state, len(tokens))
        # Everything above was checked without touching the KV.
        try:
            with _map_ov_errors("restore"):
                m.load_state(pools, tokens)
        except ModeldError as exc:
            m.clear_kv()
            raise SnapshotRejected(f"OpenVINO refused the state: {exc.message}; the resident context was cleared") from exc
        exact = header.get("exact_len", 0)
        m.adopt_logits(logits, exact if isinstance(exact, int) else 0)
        res.adopt_snapshot(snap)

    def _restore_replay(self, m: OpenVINOLoadedModel, snap: SessionSnapshot, tokens: list[int]) -> None:
        """Re-prefill a token tape: the prefix, then the rest (exact, except that tokens
        which were decoded are now computed by the prefill kernel)."""
        if snap.state:
            raise SnapshotRejected("a replay snapshot carries no state bytes")
        prefix = tokens[: snap.prefix_tokens]
        try:
            with _map_ov_errors("restore: replay prefill"):
                # whatever of the tape is already resident (and exact) stays
                m.set_kv(prefix, m.reusable(common_prefix_len(m.res.tokens, prefix)))
                m.set_kv(tokens, len(prefix))
        except BaseException:
            m.clear_kv()
            raise
        m.res.adopt_snapshot(snap)


# --- the backend -------------------------------------------------------------------------------------
def _check_type(t: str) -> None:
    if t not in ("", BACKEND_NAME):
        raise BackendMismatch(f"model type {t!r} is not served by the openvino backend", type=t)


class OpenVINOBackend:
    """The OpenVINO implementation of the daemon's Backend seam.

    ``device`` is an OpenVINO device name ("CPU", "GPU", …); ``inference_precision``
    is an INFERENCE_PRECISION_HINT ("" keeps the device default, e.g. bf16 on AMX
    CPUs, f32 elsewhere).
    """

    name = BACKEND_NAME

    def __init__(self, device: str = "CPU", inference_precision: str = "") -> None:
        self.device = device
        self.inference_precision = inference_precision
        self._core: ov.Core | None = None

    @property
    def core(self) -> ov.Core:
        if self._core is None:
            self._core = ov.Core()
        return self._core

    def runtime_version(self) -> str:
        return runtime_version()

    def load(self, req: OpenSessionRequest, progress: Callable[[float], None]) -> OpenVINOLoadedModel:
        _check_type(req.type)
        progress(0.0)
        with _map_ov_errors(f"loading {req.path}", loading=True):
            src = _resolve_source(req.path, prepare=True)
            if req.digest and req.digest != src.digest:
                raise ModelLoadFailed(
                    f"{req.path} has digest {src.digest}, the request expects {req.digest}",
                    path=req.path,
                    expected=req.digest,
                    actual=src.digest,
                )
            if src.ir is None:  # prepare=True converts or raises; this guards the invariant
                raise Internal(f"no IR was prepared for {req.path}")
            progress(0.4)
            shape = _shape_of_ir(src.ir)
            options = _LoadOptions.resolve(req.config, shape, self.inference_precision)
            hint = self.inference_precision or _type_name(
                self.core.get_property(self.device, "INFERENCE_PRECISION_HINT")
            )
            if options.kv_precision == "f32" and hint != "f32":
                # the CPU paged-attention kernels pair a bf16/f16 compute with a 16-bit cache only
                raise UnsupportedFeature(
                    f"kv_cache_type 'f32' needs an f32 inference precision; this backend computes in {hint}",
                    kv_cache_type="f32",
                    inference_precision=hint,
                )
            model = _paged_model(self.core, src.ir / "openvino_model.xml")
            compiled = self.core.compile_model(model, self.device, options.compile_config())
            progress(0.9)
            tokenizer = openvino_genai.Tokenizer(str(src.ir))
            loaded = OpenVINOLoadedModel(
                compiled=compiled,
                tokenizer=tokenizer,
                ir=src.ir,
                digest=src.digest,
                shape=shape,
                options=options,
                config=req.config,
                device=self.device,
            )
            declared = req.config.prompt_template_digest
            if declared and declared != loaded.template_digest:
                loaded.close()
                raise ModelLoadFailed(
                    f"the profile declares template {declared} but the model's chat template is "
                    f"{loaded.template_digest or 'absent'}",
                    declared=declared,
                    actual=loaded.template_digest,
                )
            loaded.warm_up()
        progress(1.0)
        return loaded

    def describe(self, req: OpenSessionRequest, credit_bytes: int = 0) -> ModelInfo:
        """ModelInfo from the GGUF header or the IR's config.json; converts and compiles nothing."""
        _check_type(req.type)
        with _map_ov_errors(f"describing {req.path}", loading=True):
            src = _resolve_source(req.path, prepare=False)
            shape = _shape_of_source(src)
            options = _LoadOptions.resolve(
                req.config.model_copy(update={"num_ctx": 0}), shape, self.inference_precision
            )
            devices = self._devices()
        requested = req.config.num_ctx or DEFAULT_NUM_CTX
        effective = min(requested, shape.n_ctx_train) if shape.n_ctx_train else requested
        kvpt = shape.kv_bytes_per_token(options.kv_precision)
        chunk = min(req.config.num_batch or DEFAULT_PREFILL_CHUNK, effective)
        overhead = shape.overhead_bytes(effective, chunk)
        main = next((d for d in devices if d.id == self.device), None)
        clamped = bool(req.config.num_ctx) and effective < req.config.num_ctx
        return ModelInfo(
            model_max_context=shape.n_ctx_train,
            effective_context=effective,
            kv_bytes_per_token=kvpt,
            weights_bytes=shape.weights_bytes,
            overhead_bytes=overhead,
            required_bytes=shape.weights_bytes + overhead + kvpt * effective,
            clamped=clamped,
            reason="model_max" if clamped else ("requested" if req.config.num_ctx else "default"),
            device_kind=main.kind if main is not None else self.device.lower(),
            device_id=self.device,
            device_total_bytes=main.total_bytes if main is not None else 0,
            free_bytes=main.free_bytes if main is not None else 0,
            requested_gpu_layers=req.config.num_gpu_layers,
            resolved_gpu_layers=0,
            runtime_name=BACKEND_NAME,
            runtime_digest=f"openvino=={runtime_version()}",
            runtime_system_info=main.name if main is not None else "",
            supports_gpu_offload=any(d.kind == "gpu" for d in devices),
            devices=devices,
            n_layer=shape.n_layer,
            n_head_kv=shape.n_head_kv,
            head_dim=shape.head_dim,
            digest=src.digest,
        )

    def model_facts(self, req: OpenSessionRequest) -> dict[str, Any]:
        """What the daemon's memory planner needs, as plain fields (nothing converted or compiled)."""
        _check_type(req.type)
        with _map_ov_errors(f"describing {req.path}", loading=True):
            shape = _shape_of_source(_resolve_source(req.path, prepare=False))
        return {
            "n_ctx_train": shape.n_ctx_train or DEFAULT_NUM_CTX,
            "n_layer": shape.n_layer,
            "n_head_kv": shape.n_head_kv,
            "head_dim_k": shape.head_dim,
            "head_dim_v": shape.head_dim,
            "weights_bytes": shape.weights_bytes,
            # f16 and bf16 caches cost the same two bytes an element.
            "kv_cache_type": "f32" if req.config.kv_cache_type == "f32" else "f16",
            "n_batch": req.config.num_batch or DEFAULT_PREFILL_CHUNK,
            "n_head": shape.n_head,
            "overhead": "openvino",
        }

    def _devices(self) -> list[DeviceInfo]:
        out: list[DeviceInfo] = []
        core = self.core
        for dev in core.available_devices:
            kind = dev.split(".")[0].lower()
            name = str(core.get_property(dev, "FULL_DEVICE_NAME"))
            total = free = 0
            if kind == "cpu":
                import psutil  # a project dependency; only the CPU needs it

                vm = psutil.virtual_memory()
                total, free = int(vm.total), int(vm.available)
            elif kind == "gpu":
                with contextlib.suppress(RuntimeError):
                    total = int(core.get_property(dev, "GPU_DEVICE_TOTAL_MEM_SIZE"))
            out.append(DeviceInfo(kind=kind, id=dev, name=name, total_bytes=total, free_bytes=free))
        return out

    def embed(self, req: EmbedRequest) -> EmbedResult:
        raise UnsupportedFeature("embeddings are not served by the openvino generation backend")

    def close(self) -> None:
        self._core = None

