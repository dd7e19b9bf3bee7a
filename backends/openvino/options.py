"""What an OpenVINO load is made of: the model source (IR or GGUF), its shape (``contract.sizing.ModelShape``),
and the load options."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import openvino as ov

from contract.errors import Internal, ModelLoadFailed, UnsupportedFeature
from contract.sizing import ModelFacts, ModelShape
from contract.types import GPU_LAYERS_ALL, GPU_LAYERS_AUTO, Config

from ..bundled import model_cache_dir
from ..digest import file_digest, files_digest
from ..engine_spec import engine_options
from ..gguf_file import is_gguf, read_gguf
from ..tape.model import resolve_num_ctx
from .graph import MIN_PREFILL_ROWS, wants_batch_graph
from .prepare import IR_FILES, ir_dir_for, is_complete_ir, prepare_ir
from .spec import SPEC, OpenVINOOptions

DEFAULT_NUM_CTX = 4096
#: prefill chunk (Config.num_batch = 0); it bounds scratch memory and does not change numerics
DEFAULT_PREFILL_CHUNK = 512
#: Config.kv_cache_type -> KV_CACHE_PRECISION; q8_0/q4_0 are refused (see ``backends.openvino.model``)
KV_PRECISIONS: dict[str, str] = {"": "f16", "f16": "f16", "f32": "f32"}
#: prefill scratch per chunk token: RSS grew by the KV plus ~15 MB (512-token chunks) and
#: ~36 MB (2,048) prefilling 4,000 tokens of SmolLM2-135M; activations scale with the
#: hidden size, so this rounds up and stays an estimate for larger models
_SCRATCH_BYTES_PER_TOKEN = 32 * 1024


def sizing(shape: ModelShape, kv_precision: str, n_batch: int = DEFAULT_PREFILL_CHUNK, *,
           batch_graph: bool = False) -> ModelFacts:
    """The shape as the sizing module's facts (f16 and bf16 caches cost the same two bytes an element);
    with ``batch_graph`` the overhead holds the second compiled graph (``graph.wants_batch_graph``)."""
    overhead = SPEC.overhead
    if batch_graph:
        overhead = replace(overhead, fixed_bytes=overhead.fixed_bytes + batch_graph_bytes(shape))
    return shape.facts(kv_cache_type="f32" if kv_precision == "f32" else "f16", n_batch=n_batch, overhead=overhead,
                       unknown_ctx=DEFAULT_NUM_CTX)


def overhead_bytes(shape: ModelShape, num_ctx: int, prefill_chunk: int, *, batch_graph: bool = False) -> int:
    """Prefill scratch beyond weights and KV (an estimate, see ``_SCRATCH_BYTES_PER_TOKEN``), and the
    batch graph when there is one."""
    copy = batch_graph_bytes(shape) if batch_graph else 0
    return min(prefill_chunk, num_ctx) * _SCRATCH_BYTES_PER_TOKEN + copy


def batch_graph_bytes(shape: ModelShape) -> int:
    """What the batch graph adds, counted as twice the weights: with the bundled model's 92 MB of
    weights, a load, a 4k prefill and a decode grew the process by 647-650 MB with it and
    487-489 MB without (proportional set size; the compiled graph holds its own forms of
    the weights, the LM head's among them)."""
    return 2 * shape.weights_bytes


_shape_cache: dict[tuple[str, int, int], ModelShape] = {}
_shape_lock = threading.Lock()


def _ir_weights_bytes(ir: Path) -> int:
    return sum((ir / f).stat().st_size for f in IR_FILES if f.endswith(".bin"))


def shape_of_ir(ir: Path) -> ModelShape:
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
                n_embd=hidden,
                n_layer=n_layer,
                n_head=n_head,
                n_head_kv=int(cfg.get("num_key_value_heads", 0) or n_head),
                head_dim_k=head_dim,
                head_dim_v=head_dim,
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
            head_dim_k=int(dims[3].get_length()),
            head_dim_v=int(dims[3].get_length()),
            weights_bytes=weights,
        )
    with _shape_lock:
        _shape_cache[key] = shape
    return shape


