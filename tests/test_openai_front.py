"""The HTTP front (modeld/front) on the reference backend, driven by the official ``openai`` SDK against real daemons."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from contract.types import EmbedRequest  # noqa: E402
from harness.daemon import ROOT, DaemonProcess, free_port, wait_http, wait_until  # noqa: E402
from runtime import Client  # noqa: E402

SYSTEM = {"role": "system", "content": "You are a terse coding assistant."}


#: a 1x1 PNG, base64
PNG_1PX = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8/5+hHgAHggJ/PchI7wAAAABJRU5ErkJggg=="


class Front:
    def __init__(self, tmp: Path, *extra: str, backend: str = "memory") -> None:
        self.port = free_port()
        model = ["--model", "/models/ref", "--model-name", "ref"] if backend == "memory" else []
        self.daemon = DaemonProcess(tmp, backend, None, *model, "--http", f"127.0.0.1:{self.port}", *extra)
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.api_key = extra[extra.index("--api-key") + 1] if "--api-key" in extra else "none"
        #: the SDK clients made for it, closed with it (their pooled sockets would otherwise be closed by the
        #: garbage collector, in whatever test runs then, as a ResourceWarning)
        self._sdks: list[openai.OpenAI] = []

    def __enter__(self) -> Front:
        self.daemon.start(wait_state=("Ready",))  # the preloaded model is in
        wait_http(self.port)
        return self

    def __exit__(self, *exc: object) -> None:
        for sdk in self._sdks:
            sdk.close()
        self.daemon.stop()

    def sdk(self, api_key: str | None = None) -> openai.OpenAI:
        # the timeout is a ceiling for a daemon that never answers, not a measure of speed: on a machine busy
        # with other work a 3-s reply took over 60 s (llama.cpp's threads wait on each other when the cores
        # are taken), and the test is about the reply, not the machine
        sdk = openai.OpenAI(base_url=self.url, api_key=api_key or self.api_key, max_retries=0, timeout=600)
        self._sdks.append(sdk)
        return sdk


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    with Front(tmp_path_factory.mktemp("front"), "--memory-token-delay-ms", "5") as f:
        yield f


def _get(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        c.request(method, path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def _post_json(port: int, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        c.request("POST", path, json.dumps(body), {"content-type": "application/json", "x-api-key": "none",
                                                   "authorization": "Bearer none"})
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


def test_every_reply_has_the_shape_the_schema_declares(front: Front) -> None:
    """Each route's reply validates against the model ``/openapi.json`` declares for its status (the same check
    ``make fuzz`` runs with schemathesis on generated requests), replies and refusals, on each API."""
    from modeld.front.anthropic import protocol as messages
    from modeld.front.app import Health
    from modeld.front.completions import protocol as completions
    from modeld.front.openai import protocol as chat
    from modeld.front.responses import protocol as responses
    from modeld.front.tokens import protocol as tokens

    status, raw = _get(front.port, "/openapi.json")
    spec = json.loads(raw)
    declared = spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "500", "503"} <= set(declared)
    assert declared["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletion")
    assert "text/event-stream" in declared["200"]["content"]
    ask = [{"role": "user", "content": "hi"}]
    cases: list[tuple[str, dict[str, Any], int, type[Any]]] = [
        ("/v1/chat/completions", {"model": "ref", "messages": ask, "max_tokens": 4}, 200, chat.ChatCompletion),
        ("/v1/chat/completions", {"model": "ref", "messages": ask, "max_tokens": 4, "logprobs": True,
                                  "top_logprobs": 2}, 200, chat.ChatCompletion),
        ("/v1/chat/completions", {"model": "ref", "messages": "no"}, 400, chat.ErrorBody),
        ("/v1/messages", {"model": "ref", "messages": ask, "max_tokens": 4}, 200, messages.MessageOut),
        ("/v1/messages", {"model": "ref", "messages": "no", "max_tokens": 4}, 400, messages.ErrorBody),
        ("/v1/messages/count_tokens", {"model": "ref", "messages": ask}, 200, messages.TokenCount),
        ("/v1/responses", {"model": "ref", "input": "hi", "max_output_tokens": 4}, 200, responses.Response),
        ("/v1/responses", {"model": "ref", "input": 5}, 400, chat.ErrorBody),
        ("/v1/responses/input_tokens", {"model": "ref", "input": "hi"}, 200, responses.InputTokens),
        ("/v1/completions", {"model": "ref", "prompt": "def f(", "max_tokens": 4, "logprobs": 1}, 200,
         completions.Completion),
        ("/v1/completions", {"model": "ref", "prompt": 5}, 400, chat.ErrorBody),
        ("/v1/completions", {"model": "ref", "prompt": "def f(", "max_tokens": 0, "logprobs": 1, "echo": True}, 200,
         completions.Completion),
        ("/tokenize", {"content": "héllo"}, 200, tokens.TokenizeOut),
        ("/tokenize", {"prompt": "héllo", "add_special_tokens": False}, 200, tokens.TokenizeOut),
        ("/tokenize", {}, 400, chat.ErrorBody),
        ("/detokenize", {"tokens": [104, 105]}, 200, tokens.DetokenizeOut),
        ("/detokenize", {"tokens": [104, 256]}, 400, chat.ErrorBody),
    ]
    for path, body, want, shape in cases:
        status, reply = _post_json(front.port, path, body)
        assert status == want, (path, body, reply)
        shape.model_validate(reply)
    # the reference backend's tokens are the text's UTF-8 bytes
    assert _post_json(front.port, "/tokenize", {"content": "héllo"})[1] == {"tokens": list("héllo".encode()), "count": 6}
    assert _post_json(front.port, "/detokenize", {"tokens": [104, 105]})[1] == {"content": "hi", "prompt": "hi"}
    status, raw = _get(front.port, "/tokenizer_info")
    assert status == 200
    tokens.TokenizerInfo.model_validate(json.loads(raw))
    stored = _post_json(front.port, "/v1/responses", {"model": "ref", "input": "hi", "max_output_tokens": 4})[1]
    status, raw = _get(front.port, f"/v1/responses/{stored['id']}")
    assert status == 200
    responses.Response.model_validate(json.loads(raw))
    status, raw = _get(front.port, f"/v1/responses/{stored['id']}", "DELETE")
    assert status == 200
    responses.DeletedResponse.model_validate(json.loads(raw))
    status, raw = _get(front.port, "/v1/models")
    chat.ModelList.model_validate(json.loads(raw))
    status, raw = _get(front.port, "/health")
    Health.model_validate(json.loads(raw))


def test_models_health_and_root(front: Front) -> None:
    models = front.sdk().models.list().data
    assert [m.id for m in models] == ["ref"]
    # created: when the daemon loaded the model, as Unix seconds
    with Client(front.daemon.endpoint, timeout_s=10.0) as c:
        active = c.status().active
    assert active is not None and active.loaded_at > 0
    assert models[0].created == int(active.loaded_at) <= time.time()
    status, raw = _get(front.port, "/health")
    body = json.loads(raw)
    assert status == 200 and body["status"] == "ok" and body["model"] == "ref"
    # clients probe the root before anything else (Claude Code sends HEAD /)
    assert _get(front.port, "/", "HEAD") == (200, b"")
    status, raw = _get(front.port, "/")
    assert status == 200 and json.loads(raw)["name"] == "modeld"
    status, raw = _get(front.port, "/openapi.json")
    assert status == 200 and "/v1/chat/completions" in json.loads(raw)["paths"]


def test_created_is_the_load_time_else_the_files(tmp_path: Path) -> None:
    from contract.types import ActiveModel
    from modeld.front.core import created_at

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    os.utime(model, (1_600_000_000, 1_600_000_000))
    assert created_at(ActiveModel(path=str(model), loaded_at=1_700_000_000.5)) == 1_700_000_000
    assert created_at(ActiveModel(path=str(model))) == 1_600_000_000  # a daemon that does not say when
    assert created_at(ActiveModel(path=str(tmp_path / "elsewhere.gguf"))) == 0  # not on this machine


def test_every_finish_reason_maps_to_one_the_api_allows() -> None:
    """Each reason a decode can end with has a chat-completions value the SDK accepts; a cancelled reply is not
    reported as one the model ended ("stop")."""
    from typing import get_args

    from openai.types.chat.chat_completion import Choice

    from contract.types import FinishReason
    from modeld.front.core import FINISH_REASONS

    allowed = set(get_args(Choice.model_fields["finish_reason"].annotation))
    assert set(FINISH_REASONS) == set(get_args(FinishReason)) - {""}
    assert set(FINISH_REASONS.values()) <= allowed, allowed
    assert FINISH_REASONS["cancelled"] != FINISH_REASONS["stop"]


def test_chat_plain_then_warm(front: Front) -> None:
    sdk = front.sdk()
    history = [SYSTEM, {"role": "user", "content": "What does slot.py do?"}]
    first = sdk.chat.completions.create(model="ref", messages=history, max_tokens=8)
    msg = first.choices[0].message
    assert msg.role == "assistant" and msg.content and first.choices[0].finish_reason == "length"
    assert first.usage is not None and first.usage.completion_tokens == 8
    assert first.usage.prompt_tokens_details is not None and first.usage.prompt_tokens_details.cached_tokens == 0
    history += [{"role": "assistant", "content": msg.content}, {"role": "user", "content": "And server.py?"}]
    second = sdk.chat.completions.create(model="ref", messages=history, max_tokens=8)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    # the whole first request and its reply came from the KV
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens + 8


def test_chat_streamed_with_usage(front: Front) -> None:
    sdk = front.sdk()
    messages = [SYSTEM, {"role": "user", "content": "Name one cache."}]
    plain = sdk.chat.completions.create(model="ref", messages=messages, max_tokens=10, temperature=0)
    stream = sdk.chat.completions.create(model="ref", messages=messages, max_tokens=10, stream=True, temperature=0,
                                         stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == plain.choices[0].message.content and finish == "length"
    assert usage is not None and usage.completion_tokens == 10
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens


def test_every_streamed_chunk_is_the_declared_chunk(front: Front) -> None:
    """Each ``chat.completion.chunk`` of a stream (with log probabilities and the usage chunk) validates against
    the front's ``ChatCompletionChunk``; the role chunk opens it, one chunk carries the finish, the last the usage."""
    import httpx

    from modeld.front.openai.protocol import ChatCompletionChunk

    body = {"model": "ref", "messages": [SYSTEM, {"role": "user", "content": "Name one cache."}], "max_tokens": 6,
            "stream": True, "logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=600) as http, http.stream("POST", f"{front.url}/chat/completions", json=body) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate_json(d) for d in data[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert not chunks[-1].choices and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    scored = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    assert len(scored) == 6 and all(1 <= len(t.top_logprobs) <= 2 for t in scored)


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_a_stream_sends_a_delta_a_decode_step_though_the_daemon_merges_frames(front: Front, api: str) -> None:
    """At 5 ms a token the daemon merges ~10 steps a frame (its 50-ms stream interval); each API still sends a
    delta a step, as a server that sends a frame a token does. (litellm, under aider and mini-swe-agent, ends a
    stream after 100 equal deltas: a reply that repeats a few tokens made them when merged frames were sent.)"""
    sdk = front.sdk()
    deltas: list[str] = []
    if api == "chat":
        for chunk in sdk.chat.completions.create(model="ref", messages=[SYSTEM, {"role": "user", "content": "Go on."}],
                                                 max_tokens=120, stream=True, temperature=0):
            if chunk.choices and chunk.choices[0].delta.content:
                deltas.append(chunk.choices[0].delta.content)
    elif api == "responses":
        for event in sdk.responses.create(model="ref", input="Go on.", max_output_tokens=120, stream=True, store=False):
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
    else:
        anthropic = pytest.importorskip("anthropic")
        client = anthropic.Anthropic(base_url=front.url.removesuffix("/v1"), api_key="none", max_retries=0)
        for ev in client.messages.create(model="ref", max_tokens=120, messages=[{"role": "user", "content": "Go on."}],
                                         stream=True):
            if ev.type == "content_block_delta" and ev.delta.type == "text_delta":
                deltas.append(ev.delta.text)
    # the reference backend's token is one character of text
    assert len(deltas) == 120 and all(len(d) == 1 for d in deltas), deltas


def test_tool_turns_are_accepted(front: Front) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "slot.py"}'}}
    tool = {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {}}}}
    out = front.sdk().chat.completions.create(
        model="ref", tools=[tool], max_tokens=4,
        messages=[SYSTEM, {"role": "user", "content": "Read slot.py"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "class SlotService: ..."}],
    )
    assert out.usage is not None and out.usage.completion_tokens == 4


