"""Tests for modeld.capacity: pure, fast, every reading injected.

Numbers are SmolLM2-135M's (n_ctx_train 8192, 30 layers, 3 KV heads of 64/64,
96,576,768 bytes of weights, n_vocab 49152, n_embd 576, 9 heads): f16 KV is
30 × 3 × 128 × 2 = 23,040 bytes per token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contract.errors import InsufficientMemory
from contract.sizing import ModelShape, compute_overhead_bytes, host_overhead_bytes
from contract.types import Config, ModelInfo, OpenSessionRequest
from modeld import capacity
from modeld.capacity import (
    CONTEXT_ALIGN,
    GPU_REASONS,
    KV_BYTES_PER_ELEMENT,
    REASONS,
    MemoryPool,
    ModelFacts,
    OverheadModel,
    Policy,
    format_size,
    kv_bytes_per_token,
    kv_cache_bytes,
    make_planner,
    overhead_bytes,
    parse_size,
    plan,
    read_host_pool,
    required_bytes,
    resolve_gpu_layers,
)

GiB = 2**30
MiB = 2**20

SMOL = ModelFacts(
    n_ctx_train=8192,
    n_layer=30,
    n_head_kv=3,
    head_dim_k=64,
    head_dim_v=64,
    weights_bytes=96_576_768,
    n_vocab=49152,
    n_embd=576,
    n_head=9,
)
#: no headroom, no reserve, no cap: arithmetic in tests stays exact
BARE = Policy(headroom_fraction=0.0, default_context=4096)


def host(free: int, total: int | None = None) -> MemoryPool:
    return MemoryPool(
        kind="cpu", id="host", total_bytes=total if total is not None else max(free, 64 * GiB), free_bytes=free
    )


def gpu(free: int, total: int | None = None, gid: str = "0") -> MemoryPool:
    return MemoryPool(kind="gpu", id=gid, total_bytes=total if total is not None else max(free, 1), free_bytes=free)


def largest_fitting(facts: ModelFacts, usable: int, hi: int) -> int:
    """Reference: the largest n <= hi with required_bytes(n) <= usable (linear scan from the top)."""
    n = hi
    while n > 0 and required_bytes(facts, n) > usable:
        n -= 1
    return n


# --- per-token cost ----------------------------------------------------------------


def test_kv_bytes_per_token_f16_matches_the_formula() -> None:
    assert kv_bytes_per_token(SMOL) == 30 * 3 * (64 + 64) * 2 == 23_040
    assert kv_cache_bytes(SMOL, 8192) == 23_040 * 8192


@pytest.mark.parametrize(
    ("kv_type", "expected", "ratio"),
    [
        ("", 23_040, 1.0),
        ("f16", 23_040, 1.0),
        ("f32", 46_080, 2.0),
        ("q8_0", 12_240, 34 / 64),  # 0.53125
        ("q4_0", 6_480, 18 / 64),  # 0.28125
        ("u8", 12_960, 36 / 64),
        ("u4", 7_200, 20 / 64),
    ],
)
def test_kv_cache_type_scales_the_per_token_cost(kv_type: str, expected: int, ratio: float) -> None:
    facts = dataclasses.replace(SMOL, kv_cache_type=kv_type)
    assert kv_bytes_per_token(facts) == expected
    assert kv_bytes_per_token(facts) / kv_bytes_per_token(SMOL) == pytest.approx(ratio)


def test_q8_and_q4_are_about_half_and_a_quarter_of_f16() -> None:
    f16 = kv_bytes_per_token(SMOL)
    assert kv_bytes_per_token(dataclasses.replace(SMOL, kv_cache_type="q8_0")) / f16 == pytest.approx(0.53, abs=0.01)
    assert kv_bytes_per_token(dataclasses.replace(SMOL, kv_cache_type="q4_0")) / f16 == pytest.approx(0.28, abs=0.01)


def test_quantised_kv_buys_a_larger_window_in_the_same_memory() -> None:
    pool = host(required_bytes(SMOL, 3000))
    f16 = plan(SMOL, pool, BARE, 8192)
    q4 = plan(dataclasses.replace(SMOL, kv_cache_type="q4_0"), pool, BARE, 8192)
    assert q4.effective_context > f16.effective_context
    assert q4.kv_bytes_per_token < f16.kv_bytes_per_token


def test_required_bytes_is_weights_plus_overhead_plus_kv() -> None:
    for n in (1, 256, 512, 4096, 8192):
        assert required_bytes(SMOL, n) == SMOL.weights_bytes + overhead_bytes(SMOL, n) + kv_cache_bytes(SMOL, n)


def test_overhead_model_terms_are_named_and_calibratable() -> None:
    n_b = 512
    m = SMOL.overhead
    expected = (
        m.fixed_bytes
        + m.logits_copies * n_b * 49152 * 4
        + m.compute_rows * n_b * 576 * 4
        + m.kq_copies * n_b * 9 * 8192 * 4
    )
    assert overhead_bytes(SMOL, 8192) == expected
    # flash attention drops the n_ctx-sized score matrix
    fa = dataclasses.replace(SMOL, flash_attn=True)
    assert overhead_bytes(SMOL, 8192) - overhead_bytes(fa, 8192) == n_b * 9 * 8192 * 4
    # a calibrated model is just other coefficients
    calibrated = dataclasses.replace(
        SMOL, overhead=OverheadModel(name="bench", fixed_bytes=0, logits_copies=0, compute_rows=0, kq_copies=0)
    )
    assert overhead_bytes(calibrated, 8192) == 0
    # llama.cpp clamps n_batch to n_ctx, so tiny windows have smaller buffers
    assert overhead_bytes(SMOL, 64) < overhead_bytes(SMOL, 512)


def test_overhead_is_monotone_in_context() -> None:
    prev = -1
    for n in range(0, 9000, 97):
        cur = required_bytes(SMOL, n)
        assert cur >= prev
        prev = cur


def test_bad_facts_are_rejected() -> None:
    with pytest.raises(ValueError, match="kv_cache_type"):
        dataclasses.replace(SMOL, kv_cache_type="q5_1")
    with pytest.raises(ValueError, match="n_layer"):
        dataclasses.replace(SMOL, n_layer=0)
    with pytest.raises(ValueError, match="n_swa_layers"):
        dataclasses.replace(SMOL, sliding_window=512, n_swa_layers=31)
    with pytest.raises(ValueError, match="weights_bytes"):
        dataclasses.replace(SMOL, weights_bytes=-1)


# --- sliding window ----------------------------------------------------------------

SWA = dataclasses.replace(SMOL, sliding_window=1024, n_swa_layers=24)  # 6 dense layers, 24 windowed


def test_sliding_window_layers_are_capped_at_window_plus_micro_batch() -> None:
    per_layer = 3 * 128 * 2
    # inside the window everything is dense
    assert kv_cache_bytes(SWA, 1024) == kv_cache_bytes(SMOL, 1024)
    # past window + n_batch, windowed layers stop growing
    n = 8192
    assert kv_cache_bytes(SWA, n) == per_layer * (6 * n + 24 * (1024 + 512))
    assert kv_cache_bytes(SWA, n) < kv_cache_bytes(SMOL, n)
    # the marginal cost beyond the window is the dense layers only
    assert kv_cache_bytes(SWA, 8000) - kv_cache_bytes(SWA, 7999) == 6 * per_layer


def test_sliding_window_without_layer_count_is_counted_dense() -> None:
    unknown = dataclasses.replace(SMOL, sliding_window=1024, n_swa_layers=0)
    assert kv_cache_bytes(unknown, 8192) == kv_cache_bytes(SMOL, 8192)


def test_sliding_window_lets_a_larger_window_fit() -> None:
    pool = host(required_bytes(SMOL, 3000))
    dense = plan(SMOL, pool, BARE, 8192)
    windowed = plan(SWA, pool, BARE, 8192)
    assert windowed.effective_context > dense.effective_context
    assert required_bytes(SWA, windowed.effective_context) <= windowed.usable_bytes
    # the contract's kv_bytes_per_token stays the dense formula
    assert windowed.kv_bytes_per_token == dense.kv_bytes_per_token


# --- plan: which limit binds ----------------------------------------------------------


def test_plenty_of_memory_serves_the_model_max_when_asked_for_everything() -> None:
    info = plan(SMOL, host(64 * GiB), Policy(default_context=0), 0)
    assert info.effective_context == info.model_max_context == 8192
    assert info.reason == "model_max"
    assert not info.clamped


def test_plenty_of_memory_serves_a_smaller_request_exactly() -> None:
    info = plan(SMOL, host(64 * GiB), Policy(), 3000)
    assert info.effective_context == 3000  # not aligned: it was asked for
    assert info.reason == "requested"
    assert not info.clamped


def test_request_equal_to_the_model_max_is_served_as_requested() -> None:
    info = plan(SMOL, host(64 * GiB), Policy(), 8192)
    assert (info.effective_context, info.reason, info.clamped) == (8192, "requested", False)


def test_zero_request_serves_the_model_max_by_default() -> None:
    # agents send 8k-22k tokens first: the default is the largest window the model and memory allow
    info = plan(SMOL, host(64 * GiB), Policy(), 0)
    assert (info.effective_context, info.reason, info.clamped) == (8192, "model_max", False)


def test_zero_request_uses_a_configured_default_window() -> None:
    info = plan(SMOL, host(64 * GiB), Policy(default_context=4096), 0)
    assert (info.effective_context, info.reason, info.clamped) == (4096, "default", False)


def test_default_above_the_model_max_is_capped_without_a_clamp() -> None:
    info = plan(SMOL, host(64 * GiB), Policy(default_context=32768), 0)
    assert (info.effective_context, info.reason, info.clamped) == (8192, "model_max", False)


def test_request_above_the_model_max_is_clamped_to_it() -> None:
    info = plan(SMOL, host(64 * GiB), Policy(), 32768)
    assert info.effective_context == 8192
    assert info.reason == "model_max"
    assert info.clamped


def test_scarce_memory_clamps_below_the_max_with_reason_memory() -> None:
    usable = required_bytes(SMOL, 3000)
    info = plan(SMOL, host(usable), BARE, 8192)
    assert info.reason == "memory"
    assert info.clamped
    assert info.usable_bytes == usable
    assert info.effective_context % CONTEXT_ALIGN == 0
    assert info.effective_context == 3000 - 3000 % CONTEXT_ALIGN == 2816
    assert info.required_bytes == required_bytes(SMOL, info.effective_context) <= info.usable_bytes
    assert required_bytes(SMOL, info.effective_context + CONTEXT_ALIGN) > info.usable_bytes


def test_scarce_memory_clamps_the_default_window_too() -> None:
    info = plan(SMOL, host(required_bytes(SMOL, 1000)), BARE, 0)
    assert (info.effective_context, info.reason, info.clamped) == (768, "memory", True)


def test_headroom_is_taken_from_free_memory() -> None:
    free = 1 * GiB
    info = plan(SMOL, host(free), Policy(headroom_fraction=0.25), 0)
    assert info.min_free_bytes == free // 4
    assert info.usable_bytes == free - free // 4
    assert info.free_bytes == free


def test_user_limit_binds_with_reason_user_limit() -> None:
    cap = required_bytes(SMOL, 2000)
    info = plan(SMOL, host(64 * GiB), Policy(user_limit_bytes=cap), 8192)
    assert info.reason == "user_limit"
    assert info.clamped
    assert info.usable_bytes == info.user_limit_bytes == cap
    assert info.effective_context == 1792
    assert info.required_bytes <= cap


def test_user_limit_above_free_memory_does_not_bind() -> None:
    info = plan(SMOL, host(required_bytes(SMOL, 2000)), BARE.model_copy(update={"user_limit_bytes": 64 * GiB}), 8192)
    assert info.reason == "memory"
    assert info.user_limit_bytes == 64 * GiB


def test_reserve_binds_with_reason_reserve() -> None:
    reserve = 256 * MiB
    free = required_bytes(SMOL, 4096) + reserve // 2  # fits 4096 only if the reserve is ignored
    info = plan(SMOL, host(free), BARE.model_copy(update={"reserve_bytes": reserve}), 4096)
    assert info.reason == "reserve"
    assert info.clamped
    assert info.effective_context < 4096
    assert info.reserved_bytes == reserve
    assert info.usable_bytes == free - reserve
    assert info.min_free_bytes == reserve


def test_memory_not_reserve_when_even_without_the_reserve_it_would_not_fit() -> None:
    free = required_bytes(SMOL, 2000) + 1 * MiB
    info = plan(SMOL, host(free), BARE.model_copy(update={"reserve_bytes": 1 * MiB}), 8192)
    assert info.reason == "memory"


def test_every_memory_field_is_filled() -> None:
    info = plan(SMOL, host(2 * GiB, total=16 * GiB), Policy(reserve_bytes=100 * MiB, user_limit_bytes=1 * GiB), 0)
    assert info.model_max_context == 8192
    assert info.kv_bytes_per_token == 23_040
    assert info.free_bytes == 2 * GiB
    assert info.weights_bytes == 96_576_768
    assert info.overhead_bytes == overhead_bytes(SMOL, info.effective_context)
    assert info.reserved_bytes == 100 * MiB
    assert info.user_limit_bytes == 1 * GiB
    assert info.min_free_bytes == 100 * MiB + int(2 * GiB * 0.10)
    assert info.usable_bytes == 1 * GiB
    assert info.required_bytes == required_bytes(SMOL, info.effective_context)
    assert info.reason in REASONS
    assert (info.device_kind, info.device_id, info.device_total_bytes) == ("cpu", "host", 16 * GiB)
    assert (info.requested_gpu_layers, info.resolved_gpu_layers, info.supports_gpu_offload) == (0, 0, False)
    assert [d.kind for d in info.devices] == ["cpu"]
    assert (info.n_layer, info.n_head_kv, info.head_dim) == (30, 3, 64)
    # and it survives the wire as the contract type
    assert ModelInfo.model_validate(info.model_dump()) == info


def test_small_explicit_request_below_the_minimum_is_served() -> None:
    info = plan(SMOL, host(64 * GiB), Policy(min_context=512), 128)
    assert (info.effective_context, info.reason) == (128, "requested")


def test_tiny_model_max_below_the_minimum_is_served() -> None:
    tiny = dataclasses.replace(SMOL, n_ctx_train=256)
    info = plan(tiny, host(64 * GiB), Policy(min_context=512), 0)
    assert (info.effective_context, info.reason) == (256, "model_max")


def test_memory_cut_does_not_align_below_the_minimum() -> None:
    # 700 tokens fit; aligning down would give 512, below min_context 600, so 700 is served unaligned
    info = plan(SMOL, host(required_bytes(SMOL, 700)), BARE.model_copy(update={"min_context": 600}), 8192)
    assert info.effective_context == 700
    assert info.reason == "memory"


# --- refusal -----------------------------------------------------------------------


def test_below_the_minimum_raises_insufficient_memory_with_the_numbers() -> None:
    free = required_bytes(SMOL, 400)
    with pytest.raises(InsufficientMemory) as exc:
        plan(SMOL, host(free), BARE, 8192)
    err = exc.value
    need = required_bytes(SMOL, 512)
    assert err.details["required_bytes"] == need
    assert err.details["usable_bytes"] == free
    assert err.details["min_context"] == 512
    assert err.details["limit"] == "memory"
    assert err.details["device_kind"] == "cpu"
    assert err.details["kv_bytes_per_token"] == 23_040
    msg = str(err)
    assert "512 tokens" in msg
    assert format_size(need) in msg
    assert str(free) in msg
    assert "bound by memory" in msg
    assert err.code == 34


def test_refusal_names_the_user_limit() -> None:
    with pytest.raises(InsufficientMemory, match="bound by user_limit") as exc:
        plan(SMOL, host(64 * GiB), Policy(user_limit_bytes=100 * MiB), 0)
    assert "--mem-max" in str(exc.value)
    assert exc.value.details["usable_bytes"] == 100 * MiB


def test_refusal_names_the_reserve() -> None:
    free = required_bytes(SMOL, 512) + 10 * MiB
    with pytest.raises(InsufficientMemory, match="bound by reserve"):
        plan(SMOL, host(free), BARE.model_copy(update={"reserve_bytes": 20 * MiB}), 0)


def test_weights_larger_than_memory_are_refused() -> None:
    with pytest.raises(InsufficientMemory):
        plan(SMOL, host(50 * MiB), Policy(), 0)


def test_reserve_larger_than_free_is_refused_not_negative() -> None:
    with pytest.raises(InsufficientMemory) as exc:
        plan(SMOL, host(1 * GiB), Policy(reserve_bytes=4 * GiB), 0)
    assert exc.value.details["usable_bytes"] < 0
    assert "usable" in str(exc.value)


def test_negative_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError):
        plan(SMOL, host(GiB), Policy(), -1)
    with pytest.raises(ValueError):
        plan(SMOL, host(GiB), Policy(), 0, credit_bytes=-1)
    with pytest.raises(ValueError):
        plan(SMOL, host(GiB), Policy(), 0, requested_gpu_layers=-3)


# --- switches ----------------------------------------------------------------------


def test_credit_of_the_resident_model_makes_a_switch_fit() -> None:
    free = required_bytes(SMOL, 256)
    credit = 1 * GiB
    with pytest.raises(InsufficientMemory):
        plan(SMOL, host(free), BARE, 4096)
    info = plan(SMOL, host(free), BARE, 4096, credit_bytes=credit)
    assert (info.effective_context, info.reason) == (4096, "requested")
    assert info.usable_bytes == free + credit
    assert info.free_bytes == free  # the reading, not the credit


def test_headroom_counts_the_credit_as_free() -> None:
    info = plan(SMOL, host(1 * GiB), Policy(headroom_fraction=0.1), 0, credit_bytes=1 * GiB)
    assert info.min_free_bytes == int(2 * GiB * 0.1)


# --- idempotence ---------------------------------------------------------------------


def test_a_memory_clamped_window_is_a_fixed_point() -> None:
    pool = host(required_bytes(SMOL, 3000))
    first = plan(SMOL, pool, BARE, 8192)
    again = plan(SMOL, pool, BARE, first.effective_context)
    assert again.effective_context == first.effective_context
    assert again.required_bytes == first.required_bytes


def test_replanning_with_the_original_request_follows_memory() -> None:
    # the caller passes the ORIGINAL request each time, never a previous effective_context
    scarce = plan(SMOL, host(required_bytes(SMOL, 3000)), BARE, 8192)
    grown = plan(SMOL, host(4 * GiB), BARE, 8192)
    assert scarce.effective_context < grown.effective_context == 8192
    assert (grown.reason, grown.clamped) == ("requested", False)


# --- properties ----------------------------------------------------------------------

KV_TYPES = sorted(KV_BYTES_PER_ELEMENT)


@settings(max_examples=300, deadline=None)
@given(
    free=st.integers(0, 8 * GiB),
    credit=st.integers(0, 2 * GiB),
    requested=st.one_of(st.just(0), st.integers(1, 40_000)),
    kv_type=st.sampled_from(KV_TYPES),
    reserve=st.integers(0, GiB),
    user_limit=st.one_of(st.just(0), st.integers(1, 4 * GiB)),
    headroom=st.floats(0.0, 0.5),
    min_context=st.integers(0, 4096),
    default_context=st.integers(0, 16384),
    swa=st.booleans(),
)
def test_plan_invariants(
    free: int,
    credit: int,
    requested: int,
    kv_type: str,
    reserve: int,
    user_limit: int,
    headroom: float,
    min_context: int,
    default_context: int,
    swa: bool,
) -> None:
    facts = dataclasses.replace(SWA if swa else SMOL, kv_cache_type=kv_type)
    policy = Policy(
        user_limit_bytes=user_limit,
        reserve_bytes=reserve,
        headroom_fraction=headroom,
        min_context=min_context,
        default_context=default_context,
    )
    try:
        info = plan(facts, host(free), policy, requested, credit_bytes=credit)
    except InsufficientMemory as exc:
        floor = exc.details["min_context"]
        assert 1 <= floor <= max(min_context, 1)
        assert required_bytes(facts, floor) > exc.details["usable_bytes"]
        return
    e = info.effective_context
    assert 1 <= e <= info.model_max_context
    if requested:
        assert e <= requested
        assert info.clamped == (e < requested or info.reason in {"memory", "reserve", "user_limit"})
    assert required_bytes(facts, e) == info.required_bytes <= info.usable_bytes
    if user_limit:
        assert info.usable_bytes <= user_limit
    assert info.reason in REASONS
    if info.reason in {"memory", "reserve", "user_limit"}:
        assert info.clamped
        # maximal up to alignment: one more aligned step would not fit
        assert required_bytes(facts, e - e % CONTEXT_ALIGN + CONTEXT_ALIGN) > info.usable_bytes
    else:
        # not memory-bound: the target itself fitted
        assert info.reason in {"requested", "default", "model_max"}
    # deterministic, and the served window is a fixed point
    assert plan(facts, host(free), policy, requested, credit_bytes=credit) == info
    assert plan(facts, host(free), policy, e, credit_bytes=credit).effective_context == e


@settings(max_examples=100, deadline=None)
@given(usable=st.integers(required_bytes(SMOL, 1), required_bytes(SMOL, 8192) + GiB))
def test_memory_bound_window_matches_a_linear_reference(usable: int) -> None:
    info = plan(SMOL, host(usable), Policy(headroom_fraction=0.0, min_context=1, default_context=0), 0)
    fits = largest_fitting(SMOL, usable, 8192)
    if fits >= 8192:
        assert info.effective_context == 8192
    else:
        aligned = fits - fits % CONTEXT_ALIGN
        assert info.effective_context == (aligned if aligned >= 1 else fits)


# --- sizes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1234", 1234),
        ("10b", 10),
        ("60MB", 60_000_000),
        ("60mb", 60_000_000),
        ("60M", 60_000_000),
        ("60MiB", 60 * MiB),
        ("8GiB", 8 * GiB),
        ("8Gi", 8 * GiB),
        ("8 GB", 8_000_000_000),
        ("512k", 512_000),
        ("512KiB", 512 * 1024),
        ("1.5GiB", 3 * GiB // 2),
        (" 2 tb ", 2 * 10**12),
        ("1TiB", 2**40),
        (".5k", 500),
        ("0.0001k", 0),  # fractions of a byte round down
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_parse_size_accepts_ints() -> None:
    assert parse_size(4096) == 4096


@pytest.mark.parametrize("bad", ["", "abc", "-1", "1.5", "8XB", "1e9", "GiB", "8 G B", "1,000", "nan", "inf"])
def test_parse_size_rejects_garbage_clearly(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(bad)


@pytest.mark.parametrize("bad", [-1, True, None, 1.5])
def test_parse_size_rejects_other_types(bad: Any) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(bad)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0B"),
        (512, "512B"),
        (1024, "1KiB"),
        (8 * GiB, "8GiB"),
        (1536 * MiB, "1.50GiB"),
        (96_576_768, "92.10MiB"),
        (2**40, "1TiB"),
        (-1024, "-1KiB"),
    ],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


@given(st.integers(0, 2**50))
def test_format_then_parse_round_trips_within_half_a_percent(n: int) -> None:
    back = parse_size(format_size(n))
    assert abs(back - n) <= n * 0.005 + 1


@given(st.integers(0, 1023), st.sampled_from([1, 2**10, 2**20, 2**30, 2**40]))
def test_exact_multiples_round_trip_exactly(k: int, unit: int) -> None:
    # a whole number of the unit format_size picks (k < 1024) is printed without decimals
    assert parse_size(format_size(k * unit)) == k * unit
    assert parse_size(format_size(1024 * k * unit)) == 1024 * k * unit


# --- policy --------------------------------------------------------------------------
# Where its values come from (flags, environment, [memory]) is the settings' (tests/test_settings.py).


def test_policy_defaults() -> None:
    p = Policy()
    assert (p.user_limit_bytes, p.reserve_bytes, p.headroom_fraction, p.min_context, p.default_context) == (
        0,
        0,
        0.10,
        512,
        0,
    )


def test_policy_reads_its_keys_as_an_operator_writes_them() -> None:
    p = Policy.model_validate({"max": "8GiB", "reserve": "1GB", "headroom": "20%", "min_context": "1024"})
    assert p == Policy(user_limit_bytes=8 * GiB, reserve_bytes=10**9, headroom_fraction=0.2, min_context=1024)


def test_policy_validates_its_fields() -> None:
    with pytest.raises(ValueError):
        Policy(headroom_fraction=1.0)
    with pytest.raises(ValueError):
        Policy(reserve_bytes=-1)
    with pytest.raises(ValueError, match="invalid token count 1.5"):
        Policy(min_context=1.5)
    with pytest.raises(ValueError, match="Extra inputs"):
        Policy.model_validate({"maxx": 1})


# --- GPU layers ----------------------------------------------------------------------

LAYER = 10 * MiB


def test_no_gpu_resolves_to_zero_layers() -> None:
    assert resolve_gpu_layers(-1, 30, None, LAYER, BARE) == (0, "no gpu")
    assert resolve_gpu_layers(12, 30, None, LAYER, BARE) == (0, "no gpu")


def test_zero_requested_stays_on_cpu() -> None:
    assert resolve_gpu_layers(0, 30, gpu(8 * GiB), LAYER, BARE) == (0, "cpu only")


def test_all_layers_when_they_fit() -> None:
    assert resolve_gpu_layers(-1, 30, gpu(30 * LAYER + 5 * MiB), LAYER, BARE, fixed_bytes=5 * MiB) == (30, "all")


def test_all_layers_that_do_not_fit_are_refused() -> None:
    with pytest.raises(InsufficientMemory, match="explicit layer count") as exc:
        resolve_gpu_layers(-1, 30, gpu(20 * LAYER), LAYER, BARE)
    assert exc.value.details["fitting_layers"] == 20
    assert exc.value.details["device_kind"] == "gpu"


def test_explicit_layers_that_fit() -> None:
    assert resolve_gpu_layers(12, 30, gpu(8 * GiB), LAYER, BARE) == (12, "requested")


def test_explicit_layers_above_n_layer_are_capped() -> None:
    assert resolve_gpu_layers(99, 30, gpu(8 * GiB), LAYER, BARE) == (30, "n_layer")


def test_explicit_layers_that_do_not_fit_are_reduced() -> None:
    assert resolve_gpu_layers(25, 30, gpu(20 * LAYER + LAYER // 2), LAYER, BARE) == (20, "gpu memory")
    assert resolve_gpu_layers(25, 30, gpu(MiB), LAYER, BARE, fixed_bytes=2 * MiB) == (0, "gpu memory")


def test_gpu_budget_honours_the_policy() -> None:
    pool = gpu(30 * LAYER)
    assert resolve_gpu_layers(30, 30, pool, LAYER, BARE).layers == 30
    assert resolve_gpu_layers(30, 30, pool, LAYER, Policy(headroom_fraction=0.1)).layers == 27
    assert resolve_gpu_layers(30, 30, pool, LAYER, BARE.model_copy(update={"user_limit_bytes": 5 * LAYER})).layers == 5


def test_every_gpu_reason_is_reported_and_none_other() -> None:
    """Over every kind of request and pool, resolve_gpu_layers reports exactly the GPU_REASONS values."""
    seen: set[str] = set()
    for requested in (-2, -1, 0, 1, 12, 30, 99):
        for pool in (None, gpu(0), gpu(LAYER // 2), gpu(20 * LAYER + LAYER // 2), gpu(8 * GiB)):
            try:
                got = resolve_gpu_layers(requested, 30, pool, LAYER, BARE)
            except InsufficientMemory:
                continue
            assert got.reason in GPU_REASONS, got
            assert 0 <= got.layers <= 30
            seen.add(got.reason)
    assert seen == GPU_REASONS


def test_auto_offloads_every_layer_that_fits() -> None:
    assert resolve_gpu_layers(-2, 30, gpu(30 * LAYER + 5 * MiB), LAYER, BARE, fixed_bytes=5 * MiB) == (30, "all")
    # partial: the most that fit, never a refusal (that is -1's)
    assert resolve_gpu_layers(-2, 30, gpu(20 * LAYER + LAYER // 2), LAYER, BARE) == (20, "gpu memory")
    assert resolve_gpu_layers(-2, 30, gpu(MiB), LAYER, BARE, fixed_bytes=2 * MiB) == (0, "gpu memory")
    assert resolve_gpu_layers(-2, 30, None, LAYER, BARE) == (0, "no gpu")


def test_bad_gpu_requests() -> None:
    with pytest.raises(ValueError):
        resolve_gpu_layers(-3, 30, gpu(GiB), LAYER, BARE)
    with pytest.raises(ValueError):
        resolve_gpu_layers(1, 0, gpu(GiB), LAYER, BARE)


def test_plan_full_offload_uses_the_gpu_pool() -> None:
    devices = (gpu(4 * GiB, total=8 * GiB, gid="cuda0"),)
    info = plan(SMOL, host(64 * GiB), BARE, 8192, requested_gpu_layers=-1, devices=devices)
    assert (info.requested_gpu_layers, info.resolved_gpu_layers) == (-1, 30)
    assert (info.device_kind, info.device_id, info.device_total_bytes) == ("gpu", "cuda0", 8 * GiB)
    assert info.supports_gpu_offload
    assert info.effective_context == 8192
    assert sorted(d.kind for d in info.devices) == ["cpu", "gpu"]


def test_plan_without_a_gpu_resolves_zero_layers() -> None:
    info = plan(SMOL, host(64 * GiB), BARE, 0, requested_gpu_layers=20)
    assert (info.requested_gpu_layers, info.resolved_gpu_layers, info.supports_gpu_offload) == (20, 0, False)
    assert info.device_kind == "cpu"


def test_plan_refuses_full_offload_that_does_not_fit() -> None:
    with pytest.raises(InsufficientMemory):
        plan(SMOL, host(64 * GiB), BARE, 0, requested_gpu_layers=-1, devices=(gpu(40 * MiB),))


def test_plan_small_gpu_limits_the_window() -> None:
    # every layer fits at the minimum window, but not at 8192: the GPU is the binding pool
    gpu_free = required_bytes(SMOL, 2000)
    info = plan(SMOL, host(64 * GiB), BARE, 8192, requested_gpu_layers=30, devices=(gpu(gpu_free),))
    assert info.resolved_gpu_layers == 30
    assert info.reason == "memory"
    assert info.device_kind == "gpu"
    assert 512 <= info.effective_context < 8192


def test_plan_partial_offload_splits_weights_between_pools() -> None:
    half_weights = SMOL.weights_bytes // 2
    devices = (gpu(half_weights + 400 * MiB),)
    info = plan(SMOL, host(64 * GiB), BARE, 4096, requested_gpu_layers=15, devices=devices)
    assert info.resolved_gpu_layers == 15
    assert info.effective_context == 4096
    assert info.usable_bytes == 64 * GiB + half_weights + 400 * MiB  # summed over both pools


def test_plan_auto_puts_everything_on_a_large_gpu_and_only_overhead_on_the_host() -> None:
    devices = (gpu(8 * GiB, gid="0"),)
    info = plan(SMOL, host(64 * GiB), BARE, 4096, requested_gpu_layers=-2, devices=devices)
    assert (info.resolved_gpu_layers, info.gpu_layers_reason) == (30, "all")
    on_gpu = SMOL.weights_bytes + kv_cache_bytes(SMOL, 4096) + compute_overhead_bytes(SMOL, 4096)
    assert info.gpu_required_bytes == on_gpu
    # the host holds what is not on the GPU: its fixed and logits overhead, no weights, no KV
    host_part = info.required_bytes - info.gpu_required_bytes
    assert host_part == host_overhead_bytes(SMOL, 4096)
    assert info.gpu_usable_bytes == 8 * GiB
    assert info.usable_bytes - info.gpu_usable_bytes == 64 * GiB


def test_plan_auto_partial_offload_leaves_the_rest_of_the_weights_on_the_host() -> None:
    # room on the GPU for about half the layers at the minimum window: the rest (and its KV) go to the host
    per_layer = SMOL.weights_bytes // 30 + kv_cache_bytes(SMOL, 512) // 30
    buffers = compute_overhead_bytes(SMOL, 512)
    devices = (gpu(buffers + 15 * per_layer + per_layer // 2),)
    info = plan(SMOL, host(64 * GiB), BARE, 512, requested_gpu_layers=-2, devices=devices)
    assert (info.resolved_gpu_layers, info.gpu_layers_reason) == (15, "gpu memory")
    host_part = info.required_bytes - info.gpu_required_bytes
    assert host_part >= SMOL.weights_bytes // 2  # half the weights stayed on the host
    assert info.gpu_required_bytes <= info.gpu_usable_bytes


def test_plan_auto_host_budget_excludes_what_went_to_the_gpu() -> None:
    # the host alone cannot hold the model; with every layer on the GPU it only holds the overhead
    small_host = host(host_overhead_bytes(SMOL, 4096) + 10 * MiB)
    with pytest.raises(InsufficientMemory):
        plan(SMOL, small_host, BARE, 4096, requested_gpu_layers=0, devices=(gpu(8 * GiB),))
    info = plan(SMOL, small_host, BARE, 4096, requested_gpu_layers=-2, devices=(gpu(8 * GiB),))
    assert (info.resolved_gpu_layers, info.effective_context) == (30, 4096)


def test_plan_auto_without_a_gpu_is_the_cpu_plan() -> None:
    auto = plan(SMOL, host(4 * GiB), BARE, 0, requested_gpu_layers=-2)
    cpu = plan(SMOL, host(4 * GiB), BARE, 0, requested_gpu_layers=0)
    assert (auto.resolved_gpu_layers, auto.gpu_layers_reason, auto.gpu_required_bytes) == (0, "no gpu", 0)
    assert auto.model_copy(update={"requested_gpu_layers": 0, "gpu_layers_reason": cpu.gpu_layers_reason}) == cpu


def test_plan_clamps_a_count_beyond_the_model_like_llama_server() -> None:
    info = plan(SMOL, host(64 * GiB), BARE, 4096, requested_gpu_layers=999, devices=(gpu(8 * GiB),))
    assert (info.requested_gpu_layers, info.resolved_gpu_layers, info.gpu_layers_reason) == (999, 30, "n_layer")


# --- readers and the daemon planner --------------------------------------------------


def test_read_host_pool_reads_psutil(monkeypatch: pytest.MonkeyPatch) -> None:
    class VM:
        total = 16 * GiB
        available = 5 * GiB

    monkeypatch.setattr("modeld.capacity.psutil.virtual_memory", lambda: VM())
    assert read_host_pool() == MemoryPool(
        kind="cpu", id="host", total_bytes=16 * GiB, free_bytes=5 * GiB, name="host RAM"
    )


def test_read_host_pool_real_machine() -> None:
    pool = read_host_pool()
    assert 0 < pool.free_bytes <= pool.total_bytes


def test_memory_pool_validates() -> None:
    with pytest.raises(ValueError):
        MemoryPool(kind="tpu", id="x", total_bytes=1, free_bytes=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        MemoryPool(kind="cpu", id="x", total_bytes=-1, free_bytes=1)


class FakeBackend:
    """The planner's view of a backend with a memory model (the Backend seam's planning half)."""

    name = "llama"

    def __init__(self, gpus: tuple[MemoryPool, ...] = ()) -> None:
        self.gpus = gpus
        self.seen: list[OpenSessionRequest] = []

    def model_facts(self, req: OpenSessionRequest) -> ModelFacts:
        self.seen.append(req)
        return SMOL

    def memory_pools(self) -> tuple[MemoryPool, ...]:
        return self.gpus

    def describe(self, req: OpenSessionRequest, credit_bytes: int = 0) -> ModelInfo:
        return ModelInfo(effective_context=req.config.num_ctx, runtime_name=self.name)


class DescribeOnly:
    """A backend with no memory model: its describe answers alone."""

    name = "memory"

    def model_facts(self, req: OpenSessionRequest) -> None:
        return None

    def memory_pools(self) -> tuple[MemoryPool, ...]:
        return ()

    def describe(self, req: OpenSessionRequest, credit_bytes: int = 0) -> ModelInfo:
        return ModelInfo(effective_context=req.config.num_ctx or 4096, reason="backend")


def test_make_planner_plans_with_request_overrides() -> None:
    planner = make_planner(Policy(user_limit_bytes=GiB), host_reader=lambda: host(64 * GiB))
    req = OpenSessionRequest(path="/m.gguf", config=Config(num_ctx=8192, kv_cache_type="q8_0", num_batch=256))
    info = planner(FakeBackend(), req, 0)
    assert info.kv_bytes_per_token == 12_240  # the request's KV type
    assert info.user_limit_bytes == GiB  # the policy's --mem-max
    assert info.runtime_name == "llama"
    assert info.effective_context == 8192


def test_make_planner_uses_backend_gpu_pools() -> None:
    planner = make_planner(Policy(), host_reader=lambda: host(64 * GiB))
    req = OpenSessionRequest(path="/m.gguf", config=Config(num_gpu_layers=-1))
    info = planner(FakeBackend(gpus=(gpu(8 * GiB, gid="cuda0"),)), req, 0)
    assert (info.resolved_gpu_layers, info.device_id) == (30, "cuda0")


def test_make_planner_falls_back_to_describe() -> None:
    planner = make_planner(Policy(), host_reader=lambda: host(64 * GiB))
    info = planner(DescribeOnly(), OpenSessionRequest(config=Config(num_ctx=100)), 0)
    assert (info.effective_context, info.reason) == (100, "backend")


def test_make_planner_refuses_before_loading() -> None:
    planner = make_planner(Policy(), host_reader=lambda: host(50 * MiB))
    with pytest.raises(InsufficientMemory):
        planner(FakeBackend(), OpenSessionRequest(path="/m.gguf"), 0)


def test_a_shape_under_a_load_config_is_the_facts() -> None:
    shape = ModelShape(n_ctx_train=8192, n_layer=30, n_head=9, n_head_kv=3, head_dim_k=64, head_dim_v=64,
                       weights_bytes=96_576_768, n_embd=576, n_vocab=49152, sliding_window=4096)
    assert shape.facts() == SMOL  # a window without its layer pattern counts every layer dense
    assert shape.facts(n_swa_layers=24) == dataclasses.replace(SMOL, sliding_window=4096, n_swa_layers=24)
    assert dataclasses.replace(shape, n_ctx_train=0).facts(unknown_ctx=4096).n_ctx_train == 4096


def test_public_names() -> None:
    assert set(capacity.__all__) <= set(dir(capacity))
    for name in ("plan", "required_bytes", "kv_bytes_per_token", "resolve_gpu_layers", "parse_size", "format_size"):
        assert name in capacity.__all__
