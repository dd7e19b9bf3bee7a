"""The bench's daemon / in-process estimates (``benchmarks.decode.short_pairs`` and ``daemon_ratio``)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.decode import (
    SHORT_TOKENS,
    TASKS,
    daemon_ratio,
    first_difference,
    order_balanced,
    paired_median,
    same_answer,
    short_pairs,
)
from contract.manifest import ContextManifest
from contract.types import DecodeConfig, StreamChunk, Usage


class _Timed:
    """A session whose decodes take ``ms_per_token`` each, and that logs which side ran when."""

    def __init__(self, side: str, ms_per_token: list[float], log: list[str]) -> None:
        self.side, self.ms, self.log = side, list(ms_per_token), log

    def ensure_prefix(self, _prefix: Any) -> None:
        pass

    def prefill_suffix(self, _suffix: Any) -> None:
        pass

    def decode(self, cfg: DecodeConfig) -> Iterator[StreamChunk]:
        assert cfg.temperature == 0.0 and cfg.speculative is False and not cfg.return_token_ids
        self.log.append(self.side)
        yield StreamChunk(done=True, usage=Usage(completion_tokens=cfg.max_tokens,
                                                 decode_ms=cfg.max_tokens * self.ms.pop(0)))


def test_short_pairs_alternate_which_side_runs_first_and_give_one_ratio_each() -> None:
    log: list[str] = []
    sides = {
        "local": (_Timed("local", [10.0, 10.0, 20.0, 10.0], log), ContextManifest()),
        "remote": (_Timed("remote", [10.0, 12.5, 20.0, 8.0], log), ContextManifest()),
    }
    ratios = short_pairs(sides, pairs=4)
    assert log == ["local", "remote", "remote", "local"] * 2
    # a slow spell (pair 3) slows both sides of its pair and leaves their ratio alone
    assert ratios == pytest.approx([1.0, 0.8, 1.0, 1.25])
    assert SHORT_TOKENS < TASKS[0][2]  # the prose answer runs on past it: no pair stops early on one side


def test_the_load_order_cancels_in_the_geometric_mean_of_the_halves() -> None:
    # the copy loaded later runs 4% faster: 0.96 with the daemon loaded first, 1.04 with it second
    first, second = [0.95, 0.96, 0.97], [1.03, 1.04, 1.05, 0.50]
    assert order_balanced(first, second) == pytest.approx(math.sqrt(0.96 * (1.03 + 1.04) / 2))
    assert order_balanced([0.99] * 3, [0.99] * 3) == pytest.approx(0.99)  # no order effect: the plain median
    assert math.isnan(order_balanced([], second))  # a half not measured is no verdict


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


def test_a_speculative_figure_says_where_its_answer_parts_from_the_plain_one() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None and same_answer([1, 2, 3], [1, 2, 3]) == "the same answer"
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert same_answer([1, 2, 3], [1, 5, 3]) == "ANSWERS PART at token 1 of 3"
    assert first_difference([1, 2, 3], [1, 2]) == 2  # one ending early parts too
    assert first_difference([], [4]) == 0
