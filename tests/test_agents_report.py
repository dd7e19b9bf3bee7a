"""The ``make agents`` table: what a row says about an agent's tasks."""

from __future__ import annotations

from benchmarks.agents.report import AgentResult, table


def _result(codes: list[int | None]) -> AgentResult:
    failed = [c for c in codes if c != 0]
    return AgentResult(agent="claude", argv=["claude"], started=0.0, exit_code=failed[0] if failed else codes[-1],
                       timed_out=codes[-1] is None, seconds=1.0, changed=False, fixed=False, task_exits=codes)


def test_a_failed_task_shows_even_when_the_last_one_ended_well() -> None:
    assert table([_result([0, 0, 0, 0])]).splitlines()[-1].endswith(" 0")
    assert table([_result([0, 0, 1, 0])]).splitlines()[-1].endswith(" 0/0/1/0")
    assert table([_result([0, 1, None])]).splitlines()[-1].endswith(" 0/1/timeout")
    assert table([_result([None])]).splitlines()[-1].endswith(" timeout")
