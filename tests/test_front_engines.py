"""The HTTP front on both engines, as ``make run`` serves it: the bundled model, driven by the official
``openai`` and ``anthropic`` SDKs through the three APIs coding agents speak.

What coding agents need of it: tools on a template that does not render them
(the generic tool block), no hidden output limit, refusals before any prefill,
sampled replies when a request sets no sampling parameter; the Responses API
(Codex) and the Messages API (Claude Code) with their streams, stored turns,
counts and a prefix that survives what the clients do to their prompts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from tests.engine_kit import openvino_precision  # noqa: E402
from tests.test_metrics import samples  # noqa: E402
from tests.test_openai_front import Front  # noqa: E402
from tests.test_responses_front import streamed_events  # noqa: E402

pytestmark = pytest.mark.slow

READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
RUN_TESTS = {"type": "function", "function": {
    "name": "run_tests", "description": "Run the test suite.", "parameters": {"type": "object", "properties": {}}}}
SYSTEM = {"role": "system", "content": "You are a coding agent. Use the tools to look at the repository."}
NUM_CTX = 1024
API_KEY = "engine-key"  # every client here sends it: the OpenAI SDK as a bearer, the Anthropic SDK as x-api-key
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Helpers that work beside you.",
             "tools": [{"type": "function", "name": "spawn_agent", "description": "Start a helper on a task.",
                        "parameters": {"type": "object", "properties": {"task": {"type": "string"}},
                                       "required": ["task"]}}]}


@pytest.fixture(scope="module", params=[pytest.param("llama", marks=pytest.mark.llama),
                                        pytest.param("openvino", marks=pytest.mark.openvino)])
def front(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    pytest.importorskip("llama_cpp" if request.param == "llama" else "openvino_genai")
    # the bundled model (its template renders no tools), in a small window so a reply can run to its end quickly
    with Front(tmp_path_factory.mktemp(f"front-{request.param}"), "--num-ctx", str(NUM_CTX), "--api-key", API_KEY,
               backend=request.param) as f:
        yield f


def _anthropic(front: Front) -> Any:
    """The official ``anthropic`` client for ``front``, sending its key as ``x-api-key``."""
    pytest.importorskip("anthropic")
    from tests.test_anthropic_front import sdk

    return sdk(front, front.api_key)


def _claude_system(n: int) -> list[dict[str, Any]]:
    """Claude Code's system blocks: the billing header (``n`` makes it new), then the prompt marked for caching
    (the prompt asks for the tools: on the bundled model a forced call's arguments then stay short)."""
    from tests.test_anthropic_front import BILLING

    return [{"type": "text", "text": BILLING.format(n=n)},
            {"type": "text", "text": "You are a coding agent. Use the tools.", "cache_control": {"type": "ephemeral"}}]


def _prefilled(front: Front) -> float:
    """The daemon's count of prefilled tokens (its metrics)."""
    with front.daemon.client(timeout_s=10.0) as c:
        text = c.metrics()
    return samples(text).get(("modeld_prompt_tokens_total", (("kind", "prefilled"),)), 0.0)


def test_tools_on_a_template_without_tool_support_round_trip(front: Front) -> None:
    sdk = front.sdk()
    history: list[dict[str, object]] = [SYSTEM, {"role": "user", "content": "What does calc.py contain?"}]
    first = sdk.chat.completions.create(model="any", messages=history, tools=[READ_FILE, RUN_TESTS], temperature=0,
                                        max_tokens=60, tool_choice={"type": "function", "function": {"name": "read_file"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "read_file" and isinstance(json.loads(call.function.arguments), dict)
    history += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "def add(a, b):\n    return a - b\n"}]
    second = sdk.chat.completions.create(model="any", messages=history, tools=[READ_FILE, RUN_TESTS], temperature=0,
                                         max_tokens=20)
    assert first.usage is not None and second.usage is not None and second.usage.prompt_tokens_details is not None
    # the first request is reused; the call and the tool result are what is computed
    # (the call, decoded under a grammar, is spelled otherwise than the tokenizer spells its text: its tokens are
    # computed again, as a fresh daemon computes the same prompt — warm equals cold)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 2
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_no_max_tokens_decodes_past_256_to_the_end(front: Front) -> None:
    out = front.sdk().chat.completions.create(
        model="any", temperature=0,
        messages=[{"role": "user", "content": "Write a very long story about a dragon who learns to program, "
                                              "with many chapters. Do not stop early."}])
    assert out.usage is not None
    used = out.usage.prompt_tokens + out.usage.completion_tokens
    # the end of generation, or the context's end: never a hidden default limit
    assert out.choices[0].finish_reason == "stop" or used == NUM_CTX, (out.choices[0].finish_reason, used)
    assert out.usage.completion_tokens > 256 or out.choices[0].finish_reason == "stop"


def test_an_oversized_prompt_is_refused_before_any_prefill(front: Front) -> None:
    sdk = front.sdk()
    before = _prefilled(front)
    big = [SYSTEM, {"role": "user", "content": "Summarise: " + "the quick brown fox jumps over the lazy dog. " * 1500}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as exc:
            sdk.chat.completions.create(model="any", messages=big, stream=stream)
        assert exc.value.code == "context_length_exceeded"
        said = re.search(rf"the prompt is (\d+) tokens but the model's context window is {NUM_CTX}", exc.value.message)
        assert said is not None and int(said.group(1)) > 15_000, exc.value.message
        # led by the sentence OpenAI-speaking clients look for
        assert exc.value.body["message"].startswith(  # type: ignore[index]
            f"This model's maximum context length is {NUM_CTX} tokens. However, your messages resulted in "
            f"{said.group(1)} tokens"), exc.value.body
    text = big[1]["content"]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as exc:
            sdk.responses.create(model="any", input=text, stream=stream, store=False)
        assert exc.value.code == "context_length_exceeded" and f"context window is {NUM_CTX}" in exc.value.message
    anthropic = pytest.importorskip("anthropic")
    with _anthropic(front) as c:
        for stream in (False, True):
            with pytest.raises(anthropic.BadRequestError) as refused:
                c.messages.create(model="claude-opus-5", max_tokens=100, messages=[{"role": "user", "content": text}],
                                  stream=stream)
            error = refused.value.body["error"]
            assert error["type"] == "invalid_request_error" and f"context window is {NUM_CTX}" in error["message"]
            # in Anthropic's words, which Claude Code reads to compact by the right amount (its own pattern)
            over = re.match(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", error["message"])
            assert over is not None and int(over.group(2)) == NUM_CTX - 1 < int(over.group(1)), error["message"]
    assert _prefilled(front) == before  # nothing was prefilled for any of them


def test_a_max_tokens_past_the_context_is_a_cap(front: Front) -> None:
    out = front.sdk().chat.completions.create(model="any", temperature=0, max_tokens=32000,
                                              messages=[SYSTEM, {"role": "user", "content": "Say hi."}])
    assert out.usage is not None and out.usage.prompt_tokens + out.usage.completion_tokens <= NUM_CTX


def test_a_request_with_no_sampling_parameters_samples(front: Front) -> None:
    sdk = front.sdk()
    messages = [{"role": "user", "content": "Write ten random words."}]
    sampled = {sdk.chat.completions.create(model="any", messages=messages, max_tokens=24).choices[0].message.content
               for _ in range(3)}
    assert len(sampled) > 1


def test_penalties_reach_the_sampler(front: Front) -> None:
    """OpenAI's frequency/presence penalties and llama-server's repeat_penalty change a greedy answer."""
    sdk = front.sdk()
    messages = [SYSTEM, {"role": "user", "content": "Count from 1 to 20, one number per line."}]
    plain = sdk.chat.completions.create(model="any", messages=messages, temperature=0, max_tokens=40)
    again = sdk.chat.completions.create(model="any", messages=messages, temperature=0, max_tokens=40)
    penalised = sdk.chat.completions.create(model="any", messages=messages, temperature=0, max_tokens=40,
                                            frequency_penalty=2.0, presence_penalty=2.0,
                                            extra_body={"repeat_penalty": 10.0, "repeat_last_n": 512})
    assert plain.choices[0].message.content == again.choices[0].message.content
    assert penalised.choices[0].message.content != plain.choices[0].message.content
    bad = sdk.with_options(max_retries=0).chat.completions
    with pytest.raises(openai.BadRequestError):
        bad.create(model="any", messages=messages, frequency_penalty=3.0)


def test_responses_forced_call_answered_then_json_schema(front: Front) -> None:
    """Codex's wire on the bundled model: a forced function call, its output, then a schema-bound answer."""
    sdk = front.sdk()
    shell = {"type": "function", "name": "read_file", "description": "Read a file.", "strict": False,
             "parameters": READ_FILE["function"]["parameters"]}  # type: ignore[index]
    base = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Use the tools."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is in calc.py?"}]}]
    first = sdk.responses.create(model="any", input=base, tools=[shell, {"type": "web_search"}], store=False,
                                 temperature=0, max_output_tokens=60, include=["reasoning.encrypted_content"],
                                 tool_choice={"type": "function", "name": "read_file"})
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "read_file" and isinstance(json.loads(calls[0].arguments), dict)
    history = [*base, *[o.model_dump(exclude_none=True) for o in first.output],
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "def add(a, b): return a - b"}]
    second = sdk.responses.create(model="any", input=history, tools=[shell], store=False, temperature=0,
                                  max_output_tokens=40,
                                  text={"format": {"type": "json_schema", "name": "answer", "schema": {
                                      "type": "object", "properties": {"bug": {"type": "string", "maxLength": 40}},
                                      "required": ["bug"], "additionalProperties": False}}})
    assert set(json.loads(second.output_text)) == {"bug"}
    # the echoed call renders as the model wrote it, after the first request, which is reused
    # (the call, decoded under a grammar, is spelled otherwise than the tokenizer spells its text: its tokens are
    # computed again, as a fresh daemon computes the same prompt — warm equals cold)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 2


