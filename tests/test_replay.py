"""``benchmarks.replay``: a replay drafts what the decode loop drafts, and the oracle bounds it."""

from __future__ import annotations

import pytest

from backends.tape.speculate import CheckCosts, DraftPolicy
from benchmarks.replay import Recorded, Replayed, copies_known, oracle, replay
from contract.types import DecodeConfig
from tests.test_tape import LLAMA_LIKE, OPENVINO_LIKE, ToyModel, _shown, prefix, suffix

#: a check that gets dearer with the context (flash attention over a quantized cache on llama.cpp grows so)
GROWING = CheckCosts.from_points({1: 1.0, 2: 1.7, 4: 2.7, 8: 4.7, 16: 8.4}, lambda r: r,
                                 longer={1: 1.0, 2: 3.0, 4: 6.0, 8: 11.0, 16: 20.0}, tokens=1000, switch=0.2)


def _answer(model: ToyModel, shown: str, max_tokens: int) -> tuple[Recorded, list[list[int]], int, int]:
    """A speculative greedy pass on the toy engine with the real policy: the tape before the answer, the
    answer, the checks the engine ran, and the drafted and kept counts the pass reported."""
    model.decoded = 0
    s = model.open_session()
    s.ensure_prefix(prefix(model, "sys"))
    s.prefill_suffix(suffix(model, "hi"))
    s.prefill_suffix(suffix(model, shown + "hi"))
    prompt = list(model.res.tokens)
    chunks = list(s.decode(DecodeConfig(max_tokens=max_tokens, return_token_ids=True)))
    usage = chunks[-1].usage
    assert usage is not None
    answer = [t for c in chunks for t in c.token_ids]
    return Recorded("toy", prompt, answer, max_tokens), list(model.verifies), usage.drafted_tokens, usage.accepted_tokens


@pytest.mark.parametrize("costs", [LLAMA_LIKE, OPENVINO_LIKE, GROWING, CheckCosts.prior()],
                         ids=["llama", "openvino", "growing", "prior"])
@pytest.mark.parametrize("twists", [set(), {5, 23, 24, 60}])
def test_a_replay_drafts_what_the_decode_loop_drafts(costs: CheckCosts, twists: set[int]) -> None:
    model = ToyModel(num_ctx=1024)
    shown = _shown(model, 80)
    model.twists = twists
    model.draft_costs = costs
    rec, checks, drafted, kept = _answer(model, shown, 70)
    got = replay(rec, costs, model.num_ctx)
    assert checks, "the pass drafted"
    assert got.checks == checks  # batch for batch: the same drafts at the same places
    assert (got.drafted, got.kept) == (drafted, kept)
    # the oracle drafts from the same lookup knowing the answer: never dearer than the policy
    assert oracle(rec, costs, model.num_ctx) <= got.cost


def test_the_oracle_prices_a_copy_at_the_best_the_table_allows_and_prose_at_plain_steps() -> None:
    costs = LLAMA_LIKE
    source = list(range(100, 160))
    # the answer copies 60 tokens of the prompt: the oracle checks 16 rows at a time where it can
    copy = Recorded("copy", [1, *source, 2, *source[:4]], source[4:], 60)
    best = oracle(copy, costs, 1024)
    assert best < (len(copy.answer) - 1) / 1.5
    assert best <= replay(copy, costs, 1024).cost
    # nothing to copy: every token is a plain step, for the oracle and the policy alike
    fresh = Recorded("prose", [1, 2, 3], list(range(200, 260)), 60)
    assert oracle(fresh, costs, 1024) == replay(fresh, costs, 1024).cost == len(fresh.answer) - 1
    assert replay(fresh, costs, 1024, policy=DraftPolicy).checks == []


class _FourAtATime(DraftPolicy):
    def plan(self, available: int, matched: int, context: int = 0) -> int:
        return min(available, 4)


def test_a_replay_prices_checks_at_their_context_and_each_change_of_row_count() -> None:
    prompt = [1, *range(10, 21), 2, 10]
    rec = Recorded("copy", prompt, list(range(11, 21)), 10)
    got = replay(rec, GROWING, 1024, policy=_FourAtATime)
    # 4 drafted after "10 11" (its earlier occurrence), all kept; then the 3 the token budget leaves
    assert got.checks == [[11, 12, 13, 14, 15], [16, 17, 18, 19]]
    assert (got.drafted, got.kept) == (7, 7)
    # into the first check and out after the last: a change of row count each
    assert got.cost == pytest.approx(GROWING.cost(5, len(prompt)) + GROWING.cost(4, len(prompt) + 5) + 2 * 0.2)
    assert got.speedup(rec.answer) == pytest.approx(9 / got.cost)


def test_told_where_copies_start_the_policy_drafts_from_a_copys_first_token() -> None:
    costs = LLAMA_LIKE
    source = list(range(100, 160))
    # the answer copies the source, puts 3 new tokens in place of 2 at token 30, and copies on: after
    # the edit the lookup matches 2 tokens, then 3, ..., and the policy waits for a longer match
    answer = source[4:30] + [900, 901, 902] + source[32:]
    rec = Recorded("edit", [1, *source, 2, *source[:4]], answer, len(answer))
    policy, known = replay(rec, costs, 1024), copies_known(rec, costs, 1024)

    def first_check_after_the_edit(got: Replayed) -> int:
        return min(answer.index(check[0]) for check in got.checks if answer.index(check[0]) > answer.index(902))

    # "902 132" matches nothing; "132 133" is the first 2-token match, and told it is a copy the
    # policy drafts there
    assert first_check_after_the_edit(known) == answer.index(133)
    assert first_check_after_the_edit(policy) > answer.index(133)
    assert oracle(rec, costs, 1024) <= known.cost < policy.cost
    # a draft is a copy by what the answer does, not by the match: prose stays plain
    fresh = Recorded("prose", [1, 2, 3], list(range(200, 260)), 60)
    assert copies_known(fresh, costs, 1024).checks == []
