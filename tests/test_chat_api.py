"""The runtime chat API (runtime/chat.py) and ``modeld chat`` (runtime/chat_cli.py), against real daemon processes.

On the memory reference: OpenAI-shaped messages in, the reply and its usage
out, the history kept warm across turns, bad messages refused while the session
keeps serving, the CLI driven as a user would (lines piped in; a messages file
with --json). On the real engines: a six-turn tool conversation on the
tool-capable fixture through a daemon, and — in exact mode — the model loaded anew (cold, its caches
emptied) given the same history answers with the same greedy reply.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from contract.errors import InvalidArgument, SessionClosed
from contract.types import ChatMessage, Config, LoadModelRequest
from harness.daemon import ROOT, DaemonProcess, wait_until
from harness.fixtures import WEATHER_TOOL, tool_gguf
from runtime import Chat, Client
from runtime.chat import ChatEvent, ChatResult, split_messages

SYSTEM = {"role": "system", "content": "You are a terse coding assistant."}
CALL = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "slot.py"}'}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("chat"), "memory", None, "--model", "/models/ref", "--model-name", "ref")
    with d:
        yield d


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Client]:
    with daemon.client(timeout_s=20.0) as c:
        yield c


def test_split_messages() -> None:
    system, rest = split_messages(
        [SYSTEM, {"role": "system", "content": "Second rule."}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    )
    assert system == "You are a terse coding assistant.\n\nSecond rule."
    assert rest == [ChatMessage(role="user", content="hi")]
    _, rest = split_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [CALL]}])
    assert rest[1].tool_calls[0].function.name == "read_file" and rest[1].tool_calls[0].id == "call_1"
    for bad in ([SYSTEM], [{"role": "user", "content": [{"type": "image_url"}]}], ["not a message"]):
        with pytest.raises(InvalidArgument):
            split_messages(bad)  # type: ignore[arg-type]


def test_a_conversation_stays_warm(client: Client) -> None:
    with Chat(client, profile="warm-chat") as chat:
        history: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "What does slot.py do?"}]
        first = chat.send(history, max_tokens=12)
        assert first.message.role == "assistant" and first.message.content and first.finish_reason == "length"
        assert first.usage.reused_tokens == 0 and first.usage.completion_tokens == 12
        assert first.usage.prompt_tokens == first.usage.prefilled_tokens
        assert first.timing.ttft_ms > 0 and first.timing.total_ms >= first.timing.ttft_ms
        history += [
            {"role": "assistant", "content": first.message.content},
            {"role": "user", "content": "And server.py?"},
        ]
        second = chat.send(history, max_tokens=12)
        # the whole first turn, the model's own reply included, came from the KV
        assert second.usage.reused_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
        assert second.usage.prefilled_tokens == second.usage.prompt_tokens - second.usage.reused_tokens
        assert second.usage.prefilled_tokens < 40


def test_tool_calls_and_results_round_trip(client: Client) -> None:
    with Chat(client, profile="tools-chat") as chat:
        history = [
            SYSTEM,
            {"role": "user", "content": "Read slot.py."},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "name": "read_file", "content": "class SlotService: ..."},
        ]
        result = chat.send(history, tools=[WEATHER_TOOL], max_tokens=8)
        assert result.usage.completion_tokens == 8
        events = list(chat.stream(history, tools=[WEATHER_TOOL], max_tokens=8))
        assert events[-1].result is not None
        assert "".join(e.text for e in events[:-1]) == (events[-1].result.message.content or "")


def test_bad_messages_are_refused_and_the_chat_keeps_serving(client: Client) -> None:
    with Chat(client, profile="bad-chat") as chat:
        for bad in (
            [SYSTEM, {"role": "assistant", "content": None}],  # neither content nor tool calls
            [SYSTEM, {"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "nobody", "content": "r"}],
            [SYSTEM, {"role": "wizard", "content": "q"}],
        ):
            with pytest.raises(InvalidArgument):
                chat.send(bad, max_tokens=4)
        with pytest.raises(InvalidArgument, match="unknown decode options"):
            chat.send([SYSTEM, {"role": "user", "content": "q"}], max_tokns=4)
        assert chat.send([SYSTEM, {"role": "user", "content": "still there?"}], max_tokens=4).usage.completion_tokens == 4


def _cli(daemon: DaemonProcess, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "modeld", "chat", "--endpoint", daemon.endpoint, *args],
        input=stdin, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )


def test_cli_chat_keeps_the_history(daemon: DaemonProcess) -> None:
    out = _cli(daemon, "--max-tokens", "6", "--profile", "cli-chat", stdin="hello there\nand again\n/system Be brief.\n/clear\nfresh start\n/bye\nnever sent\n")
    assert out.returncode == 0, out.stderr
    summaries = [line for line in out.stderr.splitlines() if line.startswith("[reused")]
    assert len(summaries) == 3, out.stderr
    assert "[system prompt set]" in out.stderr and "[history cleared]" in out.stderr
    # the second turn reused the first turn; after /clear nothing of the old history is resent
    assert summaries[0].startswith("[reused 0,")
    assert not summaries[1].startswith("[reused 0,")
    assert len([line for line in out.stdout.splitlines() if line.strip()]) == 3


def test_cli_chat_one_shot_json(daemon: DaemonProcess, tmp_path: Path) -> None:
    messages = tmp_path / "m.json"
    messages.write_text(json.dumps([SYSTEM, {"role": "user", "content": "Read slot.py."}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                    {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]))
    tools = tmp_path / "t.json"
    tools.write_text(json.dumps([WEATHER_TOOL]))
    out = _cli(daemon, "--messages-file", str(messages), "--tools-file", str(tools), "--json", "--max-tokens", "5")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["message"]["role"] == "assistant" and result["usage"]["completion_tokens"] == 5
    assert set(result["timing"]) == {"ttft_ms", "prefill_ms", "first_token_ms", "decode_tokens_per_s", "total_ms"}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([SYSTEM, {"role": "tool", "tool_call_id": "x", "content": "r"}]))
    out = _cli(daemon, "--messages-file", str(bad), "--json")
    assert out.returncode == 1 and "InvalidArgument" in out.stderr


# --- real engines through a daemon ------------------------------------------------------------------------------
TOOL_SYSTEM = {"role": "system", "content": "You are a weather assistant. Call get_weather for each city, then answer briefly."}
QUESTIONS = ["What is the weather in Paris?", "Should I take an umbrella?", "And in Oslo?"]


def _six_turns(chat: Chat, forced: dict[int, str]) -> list[tuple[list[dict[str, Any]], Any]]:
    """Six requests of an agent loop; returns what each request sent and what came back."""
    from backends.tape.conversation import tool_call_text
    from contract.types import StructuredOutputConfig, ToolCall, ToolCallFunction

    history: list[dict[str, Any]] = [TOOL_SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
    questions = iter(QUESTIONS[1:])
    turns = []
    for i in range(6):
        opts: dict[str, Any] = {"max_tokens": 16, "temperature": 0}
        if i in forced:
            call = ToolCall(function=ToolCallFunction(name="get_weather", arguments=json.dumps({"city": forced[i]})))
            opts = {"max_tokens": 80, "temperature": 0, "structured_output": StructuredOutputConfig(grammar="root ::= " + json.dumps(tool_call_text(call)))}
        sent = list(history)
        result = chat.send(sent, tools=[WEATHER_TOOL], **opts)
        turns.append((sent, result))
        reply: dict[str, Any] = {"role": "assistant", "content": result.message.content}
        if result.message.tool_calls:
            reply["tool_calls"] = [dict(c.model_dump(mode="json"), id=f"call_{i}") for c in result.message.tool_calls]
            history += [reply, {"role": "tool", "tool_call_id": f"call_{i}", "name": "get_weather", "content": '{"temp_c": 12}'}]
        else:
            history += [reply, {"role": "user", "content": next(questions, "Thanks.")}]
    return turns


@pytest.mark.slow
@pytest.mark.parametrize("backend", [pytest.param("llama", marks=pytest.mark.llama), pytest.param("openvino", marks=pytest.mark.openvino)])
def test_exact_mode_through_daemons_cold_equals_warm(backend: str, tmp_path: Path) -> None:
    request = LoadModelRequest(model_name="tools", type=backend, path=str(tool_gguf()), config=Config(num_ctx=2048, exact_reuse=True))
    with DaemonProcess(tmp_path, backend, None, "--no-preload") as d, d.client(timeout_s=120.0) as c:
        warm = c.load_model(request)
        with Chat(c, profile="exact") as chat:
            turns = _six_turns(chat, forced={0: "Paris", 2: "Oslo"})
        for i, (_, result) in enumerate(turns[1:], start=1):
            # from turn 2 on only what is new is prefilled: the history, replies included, is reused
            assert result.usage.reused_tokens > 0 and result.usage.prefilled_tokens < result.usage.prompt_tokens // 2, i
        assert any(r.message.tool_calls for _, r in turns)
        # the model given the last history cold answers exactly like the warm one: unloaded, the workspace
        # cache emptied and loaded anew (one daemon serves both sides; nothing of the warm turns is left)
        sent, last = turns[-1]
        c.unload_model()
        c.cache_clear()
        assert c.cache_list().entries == []
        cold = c.load_model(request)
        assert cold.generation != warm.generation
        with Chat(c, profile="exact") as chat:
            again = chat.send(sent, tools=[WEATHER_TOOL], max_tokens=16, temperature=0)
    assert again.usage.reused_tokens == 0
    assert again.message.content == last.message.content and again.message.tool_calls == last.message.tool_calls


# --- the queue for the slot ---------------------------------------------------------------------------------------
def test_opens_wait_for_the_slot_in_arrival_order(daemon: DaemonProcess) -> None:
    import time

    from contract.errors import ModelBusy
    from contract.types import OpenSessionRequest

    order: list[str] = []
    errors: list[BaseException] = []

    def wait_then_hold(name: str, timeout_s: float) -> None:
        try:
            with daemon.client(timeout_s=20.0) as c:
                s = c.open_session(OpenSessionRequest(queue_timeout_s=timeout_s))
                order.append(name)
                s.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with daemon.client(timeout_s=20.0) as holder_client:
        holder = holder_client.open_session(OpenSessionRequest())
        with daemon.client(timeout_s=20.0) as other:
            t0 = time.monotonic()
            with pytest.raises(ModelBusy):  # no queue asked for: the answer comes at once
                other.open_session(OpenSessionRequest())
            assert time.monotonic() - t0 < 15.0  # (not the 20 s call timeout)
            t0 = time.monotonic()
            with pytest.raises(ModelBusy, match="queue timeout"):
                other.open_session(OpenSessionRequest(queue_timeout_s=0.5))
            assert 0.45 <= time.monotonic() - t0 < 5.0
        first = threading.Thread(target=wait_then_hold, args=("first", 60.0))
        second = threading.Thread(target=wait_then_hold, args=("second", 60.0))
        first.start()
        wait_until(lambda: holder_client.status().waiting == 1, "the first open queued")
        second.start()  # it arrives after the first
        wait_until(lambda: holder_client.status().waiting == 2, "the second open queued")
        assert order == []  # both wait while the holder holds the slot
        holder.close()
        first.join(90)
        second.join(90)
    assert not errors, errors
    assert order == ["first", "second"]


def test_a_waiting_open_ends_at_its_own_deadline_while_another_session_decodes(tmp_path: Path) -> None:
    """The queue timeout is the caller's: ModelBusy at the deadline, even while the worker streams a
    long decode for the holder (it would otherwise look at the wait only when the decode ends)."""
    import time

    from contract.errors import ModelBusy
    from contract.types import DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput

    d = DaemonProcess(tmp_path, "memory", None, "--model", "/models/ref", "--model-name", "ref",
                      "--memory-token-delay-ms", "20")
    with d, d.client(timeout_s=30.0) as holder_client, d.client(timeout_s=30.0) as other:
        s = holder_client.open_session(OpenSessionRequest())
        s.ensure_prefix(PrefixInput(text="sys"))
        s.prefill_suffix(SuffixInput(text="go"))
        stream = s.decode(DecodeConfig(max_tokens=1500))  # 30 s of tokens
        next(stream)
        t0 = time.monotonic()
        with pytest.raises(ModelBusy, match="queue timeout"):
            other.open_session(OpenSessionRequest(queue_timeout_s=2.0))
        waited = time.monotonic() - t0
        assert 1.9 <= waited < 3.5, waited
        assert next(stream).text is not None  # the holder's decode went on
        stream.close()
        s.close()
        assert other.open_session(OpenSessionRequest(queue_timeout_s=5.0)) is not None  # and the slot is free again


def test_two_agents_take_turns_without_model_busy(daemon: DaemonProcess) -> None:

    results: dict[str, list[int]] = {"a": [], "b": []}
    errors: list[BaseException] = []

    def agent(name: str) -> None:
        try:
            with daemon.client(timeout_s=30.0) as c, Chat(c, profile=f"agent-{name}") as chat:
                history: list[dict[str, Any]] = [{"role": "system", "content": f"You are agent {name}."}]
                for i in range(4):
                    history.append({"role": "user", "content": f"step {i}"})
                    result = chat.send(history, max_tokens=8)
                    results[name].append(result.usage.completion_tokens)
                    history.append({"role": "assistant", "content": result.message.content})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert results == {"a": [8, 8, 8, 8], "b": [8, 8, 8, 8]}


def test_client_chat_and_chat_stream(client: Client) -> None:
    history = [SYSTEM, {"role": "user", "content": "One line on caching."}]
    result = client.chat(history, profile="client-chat", max_tokens=6, temperature=0)
    assert result.usage.completion_tokens == 6 and result.message.content
    events = list(client.chat_stream(history, profile="client-chat", max_tokens=6, temperature=0))
    assert events[-1].result is not None and events[-1].result.message.content == result.message.content
    assert events[-1].result.usage.reused_tokens == result.usage.prompt_tokens  # the same turn again: all resident


# --- cancelling a turn, closing a chat ------------------------------------------------------------------
@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon that decodes a token every 2 ms: a long reply is still streaming when the test acts on it."""
    d = DaemonProcess(tmp_path_factory.mktemp("slow-chat"), "memory", None, "--model", "/models/ref",
                      "--model-name", "ref", "--memory-token-delay-ms", "2")
    with d:
        yield d


