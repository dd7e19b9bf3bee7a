"""The Responses API (modeld/front/responses.py), driven by the official ``openai`` SDK (``client.responses``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from runtime import Client  # noqa: E402
from tests.test_openai_front import Front, typed_sse  # noqa: E402

SHELL = {"type": "function", "name": "shell", "description": "Run a command.", "strict": False,
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Agents.",
             "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {}}}]}
WEB = {"type": "web_search", "external_web_access": False}


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    with Front(tmp_path_factory.mktemp("responses"), "--memory-token-delay-ms", "2") as f:
        yield f


@pytest.fixture
def client(front: Front) -> Iterator[Any]:
    with front.sdk() as c:
        yield c


def codex_input(*extra: dict[str, Any]) -> list[dict[str, Any]]:
    """What Codex sends first: developer messages, then the user's, as ``input_text`` parts."""
    return [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox: workspace-write"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix calc.py"}]}, *extra]


def test_plain_and_stored(client: Any) -> None:
    out = client.responses.create(model="gpt-5-codex", instructions="You are terse.", input="hi", max_output_tokens=8,
                                  temperature=0)
    assert out.object == "response" and out.model == "ref" and out.status == "incomplete"
    assert out.incomplete_details.reason == "max_output_tokens" and out.usage.output_tokens == 8
    assert [o.type for o in out.output] == ["message"] and out.output_text
    assert client.responses.retrieve(out.id).output_text == out.output_text


