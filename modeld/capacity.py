"""Memory-budgeted context sizing: how large a window modeld serves on this device.

The contract's rule: ``EffectiveContext`` is the window modeld will actually serve
on this device — min(model ceiling, what fits in free memory) — derived by the
daemon from the model's metadata and the device's memory, never guessed by the
runtime. This module is that derivation. It is pure: every reading (free memory,
GPU pools, environment, config file) is an argument, and the only code that
touches the outside world is the explicit readers ``read_host_pool`` and
``Policy.load`` (plus ``make_planner``, which wires them for the daemon).

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

``kv_bytes_per_token`` (the contract field) is the dense formula from
docs/BACKENDS.md §1.7, n_layer × n_head_kv × (head_dim_k + head_dim_v) × bpe.
Sliding-window (SWA) layers hold at most ``sliding_window + n_b`` cells — that is
how llama.cpp sizes its SWA cache (window plus one micro-batch) — so past the
window only the dense layers grow. The overhead coefficients are named
(``OverheadModel``) and deliberately simple: a benchmark that measures real
resident memory at a few (n_ctx, n_batch) points calibrates them.

Reason strings (``ModelInfo.reason``; stable, see ``REASONS``):

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

import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from decimal import ROUND_FLOOR, Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path
from typing import Any, NamedTuple

import psutil  # no stubs in the venv (ignore_missing_imports); one call, typed below

from contract.errors import InsufficientMemory
from contract.interfaces import Backend
from contract.sizing import (
    KV_BYTES_PER_ELEMENT,
    LLAMA_CPP_OVERHEAD,
    OPENVINO_OVERHEAD,
    MemoryPool,
    ModelFacts,
    OverheadModel,
    compute_overhead_bytes,
    host_overhead_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    overhead_bytes,
    required_bytes,
)
from contract.types import ModelInfo, OpenSessionRequest

__all__ = [
    "CONTEXT_ALIGN",
    "DEFAULT_CONTEXT",
    "DEFAULT_HEADROOM_FRACTION",
    "DEFAULT_MIN_CONTEXT",
    "GPU_REASONS",
    "KV_BYTES_PER_ELEMENT",
    "LLAMA_CPP_OVERHEAD",
    "OPENVINO_OVERHEAD",
    "REASONS",
    "GpuLayers",
    "MemoryPool",
    "ModelFacts",
    "OverheadModel",
    "Policy",
    "format_size",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "make_planner",
    "overhead_bytes",
    "parse_size",
    "plan",
    "read_host_pool",
    "required_bytes",
    "resolve_gpu_layers",
]

#: a window cut by memory is rounded down to a multiple of this (llama.cpp's KV padding)
CONTEXT_ALIGN = 256
#: the window served when the request says 0 (0 in a Policy means "as large as fits")
DEFAULT_CONTEXT = 4096
#: below this many tokens a memory-cut window is refused instead of served
DEFAULT_MIN_CONTEXT = 512
#: fraction of free memory left untouched for allocator slack and estimate error
DEFAULT_HEADROOM_FRACTION = 0.10

#: ModelInfo.reason values, see the module docstring
REASON_REQUESTED = "requested"
REASON_DEFAULT = "default"
REASON_MODEL_MAX = "model_max"
REASON_MEMORY = "memory"
REASON_RESERVE = "reserve"
REASON_USER_LIMIT = "user_limit"
REASONS = frozenset(
    {REASON_REQUESTED, REASON_DEFAULT, REASON_MODEL_MAX, REASON_MEMORY, REASON_RESERVE, REASON_USER_LIMIT}
)
_MEMORY_REASONS = frozenset({REASON_MEMORY, REASON_RESERVE, REASON_USER_LIMIT})

#: GpuLayers.reason values, see ``resolve_gpu_layers``
GPU_NO_GPU = "no gpu"
GPU_CPU_ONLY = "cpu only"
GPU_ALL = "all"
GPU_REQUESTED = "requested"
GPU_N_LAYER = "n_layer"
GPU_MEMORY = "gpu memory"
GPU_REASONS = frozenset({GPU_NO_GPU, GPU_CPU_ONLY, GPU_ALL, GPU_REQUESTED, GPU_N_LAYER, GPU_MEMORY})

# --- facts -------------------------------------------------------------------------


# --- memory pools ---------------------------------------------------------------------


def read_host_pool() -> MemoryPool:
    """Host RAM now: psutil's ``available`` (reclaimable page cache counts as free) and ``total``."""
    vm = psutil.virtual_memory()
    return MemoryPool(kind="cpu", id="host", total_bytes=int(vm.total), free_bytes=int(vm.available), name="host RAM")


