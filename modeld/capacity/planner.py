"""The plan: the context window (and GPU layers) modeld serves, and the daemon's planners.

``plan`` is pure (every reading is an argument); ``make_planner`` and
``make_budget_check`` wire it to the host reader and a Policy for the daemon.
The model and its reasons are described in ``modeld.capacity``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from fractions import Fraction

from contract.errors import InsufficientMemory
from contract.interfaces import Backend
from contract.sizing import (
    MemoryPool,
    ModelFacts,
    compute_overhead_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    overhead_bytes,
    required_bytes,
)
from contract.types import GPU_LAYERS_AUTO, ModelInfo, OpenSessionRequest

from .gpu import GpuLayers, resolve_gpu_layers
from .policy import Policy
from .pools import Budget, Share, pool_budget, read_host_pool
from .reasons import (
    GPU_CPU_ONLY,
    GPU_NO_GPU,
    MEMORY_REASONS,
    REASON_DEFAULT,
    REASON_MODEL_MAX,
    REASON_REQUESTED,
    REASON_USER_LIMIT,
)
from .sizes import format_size

__all__ = ["CONTEXT_ALIGN", "make_budget_check", "make_planner", "plan"]

#: a window cut by memory is rounded down to a multiple of this (llama.cpp's KV padding)
CONTEXT_ALIGN = 256


def _largest(pred: Callable[[int], bool], lo: int, hi: int) -> int:
    """Largest n in [lo, hi] with pred(n), pred monotone (True then False); lo - 1 if none."""
    if hi < lo or not pred(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _align_down(n: int, floor: int) -> int:
    """n rounded down to CONTEXT_ALIGN, unless that would drop below ``floor``."""
    aligned = n - n % CONTEXT_ALIGN
    return aligned if aligned >= max(floor, 1) else n


def plan(
    facts: ModelFacts,
    pool: MemoryPool,
    policy: Policy,
    requested_ctx: int = 0,
    requested_gpu_layers: int = 0,
    credit_bytes: int = 0,
    devices: Sequence[MemoryPool] = (),
) -> ModelInfo:
    """The context window (and GPU layers) modeld will serve, with every memory field filled.

    ``pool`` is host memory; ``devices`` is the backend's inventory (GPU pools; the
    host pool may be listed too) and is reported as ``ModelInfo.devices``.
    ``credit_bytes`` is what the resident model would release on a switch; it
    counts as free in the host pool only (the slot reports one resident total, not
    a per-pool split, so a GPU is never credited with memory it may not get back).

    With GPU layers requested (a count, -1 for all, -2 for as many as fit) and a GPU
    pool in ``devices`` (the first one; tensor splits across GPUs are not modelled, so
    a second GPU only adds room the plan does not count), the layers are resolved first
    (``resolve_gpu_layers`` at the minimum context), then the window must fit
    both pools: the GPU holds its share of weights and KV plus the compute
    buffers, the host the rest plus the logits/fixed overhead. The byte fields then
    sum over both pools, device_* name the GPU, and gpu_required_bytes /
    gpu_usable_bytes are the GPU's part of them (the host's is the rest). The
    layers are fixed at the minimum window before the window is sized: with every
    layer on a small GPU the GPU's memory bounds the window ("memory"), as it does
    in llama.cpp, whose KV lives with its layer.

    Raises InsufficientMemory, with the numbers, when not even the minimum window
    fits, and ValueError on a negative request.
    """
    _check_request(requested_ctx, requested_gpu_layers, credit_bytes)
    target, target_reason = _target(facts, policy, requested_ctx)
    # An explicitly small window (or a small model) is served as is; only memory cuts are floored.
    floor = max(1, min(policy.min_context, target))
    gpu_pool = next((d for d in devices if d.kind == "gpu"), None)
    gpu, shares = _shares(facts, pool_budget(pool, policy, credit_bytes), gpu_pool, policy, requested_gpu_layers,
                          floor)

    def fits(n: int) -> bool:
        return all(s.fits(facts, n) for s in shares)

    fitting = _largest(fits, 0, target)
    if fitting < floor:
        _refuse(facts, shares, floor)
    if fitting >= target:
        effective, reason = target, target_reason
    else:
        effective = _align_down(fitting, floor)
        binding = next(s for s in shares if not s.fits(facts, target))
        reason = binding.reason(facts, target)
    clamped = (requested_ctx > 0 and effective < requested_ctx) or reason in MEMORY_REASONS
    return _report(facts, pool, policy, devices, shares, gpu, effective, reason, clamped, requested_gpu_layers,
                   gpu_pool is not None)


def _check_request(requested_ctx: int, requested_gpu_layers: int, credit_bytes: int) -> None:
    if requested_ctx < 0:
        raise ValueError(f"requested_ctx must be >= 0 (0 = default), got {requested_ctx}")
    if credit_bytes < 0:
        raise ValueError(f"credit_bytes must be >= 0, got {credit_bytes}")
    if requested_gpu_layers < GPU_LAYERS_AUTO:
        raise ValueError(
            f"requested GPU layers must be -2 (auto), -1 (all), 0 or positive, got {requested_gpu_layers}"
        )


def _target(facts: ModelFacts, policy: Policy, requested_ctx: int) -> tuple[int, str]:
    """What the plan aims for before memory, and why: the request, else the policy's default (0: the model's
    maximum), never past the model's maximum."""
    model_max = facts.n_ctx_train
    if requested_ctx > 0:
        asked, asked_reason = requested_ctx, REASON_REQUESTED
    elif policy.default_context > 0:
        asked, asked_reason = policy.default_context, REASON_DEFAULT
    else:
        asked, asked_reason = model_max, REASON_MODEL_MAX
    return (model_max, REASON_MODEL_MAX) if asked > model_max else (asked, asked_reason)