def test_responses_plain_streamed_stored_and_deleted(front: Front) -> None:
    sdk = front.sdk()
    ask: dict[str, Any] = {"model": "gpt-5-codex", "instructions": "You are terse.", "temperature": 0,
                           "input": "Name one sorting algorithm.", "max_output_tokens": 16}
    plain = sdk.responses.create(**ask)
    assert plain.status in ("completed", "incomplete") and [o.type for o in plain.output] == ["message"]
    assert plain.output_text and 0 < plain.usage.output_tokens <= 16
    assert (plain.status == "incomplete") == (plain.usage.output_tokens == 16)
    events = list(sdk.responses.create(**ask, stream=True, store=False))
    names = [e.type for e in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert names[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert names[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = events[-1].response
    assert streamed.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    # the same request again: its whole input but the last token is reused
    assert streamed.usage.input_tokens == plain.usage.input_tokens
    assert streamed.usage.input_tokens_details.cached_tokens >= plain.usage.input_tokens - 1
    # store: the API's default keeps the first one; the streamed one asked not to be kept
    assert sdk.responses.retrieve(plain.id).output_text == plain.output_text
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(streamed.id)
    assert sdk.responses.delete(plain.id) is None
    with pytest.raises(openai.NotFoundError) as gone:
        sdk.responses.retrieve(plain.id)
    assert plain.id in gone.value.message


def test_responses_previous_response_id_over_three_turns(front: Front) -> None:
    """Only the new input is sent: the stored turns and the replies are resident, as warm as a stateless resend."""
    sdk = front.sdk()
    turns = [sdk.responses.create(model="any", instructions="You are terse.", input="Name a fruit.", temperature=0,
                                  max_output_tokens=12)]
    for ask in ("Name a colour.", "Name a city."):
        turns.append(sdk.responses.create(model="any", previous_response_id=turns[-1].id, input=ask, temperature=0,
                                          max_output_tokens=12))
    for before, after in zip(turns, turns[1:], strict=False):
        assert after.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens + before.usage.output_tokens - 2
    # the third turn's whole conversation sent at once renders the same prompt
    whole: list[dict[str, Any]] = []
    for ask, turn in zip(("Name a fruit.", "Name a colour."), turns, strict=False):
        whole += [{"type": "message", "role": "user", "content": ask}, *[o.model_dump(exclude_none=True) for o in turn.output]]
    whole.append({"type": "message", "role": "user", "content": "Name a city."})
    counted = sdk.responses.input_tokens.count(model="any", instructions="You are terse.", input=whole)
    assert counted.input_tokens == turns[-1].usage.input_tokens


def test_responses_namespace_tool_called_by_its_inner_name(front: Front) -> None:
    """Codex's ``namespace`` tool: its function is offered and called by its own name, and the call names the
    namespace again; ``input_tokens`` counts what the reply's usage counts."""
    sdk = front.sdk()
    ask: dict[str, Any] = {
        "model": "any", "instructions": "Use the tools.", "tools": [NAMESPACE, {"type": "web_search"}],
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Start a helper."}]}]}
    counted = sdk.responses.input_tokens.count(**ask)
    out = sdk.responses.create(**ask, store=False, temperature=0, max_output_tokens=60,
                               tool_choice={"type": "function", "name": "spawn_agent"})
    assert counted.input_tokens == out.usage.input_tokens
    calls = [o.model_dump() for o in out.output if o.type == "function_call"]
    assert calls and calls[0]["name"] == "spawn_agent" and calls[0].get("namespace") == "multi_agent_v1", out.output
    assert set(json.loads(calls[0]["arguments"])) == {"task"}
    answered = [*ask["input"], *[o.model_dump(exclude_none=True) for o in out.output],
                {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "helper started"}]
    after = sdk.responses.create(**{**ask, "input": answered}, store=False, temperature=0, max_output_tokens=4)
    # (the call, decoded under a grammar, is spelled otherwise than the tokenizer spells its text: its tokens are
    # computed again, as a fresh daemon computes the same prompt — warm equals cold)
    assert after.usage.input_tokens_details.cached_tokens >= out.usage.input_tokens - 2


def test_messages_plain_and_streamed_in_the_documented_order(front: Front) -> None:
    with _anthropic(front) as c:
        ask: dict[str, Any] = {"model": "claude-opus-5", "max_tokens": 16, "extra_body": {"temperature": 0},
                               "messages": [{"role": "user", "content": "Name one cache eviction policy."}]}
        plain = c.messages.create(**ask, system=_claude_system(1))
        assert plain.type == "message" and plain.role == "assistant" and [b.type for b in plain.content] == ["text"]
        assert plain.stop_reason in ("end_turn", "max_tokens") and 0 < plain.usage.output_tokens <= 16
        order: list[str] = []
        with c.messages.stream(**ask, system=_claude_system(2)) as stream:
            for event in stream:
                if event.type == "content_block_delta":
                    order.append(event.delta.type)
                elif event.type in ("message_start", "content_block_start", "content_block_stop", "message_delta",
                                    "message_stop"):
                    order.append(event.type)
            final = stream.get_final_message()
    assert order[:2] == ["message_start", "content_block_start"]
    assert order[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(order[2:-3]) == {"text_delta"}
    # the billing header changed: still the same prompt, all but its last token reused
    prompt = plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt
    assert final.usage.cache_read_input_tokens >= prompt - 1


def test_messages_forced_tool_use_over_four_turns(front: Front) -> None:
    """Claude Code's loop: a forced ``tool_use`` answered by a ``tool_result``, four times, the billing header new on
    every request and the main and "small fast" model names alternating: each request reuses all the previous one."""
    read = {"name": "read_file", "description": "Read a file.", "input_schema": READ_FILE["function"]["parameters"]}  # type: ignore[index]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is in calc.py?"}]
    previous = 0
    with _anthropic(front) as c:
        for turn in range(4):
            out = c.messages.create(model=("claude-opus-5", "claude-haiku-4-5")[turn % 2], max_tokens=60,
                                    system=_claude_system(100 + turn), tools=[read], messages=messages,
                                    tool_choice={"type": "tool", "name": "read_file"}, extra_body={"temperature": 0})
            uses = [b for b in out.content if b.type == "tool_use"]
            assert out.stop_reason == "tool_use" and uses and set(uses[0].input) == {"path"}, out.content
            if turn:
                assert out.usage.cache_read_input_tokens >= previous, (turn, out.usage)
            # (the forced call is computed again next turn: its grammar's spelling is not the tokenizer's)
            previous = out.usage.input_tokens + out.usage.cache_read_input_tokens - 2
            messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in out.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                       "content": f"def f{turn}(): return {turn}"}]}]
        counted = c.messages.count_tokens(model="claude-opus-5", system=_claude_system(9), tools=[read],
                                          messages=messages)
        last = c.messages.create(model="claude-opus-5", max_tokens=8, system=_claude_system(10), tools=[read],
                                 messages=messages, extra_body={"temperature": 0})
    assert counted.input_tokens == last.usage.input_tokens + last.usage.cache_read_input_tokens


def test_messages_max_tokens_32000_is_a_cap(front: Front) -> None:
    with _anthropic(front) as c:
        out = c.messages.create(model="claude-opus-5", max_tokens=32000, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "Say hi."}])
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens + out.usage.output_tokens <= NUM_CTX
    assert out.stop_reason in ("end_turn", "max_tokens")