def test_no_max_tokens_decodes_to_the_end_of_generation(front: Front) -> None:
    out = front.sdk().chat.completions.create(model="ref", messages=[SYSTEM, {"role": "user", "content": "hi"}])
    # the reference ends a reply after a few words, as a model's end of generation does: no hidden limit cut it
    assert out.choices[0].finish_reason == "stop" and out.usage is not None and out.usage.completion_tokens > 0


def test_a_request_with_no_sampling_parameters_samples(front: Front) -> None:
    sdk = front.sdk()
    messages = [SYSTEM, {"role": "user", "content": "Name a cache."}]
    sampled = {sdk.chat.completions.create(model="ref", messages=messages, max_tokens=30).choices[0].message.content
               for _ in range(3)}
    greedy = {sdk.chat.completions.create(model="ref", messages=messages, max_tokens=30, temperature=0).choices[0].message.content
              for _ in range(2)}
    assert len(sampled) > 1 and len(greedy) == 1


def test_model_names_agents_send_are_served_by_the_loaded_model(front: Front) -> None:
    sdk = front.sdk()
    for name in ("gpt-4o", "claude-sonnet-4-5", "claude-haiku-4-5", "modeld"):
        out = sdk.chat.completions.create(model=name, messages=[SYSTEM, {"role": "user", "content": "hi"}], max_tokens=2)
        assert out.model == "ref"  # the reply names the model that answered