def _shares(facts: ModelFacts, host: Budget, gpu_pool: MemoryPool | None, policy: Policy,
            requested_gpu_layers: int, floor: int) -> tuple[GpuLayers, list[Share]]:
    """The GPU layers (resolved at the minimum window ``floor``) and the pools the model's memory is shared
    between: the host alone, or the GPU (its layers' weights and KV, the compute buffers) and the host."""
    gpu = GpuLayers(0, GPU_NO_GPU if gpu_pool is None else GPU_CPU_ONLY)
    if gpu_pool is not None and requested_gpu_layers != 0:
        layer_weights = math.ceil(Fraction(facts.weights_bytes, facts.n_layer))
        layer_kv = math.ceil(Fraction(kv_cache_bytes(facts, floor), facts.n_layer))
        gpu = resolve_gpu_layers(
            requested_gpu_layers,
            facts.n_layer,
            gpu_pool,
            layer_weights + layer_kv,
            policy,
            fixed_bytes=compute_overhead_bytes(facts, floor),
        )
    if gpu.layers > 0 and gpu_pool is not None:
        on_gpu = Fraction(gpu.layers, facts.n_layer)
        return gpu, [Share(pool_budget(gpu_pool, policy, 0), on_gpu, False, True), Share(host, 1 - on_gpu, True, False)]
    return gpu, [Share(host, Fraction(1), True, True)]


def _report(facts: ModelFacts, pool: MemoryPool, policy: Policy, devices: Sequence[MemoryPool],
            shares: Sequence[Share], gpu: GpuLayers, effective: int, reason: str, clamped: bool,
            requested_gpu_layers: int, gpu_offload: bool) -> ModelInfo:
    """The plan as ``ModelInfo``: the byte fields summed over the pools, device_* naming the first."""
    model_max = facts.n_ctx_train
    primary = shares[0]
    budgets = [s.budget for s in shares]
    # the GPU's part, so a caller can tell what of the plan is host memory (the workspace cache's RAM budget)
    on_device = shares[0] if len(shares) > 1 else None
    inventory = list(devices) if any(d.id == pool.id and d.kind == pool.kind for d in devices) else [pool, *devices]
    return ModelInfo(
        model_max_context=model_max,
        effective_context=effective,
        kv_bytes_per_token=kv_bytes_per_token(facts),
        free_bytes=sum(b.pool.free_bytes for b in budgets),
        weights_bytes=facts.weights_bytes,
        overhead_bytes=overhead_bytes(facts, effective),
        reserved_bytes=sum(b.reserve for b in budgets),
        user_limit_bytes=policy.user_limit_bytes,
        min_free_bytes=sum(b.reserve + b.headroom for b in budgets),
        usable_bytes=sum(b.usable for b in budgets),
        required_bytes=required_bytes(facts, effective),
        clamped=clamped,
        reason=reason,
        device_kind=primary.budget.pool.kind,
        device_id=primary.budget.pool.id,
        device_total_bytes=primary.budget.pool.total_bytes,
        requested_gpu_layers=requested_gpu_layers,
        resolved_gpu_layers=gpu.layers,
        gpu_layers_reason=gpu.reason,
        gpu_required_bytes=on_device.need(facts, effective) if on_device is not None else 0,
        gpu_usable_bytes=on_device.budget.usable if on_device is not None else 0,
        supports_gpu_offload=gpu_offload,
        devices=[d.device_info() for d in inventory],
        n_layer=facts.n_layer,
        n_head_kv=facts.n_head_kv,
        head_dim=facts.head_dim_k,
    )


