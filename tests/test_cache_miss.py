"""A reason for every miss: each request's usage (``cache_miss``), its access-log line, ``/metrics`` and
``modeld why`` say where its reuse stopped and why, whenever the prompt lost part of what the daemon held.

Both engines serve the bundled model through a real daemon process and its HTTP front, driven by the official
SDKs. Each test opens its own agent (a system prompt headed by a line no other test sends), so the causes are
the tests' own: a changed system prompt, changed tools, an edited message, a conversation evicted by another,
a template switched under the model. A request that only adds to what was held reports none.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from contract.types import Config, LoadModelRequest  # noqa: E402
from tests.test_openai_front import Front  # noqa: E402

pytestmark = pytest.mark.slow

ENGINES = [pytest.param("llama", marks=pytest.mark.llama), pytest.param("openvino", marks=pytest.mark.openvino)]


@pytest.fixture(scope="module", params=ENGINES)
def front(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    pytest.importorskip("llama_cpp" if request.param == "llama" else "openvino_genai")
    with Front(tmp_path_factory.mktemp(f"miss-{request.param}"), "--num-ctx", "4096", backend=request.param) as f:
        yield f


def _system(words: int = 40) -> str:
    """An agent's system prompt: a head line nobody sent before, then rules (a few hundred tokens)."""
    rules = [f"Rule {i}: keep function number {i} short, typed and tested before it is merged." for i in range(words)]
    return f"# agent {uuid.uuid4().hex}\nYou are a careful coding agent.\n" + "\n".join(rules)