# --- sizes ----------------------------------------------------------------------------

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_FORMAT_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def parse_size(value: str | int) -> int:
    """Bytes from "60MB", "8GiB", "512k", "1.5 GiB" or a plain count.

    Decimal prefixes are powers of ten (k/kB = 1000, M/MB = 10^6, G/GB = 10^9, T/TB);
    binary ones are powers of two (Ki/KiB = 1024, Mi/MiB = 2^20, Gi/GiB, Ti/TiB).
    Units are case-insensitive; a single letter is decimal (SI), as in "512k" =
    512,000. Fractions round down to whole bytes. Raises ValueError on anything else.
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}: expected a byte count")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid size {value}: must be >= 0")
        return value
    if not isinstance(value, str):
        raise ValueError(f"invalid size {value!r}: expected a string or an int")
    m = _SIZE_RE.match(value)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"invalid size {value!r}: expected a number with an optional unit, e.g. 512k, 60MB, 1.5GiB, 8GiB"
        )
    try:
        number = Decimal(m.group(1))
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"invalid size {value!r}") from exc
    scaled = number * _UNITS[unit]
    if _UNITS[unit] == 1 and scaled != scaled.to_integral_value():
        raise ValueError(f"invalid size {value!r}: a byte count must be whole")
    return int(scaled.to_integral_value(rounding=ROUND_FLOOR))


def format_size(n: int) -> str:
    """Human-readable binary size: "8GiB" when exact, else two decimals ("92.10MiB"); "512B" below 1 KiB.

    ``parse_size(format_size(n))`` is exact for multiples of the chosen unit and
    within 0.5% otherwise.
    """
    if n < 0:
        return "-" + format_size(-n)
    for suffix, unit in _FORMAT_UNITS:
        if n >= unit:
            if n % unit == 0:
                return f"{n // unit}{suffix}"
            return f"{n / unit:.2f}{suffix}"
    return f"{n}B"


def _parse_fraction(value: str | float, what: str) -> float:
    """0.1, "0.1" or "10%" → 0.1, in [0, 1)."""
    try:
        if isinstance(value, str):
            s = value.strip()
            f = float(s[:-1]) / 100 if s.endswith("%") else float(s)
        elif isinstance(value, bool):
            raise ValueError
        else:
            f = float(value)
    except ValueError:
        raise ValueError(f"{what}: invalid fraction {value!r}: expected e.g. 0.1 or 10%") from None
    if not 0.0 <= f < 1.0 or math.isnan(f):
        raise ValueError(f"{what}: fraction {value!r} must be in [0, 1)")
    return f


def _parse_count(value: str | float, what: str) -> int:
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        n = int(value.strip()) if isinstance(value, str) else int(value)
    except ValueError:
        raise ValueError(f"{what}: invalid token count {value!r}: expected a whole number") from None
    if n < 0:
        raise ValueError(f"{what}: token count {value!r} must be >= 0")
    return n


# --- policy ---------------------------------------------------------------------------

#: Policy field -> (CLI key, environment variable, [memory] key in the config file)
_POLICY_SOURCES: dict[str, tuple[str, str, str]] = {
    "user_limit_bytes": ("mem_max", "MODELD_MEM_MAX", "max"),
    "reserve_bytes": ("mem_reserve", "MODELD_MEM_RESERVE", "reserve"),
    "headroom_fraction": ("mem_headroom", "MODELD_MEM_HEADROOM", "headroom"),
    "min_context": ("min_context", "MODELD_MIN_CONTEXT", "min_context"),
    "default_context": ("default_context", "MODELD_DEFAULT_CONTEXT", "default_context"),
}


@dataclass(frozen=True)
class Policy:
    """The operator's memory policy.

    * ``user_limit_bytes`` (--mem-max): cap on everything the model uses (weights
      + overhead + KV) in each pool; 0 = no cap.
    * ``reserve_bytes`` (--mem-reserve): memory kept free for everything else.
    * ``headroom_fraction``: share of free memory (incl. the switch credit) kept
      free on top of the reserve, for allocator slack and estimate error; 0.10.
    * ``min_context``: a memory-cut window below this is refused
      (InsufficientMemory) rather than served; 512. A smaller window that was
      asked for (or is the model's maximum) is still served.
    * ``default_context``: the window when the request says 0; 4096 (a window
      that keeps prefill and KV modest on a laptop; agents that want more ask).
      0 here means "as large as fits, up to the model's maximum".
    """

    user_limit_bytes: int = 0
    reserve_bytes: int = 0
    headroom_fraction: float = DEFAULT_HEADROOM_FRACTION
    min_context: int = DEFAULT_MIN_CONTEXT
    default_context: int = DEFAULT_CONTEXT

    def __post_init__(self) -> None:
        for name in ("user_limit_bytes", "reserve_bytes", "min_context", "default_context"):
            if getattr(self, name) < 0:
                raise ValueError(f"Policy.{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.headroom_fraction < 1.0:
            raise ValueError(f"Policy.headroom_fraction must be in [0, 1), got {self.headroom_fraction}")

    @classmethod
    def load(
        cls,
        env: Mapping[str, str] | None = None,
        config_file: str | os.PathLike[str] | None = None,
        cli: Mapping[str, Any] | None = None,
    ) -> Policy:
        """Resolve each field independently: CLI > environment > config file > default.

        * ``cli``: keys ``mem_max``, ``mem_reserve``, ``mem_headroom``,
          ``min_context``, ``default_context`` (argparse names); None = not given.
        * ``env`` (default ``os.environ``): ``MODELD_MEM_MAX``, ``MODELD_MEM_RESERVE``,
          ``MODELD_MEM_HEADROOM``, ``MODELD_MIN_CONTEXT``, ``MODELD_DEFAULT_CONTEXT``;
          empty = not set.
        * config file: ``config_file``, else ``$MODELD_CONFIG``, else
          ``~/.config/modeld/config.toml`` (only this default may be absent). TOML,
          section ``[memory]`` with keys ``max``, ``reserve``, ``headroom``,
          ``min_context``, ``default_context``; an unknown key is an error.

        Sizes go through ``parse_size``; headroom accepts 0.1 or "10%". A bad value
        raises ValueError naming its source.
        """
        env = os.environ if env is None else env
        cli = cli or {}
        file_values = _read_memory_section(env, config_file)
        values: dict[str, Any] = {}
        for fname, (cli_key, env_key, file_key) in _POLICY_SOURCES.items():
            raw: Any = None
            source = ""
            if cli.get(cli_key) is not None:
                raw, source = cli[cli_key], f"--{cli_key.replace('_', '-')}"
            elif env.get(env_key):
                raw, source = env[env_key], env_key
            elif file_key in file_values:
                raw, source = file_values[file_key], f"[memory] {file_key}"
            if source:
                values[fname] = _convert(fname, raw, source)
        return cls(**values)


def _convert(fname: str, raw: Any, source: str) -> Any:
    if fname in ("user_limit_bytes", "reserve_bytes"):
        try:
            return parse_size(raw)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
    if fname == "headroom_fraction":
        return _parse_fraction(raw, source)
    return _parse_count(raw, source)


def _read_memory_section(env: Mapping[str, str], config_file: str | os.PathLike[str] | None) -> dict[str, Any]:
    explicit = config_file is not None or bool(env.get("MODELD_CONFIG"))
    if config_file is not None:
        path = Path(config_file)
    elif env.get("MODELD_CONFIG"):
        path = Path(env["MODELD_CONFIG"])
    else:
        path = Path.home() / ".config" / "modeld" / "config.toml"
    try:
        with path.open("rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        if explicit:
            raise ValueError(f"config file {path} does not exist") from None
        return {}
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path} is not valid TOML: {exc}") from None
    section = doc.get("memory", {})
    if not isinstance(section, dict):
        raise ValueError(f"config file {path}: [memory] must be a table")
    known = {keys[2] for keys in _POLICY_SOURCES.values()}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ValueError(f"config file {path}: unknown [memory] keys {unknown}; known: {sorted(known)}")
    return dict(section)


# --- budgets --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Budget:
    """What one pool lets the model use, and which limit set it."""

    pool: MemoryPool
    credit: int
    reserve: int
    headroom: int
    user_limit: int
    usable: int
    #: "user_limit" when the --mem-max cap is below the physical budget, else "memory"
    limit: str

    @property
    def physical(self) -> int:
        return self.pool.free_bytes + self.credit - self.reserve - self.headroom


def _budget(pool: MemoryPool, policy: Policy, credit: int) -> _Budget:
    avail = pool.free_bytes + credit
    headroom = int(avail * policy.headroom_fraction)
    physical = avail - policy.reserve_bytes - headroom
    if policy.user_limit_bytes and policy.user_limit_bytes < physical:
        usable, limit = policy.user_limit_bytes, REASON_USER_LIMIT
    else:
        usable, limit = physical, REASON_MEMORY
    return _Budget(pool, credit, policy.reserve_bytes, headroom, policy.user_limit_bytes, usable, limit)


class _Share(NamedTuple):
    """A pool's part of the model: ``fraction`` of weights and KV, and which overheads."""

    budget: _Budget
    fraction: Fraction
    host_overhead: bool
    compute_overhead: bool

    def need(self, facts: ModelFacts, n_ctx: int) -> int:
        b = math.ceil(self.fraction * (facts.weights_bytes + kv_cache_bytes(facts, n_ctx)))
        if self.host_overhead:
            b += host_overhead_bytes(facts, n_ctx)
        if self.compute_overhead:
            b += compute_overhead_bytes(facts, n_ctx)
        return b

    def fits(self, facts: ModelFacts, n_ctx: int) -> bool:
        return self.need(facts, n_ctx) <= self.budget.usable

    def reason(self, facts: ModelFacts, target: int) -> str:
        """The limit that stops ``target`` fitting in this pool (see the module docstring)."""
        if self.budget.limit == REASON_USER_LIMIT:
            return REASON_USER_LIMIT
        if self.budget.reserve:
            without_reserve = self.budget.physical + self.budget.reserve
            if self.budget.user_limit:
                without_reserve = min(without_reserve, self.budget.user_limit)
            if self.need(facts, target) <= without_reserve:
                return REASON_RESERVE
        return REASON_MEMORY


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


# --- GPU layers -----------------------------------------------------------------------


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
    * -1 (all) → n_layer, "all", if every layer fits, else InsufficientMemory: the
      caller asked for full offload and a silent partial one would be a surprise
      (ask for an explicit count to accept partial offload);
    * N > 0 → min(N, n_layer) ("requested", or "n_layer" when N exceeded it); when
      that does not fit, the most layers that do ("gpu memory"), possibly 0.
    """
    if requested < -1:
        raise ValueError(f"requested GPU layers must be -1 (all), 0 or positive, got {requested}")
    if n_layer <= 0:
        raise ValueError(f"n_layer must be positive, got {n_layer}")
    if per_layer_bytes < 0 or fixed_bytes < 0:
        raise ValueError("per_layer_bytes and fixed_bytes must be >= 0")
    if gpu_pool is None:
        return GpuLayers(0, GPU_NO_GPU)
    if requested == 0:
        return GpuLayers(0, GPU_CPU_ONLY)
    budget = _budget(gpu_pool, policy, credit_bytes)
    if budget.usable < fixed_bytes:
        fitting = 0
    elif per_layer_bytes == 0:
        fitting = n_layer
    else:
        fitting = (budget.usable - fixed_bytes) // per_layer_bytes
    if requested == -1:
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


# --- the plan -------------------------------------------------------------------------


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

    With GPU layers requested and a GPU pool in ``devices`` (the first one; tensor
    splits across GPUs are not modelled), the layers are resolved first
    (``resolve_gpu_layers`` at the minimum context), then the window must fit
    both pools: the GPU holds its share of weights and KV plus the compute
    buffers, the host the rest plus the logits/fixed overhead. The byte fields then
    sum over both pools, and device_* name the GPU.

    Raises InsufficientMemory, with the numbers, when not even the minimum window
    fits, and ValueError on a negative request.
    """
    if requested_ctx < 0:
        raise ValueError(f"requested_ctx must be >= 0 (0 = default), got {requested_ctx}")
    if credit_bytes < 0:
        raise ValueError(f"credit_bytes must be >= 0, got {credit_bytes}")
    if requested_gpu_layers < -1:
        raise ValueError(f"requested GPU layers must be -1 (all), 0 or positive, got {requested_gpu_layers}")
    model_max = facts.n_ctx_train

    # What we aim for before memory: request, else the policy default (0 = model max).
    if requested_ctx > 0:
        asked, asked_reason = requested_ctx, REASON_REQUESTED
    elif policy.default_context > 0:
        asked, asked_reason = policy.default_context, REASON_DEFAULT
    else:
        asked, asked_reason = model_max, REASON_MODEL_MAX
    if asked > model_max:
        target, target_reason = model_max, REASON_MODEL_MAX
    else:
        target, target_reason = asked, asked_reason
    # An explicitly small window (or a small model) is served as is; only memory cuts are floored.
    floor = max(1, min(policy.min_context, target))

    host = _budget(pool, policy, credit_bytes)
    gpu_pool = next((d for d in devices if d.kind == "gpu"), None)
    gpu = GpuLayers(0, GPU_NO_GPU if gpu_pool is None else GPU_CPU_ONLY)
    shares: list[_Share]
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
        shares = [
            _Share(_budget(gpu_pool, policy, 0), on_gpu, False, True),
            _Share(host, 1 - on_gpu, True, False),
        ]
    else:
        shares = [_Share(host, Fraction(1), True, True)]

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
    clamped = (requested_ctx > 0 and effective < requested_ctx) or reason in _MEMORY_REASONS

    primary = shares[0]
    budgets = [s.budget for s in shares]
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
        supports_gpu_offload=gpu_pool is not None,
        devices=[d.device_info() for d in inventory],
        n_layer=facts.n_layer,
        n_head_kv=facts.n_head_kv,
        head_dim=facts.head_dim_k,
    )