def _refuse(facts: ModelFacts, shares: Sequence[Share], floor: int) -> None:
    """Raise InsufficientMemory for the first pool where ``floor`` tokens do not fit."""
    s = next((s for s in shares if not s.fits(facts, floor)), shares[0])
    b = s.budget
    need = s.need(facts, floor)
    limit = s.reason(facts, floor)
    where = f"{b.pool.kind}:{b.pool.id}"
    how = (
        f"free {format_size(b.pool.free_bytes)} + credit {format_size(b.credit)}"
        f" − reserve {format_size(b.reserve)} − headroom {format_size(b.headroom)}"
    )
    if b.limit == REASON_USER_LIMIT:
        how = f"capped by --mem-max {format_size(b.user_limit)}; {how}"
    raise InsufficientMemory(
        f"{format_size(need)} needed on {where} for the minimum context of {floor} tokens"
        f" (weights {format_size(facts.weights_bytes)} + overhead {format_size(overhead_bytes(facts, floor))}"
        f" + KV {format_size(kv_cache_bytes(facts, floor))}), but only {format_size(max(b.usable, 0))}"
        f" ({b.usable} bytes) is usable ({how}); bound by {limit}",
        required_bytes=need,
        usable_bytes=b.usable,
        min_context=floor,
        limit=limit,
        device_kind=b.pool.kind,
        device_id=b.pool.id,
        free_bytes=b.pool.free_bytes,
        credit_bytes=b.credit,
        reserved_bytes=b.reserve,
        headroom_bytes=b.headroom,
        user_limit_bytes=b.user_limit,
        weights_bytes=facts.weights_bytes,
        kv_bytes_per_token=kv_bytes_per_token(facts),
    )


# --- the daemon's planner -------------------------------------------------------------


#: ModelInfo fields the backend's describe owns; the planner owns the memory fields.
_BACKEND_FIELDS = (
    "runtime_name",
    "runtime_digest",
    "runtime_system_info",
    "chat_template",
    "tool_format",
    "capabilities",
    "supports_gpu_offload",
    "engine_options",
    "n_layer",
    "n_head_kv",
    "head_dim",
    "digest",
)


def make_planner(
    policy: Policy, *, host_reader: Callable[[], MemoryPool] = read_host_pool
) -> Callable[[Backend, OpenSessionRequest, int], ModelInfo]:
    """The ``SlotService`` planner under ``policy``: ``(backend, request, credit_bytes) -> ModelInfo``.

    Per call, facts come from the backend's ``model_facts(req)`` and GPU pools
    from its ``memory_pools()``; the request's num_batch, kv_cache_type and
    flash_attn override the facts' ones. A backend whose ``model_facts`` is None
    cannot be planned here, and its own ``describe`` answers.
    """

    def planner(backend: Backend, req: OpenSessionRequest, credit_bytes: int) -> ModelInfo:
        facts = backend.model_facts(req)
        if facts is None:
            return backend.describe(req, credit_bytes)
        cfg = req.config
        facts = replace(
            facts,
            n_batch=cfg.num_batch or facts.n_batch,
            kv_cache_type=cfg.kv_cache_type or facts.kv_cache_type,
            flash_attn=cfg.flash_attn or facts.flash_attn,
        )
        host = host_reader()
        gpus = tuple(backend.memory_pools())
        info = plan(facts, host, policy, cfg.num_ctx, cfg.num_gpu_layers, credit_bytes, devices=(host, *gpus))
        # The backend's own describe knows the runtime and the model identity.
        planned = req.model_copy(update={"config": cfg.model_copy(update={"num_ctx": info.effective_context})})
        own = backend.describe(planned, credit_bytes)
        return info.model_copy(update={name: getattr(own, name) for name in _BACKEND_FIELDS})

    return planner


def make_budget_check(
    policy: Policy, *, other_bytes: Callable[[], int], host_reader: Callable[[], MemoryPool] = read_host_pool
) -> Callable[[int], None]:
    """A check for side loads (the embedding slot): raise InsufficientMemory if ``needed`` bytes do not fit.

    Host free memory already excludes what the generation model holds, so only
    the user limit (``--mem-max``, shared by everything the daemon loads) has the
    generation model's ``other_bytes()`` taken off it. The reserve and headroom
    apply as for the generation model. Nothing is ever evicted to make room.
    """

    def check(needed: int) -> None:
        pool = host_reader()
        headroom = int(policy.headroom_fraction * pool.free_bytes)
        usable = pool.free_bytes - policy.reserve_bytes - headroom
        bound = "memory" if policy.reserve_bytes == 0 else "reserve"
        held = other_bytes()
        if policy.user_limit_bytes and policy.user_limit_bytes - held < usable:
            usable = policy.user_limit_bytes - held
            bound = "user_limit"
        if needed > usable:
            raise InsufficientMemory(
                f"the embedding model needs {format_size(needed)} but only {format_size(max(usable, 0))} is usable "
                f"(free {format_size(pool.free_bytes)} − reserve {format_size(policy.reserve_bytes)} − headroom "
                f"{format_size(headroom)}"
                + (f"; --mem-max {format_size(policy.user_limit_bytes)} minus {format_size(held)} held by the "
                   "generation model" if bound == "user_limit" else "")
                + f"); bound by {bound}; the chat model is not evicted",
                required_bytes=needed,
                usable_bytes=usable,
                generation_bytes=held,
                limit=bound,
            )

    return check
