"""The Anthropic Messages API (modeld/front/anthropic.py), driven by the official ``anthropic`` SDK against real daemons."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
anthropic = pytest.importorskip("anthropic")

from tests.test_openai_front import PNG_1PX, Front, typed_sse  # noqa: E402

BILLING = "x-anthropic-billing-header: cc_version=2.1.197.322; cc_entrypoint=sdk-cli; cch={n};"
READ = {"name": "Read", "description": "Read a file of the repository.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


def system(n: int) -> list[dict[str, Any]]:
    """Claude Code's system blocks: a billing header that changes every request, then its prompt, marked for caching."""
    return [{"type": "text", "text": BILLING.format(n=n)},
            {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}]


def sdk(front: Front, api_key: str = "none") -> Any:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{front.port}", api_key=api_key, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    with Front(tmp_path_factory.mktemp("anthropic"), "--memory-token-delay-ms", "2") as f:
        yield f


@pytest.fixture
def client(front: Front) -> Iterator[Any]:
    with sdk(front) as c:
        yield c


def test_every_finish_reason_maps_to_a_stop_reason_the_api_allows() -> None:
    """Each reason a decode can end with has a stop_reason the SDK accepts; a cancelled reply is not reported as
    one the model ended ("end_turn")."""
    from typing import get_args

    from anthropic.types import StopReason

    from contract.types import FinishReason
    from modeld.front.anthropic import STOP_REASONS

    assert set(STOP_REASONS) == set(get_args(FinishReason)) - {""}
    assert set(STOP_REASONS.values()) <= set(get_args(StopReason))
    assert STOP_REASONS["cancelled"] != STOP_REASONS["stop"]


def test_plain_reply(client: Any) -> None:
    out = client.messages.create(model="claude-opus-5", max_tokens=12, system=system(0),
                                     messages=[{"role": "user", "content": "hi"}], extra_body={"temperature": 0})
    assert out.type == "message" and out.role == "assistant" and out.model == "ref"
    assert out.stop_reason == "max_tokens" and out.usage.output_tokens == 12
    assert [b.type for b in out.content] == ["text"] and out.content[0].text