LONG = {"max_tokens": 1000, "temperature": 0.0}


def _result(events: Iterator[ChatEvent]) -> ChatResult:
    results = [e.result for e in events if e.result is not None]
    assert len(results) == 1
    return results[0]


def test_a_turn_cancelled_from_another_thread_ends_as_cancelled(slow: DaemonProcess) -> None:
    with slow.client(timeout_s=20.0) as c:
        turn = Chat(c, profile="cancel").begin([SYSTEM, {"role": "user", "content": "Go on."}], **LONG)
        events = turn.events()
        first = next(events)  # the reply is streaming
        canceller = threading.Thread(target=turn.cancel)
        canceller.start()
        result = _result(events)
        canceller.join(10)
        assert result.finish_reason == "cancelled"
        assert 0 < len(first.text + (result.message.content or "")) < 1000
        assert turn.finished and not c.status().session_open


def test_a_turn_cancelled_before_it_runs_stops_at_its_first_token(slow: DaemonProcess) -> None:
    with slow.client(timeout_s=20.0) as c:
        turn = Chat(c, profile="cancel-early").begin([SYSTEM, {"role": "user", "content": "Go on."}], **LONG)
        turn.cancel()  # (as the HTTP front's cancel may, while the turn is still prefilling)
        result = _result(turn.events())
        assert result.finish_reason == "cancelled" and len(result.message.content or "") < 100
        assert not c.status().session_open


def test_closing_a_chat_gives_back_the_slot_its_turns_hold(slow: DaemonProcess) -> None:
    with slow.client(timeout_s=20.0) as c, slow.client(timeout_s=20.0) as watcher:
        with Chat(c, profile="close") as chat:
            stream = chat.stream([SYSTEM, {"role": "user", "content": "Go on."}], **LONG)
            next(stream)  # a reply left streaming when the chat ends
            assert watcher.status().session_open
        assert not watcher.status().session_open
        with pytest.raises(SessionClosed, match="chat is closed"):
            chat.send([SYSTEM, {"role": "user", "content": "again"}])

        chat = Chat(c, profile="close")
        chat.begin([SYSTEM, {"role": "user", "content": "Go on."}], **LONG)  # begun, never run
        assert watcher.status().session_open
        chat.close()
        assert not watcher.status().session_open
        # a turn that ran to its end holds nothing: closing its chat sends nothing more
        chat = Chat(c, profile="close")
        assert chat.send([SYSTEM, {"role": "user", "content": "hi"}], max_tokens=2).finish_reason == "length"
        chat.close()