def test_strict_model_names_and_aliases(tmp_path: Path) -> None:
    with Front(tmp_path, "--strict-model-names", "--alias", "gpt-4o=ref") as f:
        sdk = f.sdk()
        with pytest.raises(openai.NotFoundError) as missing:
            sdk.chat.completions.create(model="gpt-7", messages=[SYSTEM, {"role": "user", "content": "hi"}], max_tokens=2)
        assert "gpt-7" in missing.value.message and "gpt-4o" in missing.value.message
        out = sdk.chat.completions.create(model="gpt-4o", messages=[SYSTEM, {"role": "user", "content": "hi"}], max_tokens=2)
        assert out.model == "ref"
        assert [m.id for m in sdk.models.list()] == ["ref", "gpt-4o"]


def test_max_tokens_is_the_reply_length_of_requests_that_set_none(tmp_path: Path) -> None:
    """``serve --max-tokens`` (llama-server's ``--n-predict``) bounds a reply whose request sets no limit, on every
    API that lets a request leave it unset; a request's own limit, lower or higher, is kept."""
    long = [SYSTEM, {"role": "user", "content": "Talk at length."}]
    with Front(tmp_path, "--max-tokens", "7") as f:
        sdk = f.sdk()
        out = sdk.chat.completions.create(model="ref", messages=long)  # type: ignore[arg-type]
        assert out.usage is not None and out.usage.completion_tokens == 7 and out.choices[0].finish_reason == "length"
        out = sdk.chat.completions.create(model="ref", messages=long, max_tokens=3)  # type: ignore[arg-type]
        assert out.usage is not None and out.usage.completion_tokens == 3
        out = sdk.chat.completions.create(model="ref", messages=long, max_tokens=12)  # type: ignore[arg-type]
        assert out.usage is not None and out.usage.completion_tokens == 12
        greedy = sdk.chat.completions.create(model="ref", messages=long, temperature=0)  # type: ignore[arg-type]
        assert greedy.usage is not None and greedy.usage.completion_tokens == 7
        reply = sdk.responses.create(model="ref", input="Talk at length.", store=False)
        assert reply.usage is not None and reply.usage.output_tokens == 7 and reply.status == "incomplete"


def test_the_access_log_has_a_line_per_request(front: Front) -> None:
    sdk = front.sdk()
    sdk.chat.completions.create(model="someone", messages=[SYSTEM, {"role": "user", "content": "log me"}], max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model="ref", messages=[])
    lines = front.daemon.wait_lines(lambda ln: "modeld.access" in ln and " 400 " in ln)  # (written after the reply)
    lines = [ln for ln in front.daemon.log().splitlines() if "modeld.access" in ln]
    ok = [ln for ln in lines if "POST /v1/chat/completions 200" in ln and "completion_tokens=3" in ln]
    assert ok and "model=ref" in ok[-1] and "prompt_tokens=" in ok[-1] and "total_ms=" in ok[-1]
    assert "log me" not in front.daemon.log()  # never the content
    bad = [ln for ln in lines if "POST /v1/chat/completions 400" in ln]
    assert bad and "error=invalid_request" in bad[-1]


