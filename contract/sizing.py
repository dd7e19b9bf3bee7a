"""Sizing: what a model costs in memory, from its shape and the runtime config.

One formula for everyone: the daemon's capacity planner (``modeld.capacity``)
and every engine's ``describe`` compute KV bytes with ``kv_bytes_per_token`` over
the same ``ModelFacts`` (a ``ModelShape`` under a load config), which an engine's
``Backend.model_facts`` returns. See
``modeld.capacity`` for the whole model (overhead, budgets, reasons).

    kv_cache(n) = bpe × n_head_kv × (head_dim_k + head_dim_v)
                  × (dense_layers × n + swa_layers × min(n, sliding_window + n_b))
    overhead(n) = fixed_bytes + logits_copies × n_b × n_vocab × 4
                + compute_rows × n_b × n_embd × 4 + kq_copies × n_b × n_head × n × 4
    n_b = min(n_batch, n)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal

from .types import DeviceInfo

__all__ = [
    "DEFAULT_N_BATCH",
    "DEFAULT_OVERHEAD",
    "KV_BYTES_PER_ELEMENT",
    "MemoryPool",
    "ModelFacts",
    "ModelShape",
    "OverheadModel",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "overhead_bytes",
    "required_bytes",
]

#: llama.cpp's default micro-batch when the config says 0
DEFAULT_N_BATCH = 512

#: bytes per KV element. ggml block types: q8_0 is 32 int8 + an f16 scale per 32
#: (34/32), q4_0 is 32 nibbles + an f16 scale (18/32). OpenVINO's u8/u4 are its own
#: asymmetric grouped quantisation; we assume a group of 32 with an f16 scale and
#: an f16 zero point (+4/32), which is on the conservative side of its defaults.
#: "" is the backend default, f16 for llama.cpp (an OpenVINO adapter should pass
#: its real precision, which on CPU defaults to u8).
KV_BYTES_PER_ELEMENT: dict[str, Fraction] = {
    "": Fraction(2),
    "f16": Fraction(2),
    "f32": Fraction(4),
    "q8_0": Fraction(34, 32),
    "q4_0": Fraction(18, 32),
    "u8": Fraction(32 + 4, 32),
    "u4": Fraction(16 + 4, 32),
}


@dataclass(frozen=True)
class OverheadModel:
    """Named coefficients of ``overhead(n)`` (module docstring); calibrate them by benchmark.

    The defaults are reasoned estimates, not measurements: ``logits_copies`` 1 is
    the n_batch × n_vocab f32 logits buffer; ``compute_rows`` 16 covers the
    activations of one micro-batch (a handful of n_embd-wide rows plus the FFN,
    which is ~3-4 × n_embd wide) with allocator slack; ``kq_copies`` 1 is the
    n_ctx × n_batch × n_head f32 attention-score matrix llama.cpp reserves when
    flash attention is off (with it, scores are tiled and the term vanishes).
    """

    name: str
    fixed_bytes: int = 16 * 1024 * 1024
    logits_copies: float = 1.0
    compute_rows: float = 16.0
    kq_copies: float = 1.0


#: the coefficients an engine without a calibrated model is planned with; each engine's own, measured
#: by ``make bench``, is in its registry entry (``backends.registry``)
DEFAULT_OVERHEAD = OverheadModel(name="default")


@dataclass(frozen=True)
class ModelShape:
    """A model's numbers as its file says them (0: not said): the one shape record every engine reads.

    A GGUF header (``backends.gguf_file``), an OpenVINO IR's config.json or graph and
    a loaded llama.cpp model fill it; ``facts`` puts it under a load config for the
    formula. ``n_vocab`` is the token list's length.
    """

    n_ctx_train: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    weights_bytes: int
    n_embd: int = 0
    n_vocab: int = 0
    sliding_window: int = 0

    def facts(
        self,
        *,
        kv_cache_type: str = "",
        n_batch: int = DEFAULT_N_BATCH,
        flash_attn: bool = False,
        n_swa_layers: int = 0,
        overhead: OverheadModel = DEFAULT_OVERHEAD,
        unknown_ctx: int = 1,
    ) -> ModelFacts:
        """The shape under a load config; ``unknown_ctx`` stands for a training window the file does not say.
        The SWA layer pattern is not in GGUF scalars: without ``n_swa_layers`` every layer counts dense."""
        return ModelFacts(
            n_ctx_train=self.n_ctx_train or unknown_ctx,
            n_layer=self.n_layer,
            n_head_kv=self.n_head_kv,
            head_dim_k=self.head_dim_k,
            head_dim_v=self.head_dim_v,
            weights_bytes=self.weights_bytes,
            sliding_window=self.sliding_window if n_swa_layers else 0,
            n_swa_layers=n_swa_layers,
            kv_cache_type=kv_cache_type,
            n_batch=n_batch or DEFAULT_N_BATCH,
            n_vocab=self.n_vocab,
            n_embd=self.n_embd,
            n_head=self.n_head,
            flash_attn=flash_attn,
            overhead=overhead,
        )


@dataclass(frozen=True)
class ModelFacts:
    """What planning needs from the model's metadata and the load config (``ModelShape.facts``).

    Kept apart from ``ModelShape``: the same model is planned under many load configs.

    ``n_swa_layers`` is how many of the ``n_layer`` layers use ``sliding_window``
    (0 with a window set means the pattern is unknown: every layer is counted
    dense, which over- rather than under-estimates). ``n_batch`` is the micro-batch
    the backend evaluates at once (llama.cpp's n_ubatch, which equals n_batch
    unless set). ``n_vocab``/``n_embd``/``n_head`` feed the overhead model; a 0
    drops its term, so pass them.
    """

    n_ctx_train: int
    n_layer: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    weights_bytes: int
    sliding_window: int = 0
    n_swa_layers: int = 0
    kv_cache_type: str = ""
    n_batch: int = DEFAULT_N_BATCH
    n_vocab: int = 0
    n_embd: int = 0
    n_head: int = 0
    flash_attn: bool = False
    overhead: OverheadModel = field(default=DEFAULT_OVERHEAD)

    def __post_init__(self) -> None:
        for name in ("n_ctx_train", "n_layer", "n_head_kv", "head_dim_k", "head_dim_v", "n_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelFacts.{name} must be positive, got {getattr(self, name)}")
        for name in ("weights_bytes", "sliding_window", "n_swa_layers", "n_vocab", "n_embd", "n_head"):
            if getattr(self, name) < 0:
                raise ValueError(f"ModelFacts.{name} must be >= 0, got {getattr(self, name)}")
        if self.n_swa_layers > self.n_layer:
            raise ValueError(f"ModelFacts.n_swa_layers {self.n_swa_layers} exceeds n_layer {self.n_layer}")
        if self.kv_cache_type not in KV_BYTES_PER_ELEMENT:
            raise ValueError(
                f"unknown kv_cache_type {self.kv_cache_type!r}; expected one of {sorted(KV_BYTES_PER_ELEMENT)}"
            )


def _kv_bytes_per_cell_per_layer(facts: ModelFacts) -> Fraction:
    return facts.n_head_kv * (facts.head_dim_k + facts.head_dim_v) * KV_BYTES_PER_ELEMENT[facts.kv_cache_type]


def _n_b(facts: ModelFacts, n_ctx: int) -> int:
    return min(facts.n_batch, n_ctx)


def kv_bytes_per_token(facts: ModelFacts) -> int:
    """Dense KV cost of one token: n_layer × n_head_kv × (head_dim_k + head_dim_v) × bpe (rounded up)."""
    return math.ceil(facts.n_layer * _kv_bytes_per_cell_per_layer(facts))


def _kv_cells(facts: ModelFacts, n_ctx: int) -> int:
    """Layer-cells of KV at ``n_ctx``: dense layers hold n_ctx, SWA layers at most window + n_b."""
    if facts.sliding_window > 0 and facts.n_swa_layers > 0:
        swa_cells = min(n_ctx, facts.sliding_window + _n_b(facts, n_ctx))
        return (facts.n_layer - facts.n_swa_layers) * n_ctx + facts.n_swa_layers * swa_cells
    return facts.n_layer * n_ctx


def kv_cache_bytes(facts: ModelFacts, n_ctx: int) -> int:
    """Bytes of the KV cache at ``n_ctx`` tokens, with sliding-window layers capped."""
    if n_ctx < 0:
        raise ValueError(f"n_ctx must be >= 0, got {n_ctx}")
    return math.ceil(_kv_cells(facts, n_ctx) * _kv_bytes_per_cell_per_layer(facts))


def host_overhead_bytes(facts: ModelFacts, n_ctx: int) -> int:
    """Fixed runtime + output logits: always in host memory."""
    m = facts.overhead
    return m.fixed_bytes + math.ceil(m.logits_copies * _n_b(facts, n_ctx) * facts.n_vocab * 4)


def compute_overhead_bytes(facts: ModelFacts, n_ctx: int) -> int:
    """Activations + attention scores: on the device that computes (the GPU when offloading)."""
    m = facts.overhead
    n_b = _n_b(facts, n_ctx)
    compute = m.compute_rows * n_b * facts.n_embd * 4
    kq = 0.0 if facts.flash_attn else m.kq_copies * n_b * facts.n_head * n_ctx * 4
    return math.ceil(compute + kq)


def overhead_bytes(facts: ModelFacts, n_ctx: int) -> int:
    """Runtime overhead at ``n_ctx`` (``OverheadModel``): fixed + logits + compute + attention scores."""
    if n_ctx < 0:
        raise ValueError(f"n_ctx must be >= 0, got {n_ctx}")
    return host_overhead_bytes(facts, n_ctx) + compute_overhead_bytes(facts, n_ctx)


def required_bytes(facts: ModelFacts, n_ctx: int) -> int:
    """Total bytes to serve ``n_ctx`` tokens: weights + overhead(n_ctx) + kv_cache(n_ctx)."""
    return facts.weights_bytes + overhead_bytes(facts, n_ctx) + kv_cache_bytes(facts, n_ctx)


@dataclass(frozen=True)
class MemoryPool:
    """One allocatable memory: host RAM ("cpu") or a GPU's memory. ``free_bytes`` is what is available now."""

    kind: Literal["cpu", "gpu"]
    id: str
    total_bytes: int
    free_bytes: int
    name: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "gpu"):
            raise ValueError(f"MemoryPool.kind must be 'cpu' or 'gpu', got {self.kind!r}")
        if self.total_bytes < 0 or self.free_bytes < 0:
            raise ValueError(f"MemoryPool bytes must be >= 0, got total={self.total_bytes} free={self.free_bytes}")

    def device_info(self) -> DeviceInfo:
        return DeviceInfo(
            kind=self.kind, id=self.id, name=self.name, total_bytes=self.total_bytes, free_bytes=self.free_bytes
        )