@dataclass(frozen=True)
class Source:
    """A request's ``path`` resolved: the IR directory to serve (when it exists) and the identity."""

    gguf: Path | None
    ir: Path | None  # None: a GGUF whose IR is not prepared yet (describe only)
    digest: str


def resolve_source(path: str, *, prepare: bool, progress: Callable[[str], None] | None = None) -> Source:
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
        return Source(gguf=None, ir=p, digest=files_digest(files, model_cache_dir()))
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
    return Source(gguf=p, ir=ir, digest=digest)


def shape_of_source(src: Source) -> ModelShape:
    if src.ir is not None:
        return shape_of_ir(src.ir)
    if src.gguf is None:
        raise Internal("a model source has neither an IR nor a GGUF")
    st = src.gguf.stat()
    key = (str(src.gguf.resolve()), st.st_size, st.st_mtime_ns)
    with _shape_lock:
        hit = _shape_cache.get(key)
    if hit is not None:
        return hit
    shape = read_gguf(src.gguf).shape
    with _shape_lock:
        _shape_cache[key] = shape
    return shape


# --- load options ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadOptions:
    num_ctx: int
    prefill_chunk: int
    num_threads: int  # 0 = OpenVINO's default
    kv_precision: str
    inference_precision: str  # "" = the device default (resolved after compiling)
    #: decode steps run padded to a prefill's kernels (``graph.EXACT_STEP_ROWS``)
    exact_decode: bool = False
    #: a second compiled graph runs prefills and draft checks (``graph.wants_batch_graph``)
    batch_graph: bool = False

    @classmethod
    def resolve(
        cls, cfg: Config, shape: ModelShape, *, speculative: bool = False, device: str = "CPU"
    ) -> LoadOptions:
        num_ctx = resolve_num_ctx(cfg.num_ctx, shape.n_ctx_train, DEFAULT_NUM_CTX)
        inference_precision = engine_options(SPEC, cfg, OpenVINOOptions).inference_precision or ""
        if cfg.kv_cache_type not in KV_PRECISIONS:
            raise UnsupportedFeature(
                f"kv_cache_type {cfg.kv_cache_type!r} is not offered by the openvino backend: with its quantised "
                "paged cache a reused prefix computes different numbers than a cold one; use f16 or f32",
                kv_cache_type=cfg.kv_cache_type,
            )
        # auto (-2) is as many layers as fit on a GPU the engine uses: none here, the OpenVINO backend serves the CPU
        if cfg.num_gpu_layers not in (0, GPU_LAYERS_ALL, GPU_LAYERS_AUTO):
            raise UnsupportedFeature(
                "OpenVINO places the whole model on one device; partial GPU offload (num_gpu_layers) does not exist",
                num_gpu_layers=cfg.num_gpu_layers,
            )
        kv_precision = KV_PRECISIONS[cfg.kv_cache_type]
        if cfg.exact_decode and not cfg.kv_cache_type and not inference_precision:
            # Exact decode computes in f32 over an f32 cache unless a load says otherwise: with a 16-bit cache
            # the CPU plugin rounds a prefill apart by how it was split on some CPUs (measured on an AMX Xeon:
            # an answer reused from decode steps, then prefilled again in other chunks, decoded apart), and
            # only f32 compute takes an f32 cache.
            kv_precision, inference_precision = "f32", "f32"
        return cls(
            num_ctx=num_ctx,
            prefill_chunk=max(MIN_PREFILL_ROWS, min(cfg.num_batch or DEFAULT_PREFILL_CHUNK, num_ctx)),
            num_threads=cfg.num_threads,
            kv_precision=kv_precision,
            inference_precision=inference_precision,
            exact_decode=cfg.exact_decode,
            batch_graph=wants_batch_graph(speculative, shape.weights_bytes, device),
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