def test_errors_are_openai_errors(front: Front) -> None:
    sdk = front.sdk()
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model="ref", messages=[SYSTEM, {"role": "tool", "tool_call_id": "x", "content": "r"}])
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as overflow:  # an HTTP status, streamed or not
            sdk.chat.completions.create(model="ref", messages=[SYSTEM, {"role": "user", "content": "word " * 5000}],
                                        stream=stream)
        assert overflow.value.code == "context_length_exceeded"
        said = re.search(r"the prompt is (\d+) tokens but the model's context window is 4096", overflow.value.message)
        assert said is not None and int(said.group(1)) > 25_000  # the prompt's real size, counted before any prefill
    with pytest.raises(openai.BadRequestError) as image:  # a model that reads text only (tests/test_images.py)
        sdk.chat.completions.create(model="ref", messages=[SYSTEM, {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG_1PX}}]}])
    assert image.value.code == "vision_unsupported"
    with pytest.raises(openai.BadRequestError) as audio:
        sdk.chat.completions.create(model="ref", messages=[SYSTEM, {"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}])
    assert audio.value.code == "unsupported_content"
    with pytest.raises(openai.BadRequestError) as bad_field:
        sdk.chat.completions.create(model="ref", messages=[SYSTEM, {"role": "user", "content": "hi"}], temperature=-1)
    assert bad_field.value.param == "temperature"
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model="ref", messages=[SYSTEM, {"role": "user", "content": "hi"}], n=2)
    for refused, param in (({"prompt": ["a", "b"]}, "prompt"), ({"prompt": "a", "n": 2}, "n"),
                           ({"prompt": "a", "suffix": "b"}, "suffix"), ({"prompt": "a", "echo": True, "logprobs": 21}, "logprobs"),
                           ({"prompt": "a", "logprobs": 21}, "logprobs"), ({"prompt": ""}, "prompt"),
                           ({"prompt": [[]]}, "prompt")):
        with pytest.raises(openai.BadRequestError) as legacy:
            sdk.completions.create(model="ref", **refused)
        assert legacy.value.param == param
    for asked in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):  # (OpenAI's rules and limit)
        with pytest.raises(openai.BadRequestError) as logprobs:
            sdk.chat.completions.create(model="ref", messages=[SYSTEM, {"role": "user", "content": "hi"}], **asked)
        assert logprobs.value.param == "top_logprobs"
    for path, body in (("/v1/completions", {"model": "ref", "prompt": [2**70]}), ("/detokenize", {"tokens": [2**70]})):
        assert _post_json(front.port, path, body)[0] == 400  # an id no encoder holds: refused at the edge
    with pytest.raises(openai.BadRequestError):  # the reference cannot constrain output: refused, not ignored
        sdk.chat.completions.create(model="ref", messages=[SYSTEM, {"role": "user", "content": "hi"}],
                                    response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError):  # the reference has no embedding model
        sdk.embeddings.create(model="ref", input="hello")
    # and the front keeps serving
    assert sdk.chat.completions.create(model="ref", messages=[SYSTEM, {"role": "user", "content": "hi"}], max_tokens=2).choices


#: request bodies that once made the front answer 500 (or were accepted with a loose type): each a 400
MALFORMED = {
    "seed": {"seed": 2**70},
    "stop": {"stop": 5},
    "tools": {"tools": 5},
    "stream_options": {"stream_options": "x"},
    "response_format.json_schema": {"response_format": {"type": "json_schema", "json_schema": "x"}},
    "tools.0.function": {"tools": [{"function": "x"}]},
    "tool_choice": {"tool_choice": {"type": "function", "function": "read_file"}},
    "n": {"n": True},
    "stream": {"stream": "yes"},
    "max_tokens": {"max_tokens": "5"},
}


def _post(front: Front, path: str, body: bytes, **headers: str) -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/json", **headers})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


@pytest.mark.parametrize("field", sorted(MALFORMED))
def test_a_malformed_field_is_a_400_naming_it(front: Front, field: str) -> None:
    body = {"model": "ref", "messages": [SYSTEM, {"role": "user", "content": "hi"}], "max_tokens": 2, **MALFORMED[field]}
    status, answer = _post(front, "/v1/chat/completions", json.dumps(body).encode())
    error = answer["error"]
    assert status == 400 and isinstance(error, dict) and str(error["param"]).startswith(field.split(".")[0]), answer


@pytest.mark.parametrize("body", [{"input": 5}, {"input": []}, {"input": [1, 2]}, {"input": ["a", None]}, {}])
def test_a_malformed_embeddings_input_is_a_400_naming_it(front: Front, body: dict[str, object]) -> None:
    status, answer = _post(front, "/v1/embeddings", json.dumps({"model": "ref", **body}).encode())
    error = answer["error"]
    assert status == 400 and isinstance(error, dict) and str(error["param"]).startswith("input"), answer


def test_framework_refusals_are_api_errors(front: Front) -> None:
    """A body the parser refuses (JSON nested 2,000 deep) and an unknown route answer in each API's shape."""
    deep = b'{"model": "ref", "messages": ' + b"[" * 2000 + b"]" * 2000 + b"}"
    status, answer = _post(front, "/v1/chat/completions", deep)
    assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer  # type: ignore[index]
    status, answer = _post(front, "/v1/messages", deep)
    assert status == 400 and answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error", answer  # type: ignore[index]
    status, answer = _post(front, "/v1/nothing", b"{}")
    assert status == 404 and "/v1/nothing" in answer["error"]["message"], answer  # type: ignore[index]
    # and the front keeps serving
    assert front.sdk().chat.completions.create(model="ref", messages=[SYSTEM, {"role": "user", "content": "hi"}],
                                               max_tokens=2).choices


@pytest.mark.parametrize(("details", "prompt"), [({"prompt_tokens": 9000, "num_ctx": 8192}, 9000),
                                                ({"requested_tokens": 100, "prefix_tokens": 8150, "num_ctx": 8192}, 8250),
                                                ({"prefix_tokens": 9001, "num_ctx": 8192}, 9001)])
def test_a_context_overflow_reads_as_each_api_says_it(details: dict[str, int], prompt: int) -> None:
    """However the overflow was found (the front's count, a suffix or a prefix past the window), both APIs lead
    with their own sentence and keep the daemon's; without numbers the daemon's message stands alone."""
    from contract.errors import ContextOverflow
    from modeld.front.anthropic.protocol import error_body as anthropic_error
    from modeld.front.errors import api_error
    from modeld.front.openai.protocol import error_body as openai_error

    err = api_error(ContextOverflow("it does not fit", **details))
    assert err.status == 400 and err.code == "context_length_exceeded"
    assert openai_error(err).error.message == (f"This model's maximum context length is 8192 tokens. However, your "
                                               f"messages resulted in {prompt} tokens: it does not fit")
    assert anthropic_error(err).error.message == f"prompt is too long: {prompt} tokens > 8191 maximum: it does not fit"
    assert anthropic_error(err).error.code == openai_error(err).error.code == "context_length_exceeded"
    bare = api_error(ContextOverflow("it does not fit"))
    assert openai_error(bare).error.message == anthropic_error(bare).error.message == "it does not fit"


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_a_client_that_disconnects_cancels_its_decode(front: Front, api: str) -> None:
    sdk = front.sdk()
    route = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}[api]

    def cancelled() -> list[str]:
        return [ln for ln in front.daemon.log().splitlines() if "modeld.access" in ln and f"POST {route} " in ln
                and "finish_reason=cancelled" in ln]

    before = len(cancelled())
    stream: Any
    if api == "chat":
        stream = sdk.chat.completions.create(model="ref", messages=[SYSTEM, {"role": "user", "content": "Talk at length."}],
                                             max_tokens=3000, stream=True)
    elif api == "responses":
        stream = sdk.responses.create(model="ref", input="Talk at length.", max_output_tokens=3000, stream=True,
                                      store=False)
    else:
        anthropic = pytest.importorskip("anthropic")
        stream = anthropic.Anthropic(base_url=front.url.removesuffix("/v1"), api_key="none", max_retries=0).messages.create(
            model="ref", max_tokens=3000, messages=[{"role": "user", "content": "Talk at length."}], stream=True)
    texts = 0
    for chunk in stream:  # read until the reply's text has begun
        texts += _text_delta(chunk)
        if texts >= 3:
            break
    stream.close()
    # the access line says what the abandoned turn did: its prompt, the tokens it wrote before it was cut short
    # (the decode of 3000 tokens was cancelled, not run to its end) and when the first came, and that the client
    # left; it is written once the response ended
    found = front.daemon.wait_lines(lambda ln: "modeld.access" in ln and f"POST {route} " in ln
                                    and "finish_reason=cancelled" in ln, before + 1)[before:]
    assert "error=client_gone" in found[-1], found
    fields = dict(kv.split("=", 1) for kv in found[-1].split() if "=" in kv)
    assert int(fields.get("prompt_tokens", 0)) > 0, found[-1]
    assert 3 <= int(fields["completion_tokens"]) < 3000, found[-1]
    assert float(fields["ttft_ms"]) > 0, found[-1]
    slot_free(front)
    out = sdk.chat.completions.create(model="ref", messages=[SYSTEM, {"role": "user", "content": "hi"}], max_tokens=2)
    assert out.usage is not None and out.usage.completion_tokens == 2


