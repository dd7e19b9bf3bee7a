"""The llama.cpp engine's spec (``SPEC``, listed by ``backends.registry``) and the options only it takes.

This module stays light: every factory imports the engine when it is called.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from contract.interfaces import Backend, EngineFactory, StateCache
from contract.sizing import OverheadModel
from contract.types import QUANTIZED_KV_CACHE_TYPES, Config

from ..engine_spec import BackendSettings, EngineOptions, EngineSpec
from ..formats import GGUF

__all__ = ["SPEC", "LlamaOptions"]


def _llama_backend(cache: StateCache | None, settings: BackendSettings) -> Backend:
    from backends.llama.backend import LlamaBackend

    return LlamaBackend(cache=cache, speculative=settings.speculative, readouts=settings.readouts)


def _llama_embedder() -> EngineFactory[Any]:
    from backends.llama.embedder import LlamaEmbedder

    return LlamaEmbedder


def _llama_gpu_offload() -> bool:
    from backends.llama.native import gpu_offload

    return gpu_offload()


def _llama_build_info() -> str:
    from backends.llama.native import system_info

    return system_info()


def _llama_only_settings(cfg: Config) -> str:
    """Flash attention and a quantized KV cache: OpenVINO serves an f16 cache and exact decodes too."""
    given = ["--flash-attn"] if cfg.flash_attn else []
    if cfg.kv_cache_type in QUANTIZED_KV_CACHE_TYPES:
        given.append(f"--kv-cache-type {cfg.kv_cache_type}")
    return " and ".join(given)


class LlamaOptions(EngineOptions):
    """What only llama.cpp takes in ``Config.options``."""

    extra_bufts: bool | None = Field(
        None, description="the CPU's repacked forms of the weights (llama.cpp's extra buffer types); unset: on, "
        "except on a build that reports AMX (its AMX matrix product crashed the process; MODELD_LLAMA_EXTRA_BUFTS=1|0 "
        "sets what unset means) and in the exact-decode layout, which keeps the file's weights")
    mmproj: str | None = Field(
        None, description="the model's multimodal projector GGUF (its image encoder: `modeld serve --mmproj FILE`); "
        "unset: the one projector file beside the model (an mmproj*.gguf in its directory), if there is one; none: "
        "no image encoder")


SPEC = EngineSpec(
    name="llama",
    title="llama.cpp",
    package="llama_cpp",
    extra="llama",
    modules=("llama_cpp",),
    missing="llama-cpp-python is not installed",
    # Compute buffer and KQ scores without flash attention. The logits term is 0:
    # llama-cpp-python allocates an (n_batch, n_vocab) float32 ``scores`` array but,
    # without logits_all, writes only its last row, so the rest is never backed by
    # RAM (``make bench``: RSS growth was 20% below the estimate that counted it, and
    # 6% below without it).
    overhead=OverheadModel(name="llama.cpp", logits_copies=0.0),
    backend=_llama_backend,
    embedder=_llama_embedder,
    # every other engine is asked first: llama.cpp serves what they decline, and its load
    # says what it cannot serve
    auto_rank=100,
    formats=(GGUF,),
    exclusive_settings=_llama_only_settings,
    gpu_offload=_llama_gpu_offload,
    build_info=_llama_build_info,
    options=LlamaOptions,
)