@pytest.fixture(scope="module", params=[pytest.param("llama", marks=pytest.mark.llama),
                                        pytest.param("openvino", marks=pytest.mark.openvino)])
def think_front(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    """The bundled weights under a reasoning template (``<think>`` opened by the prompt)."""
    pytest.importorskip("llama_cpp" if request.param == "llama" else "openvino_genai")
    from harness.fixtures import think_gguf

    with Front(tmp_path_factory.mktemp(f"front-think-{request.param}"), "--model", str(think_gguf()),
               "--num-ctx", str(NUM_CTX), backend=request.param) as f:
        yield f


def test_messages_thinking_comes_back_with_its_signature(think_front: Front) -> None:
    """A thinking block the daemon signed renders back as the model wrote it, so the next turn reuses
    the whole first one; a block whose signature is not the daemon's is left out of the prompt."""
    with _anthropic(think_front) as c:
        messages: list[dict[str, object]] = [{"role": "user", "content": "What is 2 + 3? Think first."}]
        first = c.messages.create(model="claude-opus-5", max_tokens=40, messages=messages,
                                  thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0})
        thinking = [b for b in first.content if b.type == "thinking"]
        assert thinking and thinking[0].thinking and thinking[0].signature, first.content
        prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens

        def follow(blocks: list[dict[str, object]]) -> int:
            turn = [*messages, {"role": "assistant", "content": blocks}, {"role": "user", "content": "And 3 + 4?"}]
            out = c.messages.create(model="claude-opus-5", max_tokens=4, messages=turn,
                                    thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0})
            return int(out.usage.cache_read_input_tokens)

        echoed = [b.model_dump(exclude_none=True) for b in first.content]
        assert follow(echoed) >= prompt + first.usage.output_tokens - 4
        forged = [{**b, "signature": "forged"} if b["type"] == "thinking" else b for b in echoed]
        # left out of the prompt (with a text block, the turn is not empty): the reply's tokens are not reused
        assert follow([*forged, {"type": "text", "text": "5"}]) < prompt + 4