def test_streamed_in_the_documented_order(client: Any) -> None:
    events = list(client.responses.create(model="m", input="Name a cache.", max_output_tokens=6, stream=True, temperature=0))
    names = [e.type for e in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert done.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")


def streamed_events(front: Front, body: dict[str, Any]) -> list[Any]:
    """``body`` streamed through the front's ``POST /v1/responses``, every event validated against the front's
    model for its ``type`` (the SSE ``event:`` names it), numbered in order; the events."""
    import httpx
    from pydantic import TypeAdapter

    from modeld.front.responses.protocol import StreamEvent

    adapter: TypeAdapter[Any] = TypeAdapter(StreamEvent)
    with httpx.Client(timeout=600, headers={"Authorization": f"Bearer {front.api_key}"}) as http, \
            http.stream("POST", f"{front.url}/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = typed_sse(r, adapter)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_every_streamed_event_is_its_declared_model(front: Front) -> None:
    """The stream's events and the response they end with, each validated by its model; with log probabilities
    asked, each text delta carries its tokens' and the finished text part all of them."""
    events = streamed_events(front, {"model": "m", "input": "Name a cache.", "max_output_tokens": 6,
                                         "temperature": 0, "include": ["message.output_text.logprobs"]})
    assert [e.type for e in events][:4] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.content_part.added"]
    assert events[0].response.status == "in_progress" and events[0].response.usage is None
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    # each delta with its own token's (the reference backend's tokens are bytes: one a delta here, however the
    # daemon merged decode steps into frames)
    assert deltas and all([lp.token for lp in d.logprobs] == [d.delta] for d in deltas), deltas
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.incomplete_details.reason == "max_output_tokens"
    part = final.output[0].content[0]
    assert part.text == "".join(d.delta for d in deltas) == final.output_text
    assert len(part.logprobs) == final.usage.output_tokens == 6
    assert final.text.format.type == "text" and final.tools == [] and final.store


def test_codex_tools_are_accepted_and_a_call_is_answered(client: Any) -> None:
    """``web_search`` is left out, a ``namespace`` tool is offered by its inner name; a forced call round trips."""
    first = client.responses.create(model="m", instructions="You are Codex.", input=codex_input(), store=False,
                                    tools=[SHELL, WEB, NAMESPACE], tool_choice="auto", parallel_tool_calls=True,
                                    include=["reasoning.encrypted_content"], reasoning={"summary": "auto"},
                                    max_output_tokens=8, extra_body={"prompt_cache_key": "k", "client_metadata": {"a": "b"}})
    assert first.status in ("completed", "incomplete")
    call = {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"cmd": "ls"}'}
    spawned = {"type": "function_call", "call_id": "call_2", "name": "spawn_agent", "namespace": "multi_agent_v1",
               "arguments": "{}"}
    second = client.responses.create(
        model="m", instructions="You are Codex.", store=False, tools=[SHELL, WEB, NAMESPACE], max_output_tokens=8,
        input=codex_input({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                          call, {"type": "function_call_output", "call_id": "call_1", "output": "calc.py"},
                          spawned, {"type": "function_call_output", "call_id": "call_2", "output": "spawned"}))
    # the stateless resend reuses the whole first request
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_previous_response_id_over_three_turns(client: Any) -> None:
    first = client.responses.create(model="m", instructions="You are terse.", input="one", max_output_tokens=5)
    second = client.responses.create(model="m", previous_response_id=first.id, input="two", max_output_tokens=5)
    third = client.responses.create(model="m", previous_response_id=second.id, input="three", max_output_tokens=5)
    for before, after in ((first, second), (second, third)):
        # the stored conversation and its reply are resident: at least the whole earlier input is reused
        assert after.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens + before.usage.output_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", previous_response_id="resp_" + "0" * 32, input="x")


def test_a_stored_turn_renders_as_the_same_items_sent_whole(client: Any) -> None:
    """A function_call sent after a stored reply joins that reply, as it does in one request's items: the
    stateful and the stateless request count the same prompt."""
    first = client.responses.create(model="m", instructions="You are terse.", input="read it", max_output_tokens=4)
    call = {"type": "function_call", "call_id": "call_9", "name": "read_file", "arguments": '{"path": "a.py"}'}
    output = {"type": "function_call_output", "call_id": "call_9", "output": "x = 1"}
    tools = [{"type": "function", "name": "read_file", "parameters": {"type": "object", "properties": {}}}]
    stateful = client.responses.create(model="m", instructions="You are terse.", previous_response_id=first.id,
                                       input=[call, output], tools=tools, max_output_tokens=1)
    whole = [{"type": "message", "role": "user", "content": "read it"},
             *[o.model_dump(exclude_none=True) for o in first.output], call, output]
    stateless = client.responses.create(model="m", instructions="You are terse.", input=whole, tools=tools,
                                        max_output_tokens=1, store=False)
    assert stateful.usage.input_tokens == stateless.usage.input_tokens


def test_get_and_delete(client: Any) -> None:
    out = client.responses.create(model="m", input="keep me", max_output_tokens=3)
    assert client.responses.retrieve(out.id).id == out.id
    assert client.responses.delete(out.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)


def test_cancel_cuts_a_running_response_short(front: Front, client: Any) -> None:
    """POST /v1/responses/{id}/cancel stops the decode: the stream ends at once, as a cancelled response."""
    events = iter(client.responses.create(model="m", input="Go on.", max_output_tokens=2000, stream=True,
                                          temperature=0))
    created = next(events)
    assert created.type == "response.created"
    rid = created.response.id
    assert next(e for e in events if e.type == "response.output_text.delta").delta  # the reply is streaming
    with front.sdk() as other:
        assert other.responses.cancel(rid).status == "cancelled"
    last = list(events)[-1]
    assert last.type == "response.incomplete" and last.response.status == "cancelled"
    assert 0 < len(last.response.output_text) < 2000
    assert client.responses.retrieve(rid).status == "cancelled"
    again = client.responses.cancel(rid)  # finished now: the stored response, whole, not a reference
    assert again.status == "cancelled" and again.output_text == last.response.output_text
    assert again.model_dump(exclude_unset=True) == last.response.model_dump(exclude_unset=True)
    with Client(front.daemon.endpoint, timeout_s=10.0) as c:
        assert not c.status().session_open  # the slot is free


def test_input_tokens_counts_what_the_reply_counts(client: Any) -> None:
    args: dict[str, Any] = {"model": "m", "instructions": "Count.", "input": codex_input(), "tools": [SHELL]}
    counted = client.responses.input_tokens.count(**args)
    out = client.responses.create(**args, max_output_tokens=2, store=False)
    assert counted.input_tokens == out.usage.input_tokens


def test_an_oversized_input_is_refused_before_prefill(client: Any) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as exc:
            client.responses.create(model="m", input="word " * 5000, stream=stream)
        assert exc.value.code == "context_length_exceeded"


def test_input_items_are_read_by_type_and_a_malformed_one_is_a_400_naming_it(client: Any) -> None:
    """Each input item is validated by the model for its ``type`` (a message when it has none): a call without
    its id is refused naming the field; an item of a type this daemon does not read (a hosted tool's call) is left
    out of the prompt, and the request is served as if it were not there."""
    call = {"type": "function_call", "call_id": "", "name": "shell", "arguments": "{}"}
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="m", input=[{"role": "user", "content": "hi"}, call], max_output_tokens=2)
    assert bad.value.body["param"] == "input.1.function_call.call_id", bad.value.body
    with pytest.raises(openai.BadRequestError) as role:
        client.responses.create(model="m", input=[{"role": "tool", "content": "hi"}], max_output_tokens=2)
    assert role.value.body["param"] == "input.0.message.role", role.value.body
    for endpoint in (client.responses.create, client.responses.input_tokens.count):
        with pytest.raises(openai.BadRequestError) as odd:  # a type that is no text (found by make fuzz)
            endpoint(model="m", input=[{"type": {}}])
        assert odd.value.body["param"] == "input.0.other.type", odd.value.body
    plain = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    hosted = {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search", "query": "x"}}
    alone = client.responses.create(model="m", input=plain, max_output_tokens=2, store=False)
    beside = client.responses.create(model="m", input=[hosted, *plain], max_output_tokens=2, store=False)
    assert beside.usage.input_tokens == alone.usage.input_tokens
