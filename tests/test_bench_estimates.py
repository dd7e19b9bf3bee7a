"""The bench's daemon / in-process estimates (``benchmarks.decode.daemon_ratio``)."""

from __future__ import annotations

import math

import pytest

from benchmarks.decode import daemon_ratio, paired_median


def test_pairs_are_matched_by_round_and_the_fastest_rounds_by_task() -> None:
    local = {"prose/plain": [100.0, 50.0, 100.0], "edit/plain": [80.0, 80.0, 40.0]}
    remote = {"prose/plain": [98.0, 49.0, 90.0], "edit/plain": [76.0, 84.0, 40.0]}
    median, fastest, n = daemon_ratio(local, remote)
    assert n == 6
    # pairs: 0.98, 0.98, 0.90, 0.95, 1.05, 1.0 -> median of the middle two
    assert median == pytest.approx((0.98 + 0.98) / 2)
    # fastest: prose 98 / 100, edit 84 / 80 -> geometric mean
    assert fastest == pytest.approx(math.sqrt(0.98 * 84 / 80))


def test_a_slow_spell_on_one_side_moves_the_median_of_pairs_less_than_a_mean() -> None:
    local = {"prose/plain": [100.0] * 5}
    remote = {"prose/plain": [97.0, 97.0, 97.0, 50.0, 97.0]}
    median, fastest, _ = daemon_ratio(local, remote)
    assert median == pytest.approx(0.97)
    assert fastest == pytest.approx(0.97)


def test_nothing_measured_reads_as_not_a_number() -> None:
    median, fastest, n = daemon_ratio({}, {})
    assert n == 0 and math.isnan(median) and math.isnan(fastest)
    with pytest.raises(ValueError):
        daemon_ratio({"prose/plain": [1.0, 2.0]}, {"prose/plain": [1.0]})  # rounds must pair up


def test_a_speedup_pairs_the_rates_of_one_round() -> None:
    # a slow spell in round 2 slows both modes; read apart, the medians would say 1.0x
    plain = [100.0, 100.0, 50.0, 100.0, 100.0]
    spec = [110.0, 110.0, 55.0, 100.0, 50.0]
    assert paired_median(spec, plain) == pytest.approx(1.1)
    assert paired_median([], []) != paired_median([], [])  # nan
