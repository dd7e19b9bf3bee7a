"""What a llama.cpp load is made of: the model's shape (``contract.sizing.ModelShape``) and the resolved load options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contract.errors import InvalidArgument, UnsupportedFeature
from contract.sizing import ModelShape
from contract.types import GPU_LAYERS_ALL, GPU_LAYERS_AUTO, QUANTIZED_KV_CACHE_TYPES, Config

from ..devices import usable_cpus
from ..engine_spec import engine_options
from ..tape.model import resolve_num_ctx
from .native import KV_GGML_TYPES, extra_bufts_default, gpu_offload
from .spec import SPEC, LlamaOptions

DEFAULT_NUM_CTX = 4096
DEFAULT_NUM_BATCH = 512
#: q8_0 / q4_0 KV blocks hold 32 values; the head dimension must be a multiple
_QUANT_BLOCK = 32


def shape_from_scalars(scalars: dict[str, Any]) -> ModelShape:
    """What the header says before loading (per-layer arrays are not read here)."""
    arch = str(scalars.get("general.architecture", ""))

    def g(key: str) -> int:
        v = scalars.get(f"{arch}.{key}", 0)
        return int(v) if isinstance(v, (int, float)) else 0

    n_head = g("attention.head_count")
    head = g("embedding_length") // n_head if n_head else 0
    return ModelShape(
        n_ctx_train=g("context_length"),
        n_layer=g("block_count"),
        n_head=n_head,
        n_head_kv=g("attention.head_count_kv") or n_head,
        head_dim_k=g("attention.key_length") or head,
        head_dim_v=g("attention.value_length") or head,
        weights_bytes=0,
        n_embd=g("embedding_length"),
    )


def unplanned_gpu_layers(requested: int) -> int:
    """The layer count a load uses; "auto" (-2) reaches a load unresolved only without the daemon's planner
    (in-process use): then every layer when this build offloads (llama.cpp places them; nothing checked the
    GPU's memory), none on a CPU build. A count, or -1 (all), is the load's as given."""
    if requested == GPU_LAYERS_AUTO:
        return GPU_LAYERS_ALL if gpu_offload() else 0
    return requested


@dataclass(frozen=True)
class LoadOptions:
    num_ctx: int
    num_batch: int
    num_threads: int
    num_gpu_layers: int
    flash_attn: bool
    kv_cache_type: str  # normalised: "" becomes "f16"
    extra_bufts: bool
    tensor_split: tuple[float, ...]
    #: the model's layer count (0: unknown): a count that reaches it offloads the output layer too
    n_layer: int = 0

    @classmethod
    def resolve(cls, cfg: Config, facts: ModelShape) -> LoadOptions:
        num_ctx = resolve_num_ctx(cfg.num_ctx, facts.n_ctx_train, DEFAULT_NUM_CTX)
        kv = cfg.kv_cache_type or "f16"
        if kv in QUANTIZED_KV_CACHE_TYPES:
            if not cfg.flash_attn:
                # llama.cpp refuses a quantized V cache without flash attention and
                # only says "Failed to create llama_context".
                raise InvalidArgument(
                    f"kv_cache_type {kv!r} needs flash_attn=true (llama.cpp cannot quantize the V cache without it)",
                    kv_cache_type=kv,
                )
            for dim in (facts.head_dim_k, facts.head_dim_v):
                if dim % _QUANT_BLOCK:
                    raise InvalidArgument(
                        f"kv_cache_type {kv!r} needs a head dimension divisible by {_QUANT_BLOCK}; this model has {dim}",
                        kv_cache_type=kv,
                    )
        num_batch = min(cfg.num_batch or DEFAULT_NUM_BATCH, num_ctx)
        # The row-invariant layout (flash attention over a quantized cache) also keeps the weights as the
        # file has them: the CPU's repacked forms of Q4_0/Q4_K/IQ4 weights (llama.cpp's extra buffer types)
        # multiply one row and a batch of rows by different kernels, which round apart. Measured on Gemma 3
        # 270M Q4_K_M with exact decode: repacked, a speculative edit parted from the plain one at token 140
        # of 200; as in the file, equal. Q4_1 (the bundled model) has no repacked form: nothing changes there.
        layers = unplanned_gpu_layers(cfg.num_gpu_layers)
        row_invariant = cfg.flash_attn and kv in QUANTIZED_KV_CACHE_TYPES and layers == 0
        own = engine_options(SPEC, cfg, LlamaOptions)
        if row_invariant and own.extra_bufts:
            raise InvalidArgument("engine option extra_bufts=true contradicts the layout asked for: flash attention over "
                                  f"a {kv} cache keeps the weights as the file has them (their rows can then be exact)",
                                  kv_cache_type=kv)
        options = cls(
            num_ctx=num_ctx,
            num_batch=num_batch,
            num_threads=cfg.num_threads or usable_cpus(),
            num_gpu_layers=layers,
            flash_attn=cfg.flash_attn,
            kv_cache_type=kv,
            extra_bufts=(extra_bufts_default() if own.extra_bufts is None else own.extra_bufts) and not row_invariant,
            tensor_split=tuple(cfg.tensor_split),
            n_layer=facts.n_layer,
        )
        if cfg.exact_decode and not options.exact_layout:
            # the layout decides it; choosing one behind the request's back would make the
            # active config say something other than what runs
            raise UnsupportedFeature(
                "exact_decode on llama.cpp needs the layout whose rows can be exact: flash_attn=true with "
                f"kv_cache_type {' or '.join(QUANTIZED_KV_CACHE_TYPES)} on the CPU "
                "(modeld serve --flash-attn --kv-cache-type q8_0); this request has "
                f"flash_attn={str(cfg.flash_attn).lower()}, kv_cache_type {kv!r}, num_gpu_layers {layers}",
                flash_attn=cfg.flash_attn,
                kv_cache_type=kv,
                num_gpu_layers=layers,
            )
        return options

    @property
    def exact_layout(self) -> bool:
        """Whether this is the layout under which llama.cpp can compute a token's row the same alone, in a
        check or in any prefill split; whether it does for the loaded model on this CPU is the load's probe's
        (``backends.llama.probe``), which sets the model's ``rows_exact``.

        With a quantized K cache its CPU flash attention runs every row through one
        kernel; an f16 cache sends a lone token past 512 keys to a split-KV kernel and
        a large batch to a tiled one, and without flash attention a batch's attention
        products take other kernels than a one-token step's. The matrix products are the
        weights' own: per row for Q4_1 (the bundled model: logits equal bit for bit over
        5 to 1,900 tokens of context, one token at a time, in checks of 2 to 48 rows and
        one-shot; 0.98-1.18 apart in the default layout), but some types' batch kernels round
        apart from their one-row ones on some CPUs (Gemma 3 270M Q4_K_M here), which is what the
        probe finds out. GPU kernels are not covered, nor the CPU's repacked weight forms
        (``extra_bufts``), which the layout turns off (``resolve``).
        """
        return (self.flash_attn and self.kv_cache_type in QUANTIZED_KV_CACHE_TYPES and self.num_gpu_layers == 0
                and not self.extra_bufts)

    @property
    def llama_gpu_layers(self) -> int:
        """``n_gpu_layers`` for llama.cpp: -1 once every repeating layer is offloaded.

        llama.cpp counts the output layer as one more (``-ngl n_layer`` leaves it, and its
        n_vocab-wide matrix product, on the CPU; ``n_layer + 1`` or more moves it too, clamped
        as llama-server clamps ``-ngl 999``): a plan that put every layer on the GPU means all of
        them. llama-cpp-python reads -1 as "all".
        """
        n = self.num_gpu_layers
        return GPU_LAYERS_ALL if n == GPU_LAYERS_ALL or (self.n_layer and n >= self.n_layer) else n

    def llama_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "n_ctx": self.num_ctx,
            "n_batch": self.num_batch,
            "n_ubatch": self.num_batch,
            "n_threads": self.num_threads,
            "n_threads_batch": self.num_threads,
            "n_gpu_layers": self.llama_gpu_layers,
            "flash_attn": self.flash_attn,
            "type_k": KV_GGML_TYPES[self.kv_cache_type],
            "type_v": KV_GGML_TYPES[self.kv_cache_type],
            # sliding-window layers keep every position, not only the window: the daemon cuts its KV at any
            # token-LCP and prefills the tail, which a window-sized ring cannot give back (measured on Gemma 3
            # 270M: a cut 1,000 tokens into a 1,500-token prompt then parted from a cold prefill by up to 0.86 in
            # the logits, greedy tokens after 6; full size, equal bit for bit; 72 MiB of KV at 4k against 27)
            "swa_full": True,
            "verbose": False,
        }
        if self.tensor_split:
            kw["tensor_split"] = list(self.tensor_split)
        return kw

    def runtime_identity(self) -> dict[str, Any]:
        """The settings that change numerics (and so KV reuse/snapshot validity)."""
        return {
            "n_ctx": self.num_ctx,
            "kv_cache_type": self.kv_cache_type,
            "flash_attn": self.flash_attn,
            "num_gpu_layers": self.num_gpu_layers,
            "extra_bufts": self.extra_bufts,
        }
