"""GPU offload: how many layers go to the GPU, within the GPU pool's budget."""

from __future__ import annotations

from typing import NamedTuple

from contract.errors import InsufficientMemory
from contract.types import GPU_LAYERS_ALL, GPU_LAYERS_AUTO

from .policy import Policy
from .pools import MemoryPool, pool_budget
from .reasons import GPU_ALL, GPU_CPU_ONLY, GPU_MEMORY, GPU_N_LAYER, GPU_NO_GPU, GPU_REQUESTED
from .sizes import format_size

__all__ = ["GpuLayers", "resolve_gpu_layers"]


class GpuLayers(NamedTuple):
    """How many layers go to the GPU, and why (``GPU_REASONS``)."""

    layers: int
    reason: str


def resolve_gpu_layers(
    requested: int,
    n_layer: int,
    gpu_pool: MemoryPool | None,
    per_layer_bytes: int,
    policy: Policy,
    *,
    fixed_bytes: int = 0,
    credit_bytes: int = 0,
) -> GpuLayers:
    """Resolve the requested GPU layer count against the GPU's budget.

    ``per_layer_bytes`` is one layer's weights plus its KV at the minimum context;
    ``fixed_bytes`` what the GPU needs regardless of layers (compute buffers). The
    GPU's budget follows the same Policy as the host (reserve, headroom, --mem-max).

    * no GPU pool → 0, "no gpu"; requested 0 → 0, "cpu only";
    * -2 (auto, ``GPU_LAYERS_AUTO``) → n_layer, "all", when every layer fits, else the
      most that do, "gpu memory" (possibly 0): what Ollama and llama-server's
      ``--fit`` do by default;
    * -1 (all) → n_layer, "all", if every layer fits, else InsufficientMemory: the
      caller asked for full offload and a silent partial one would be a surprise
      (ask for an explicit count to accept partial offload);
    * N > 0 → min(N, n_layer) ("requested", or "n_layer" when N exceeded it); when
      that does not fit, the most layers that do ("gpu memory"), possibly 0.
    """
    if requested < GPU_LAYERS_AUTO:
        raise ValueError(f"requested GPU layers must be -2 (auto), -1 (all), 0 or positive, got {requested}")
    if n_layer <= 0:
        raise ValueError(f"n_layer must be positive, got {n_layer}")
    if per_layer_bytes < 0 or fixed_bytes < 0:
        raise ValueError("per_layer_bytes and fixed_bytes must be >= 0")
    if gpu_pool is None:
        return GpuLayers(0, GPU_NO_GPU)
    if requested == 0:
        return GpuLayers(0, GPU_CPU_ONLY)
    budget = pool_budget(gpu_pool, policy, credit_bytes)
    if budget.usable < fixed_bytes:
        fitting = 0
    elif per_layer_bytes == 0:
        fitting = n_layer
    else:
        fitting = (budget.usable - fixed_bytes) // per_layer_bytes
    if requested == GPU_LAYERS_AUTO:
        return GpuLayers(n_layer, GPU_ALL) if fitting >= n_layer else GpuLayers(fitting, GPU_MEMORY)
    if requested == GPU_LAYERS_ALL:
        if fitting >= n_layer:
            return GpuLayers(n_layer, GPU_ALL)
        need = fixed_bytes + n_layer * per_layer_bytes
        raise InsufficientMemory(
            f"full GPU offload needs {format_size(need)} ({n_layer} layers × {format_size(per_layer_bytes)}"
            f" + {format_size(fixed_bytes)} buffers) but only {format_size(max(budget.usable, 0))} is usable on"
            f" gpu:{gpu_pool.id} (bound by {budget.limit}); {fitting} layers would fit —"
            " request an explicit layer count to accept partial offload",
            required_bytes=need,
            usable_bytes=budget.usable,
            limit=budget.limit,
            device_kind="gpu",
            device_id=gpu_pool.id,
            n_layer=n_layer,
            fitting_layers=fitting,
        )
    want = min(requested, n_layer)
    if fitting >= want:
        return GpuLayers(want, GPU_REQUESTED if requested <= n_layer else GPU_N_LAYER)
    return GpuLayers(fitting, GPU_MEMORY)