def _text_delta(chunk: Any) -> bool:
    """Whether a streamed event of any of the three APIs (as its SDK gives it) carries a piece of the reply's text."""
    kind = getattr(chunk, "type", "")
    if kind in ("response.output_text.delta", "content_block_delta"):
        return True
    choices = getattr(chunk, "choices", None)
    return bool(choices and choices[0].delta.content)


def typed_sse(response: Any, events: Any) -> list[Any]:
    """A streamed reply's SSE events (an httpx streaming response), each validated by ``events`` (a pydantic
    ``TypeAdapter`` of the API's event union), whose ``type`` must be the SSE ``event:`` name; the events."""
    lines = [line for line in response.iter_lines() if line.startswith(("event: ", "data: "))]
    out = []
    for name, payload in zip(lines[0::2], lines[1::2], strict=True):
        event = events.validate_json(payload[6:])
        assert name == f"event: {event.type}"
        out.append(event)
    return out


def slot_free(front: Front, timeout_s: float = 60.0) -> None:
    """Wait until no session holds the slot and nothing runs on it (a ceiling for a slot that stays held, which
    fails the test; not a measure of how fast it frees)."""
    deadline = time.monotonic() + timeout_s
    with front.daemon.client(timeout_s=10.0) as c:
        while (st := c.status()).session_open or st.busy_operation:
            assert time.monotonic() < deadline, f"the slot stayed held: {st}\n{front.daemon.log()[-3000:]}"
            time.sleep(0.05)


def wait_busy(front: Front, ops: tuple[str, ...] = ("decode",), timeout_s: float = 60.0) -> str:
    """Wait until the slot runs one of ``ops`` (the default: the request in flight has been prefilled and
    decodes); the one it runs."""
    deadline = time.monotonic() + timeout_s
    with front.daemon.client(timeout_s=10.0) as c:
        while (op := c.status().busy_operation) not in ops:
            assert time.monotonic() < deadline, f"the daemon never ran {ops}\n{front.daemon.log()[-3000:]}"
            time.sleep(0.02)
    return op


def _send(front: Front, body: dict[str, Any]) -> http.client.HTTPConnection:
    """A plain POST to chat completions whose reply is not read: closing the connection is the client giving up."""
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                 headers={"content-type": "application/json"})
    return conn


def test_a_client_that_gives_up_on_a_plain_request_cancels_its_decode(front: Front) -> None:
    """A client that closes its connection while the reply is being decoded cancels the decode (3000 tokens at 5 ms
    a token would hold the slot for 15 s and more); the access line says so with a 499."""
    before = len(front.daemon.wait_lines(lambda ln: "modeld.access" in ln and " 499 " in ln, 0))
    conn = _send(front, {"model": "ref", "messages": [SYSTEM, {"role": "user", "content": "Talk at length."}],
                         "max_tokens": 3000})
    wait_busy(front)
    conn.close()
    lines = front.daemon.wait_lines(lambda ln: "modeld.access" in ln and " 499 " in ln, before + 1)
    assert "error=client_gone" in lines[-1] and "finish_reason=cancelled" in lines[-1], lines[-1:]
    assert "prompt_tokens=" in lines[-1], lines[-1]
    slot_free(front)


