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
    prose_pairs,
    prose_rows,
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


class _Prose:
    """A session whose decodes take the next of ``ms`` per token, with a fixed answer per mode and
    ``kept`` draft tokens per prompt (each prompt runs ``runs`` decodes); it logs the modes it ran."""

    def __init__(self, ms: list[float], kept: list[int], answers: dict[bool, list[int]], runs: int) -> None:
        self.ms, self.kept, self.answers, self.runs = list(ms), list(kept), answers, runs
        self.log: list[str] = []

    def ensure_prefix(self, _prefix: Any) -> None:
        pass

    def prefill_suffix(self, _suffix: Any) -> None:
        pass

    def decode(self, cfg: DecodeConfig) -> Iterator[StreamChunk]:
        spec = bool(cfg.speculative)
        kept = self.kept[len(self.log) // self.runs] if spec else 0
        self.log.append("S" if spec else "P")
        ids = self.answers[spec] if cfg.return_token_ids else []
        yield StreamChunk(done=True, token_ids=ids, usage=Usage(
            completion_tokens=cfg.max_tokens, decode_ms=cfg.max_tokens * self.ms.pop(0),
            drafted_tokens=2 * kept, accepted_tokens=kept))


def test_prose_pairs_balance_the_order_and_judge_only_answers_with_nothing_to_copy() -> None:
    # prompt 0: speculative 2% slower, a slow spell over the whole second round; prompt 1 copies
    # itself (60 of 128 kept) and runs twice as fast; prompt 2: 6% slower
    ms = [10.0, 10.2, 10.2, 10.0] + [20.4, 20.0, 20.0, 20.4] \
        + [10.0, 5.0, 5.0, 10.0] + [5.0, 10.0, 10.0, 5.0] \
        + [10.0, 10.6, 10.6, 10.0] + [10.6, 10.0, 10.0, 10.6]
    sess = _Prose(ms, kept=[0, 60, 1], answers={False: [1, 2, 3], True: [1, 2, 3]}, runs=8)
    answers = prose_pairs(sess, ContextManifest(), prompts=("a", "b", "c"), rounds=2, tokens=128)
    assert sess.log == list("PSSPSPPS") * 3
    assert [a["copied"] for a in answers] == [False, True, False]
    assert answers[0]["ratios"] == pytest.approx([10 / 10.2] * 4)  # the slow spell cancels within its pairs
    assert answers[1]["ratios"] == pytest.approx([2.0] * 4)
    assert all(a["same"] for a in answers)
    rows = prose_rows(answers)
    # judged over prompts 0 and 2 only: 0.980 x4 and 0.943 x4
    assert rows[0][1] == f"{(10 / 10.2 + 10 / 10.6) / 2:.3f}"
    assert "8 back-to-back pairs over the 2 answers with nothing to copy" in rows[0][2]
    assert "worst answer's median 0.943" in rows[0][2] and "(MISSED)" in rows[0][2]
    assert "copies itself" in rows[1][2]


def test_prose_pairs_say_where_answers_part_and_when_nothing_is_left_to_judge() -> None:
    sess = _Prose([10.0] * 4, kept=[100], answers={False: [1, 2, 3], True: [1, 2, 4]}, runs=4)
    answers = prose_pairs(sess, ContextManifest(), prompts=("a",), rounds=1, tokens=128)
    assert answers[0]["same"] is False and answers[0]["copied"] is True
    rows = prose_rows(answers)
    assert rows == [(rows[0][0], "n/a", rows[0][2])] and "every answer copied itself" in rows[0][2]
    assert "answers part" in rows[0][2]