def test_streamed_in_the_documented_order(client: Any) -> None:
    plain = client.messages.create(model="m", max_tokens=10, system=system(1), extra_body={"temperature": 0},
                                       messages=[{"role": "user", "content": "Name one cache."}])
    order: list[str] = []
    with client.messages.stream(model="m", max_tokens=10, system=system(2), extra_body={"temperature": 0},
                                    messages=[{"role": "user", "content": "Name one cache."}]) as stream:
        for event in stream:
            if event.type in ("message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"):
                order.append(event.type)
            elif event.type == "content_block_delta":
                order.append(event.delta.type)
        final = stream.get_final_message()
    assert order[0] == "message_start" and order[1] == "content_block_start" and order[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(order[2:-3]) == {"text_delta"}
    # the billing header changed between the two: the reply (greedy) and the reuse are untouched
    assert final.content[0].text == plain.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.cache_read_input_tokens == plain.usage.input_tokens + plain.usage.cache_read_input_tokens


def test_every_streamed_event_is_its_declared_model(front: Front) -> None:
    """Each event of a stream validates against the front's model for its ``type`` (the SSE ``event:`` names it):
    message_start, ping, the content block's start, deltas and stop, message_delta with the stop reason and the
    usage, message_stop."""
    import httpx
    from pydantic import TypeAdapter

    from modeld.front.anthropic.protocol import StreamEvent

    events = TypeAdapter(StreamEvent)
    body = {"model": "m", "max_tokens": 6, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Name one cache."}]}
    with httpx.Client(timeout=600) as http, http.stream(
            "POST", f"{front.url}/messages", json=body,
            headers={"x-api-key": "none", "anthropic-version": "2023-06-01"}) as r:
        seen = typed_sse(r, events)
    assert [e.type for e in seen][:2] == ["message_start", "ping"]
    assert [e.type for e in seen][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    final = seen[-2]
    assert final.delta.stop_reason == "max_tokens" and final.usage.output_tokens == 6  # type: ignore[union-attr]


def test_tool_use_over_four_turns_keeps_the_prefix_whatever_the_billing_header(client: Any) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Read a.py"}]
    previous_prompt = 0
    for turn in range(4):
        out = client.messages.create(model="claude-haiku-4-5", max_tokens=8, system=system(100 + turn), tools=[READ],
                                     messages=messages, extra_body={"temperature": 0})
        prompt = out.usage.input_tokens + out.usage.cache_read_input_tokens
        if turn:
            # everything the previous request sent is reused, though its first system block changed
            assert out.usage.cache_read_input_tokens >= previous_prompt, (turn, out.usage)
        previous_prompt = prompt
        call_id = f"toolu_{turn:04d}"
        messages += [
            {"role": "assistant", "content": [{"type": "text", "text": out.content[0].text},
                                              {"type": "tool_use", "id": call_id, "name": "Read", "input": {"path": f"f{turn}.py"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": f"body {turn}"},
                                         {"type": "text", "text": "and next?"}]},
        ]


def test_count_tokens_equals_the_counted_prompt(client: Any) -> None:
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    counted = client.messages.count_tokens(model="m", system=system(7), tools=[READ], messages=messages)
    out = client.messages.create(model="m", max_tokens=4, system=system(8), tools=[READ], messages=messages)
    assert counted.input_tokens == out.usage.input_tokens + out.usage.cache_read_input_tokens


def test_refusals_are_anthropic_errors(client: Any) -> None:
    with pytest.raises(anthropic.BadRequestError) as overflow:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "word " * 5000}])
    assert overflow.value.body["type"] == "error" and overflow.value.body["error"]["type"] == "invalid_request_error"
    assert "context window is 4096" in overflow.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as image:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_1PX}}]}])
    assert "text only" in image.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "robot", "content": "hi"}])  # type: ignore[typeddict-item]
    assert "messages.0.role" in bad.value.body["error"]["message"]


def test_max_tokens_32000_is_a_cap(client: Any) -> None:
    out = client.messages.create(model="m", max_tokens=32000, messages=[{"role": "user", "content": "hi"}])
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens + out.usage.output_tokens <= 4096


def test_claude_codes_first_requests(front: Front) -> None:
    """HEAD / first, then ``?beta=true`` with beta headers and fields the daemon does not act on."""
    c = http.client.HTTPConnection("127.0.0.1", front.port, timeout=30)
    try:
        c.request("HEAD", "/")
        r = c.getresponse()
        r.read()
        assert r.status == 200
        body = {"model": "claude-sonnet-4-5", "max_tokens": 32000, "stream": False, "system": system(9),
                "messages": [{"role": "system", "content": "Mid-conversation note."}, {"role": "user", "content": "hi"}],
                "thinking": {"type": "adaptive"}, "metadata": {"user_id": "u"}, "context_management": {"edits": []},
                "output_config": {"effort": "low"}, "tools": [READ, {"type": "web_search_20250305", "name": "web_search"}]}
        c.request("POST", "/v1/messages?beta=true", json.dumps(body),
                  {"content-type": "application/json", "anthropic-version": "2023-06-01",
                   "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14", "x-api-key": "k"})
        r = c.getresponse()
        out = json.loads(r.read())
    finally:
        c.close()
    assert r.status == 200 and out["type"] == "message" and out["stop_reason"] in ("end_turn", "max_tokens")


def test_x_api_key_is_accepted(tmp_path: Path) -> None:
    with Front(tmp_path, "--api-key", "s3cret") as f:
        with sdk(f, "wrong") as wrong_key, pytest.raises(anthropic.AuthenticationError) as wrong:
            wrong_key.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert wrong.value.body["error"]["type"] == "authentication_error"
        with sdk(f, "s3cret") as right:
            out = right.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert out.usage.output_tokens == 2