def _refuse(facts: ModelFacts, shares: Sequence[_Share], floor: int) -> None:
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
    "supports_gpu_offload",
    "n_layer",
    "n_head_kv",
    "head_dim",
    "digest",
)


def make_planner(
    mem_max: str | int | None = None,
    mem_reserve: str | int | None = None,
    *,
    env: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
    host_reader: Callable[[], MemoryPool] = read_host_pool,
) -> Callable[[Backend, OpenSessionRequest, int], ModelInfo]:
    """The ``SlotService`` planner: ``(backend, request, credit_bytes) -> ModelInfo``.

    The policy is loaded once (CLI ``--mem-max``/``--mem-reserve`` over env over
    config file). Per call, facts come from the backend's ``model_facts(req)``
    and GPU pools from its ``memory_pools()``; the request's num_batch,
    kv_cache_type and flash_attn override the facts' ones. A backend whose
    ``model_facts`` is None cannot be planned here, and its own ``describe`` answers.
    """
    policy = Policy.load(env=env, config_file=config_file, cli={"mem_max": mem_max, "mem_reserve": mem_reserve})

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
    mem_max: str | int | None = None,
    mem_reserve: str | int | None = None,
    *,
    other_bytes: Callable[[], int],
    env: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
    host_reader: Callable[[], MemoryPool] = read_host_pool,
) -> Callable[[int], None]:
    """A check for side loads (the embedding slot): raise InsufficientMemory if ``needed`` bytes do not fit.

    Host free memory already excludes what the generation model holds, so only
    the user limit (``--mem-max``, shared by everything the daemon loads) has the
    generation model's ``other_bytes()`` taken off it. The reserve and headroom
    apply as for the generation model. Nothing is ever evicted to make room.
    """
    policy = Policy.load(env=env, config_file=config_file, cli={"mem_max": mem_max, "mem_reserve": mem_reserve})

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