def test_api_key(tmp_path: Path) -> None:
    with Front(tmp_path, "--api-key", "s3cret") as f:
        with pytest.raises(openai.AuthenticationError):
            f.sdk("wrong").models.list()
        assert [m.id for m in f.sdk("s3cret").models.list()] == ["ref"]


def test_a_remote_address_needs_an_explicit_flag(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "modeld", "serve", "--backend", "memory", "--endpoint", f"ipc://{tmp_path / 's.sock'}",
         "--data-dir", str(tmp_path / "data"), "--http", "0.0.0.0:9"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=30,
    )
    assert out.returncode == 2 and "--http-allow-remote" in out.stderr


def test_serving_other_machines_without_a_key_is_warned_of(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, "memory", None, "--no-preload", "--http", f"0.0.0.0:{free_port()}", "--http-allow-remote")
    with d:
        assert "serves other machines with no --api-key" in d.log()


@pytest.fixture(scope="module", params=[pytest.param("llama", marks=pytest.mark.llama),
                                        pytest.param("openvino", marks=pytest.mark.openvino)])
def tools_front(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    """A front on each engine serving the tool-capable fixture (its embedding model is the daemon's own)."""
    pytest.importorskip("llama_cpp" if request.param == "llama" else "openvino_genai")
    from harness.fixtures import tool_gguf

    with Front(tmp_path_factory.mktemp(f"tools-{request.param}"), "--model", str(tool_gguf()), "--model-name", "tools",
               "--num-ctx", "2048", backend=request.param) as f:
        yield f


def test_logprobs_streamed_and_not(tools_front: Front) -> None:
    """``logprobs`` and ``top_logprobs`` through the SDK on each engine: every reply token's, whose bytes are the
    reply, the likeliest first; a streamed reply's chunks carry the same figures as the plain reply's."""
    sdk = tools_front.sdk()
    ask: dict[str, Any] = {"model": "tools", "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 3,
                           "messages": [SYSTEM, {"role": "user", "content": "List three sorting algorithms."}]}
    sdk.chat.completions.create(**ask)  # (cold: the next two reuse the whole prompt alike)
    plain = sdk.chat.completions.create(**ask)
    choice = plain.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None and plain.usage is not None
    tokens = choice.logprobs.content
    assert len(tokens) == plain.usage.completion_tokens and choice.message.content
    assert b"".join(bytes(t.bytes or []) for t in tokens).decode() == choice.message.content
    for t in tokens:
        tops = [a.logprob for a in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and t.logprob == tops[0] <= 0.0  # greedy
    streamed: list[Any] = []
    text = ""
    with sdk.chat.completions.create(**ask, stream=True) as chunks:
        for chunk in chunks:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                if chunk.choices[0].logprobs is not None:
                    streamed += chunk.choices[0].logprobs.content or []
    assert text == choice.message.content
    assert [(t.token, t.bytes) for t in streamed] == [(t.token, t.bytes) for t in tokens]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in tokens], abs=1e-6)
    without = sdk.chat.completions.create(**{k: v for k, v in ask.items() if k not in ("logprobs", "top_logprobs")})
    assert without.choices[0].logprobs is None and without.choices[0].message.content == choice.message.content
    # the Responses API: include message.output_text.logprobs, top_logprobs; the same conversation, the same figures
    asked: dict[str, Any] = {"model": "tools", "max_output_tokens": 16, "temperature": 0, "top_logprobs": 3,
                             "include": ["message.output_text.logprobs"], "instructions": SYSTEM["content"],
                             "input": "List three sorting algorithms.", "store": False}
    done = sdk.responses.create(**asked)
    part = next(c for item in done.output if item.type == "message" for c in item.content)
    assert part.type == "output_text" and part.text == choice.message.content and part.logprobs is not None
    assert [(t.token, t.bytes) for t in part.logprobs] == [(t.token, t.bytes) for t in tokens]
    assert [t.logprob for t in part.logprobs] == pytest.approx([t.logprob for t in tokens], abs=1e-6)
    assert all(len(t.top_logprobs) == 3 for t in part.logprobs)
    deltas: list[Any] = []
    with sdk.responses.create(**asked, stream=True) as events:
        for ev in events:
            if ev.type == "response.output_text.delta":
                deltas += ev.logprobs
    assert [t.logprob for t in deltas] == pytest.approx([t.logprob for t in tokens], abs=1e-6)


