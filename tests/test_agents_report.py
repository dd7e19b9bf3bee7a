"""The ``make agents`` table: what a row says about an agent's tasks."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_a_replay_takes_the_generation_requests_in_order_with_one_output_token(tmp_path: Path) -> None:
    from benchmarks.agents.replay import one_token, prompt_tokens, recorded
    from benchmarks.agents.replay import table as replay_table

    run = tmp_path / "run"
    (run / "claude").mkdir(parents=True)
    (run / "codex").mkdir()
    (run / "agents.json").write_text(json.dumps({"context": 4096, "agents": [{"agent": "codex"}, {"agent": "claude"}]}))
    files = {
        "claude/001-v1_messages_count_tokens.json": ("POST", "/v1/messages/count_tokens", {"messages": []}),
        "claude/002-v1_messages.json": ("POST", "/v1/messages?beta=true",
                                        {"max_tokens": 32000, "stream": True, "thinking": {"type": "adaptive"}}),
        "claude/003-root.json": ("HEAD", "/", None),
        "codex/001-v1_responses.json": ("POST", "/v1/responses", {"stream": True, "max_output_tokens": None}),
    }
    for name, (method, path, body) in files.items():
        (run / name).write_text(json.dumps({"method": method, "path": path, "request_body": body}))
    got = recorded(run)
    assert list(got) == ["codex", "claude"]  # the run's order
    assert [r["file"] for r in got["claude"]] == ["002-v1_messages.json"]  # generation requests only
    assert one_token("/v1/messages?beta=true", got["claude"][0]["body"]) == {"max_tokens": 1, "stream": False}
    assert one_token("/v1/responses", got["codex"][0]["body"]) == {"stream": False, "max_output_tokens": 1}
    assert one_token("/v1/chat/completions", {"max_completion_tokens": 9, "stream": True,
                                              "stream_options": {}}) == {"stream": False, "max_tokens": 1}
    rows = replay_table({"modeld": {"codex": [(200, 4.0, 9600), (200, 0.5, 9700), (200, 0.5, 9800)]},
                         "llama-server": {"codex": [(200, 8.0, 4990), (500, 0.1, 0), (200, 2.0, 5100)]}}).splitlines()
    assert rows[-1] == "| codex | 3 | 4.0 (9,600), 1.0 | 8.0 (4,990), 2.0 (1 not 200) | 0.50x, 0.50x |"
    # each API's usage: the prompt as the server counted it (a cache read is part of it)
    assert prompt_tokens({"usage": {"prompt_tokens": 12}}) == 12
    assert prompt_tokens({"usage": {"input_tokens": 3, "cache_read_input_tokens": 9}}) == 12
    assert prompt_tokens({"error": "x"}) == 0


def test_a_replay_splits_the_requests_whose_head_the_agent_sent_before_from_the_cold_ones() -> None:
    from benchmarks.agents.replay import goals, head, repeated_heads

    tool = [{"type": "function", "function": {"name": "read"}}]
    chat = "/v1/chat/completions"
    reqs = [
        {"path": chat, "body": {"messages": [{"role": "system", "content": "title"}, {"role": "user", "content": "a"}]}},
        {"path": chat, "body": {"messages": [{"role": "system", "content": "main"}, {"role": "user", "content": "a"}],
                                "tools": tool}},
        {"path": chat, "body": {"messages": [{"role": "system", "content": "main"}, {"role": "user", "content": "a"},
                                             {"role": "assistant", "content": "b"}], "tools": tool}},
        {"path": chat, "body": {"messages": [{"role": "system", "content": "main"}, {"role": "user", "content": "c"}],
                                "tools": []}},  # the tools changed: another head
    ]
    assert repeated_heads(reqs) == [False, False, True, False]
    # each API's own fields: Responses' instructions, Messages' system; the conversation after them is not the head
    assert head("/v1/responses", {"instructions": "x", "input": [{"role": "user", "content": "1"}]}) == \
        head("/v1/responses", {"instructions": "x", "input": [{"role": "user", "content": "2"}]})
    assert head("/v1/responses", {"instructions": "x"}) != head("/v1/responses", {"instructions": "y"})
    assert head("/v1/messages?beta=true", {"system": "s", "messages": [1]}) == head("/v1/messages", {"system": "s"})
    assert head("/v1/messages", {"system": "s"}) != head("/v1/messages", {"system": "s", "tools": tool})
    rows = goals({"modeld": {"opencode": [(200, 1.0, 1), (200, 10.0, 1), (200, 0.5, 1), (200, 4.0, 1)]},
                  "llama-server": {"opencode": [(200, 2.0, 1), (200, 10.0, 1), (200, 2.0, 1), (500, 0.1, 0)]}},
                 {"opencode": reqs}).splitlines()
    assert rows[2] == "| head sent before | 1 | 0.5 | 2.0 | 0.25x |"
    # a request one server did not answer is left out of every server's sum, and the count says so
    assert rows[3] == "| cold, all agents | 2 of 3 | 11.0 | 12.0 | 0.92x |"
    assert rows[4] == "| cold, opencode | 2 of 3 | 11.0 | 12.0 | 0.92x |"


def test_the_agents_get_the_slower_machines_time_under_load() -> None:
    from benchmarks.agents.runner import TIMEOUT_S, load_timeout, parse_args

    assert load_timeout(0, cpus=2) == TIMEOUT_S
    assert load_timeout(2, cpus=2) == 2 * TIMEOUT_S  # two busy processes on two CPUs: each runs at half speed
    assert parse_args(["--load", "2", "--tasks", "1"]).timeout == load_timeout(2)
    assert parse_args(["--load", "2", "--timeout", "100"]).timeout == 100  # a timeout asked for is kept
    assert parse_args(["--tasks", "1"]).task == parse_args([]).task[:1]


def test_a_peers_figures_come_from_what_the_proxy_recorded() -> None:
    from benchmarks.agents.report import AccessLine, side_by_side, usage_of

    chat_stream = {"method": "POST", "path": "/v1/chat/completions", "status": 200, "stream": True,
                   "first_byte_ms": 1200.0, "duration_ms": 3000.0,
                   "response_tail": 'a": 1}\n\ndata: {"choices": [], "usage": {"prompt_tokens": 900, '
                                    '"completion_tokens": 12, "prompt_tokens_details": {"cached_tokens": 850}}}\n\n'
                                    "data: [DONE]\n\n"}
    line = AccessLine.from_proxied(chat_stream)
    assert (line.prompt_tokens, line.cached_tokens, line.completion_tokens) == (900, 850, 12)
    assert line.ttft_ms == 1200.0 and line.total_ms == 3000.0 and not line.failed
    responses = {"response_tail": 'data: {"type": "response.completed", "response": {"usage": {"input_tokens": 50, '
                                  '"output_tokens": 3, "input_tokens_details": {"cached_tokens": 40}}}}\n'}
    assert usage_of(responses) == (50, 40, 3)
    messages = {"response_body": {"usage": {"input_tokens": 10, "cache_read_input_tokens": 90, "output_tokens": 4}}}
    assert usage_of(messages) == (100, 90, 4)  # Messages' input_tokens counts what was not read from the cache
    assert usage_of({"response_tail": "data: [DONE]\n"}) == (0, 0, 0)
    summary = {"method": "POST", "path": "/v1/chat/completions", "status": 200, "duration_ms": 9.0,
               "usage": {"prompt_tokens": 984, "cached_tokens": 835, "completion_tokens": 15}}  # the proxy's summary
    assert AccessLine.from_proxied(summary).cached_tokens == 835
    failed = AccessLine.from_proxied({"method": "POST", "path": "/v1/messages?beta=true", "status": 500,
                                      "duration_ms": 5.0, "response_body": {"error": {}}})
    assert failed.failed and failed.route == "/v1/messages" and failed.ttft_ms == 5.0

    ours, theirs = _result([0]), _result([0])
    ours.access, theirs.access = [line, line], [failed]
    ours.requests = [{"method": "POST", "duration_ms": d} for d in (1000.0, 3000.0, 2000.0)]
    theirs.requests = [{"method": "POST", "duration_ms": 8000.0}, {"method": "GET", "duration_ms": 1.0}]
    text = side_by_side([ours], [theirs], "llama-server")
    row = text.splitlines()[-1].split()
    assert row[:7] == ["claude", "2", "/", "1", "0", "/", "1"], row  # requests, then errors: modeld's / the peer's
    assert row[10:13] == ["2.0", "/", "8.0"], row  # the median request's seconds, as the proxy timed both
