"""Memory-budgeted context sizing: how large a window modeld serves on this device.

The contract's rule: ``EffectiveContext`` is the window modeld will actually serve
on this device — min(model ceiling, what fits in free memory) — derived by the
daemon from the model's metadata and the device's memory, never guessed by the
runtime. This package is that derivation. It is pure: every reading (free memory,
GPU pools, the operator's policy) is an argument, and the only code that
touches the outside world is the explicit reader ``read_host_pool`` (plus
``make_planner``, which wires it for the daemon). The policy's values come from
the daemon's settings (``modeld.settings``: flags, environment, config file).

One concern per module:

* ``sizes``   – ``parse_size`` / ``format_size`` and the other value-from-text rules;
* ``policy``  – ``Policy``: --mem-max, --mem-reserve, headroom, minimum and default
  window (the ``memory`` part of ``modeld.settings.ServeSettings``);
* ``pools``   – ``read_host_pool`` (psutil) and what one pool lets the model use;
* ``reasons`` – the stable reason strings below;
* ``gpu``     – ``resolve_gpu_layers``: layers offloaded within the GPU's budget;
* ``planner`` – ``plan`` (the window, or the refusal with the numbers) and the
  daemon's ``make_planner`` / ``make_budget_check``.

The model's inputs (``ModelFacts``, ``OverheadModel``) and the KV/overhead
formulas are the contract's (``contract.sizing``): engines size their own
``describe`` with the same functions. They are re-exported here; each engine's
coefficients are in its spec (``EngineSpec.overhead``, in its package's ``spec.py``).

The model, in bytes::

    required(n) = weights + overhead(n) + kv_cache(n)

    kv_cache(n) = bpe × n_head_kv × (head_dim_k + head_dim_v)
                  × (dense_layers × n + swa_layers × min(n, sliding_window + n_b))
    overhead(n) = fixed_bytes                                   (runtime, graph metadata)
                + logits_copies × n_b × n_vocab × 4             (f32 output logits)
                + compute_rows  × n_b × n_embd  × 4             (activations of one micro-batch)
                + kq_copies     × n_b × n_head  × n × 4         (attention scores; 0 with flash attention)
    n_b = min(n_batch, n)                                       (llama.cpp clamps n_batch to n_ctx)

    usable  = min(free + credit − reserve − headroom, user_limit if set)
    headroom = headroom_fraction × (free + credit)
    fits     = the largest n with required(n) ≤ usable
    effective = min(requested or default, model max, fits)

``kv_bytes_per_token`` (the contract field) is the dense formula,
n_layer × n_head_kv × (head_dim_k + head_dim_v) × bpe.
Sliding-window (SWA) layers hold at most ``sliding_window + n_b`` cells — that is
how llama.cpp sizes its SWA cache (window plus one micro-batch) — so past the
window only the dense layers grow. The overhead coefficients are named
(``OverheadModel``) and deliberately simple: a benchmark that measures real
resident memory at a few (n_ctx, n_batch) points calibrates them.

Reason strings (``ModelInfo.reason``; stable, see ``REASONS`` in ``reasons``):

* ``"requested"``  the caller's num_ctx was served in full;
* ``"default"``    num_ctx was 0 and ``Policy.default_context`` was served;
* ``"model_max"``  the model's trained window (n_ctx_train) is the ceiling; a
  larger request was clamped to it;
* ``"memory"``     physical free memory (after headroom) is the limit;
* ``"reserve"``    the ``--mem-reserve`` floor is the limit: without it the
  asked-for window would have fit;
* ``"user_limit"`` the ``--mem-max`` cap is the limit.

``clamped`` is True when the served window is below what the caller explicitly
asked for (requested num_ctx > 0), or when memory (``memory``/``reserve``/
``user_limit``) cut the window below its target. A request never shrinks silently.

A window cut by memory is rounded down to a multiple of ``CONTEXT_ALIGN`` (256):
llama.cpp pads its KV cache up to 256 cells, so an aligned window is one whose
real allocation matches the plan. A window that was asked for (requested,
default, model max) is served exactly.

Never feed a previous ``effective_context`` back as ``requested_ctx``: that turns a
transient memory clamp into a permanent one (when memory grows, the old clamp is
"requested" and sticks). ``plan`` is pure, so the caller is responsible for
passing the original request each time.
"""

from __future__ import annotations

# "modeld.capacity.psutil" stays the patch point for the host reading (tests fake
# ``psutil.virtual_memory`` through it); ``pools`` calls psutil through the module.
import psutil as psutil

from contract.sizing import (
    KV_BYTES_PER_ELEMENT,
    MemoryPool,
    ModelFacts,
    OverheadModel,
    kv_bytes_per_token,
    kv_cache_bytes,
    overhead_bytes,
    required_bytes,
)

from .gpu import GpuLayers, resolve_gpu_layers
from .planner import CONTEXT_ALIGN, make_budget_check, make_planner, plan
from .policy import DEFAULT_CONTEXT, DEFAULT_HEADROOM_FRACTION, DEFAULT_MIN_CONTEXT, Policy
from .pools import read_host_pool
from .reasons import GPU_REASONS, REASONS
from .sizes import format_size, parse_size

__all__ = [
    "CONTEXT_ALIGN",
    "DEFAULT_CONTEXT",
    "DEFAULT_HEADROOM_FRACTION",
    "DEFAULT_MIN_CONTEXT",
    "GPU_REASONS",
    "KV_BYTES_PER_ELEMENT",
    "REASONS",
    "GpuLayers",
    "MemoryPool",
    "ModelFacts",
    "OverheadModel",
    "Policy",
    "format_size",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "make_budget_check",
    "make_planner",
    "overhead_bytes",
    "parse_size",
    "plan",
    "read_host_pool",
    "required_bytes",
    "resolve_gpu_layers",
]