def test_a_prompt_scored_on_the_reference(front: Front) -> None:
    """Prefill-only scoring on the reference backend (its tokens are bytes, each certain): ``echo`` with
    ``logprobs`` and ``max_tokens: 0`` gives every prompt token, the first one null, and decodes nothing; the
    token ids a client sends are scored alike; the prompt is computed again, not reused."""
    sdk = front.sdk()
    prompt = "def add(a, b):\n    return a + b\n"
    scored = sdk.completions.create(model="ref", prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    choice = scored.choices[0]
    assert choice.text == prompt and scored.usage is not None and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp is not None and lp.tokens == list(prompt) and lp.text_offset == list(range(len(prompt)))
    assert lp.token_logprobs == [None] + [0.0] * (len(prompt) - 1)
    assert lp.top_logprobs == [None] + [{c: 0.0} for c in prompt[1:]]
    again = sdk.completions.create(model="ref", prompt=list(prompt.encode()), echo=True, logprobs=0, max_tokens=0)
    assert again.choices[0].logprobs.tokens == list(prompt) and again.choices[0].logprobs.top_logprobs[1] == {}
    assert again.usage.prompt_tokens_details is None or not again.usage.prompt_tokens_details.cached_tokens
    with sdk.completions.create(model="ref", prompt=prompt, echo=True, logprobs=1, max_tokens=3, stream=True) as chunks:
        parts = [c.choices[0] for c in chunks if c.choices and c.choices[0].text]
    assert parts[0].text == prompt and parts[0].logprobs.token_logprobs == lp.token_logprobs
    # the reply's tokens after it, their offsets running on from the prompt's end (a frame that merged several
    # steps gives its tokens' figures with its first delta)
    tokens = [t for p in parts[1:] for t in p.logprobs.tokens]
    assert "".join(tokens) == "".join(p.text for p in parts[1:]) and 0 < len(tokens) <= 3
    assert [o for p in parts[1:] for o in p.logprobs.text_offset] == [len(prompt) + i for i in range(len(tokens))]


def test_raw_completions(tools_front: Front) -> None:
    """``/v1/completions`` through the SDK on each engine: a raw prompt continued (no template), as text or as
    token ids alike, streamed as plain; ``echo``; legacy ``logprobs`` whose tokens are the reply; and a longer
    prompt with the same head (an editor completing as the user types) reuses it."""
    sdk = tools_front.sdk()
    head = "def fibonacci(n):\n"
    ask: dict[str, Any] = {"model": "tools", "max_tokens": 12, "temperature": 0}
    first = sdk.completions.create(prompt=head, logprobs=2, **ask)
    choice = first.choices[0]
    assert first.object == "text_completion" and choice.text and choice.finish_reason in ("length", "stop")
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert first.usage is not None and first.usage.completion_tokens == len(lp.tokens)
    assert "".join(lp.tokens) == choice.text and lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    for t, p, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 2 and p == max(top.values()) <= 0.0 and top.get(t) == p  # greedy: the likeliest
    status, tokenized = _post_json(tools_front.port, "/tokenize", {"content": head})
    ids = tokenized["tokens"]
    assert status == 200 and ids
    assert sdk.completions.create(prompt=ids, **ask).choices[0].text == choice.text
    with sdk.completions.create(prompt=head, stream=True, **ask) as chunks:
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == choice.text
    echoed = sdk.completions.create(prompt=head, echo=True, **ask).choices[0].text
    assert echoed == head + choice.text
    typed = sdk.completions.create(prompt=head + choice.text[:4], **ask)
    assert typed.usage is not None and typed.usage.prompt_tokens_details is not None
    assert typed.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


# the embedding model is loaded beside the chat model, whichever that is: the tool round trip's daemon serves
@pytest.mark.parametrize("tools_front", ["llama"], indirect=True)
def test_embeddings_equal_the_cli(tools_front: Front) -> None:
    f = tools_front
    got = f.sdk().embeddings.create(model="x", input=["a KV cache", "a prefix cache"])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = subprocess.run(
        [sys.executable, "-m", "modeld", "embed", "--endpoint", f.daemon.endpoint, "--json", "a KV cache", "a prefix cache"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    import numpy as np

    vectors = np.asarray(json.loads(cli.stdout)["vectors"])
    assert np.allclose(np.asarray([d.embedding for d in got.data]), vectors, atol=1e-6) and vectors.shape == (2, 384)
    # the usage counts the inputs' tokens together (a number, not the daemon's list per input)
    with f.daemon.client() as c:
        each = c.embed(EmbedRequest(texts=["a KV cache", "a prefix cache"])).tokens
    assert len(each) == 2 and got.usage.prompt_tokens == got.usage.total_tokens == sum(each) > 0


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather for a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.slow
def test_tool_call_round_trip_and_json_schema(tools_front: Front) -> None:
    """On the tool-capable fixture: a forced call, its result, the answer — each request reusing the previous one."""
    f = tools_front
    sdk = f.sdk()
    history: list[dict[str, object]] = [
        {"role": "system", "content": "You are a weather assistant. Use the tools."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    first = sdk.chat.completions.create(model="tools", messages=history, tools=[WEATHER], max_tokens=60, temperature=0,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    history += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21, "sky": "clear"}'},
    ]
    second = sdk.chat.completions.create(model="tools", messages=history, tools=[WEATHER], max_tokens=24, temperature=0)
    assert first.usage is not None and second.usage is not None and second.usage.prompt_tokens_details is not None
    # the first request is reused; the call and the tool result are what is computed
    # (the call, decoded under a grammar, is spelled otherwise than the tokenizer spells its text: its tokens are
    # computed again, as a fresh daemon computes the same prompt — warm equals cold)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 2
    history += [{"role": "assistant", "content": second.choices[0].message.content or ""},
                {"role": "user", "content": "Give it as JSON."}]
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "temp_c": {"type": "integer"}},
              "required": ["city", "temp_c"], "additionalProperties": False}
    third = sdk.chat.completions.create(model="tools", messages=history, max_tokens=60, temperature=0, tools=[WEATHER],
                                        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    data = json.loads(third.choices[0].message.content or "")
    assert set(data) == {"city", "temp_c"} and isinstance(data["temp_c"], int)
    with pytest.raises(openai.BadRequestError):  # a forced call of a tool nobody gave
        sdk.chat.completions.create(model="tools", messages=history, tools=[WEATHER],
                                    tool_choice={"type": "function", "function": {"name": "nope"}})


def test_a_busy_slot_queues_then_answers_503(tmp_path: Path) -> None:
    import threading

    from contract.types import OpenSessionRequest

    with Front(tmp_path, "--http-queue-timeout", "1") as f:
        sdk = f.sdk()
        messages = [SYSTEM, {"role": "user", "content": "hi"}]
        with f.daemon.client(timeout_s=10.0) as holder:
            session = holder.open_session(OpenSessionRequest())  # another agent holds the slot
            t0 = time.monotonic()
            with pytest.raises(openai.InternalServerError) as busy:
                sdk.chat.completions.create(model="ref", messages=messages, max_tokens=2)
            assert busy.value.status_code == 503 and busy.value.response.headers.get("retry-after") == "1"
            assert 0.9 <= time.monotonic() - t0 < 10
            # a request that arrives while the slot is held is served once it is released
            done: list[int] = []
            waiter = threading.Thread(target=lambda: done.append(
                sdk.chat.completions.create(model="ref", messages=messages, max_tokens=2).usage.completion_tokens))  # type: ignore[union-attr]
            waiter.start()
            wait_until(lambda: holder.status().waiting == 1, "the request queued for the slot")
            session.close()
            waiter.join(10)
        assert done == [2]


def test_the_front_as_its_own_process(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with DaemonProcess(tmp_path / "d", "memory", None, "--model", "/models/ref", "--model-name", "ref") as d:
        front = subprocess.Popen([sys.executable, "-m", "modeld", "http", "--endpoint", d.endpoint, "--http", f"127.0.0.1:{port}"],
                                 env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_http(port)
            sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)
            out = sdk.chat.completions.create(model="ref", messages=[SYSTEM, {"role": "user", "content": "hi"}], max_tokens=3)
            sdk.close()
            assert out.usage is not None and out.usage.completion_tokens == 3
        finally:
            front.terminate()
            _, err = front.communicate(timeout=10)
        assert front.returncode == 0 and "HTTP APIs at" in err.decode()
        assert "POST /v1/chat/completions 200" in err.decode()  # its access log


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_a_daemon_killed_under_a_separate_front_ends_every_stream_as_a_failure(tmp_path: Path, api: str) -> None:
    """``modeld http`` as its own process: the daemon killed mid-stream ends the stream with the API's error
    event (no [DONE], no message_stop), which the official SDK raises; the front keeps running."""
    import signal

    anthropic = pytest.importorskip("anthropic")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    d = DaemonProcess(tmp_path / "d", "memory", None, "--model", "/models/ref", "--model-name", "ref",
                      "--memory-token-delay-ms", "20").start(wait_state=("Ready",))
    front = subprocess.Popen([sys.executable, "-m", "modeld", "http", "--endpoint", d.endpoint, "--http", f"127.0.0.1:{port}"],
                             env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_http(port)
        base = f"http://127.0.0.1:{port}"
        if api == "chat":
            sdk = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
            stream: Any = sdk.chat.completions.create(model="ref", messages=[SYSTEM, {"role": "user", "content": "go"}],
                                                      max_tokens=3000, stream=True)
            raised: tuple[type[BaseException], ...] = (openai.APIError,)
        elif api == "responses":
            sdk = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
            stream = sdk.responses.create(model="ref", input="go", max_output_tokens=3000, stream=True)
            raised = (openai.APIError,)
        else:
            client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=60)
            stream = client.messages.create(model="ref", max_tokens=3000, messages=[{"role": "user", "content": "go"}],
                                            stream=True)
            raised = (anthropic.APIError,)
        seen: list[str] = []
        with pytest.raises(raised):
            for event in stream:
                seen.append(str(getattr(event, "type", "chunk")))
                if len(seen) == 6:
                    assert d.proc is not None
                    d.proc.send_signal(signal.SIGKILL)
        assert len(seen) >= 6
        assert not {"response.completed", "message_stop"} & set(seen), seen
        assert front.poll() is None  # the front is still there for the next daemon
    finally:
        d.stop()
        front.terminate()
        front.communicate(timeout=10)


# the SDK's own event generator, dropped mid-read after the connection died, may raise again when it is collected:
# that is the SDK's cleanup, not the daemon's behaviour under test
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_daemon_killed_mid_stream_makes_the_sdk_raise(tmp_path: Path) -> None:
    import signal

    import httpx

    with Front(tmp_path, "--memory-token-delay-ms", "20") as f:
        stream = f.sdk().chat.completions.create(model="ref", messages=[SYSTEM, {"role": "user", "content": "go"}],
                                                 max_tokens=3000, stream=True)
        got = 0
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for _chunk in stream:
                got += 1
                if got == 3:
                    assert f.daemon.proc is not None
                    f.daemon.proc.send_signal(signal.SIGKILL)
        assert got >= 3


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
def test_a_client_gone_while_its_request_waited_for_the_slot_leaves_it_free(front: Front, stream: bool) -> None:
    """A request queued behind another turn whose client gives up while it waits: once the slot is free, its turn
    (which ``begin`` then takes) is given back at once, not held by a reply nobody reads until the session's TTL
    (a streamed reply whose client left before its first event never ran its generator)."""
    sdk = front.sdk()
    gone = lambda ln: "modeld.access" in ln and " 499 " in ln  # noqa: E731
    before = len(front.daemon.wait_lines(gone, 0))
    holder = sdk.chat.completions.create(model="ref", messages=[SYSTEM, {"role": "user", "content": "Talk at length."}],
                                         max_tokens=3000, stream=True)  # 15 s and more at 5 ms a token
    next(iter(holder))
    wait_busy(front)
    waiting = _send(front, {"model": "ref", "messages": [SYSTEM, {"role": "user", "content": "hi"}], "max_tokens": 5,
                            "stream": stream})
    with front.daemon.client(timeout_s=10.0) as c:  # it waits for the slot: the front's client is queued
        deadline = time.monotonic() + 60
        while not c.status().waiting:
            assert time.monotonic() < deadline, front.daemon.log()[-3000:]
            time.sleep(0.02)
    waiting.close()  # and gives up
    holder.close()  # the slot frees; the abandoned request's begin takes it, and must give it back
    front.daemon.wait_lines(gone, before + 1)  # the request that waited went with a 499
    slot_free(front)
    out = sdk.chat.completions.create(model="ref", messages=[SYSTEM, {"role": "user", "content": "hi"}], max_tokens=2)
    assert out.usage is not None and out.usage.completion_tokens == 2
