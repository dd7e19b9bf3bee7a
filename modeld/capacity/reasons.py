"""The stable reason strings a plan reports (``ModelInfo.reason``, ``GpuLayers.reason``).

Clients match on these values, so they never change meaning; the package
docstring (``modeld.capacity``) says when each one is reported.
"""

from __future__ import annotations

__all__ = [
    "GPU_ALL",
    "GPU_CPU_ONLY",
    "GPU_MEMORY",
    "GPU_NO_GPU",
    "GPU_N_LAYER",
    "GPU_REASONS",
    "GPU_REQUESTED",
    "MEMORY_REASONS",
    "REASONS",
    "REASON_DEFAULT",
    "REASON_MEMORY",
    "REASON_MODEL_MAX",
    "REASON_REQUESTED",
    "REASON_RESERVE",
    "REASON_USER_LIMIT",
]

#: ModelInfo.reason values
REASON_REQUESTED = "requested"
REASON_DEFAULT = "default"
REASON_MODEL_MAX = "model_max"
REASON_MEMORY = "memory"
REASON_RESERVE = "reserve"
REASON_USER_LIMIT = "user_limit"
REASONS = frozenset(
    {REASON_REQUESTED, REASON_DEFAULT, REASON_MODEL_MAX, REASON_MEMORY, REASON_RESERVE, REASON_USER_LIMIT}
)
#: the reasons that mean memory cut the window below its target (the plan is then ``clamped``)
MEMORY_REASONS = frozenset({REASON_MEMORY, REASON_RESERVE, REASON_USER_LIMIT})

#: GpuLayers.reason values, see ``resolve_gpu_layers``
GPU_NO_GPU = "no gpu"
GPU_CPU_ONLY = "cpu only"
GPU_ALL = "all"
GPU_REQUESTED = "requested"
GPU_N_LAYER = "n_layer"
GPU_MEMORY = "gpu memory"
GPU_REASONS = frozenset({GPU_NO_GPU, GPU_CPU_ONLY, GPU_ALL, GPU_REQUESTED, GPU_N_LAYER, GPU_MEMORY})