TOOL_READ = {"type": "function", "function": {"name": "read_file", "description": "Read a file of the workspace.",
                                              "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                             "required": ["path"]}}}
TOOL_GREP = {"type": "function", "function": {"name": "grep", "description": "Search the workspace for a pattern.",
                                              "parameters": {"type": "object",
                                                             "properties": {"pattern": {"type": "string"}},
                                                             "required": ["pattern"]}}}


def _chat(front: Front, system: str, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return front.sdk().chat.completions.create(
        model="default", messages=[{"role": "system", "content": system}, *messages], max_tokens=8, temperature=0,
        **kw)


def _miss(reply: Any) -> dict[str, Any] | None:
    """The usage's ``cache_miss`` extension (the SDK keeps the fields it does not know)."""
    extra = reply.usage.model_extra or {}
    miss = extra.get("cache_miss")
    assert miss is None or isinstance(miss, dict)
    return miss


def _reply(reply: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": reply.choices[0].message.content or ""}


def _prompt_tokens(reply: Any) -> int:
    return int(reply.usage.prompt_tokens)


U1 = {"role": "user", "content": "Which rule speaks of function number 7?"}
U2 = {"role": "user", "content": "And which one of number 12?"}


def test_a_new_agent_is_first_sight_and_its_next_turn_reports_no_miss(front: Front) -> None:
    system = _system()
    first = _chat(front, system, [U1])
    miss = _miss(first)
    assert miss is not None and miss["cause"] == "first_sight", miss
    assert miss["index"] <= 8  # at most the template's opening is shared with another agent's prompt
    assert "# agent" in miss["new_text"]
    # the next turn resends the conversation and the reply: all of it is reused, nothing is missed
    second = _chat(front, system, [U1, _reply(first), U2])
    assert _miss(second) is None
    assert second.usage.prompt_tokens_details.cached_tokens >= _prompt_tokens(first)


def test_a_changed_system_prompt_is_reported_at_the_token_it_changed(front: Front) -> None:
    system = _system()
    first = _chat(front, system, [U1])
    changed = system.replace("Rule 20:", "Rule twenty:")
    second = _chat(front, changed, [U1])
    miss = _miss(second)
    assert miss is not None and miss["cause"] == "system_changed", miss
    cached = second.usage.prompt_tokens_details.cached_tokens
    # reuse stopped where the prompt changed, well inside the system prompt
    assert miss["index"] == cached and 100 < miss["index"] < _prompt_tokens(first) - 50
    assert "20" in miss["held_text"] and "twenty" in miss["new_text"]
    assert miss["held_tokens"] >= _prompt_tokens(first)


def test_changed_tools_are_reported_as_such(front: Front) -> None:
    system = _system()
    _chat(front, system, [U1], tools=[TOOL_READ])
    again = _chat(front, system, [U1], tools=[TOOL_READ])
    assert _miss(again) is None  # the same tools: all reused
    other = _chat(front, system, [U1], tools=[TOOL_GREP])
    miss = _miss(other)
    assert miss is not None and miss["cause"] == "tools_changed", miss
    assert miss["index"] == other.usage.prompt_tokens_details.cached_tokens > 100


def test_an_edited_message_is_history_rewritten_at_that_message(front: Front) -> None:
    system = _system()
    first = _chat(front, system, [U1])
    reply = _reply(first)
    second = _chat(front, system, [U1, reply, U2])
    assert _miss(second) is None
    # the agent sends the history again with the model's reply edited: history rewritten, at that message
    third = _chat(front, system, [U1, {"role": "assistant", "content": "Rule 7, surely."}, U2])
    miss = _miss(third)
    assert miss is not None and miss["cause"] == "history_rewritten" and miss["message"] == 1, miss
    assert miss["index"] == third.usage.prompt_tokens_details.cached_tokens > _prompt_tokens(first) - 20
    # a conversation that parts at its first message is another conversation under the same agent
    fourth = _chat(front, system, [{"role": "user", "content": "Which rule speaks of function number 9?"}])
    miss = _miss(fourth)
    assert miss is not None and miss["cause"] == "first_sight" and miss["message"] == 0, miss


def test_the_access_log_metrics_and_why_carry_the_cause(front: Front) -> None:
    system = _system()
    _chat(front, system, [U1])
    second = _chat(front, system.replace("Rule 5:", "Rule five:"), [U1])
    index = _miss(second)["index"]  # type: ignore[index]
    lines = [ln for ln in front.daemon.log().splitlines() if "modeld.access" in ln and "/v1/chat/completions" in ln]
    assert f"miss=system_changed@{index}" in lines[-1]
    with front.daemon.client(timeout_s=10.0) as c:
        records = c.why(2)
        metrics = c.metrics()
    assert [r.miss.cause.value if r.miss else None for r in records] == ["first_sight", "system_changed"]
    assert records[-1].miss is not None and records[-1].miss.index == index
    assert records[-1].reused_tokens == index and records[-1].prompt_tokens == _prompt_tokens(second)
    found = re.search(r'modeld_cache_misses_total\{cause="system_changed"\} (\d+)', metrics)
    assert found is not None and int(found.group(1)) >= 1


def test_the_cli_prints_the_last_requests_and_why(front: Front) -> None:
    import subprocess
    import sys

    system = _system()
    _chat(front, system, [U1])
    _chat(front, system + "\nRule extra: one more.", [U1])  # the prompt only grew: the rules before it are kept
    out = subprocess.run([sys.executable, "-m", "modeld", "why", "2", "--endpoint", front.daemon.endpoint],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["WHEN", "PROMPT", "REUSED"]
    assert "first_sight at token" in out
    data = json.loads(subprocess.run(
        [sys.executable, "-m", "modeld", "why", "1", "--json", "--endpoint", front.daemon.endpoint],
        capture_output=True, text=True, timeout=60, check=True).stdout)
    assert len(data) == 1 and data[0]["prompt_tokens"] > data[0]["reused_tokens"] > 100


# --- sub-agents from their parent ----------------------------------------------------------------------------
def _task(who: str) -> dict[str, Any]:
    """A sub-agent's (or the parent's) first message: its own task, long enough to be worth keeping (~100 tokens)."""
    steps = " ".join(f"Step {i}: look at module {who}_{i} and note what it exports." for i in range(8))
    return {"role": "user", "content": f"You are the {who} agent. {steps}"}


def test_sub_agents_start_from_their_parents_prefix_and_nobody_loses_what_it_had(front: Front) -> None:
    """A parent and two sub-agents interleaved, as an agent that forks them runs: the same system prompt and tools,
    each its own conversation. Each sub-agent's first request reuses the parent's head; from then on every request
    of each of the three reuses all it sent before (the other two's turns in between notwithstanding)."""
    system, tools = _system(), [TOOL_READ, TOOL_GREP]
    names = ("parent", "reviewer", "searcher")
    history: dict[str, list[dict[str, Any]]] = {who: [_task(who)] for who in names}
    sent: dict[str, int] = {}
    head = 0
    for rnd in range(3):
        for who in names:
            reply = _chat(front, system, history[who], tools=tools)
            cached, miss = reply.usage.prompt_tokens_details.cached_tokens, _miss(reply)
            if rnd == 0 and who == "parent":
                assert miss is not None and miss["cause"] == "first_sight", miss
                head = miss["index"]
            elif rnd == 0:
                # a sub-agent's first request: the parent's system prompt and tools come from the resident KV
                assert miss is not None and miss["cause"] == "first_sight" and miss["message"] == 0, miss
                assert cached == miss["index"] > 300, (who, cached, miss)
            else:
                # everything this conversation sent before is reused, from the KV or the workspace cache (a reply
                # the model spelled otherwise than the tokenizer spells its text is tokenized as a cold rendering
                # does: the miss, if any, is inside the reply, past all that was sent before)
                assert cached >= sent[who], (rnd, who, cached, sent[who], miss)
                assert miss is None or (miss["cause"] == "history_rewritten" and miss["index"] >= sent[who]), miss
            sent[who] = _prompt_tokens(reply)
            history[who] += [_reply(reply), {"role": "user", "content": f"Round {rnd}: go on, {who}."}]
    assert head <= 8


def test_the_agents_own_ids_name_the_conversations_the_cache_keeps(front: Front) -> None:
    """Claude Code's headers: its main agent's requests carry the session id, a sub-agent's its agent id as well.
    Each conversation's state in the workspace cache is filed under the id its requests named, the sub-agent's
    under its agent id (``modeld cache ls`` shows them); a request that names none files it under none."""
    system, tools = _system(), [TOOL_READ, TOOL_GREP]
    session, agent = f"session-{uuid.uuid4().hex}", f"agent-{uuid.uuid4().hex}"
    main = {"x-claude-code-session-id": session}
    sub = {"x-claude-code-session-id": session, "x-claude-code-agent-id": agent}
    parent = [_task("parent")]
    first = _chat(front, system, parent, tools=tools, extra_headers=main)
    _chat(front, system, [_task("reviewer")], tools=tools, extra_headers=sub)  # the parent's tape is saved
    parent += [_reply(first), {"role": "user", "content": "Go on."}]
    again = _chat(front, system, parent, tools=tools, extra_headers=main)  # the sub-agent's is saved
    assert _miss(again) is None and again.usage.prompt_tokens_details.cached_tokens >= _prompt_tokens(first)
    _chat(front, system, [_task("anonymous")], tools=tools)  # the parent's again, as the session's
    with front.daemon.client(timeout_s=60.0) as c:
        named = {e.conversation for e in c.cache_list().entries}
    assert {session, agent} <= named, named


# --- a small RAM cache: conversations evict one another; a template switched under the model ------------------
@pytest.fixture(scope="module", params=ENGINES)
def tight(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    """A daemon whose workspace cache holds nothing (a RAM budget smaller than any entry, no disk tier)."""
    pytest.importorskip("llama_cpp" if request.param == "llama" else "openvino_genai")
    with Front(tmp_path_factory.mktemp(f"tight-{request.param}"), "--num-ctx", "4096", "--cache-ram", "4KiB",
               "--cache-disk", "0", backend=request.param) as f:
        yield f


def test_a_conversation_evicted_by_another_is_reported_evicted(tight: Front) -> None:
    a, b = _system(), _system()
    first = _chat(tight, a, [U1])
    _chat(tight, b, [U1])  # another agent: its prefix replaces the first one's in the KV, and nothing is cached
    again = _chat(tight, a, [U1, _reply(first), U2])
    miss = _miss(again)
    assert miss is not None and miss["cause"] == "evicted", miss
    assert miss["index"] == again.usage.prompt_tokens_details.cached_tokens < 16
    # the daemon had computed the whole first prompt, to the block
    assert miss["held_tokens"] >= _prompt_tokens(first) - 64


def test_a_template_switched_under_the_model_is_a_manifest_change(tight: Front, tmp_path: Path) -> None:
    from tests.test_templates import PREAMBLE_TEMPLATE

    system = _system()
    _chat(tight, system, [U1])
    template = tmp_path / "preamble.jinja"
    template.write_text(PREAMBLE_TEMPLATE, encoding="utf-8")
    with tight.daemon.client(timeout_s=300.0) as c:
        active = c.status().active
        assert active is not None
        c.load_model(LoadModelRequest(model_name=active.model_name, type=active.type, path=active.path,
                                      config=Config(num_ctx=4096, chat_template=str(template))))
    after = _chat(tight, system, [U1])
    miss = _miss(after)
    assert miss is not None and miss["cause"] == "manifest_changed", miss
    assert "template_digest" in miss["detail"] and "model_digest" not in miss["detail"]


# --- previous_response_id across a restart --------------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
def test_a_codex_turn_after_a_restart_is_warm_from_disk(engine: str, tmp_path: Path) -> None:
    """Codex names its previous response: the stored conversation and the KV the stop wrote to the workspace
    cache's disk tier survive a restart, so the next turn reuses the first turn's prompt and reply."""
    pytest.importorskip("llama_cpp" if engine == "llama" else "openvino_genai")
    flags = ("--num-ctx", "4096", "--cache-disk", "1GiB")
    with Front(tmp_path, *flags, backend=engine) as f:
        first = f.sdk().responses.create(model="default", instructions=_system(), input=U1["content"],
                                         max_output_tokens=8, temperature=0)
    with Front(tmp_path, *flags, backend=engine) as f:
        second = f.sdk().responses.create(model="default", previous_response_id=first.id, input=U2["content"],
                                          max_output_tokens=8, temperature=0)
    had = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= had - 2, (second.usage, had)
    assert (second.usage.model_extra or {}).get("cache_miss") is None