def test_responses_encrypted_reasoning_reproduces_the_turn(think_front: Front) -> None:
    """``include: reasoning.encrypted_content``: the echoed reasoning item renders the turn as it was decoded."""
    sdk = think_front.sdk()
    base = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is 2 + 3? Think first."}]}]
    first = sdk.responses.create(model="any", input=base, store=False, temperature=0, max_output_tokens=40,
                                 reasoning={"summary": "auto"}, include=["reasoning.encrypted_content"])
    reasoning = [o for o in first.output if o.type == "reasoning"]
    assert reasoning and reasoning[0].encrypted_content, first.output
    # streamed, the reasoning comes as its summary's deltas, each event as the front's model declares it, and ends
    # as the same item (greedy)
    events = streamed_events(think_front, {"model": "any", "input": base, "store": False, "temperature": 0,
                                               "max_output_tokens": 40, "reasoning": {"summary": "auto"},
                                               "include": ["reasoning.encrypted_content"]})
    summary = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    streamed = [o for o in events[-1].response.output if o.type == "reasoning"]
    assert summary and streamed[0].summary[0].text == summary == reasoning[0].summary[0].text
    assert streamed[0].encrypted_content
    history = [*base, *[o.model_dump(exclude_none=True) for o in first.output],
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And 3 + 4?"}]}]
    second = sdk.responses.create(model="any", input=history, store=False, temperature=0, max_output_tokens=4)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens - 4


def test_a_streamed_call_comes_as_its_arguments_are_written_in_all_three_apis(front: Front) -> None:
    """A forced call, streamed: chat completions give its ``function.arguments`` in pieces keyed by the call's
    index (the first with its id and name), Responses its ``function_call_arguments.delta`` s, Messages its
    ``input_json_delta`` s; in each the pieces join to the call the reply reports, and there is more than one."""
    sdk = front.sdk()
    ask: dict[str, Any] = {"model": "any", "messages": [SYSTEM, {"role": "user", "content": "What does calc.py contain?"}],
                           "tools": [READ_FILE, RUN_TESTS], "temperature": 0, "max_tokens": 60,
                           "tool_choice": {"type": "function", "function": {"name": "read_file"}}}
    entries = []
    finish = None
    for chunk in sdk.chat.completions.create(**ask, stream=True):
        if chunk.choices:
            entries += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and entries
    assert {e.index for e in entries} == {0}
    assert entries[0].id and entries[0].function.name == "read_file" and entries[0].type == "function"
    assert all(e.id is None and e.function.name is None for e in entries[1:])
    arguments = "".join(e.function.arguments or "" for e in entries)
    assert len([e for e in entries if e.function.arguments]) > 1, entries
    plain = sdk.chat.completions.create(**ask).choices[0].message.tool_calls
    assert plain and plain[0].function.arguments == arguments and set(json.loads(arguments)) == {"path"}

    shell = {"type": "function", "name": "read_file", "description": "Read a file.",
             "parameters": READ_FILE["function"]["parameters"]}  # type: ignore[index]
    base = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Use the tools."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is in calc.py?"}]}]
    # (every event checked against the front's model for it, as the raw stream carries it)
    events = streamed_events(front, {"model": "any", "input": base, "tools": [shell], "store": False,
                                         "temperature": 0, "max_output_tokens": 60,
                                         "tool_choice": {"type": "function", "name": "read_file"}})
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    items = [o for o in events[-1].response.output if o.type == "function_call"]
    assert len(deltas) > 1 and len(done) == 1 and len(items) == 1, [e.type for e in events]
    assert "".join(deltas) == done[0].arguments == items[0].arguments and set(json.loads(items[0].arguments)) == {"path"}

    read = {"name": "read_file", "description": "Read a file.", "input_schema": READ_FILE["function"]["parameters"]}  # type: ignore[index]
    with _anthropic(front) as c:
        stream = c.messages.create(model="claude-haiku-4-5", max_tokens=60, stream=True, tools=[read],
                                   system=_claude_system(7),
                                   messages=[{"role": "user", "content": "What is in calc.py?"}],
                                   tool_choice={"type": "tool", "name": "read_file"}, extra_body={"temperature": 0})
        got = list(stream)
    starts = [e for e in got if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    parts = [e.delta.partial_json for e in got if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(starts) == 1 and starts[0].content_block.name == "read_file" and len(parts) > 1, got
    assert set(json.loads("".join(parts))) == {"path"}


# --- tokens ------------------------------------------------------------------------------------
def test_tokenize_and_detokenize_round_trip_on_the_model(front: Front) -> None:
    """llama-server's ``/tokenize`` and ``/detokenize`` on the loaded model: special tokens parse as in a prompt,
    ids come back as the text, and an id outside the vocabulary is a 400 naming it, the daemon serving on."""
    import httpx

    text = "<|im_start|>user\nFix the failing test in café.py, then run it.<|im_end|>\n"
    with httpx.Client(base_url=front.url.removesuffix("/v1"), timeout=600,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as h:
        tokens = h.post("/tokenize", json={"content": text}).json()["tokens"]
        marker = h.post("/tokenize", json={"content": "<|im_start|>"}).json()["tokens"]
        assert len(marker) == 1 and tokens[0] == marker[0]  # one special token, as a prompt holds it
        assert len(tokens) < len(text.encode()) / 2  # words, not bytes
        assert h.post("/detokenize", json={"tokens": tokens}).json() == {"content": text, "prompt": text}
        with_bos = h.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
        assert with_bos[len(with_bos) - len(tokens):] == tokens and len(with_bos) - len(tokens) in (0, 1)

        bad = h.post("/detokenize", json={"tokens": [tokens[0], 10**9]})
        assert bad.status_code == 400 and "tokens[1]" in bad.json()["error"]["message"]
        assert h.post("/detokenize", json={"tokens": [-1]}).status_code == 400
        pieces = h.post("/tokenize", json={"content": "x", "with_pieces": True})
        assert pieces.status_code == 400 and pieces.json()["error"]["param"] == "with_pieces"
        assert h.post("/tokenize", json={"content": 7}).status_code == 400  # a field of the wrong type, named
        assert h.post("/tokenize", json={"content": text}).json()["tokens"] == tokens  # still serving, the same
        # vLLM's shape, which evaluation harnesses tokenize on the server with
        vllm = h.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
        assert vllm["tokens"] == tokens and vllm["count"] == len(tokens)
        assert h.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == text
        info = h.get("/tokenizer_info").json()
        assert info["model_max_length"] == NUM_CTX and "eos_token" in info
        for neither_or_both in ({}, {"content": text, "prompt": text}):
            assert h.post("/tokenize", json=neither_or_both).status_code == 400


#: prompt-token log probabilities against the same figures read another way. llama-cpp-python's ``logits_all``
#: rows run the same batches as the daemon's prefill (measured equal bit for bit on this AVX-512 CPU); a
#: decode's first step runs one row where the prefill ran a batch, which llama.cpp's kernels round apart
#: (measured 0.28 on llama.cpp with the bundled Q4_1 model, 0.0017 on OpenVINO in f32, 0.35 on OpenVINO in bf16 on an
#: Intel Xeon with AVX512_BF16)
SCORE_TOLERANCE = 1e-3
CUT_TOLERANCE = {"llama": 0.75, "openvino": 0.05, "openvino-bf16": 0.75}
SCORED = ("def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n\n\n"
          "def test_add():\n    assert add(2, 3) == 5\n    assert add(-1, 1) == 0\n") * 3


def _scored(front: Front, prompt: str | list[int], k: int, max_tokens: int = 0, stream: bool = False) -> Any:
    ask: dict[str, Any] = {"model": "any", "prompt": prompt, "echo": True, "logprobs": k, "max_tokens": max_tokens,
                           "temperature": 0}
    sdk = front.sdk()
    return list(sdk.completions.create(**ask, stream=True)) if stream else sdk.completions.create(**ask)


def test_a_prompt_scored_through_completions_is_the_engines_own(front: Front) -> None:
    """Prefill-only scoring (``echo``, ``logprobs``, ``max_tokens: 0``, as lm-evaluation-harness asks): every
    prompt token's log probability given the ones before it and the k likeliest tokens there, the first token
    null (the bundled model has no BOS); the same streamed; each figure the model's own: equal to what a decode
    from the prompt cut there reports for its first step (and on llama.cpp, to its own rows read by
    llama-cpp-python), however much of the prompt was resident before."""
    k = 5
    first = _scored(front, SCORED, k)
    lp = first.choices[0].logprobs
    assert first.choices[0].text == SCORED and first.usage.completion_tokens == 0
    n = first.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n > 60
    assert "".join(lp.tokens) == SCORED and lp.text_offset[0] == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, n):
        tops = lp.top_logprobs[j]
        assert len(tops) <= k and lp.token_logprobs[j] <= 0.0  # (two tokens may show as one text)
        assert max(tops.values()) >= lp.token_logprobs[j] - 1e-9
    # the code repeats three times: its later copies are near certain
    assert sum(lp.token_logprobs[-20:]) / 20 > sum(lp.token_logprobs[1:21]) / 20
    # again, now that all of it is resident: the same figures (scored rows are computed again, never reused)
    again = _scored(front, SCORED, k).choices[0].logprobs
    assert again.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    streamed = _scored(front, SCORED, k, stream=True)
    echo = [c for c in streamed if c.choices and c.choices[0].text]
    assert echo[0].choices[0].text == SCORED
    assert echo[0].choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    # with a reply: the prompt's figures, then the reply's, offsets running on
    reply = _scored(front, SCORED, k, max_tokens=4).choices[0]
    assert reply.text.startswith(SCORED) and n < len(reply.logprobs.tokens) <= n + 4
    assert reply.logprobs.token_logprobs[1:n] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    assert reply.logprobs.text_offset[n] == len(SCORED)

    # the decode's own first step from the prompt cut at j: its top-k is what the scoring said at j
    import httpx

    with httpx.Client(base_url=front.url.removesuffix("/v1"), timeout=600,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as h:
        ids = h.post("/tokenize", json={"content": SCORED}).json()["tokens"]
    assert len(ids) == n
    worst = 0.0
    for j in (17, n // 2, n - 1):
        step = front.sdk().completions.create(model="any", prompt=ids[:j], max_tokens=1, logprobs=k, temperature=0)
        top, scored = step.choices[0].logprobs.top_logprobs[0], lp.top_logprobs[j]
        both = set(top) & set(scored)
        assert len(both) >= len(scored) - 1, (j, top, scored)  # (the k-th may trade places at a near tie)
        worst = max([worst, *(abs(top[t] - scored[t]) for t in both)])
    kind = front.daemon.backend
    if kind == "openvino" and openvino_precision() == "bf16":
        kind = "openvino-bf16"
    assert worst <= CUT_TOLERANCE[kind], worst
    print(f"scoring against a decode's first step: {worst:.5f}")

    if front.daemon.backend == "llama":
        from backends.llama.native import open_llama  # the daemon's kernels (its AMX workaround too)

        with front.daemon.client(timeout_s=30.0) as c:
            active = c.status().active
        assert active is not None
        ref = open_llama(active.path, n_ctx=NUM_CTX, n_batch=512, n_ubatch=512, logits_all=True,
                    verbose=False, swa_full=True)
        try:
            theirs = ref.create_completion(SCORED, echo=True, logprobs=k, max_tokens=1, temperature=0)
            assert ref.input_ids[:n].tolist() == ids
            rows = np.asarray(ref.scores[:n], dtype=np.float64)
        finally:
            ref.close()
        lsm = rows - (rows.max(axis=1, keepdims=True)
                      + np.log(np.exp(rows - rows.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True)))
        diff = max(abs(lp.token_logprobs[j] - lsm[j - 1, ids[j]]) for j in range(1, n))
        assert diff <= SCORE_TOLERANCE, diff
        print(f"scoring against llama-cpp-python's logits_all rows: {diff:.6f}")
        # llama-cpp-python's own echo files the distribution after token j under token j (0.3.36): its top-k
        # at j is the daemon's at j + 1, the same texts
        for j in range(1, n - 1):
            assert set(lp.top_logprobs[j + 1]) <= set(theirs["choices"][0]["logprobs"]["top_logprobs"][j]), j
