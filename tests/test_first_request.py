"""The first request, the long one: a client that goes away frees the slot at once, a resent request reuses what
the first attempt computed, no internal timeout ends a prefill that progresses, and every streamed API shows life
while it runs.

Both engines serve the bundled model through a real daemon process and its HTTP front, driven by the official
SDKs (raw HTTP where the SDKs hide what is checked: SSE comments and ``ping`` events). The prefill is made slow
with the daemon's ``--prefill-chunk-delay-ms`` (a slower machine on demand) over small chunks (``--num-batch``),
not with a big prompt, and the lease is shorter than the prefill, as the client's own liveness window is.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.test_metrics import samples  # noqa: E402
from tests.test_openai_front import Front, slot_free, wait_busy  # noqa: E402

pytestmark = pytest.mark.slow

#: what the slot runs while a request prefills
PREFILLS = ("ensure_prefix", "prefill_suffix")
#: tokens per prefill chunk, and how long each is held back
CHUNK = 64
DELAY_MS = 800
#: the daemon's lease, shorter than every prefill here: a client busy with a long prefill must keep its session (4 s,
#: not 2: on a 2-core machine far past its cores, a front's lease thread went more than 1.3 s without a core and its
#: session's prefill was cancelled for a lease that ran out)
LEASE_S = 4
API_KEY = "first-key"
APIS = ["chat", "responses", "messages"]


@pytest.fixture(scope="module", params=[pytest.param("llama", marks=pytest.mark.llama),
                                        pytest.param("openvino", marks=pytest.mark.openvino)])
def front(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    pytest.importorskip("llama_cpp" if request.param == "llama" else "openvino_genai")
    with Front(tmp_path_factory.mktemp(f"first-{request.param}"), "--num-ctx", "4096", "--num-batch", str(CHUNK),
               "--prefill-chunk-delay-ms", str(DELAY_MS), "--lease", str(LEASE_S), "--api-key", API_KEY,
               backend=request.param) as f:
        yield f


def _long_text(chunks: int) -> str:
    """About ``chunks`` prefill chunks of code, headed by a line no earlier request had (nothing of it is resident)."""
    lines = [f"# session {uuid.uuid4().hex}"]
    lines += [f"def helper_{i}(value):\n    return value * {i} + {i % 7}\n" for i in range(chunks * 3)]
    return "\n".join(lines)


def _cancelled_prefills(front: Front) -> float:
    """Prefills the daemon answered Cancelled (its metrics): a prefill cut short, not one that ran to its end."""
    with front.daemon.client(timeout_s=10.0) as c:
        text = c.metrics()
    return sum(value for (name, labels), value in samples(text).items() if name == "modeld_errors_total"
               and dict(labels).get("error") == "Cancelled" and dict(labels).get("op") in ("ensure_prefix",
                                                                                             "prefill_suffix"))


def _openai(front: Front, **kw: Any) -> Any:
    return openai.OpenAI(base_url=front.url, api_key=API_KEY, max_retries=0, **{"timeout": 600.0, **kw})


def _anthropic(front: Front, **kw: Any) -> Any:
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{front.port}", api_key=API_KEY, max_retries=0,
                               **{"timeout": 600.0, **kw})


def _request(front: Front, api: str, system: str, *, stream: bool, max_tokens: int, **kw: Any) -> Any:
    """One request of ``api`` through its SDK: a long system prompt, a short question."""
    question = "What does helper_3 return for 2?"
    if api == "chat":
        return _openai(front, **kw).chat.completions.create(
            model="default", messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=max_tokens, stream=stream, temperature=0)
    if api == "responses":
        return _openai(front, **kw).responses.create(model="default", instructions=system, input=question,
                                                     max_output_tokens=max_tokens, stream=stream, store=False,
                                                     temperature=0)
    return _anthropic(front, **kw).messages.create(model="default", system=system, max_tokens=max_tokens,
                                                   messages=[{"role": "user", "content": question}], stream=stream)


def _access(front: Front, route: str) -> list[str]:
    return [ln for ln in front.daemon.log().splitlines() if "modeld.access" in ln and f"POST {route} " in ln]


ROUTES = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


def _cancelled_line(route: str) -> Callable[[str], bool]:
    """An access line of a request to ``route`` that ended cancelled."""
    return lambda ln: "modeld.access" in ln and f"POST {route} " in ln and "finish_reason=cancelled" in ln


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
@pytest.mark.parametrize("api", APIS)
def test_a_client_gone_during_the_prefill_frees_the_slot_at_once(front: Front, api: str, stream: bool) -> None:
    system = _long_text(12)  # 12 chunks at 800 ms and more: the client leaves long before the prefill would end
    before = len(_access(front, ROUTES[api]))
    cancelled = _cancelled_prefills(front)

    abandoned = _cancelled_line(ROUTES[api])
    gone = len(front.daemon.wait_lines(abandoned, 0))
    if stream:
        events = _request(front, api, system, stream=True, max_tokens=200)
        next(iter(events))  # the stream's first event comes at once, before the prefill
        wait_busy(front, PREFILLS)
        events.close()
    else:
        # a client that gives up on a reply that is not streamed: it closes its connection while the prefill runs
        question = "What does helper_3 return for 2?"
        body: dict[str, Any] = {"model": "default", "max_tokens": 200, "stream": False}
        if api == "responses":
            body = {"model": "default", "instructions": system, "input": question, "max_output_tokens": 200,
                    "store": False}
        elif api == "messages":
            body["system"], body["messages"] = system, [{"role": "user", "content": question}]
        else:
            body["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=600)
        conn.request("POST", ROUTES[api], body=json.dumps(body).encode(),
                     headers={"content-type": "application/json", "authorization": f"Bearer {API_KEY}",
                              "x-api-key": API_KEY})
        wait_busy(front, PREFILLS)
        conn.close()
    slot_free(front, timeout_s=120.0)
    # it was the prefill that was cut short (the daemon answered it Cancelled), not a prefill that ran to its end
    assert _cancelled_prefills(front) > cancelled
    # the next client is served at once, and the access line says what the abandoned turn did
    out = _openai(front).chat.completions.create(model="default", max_tokens=2, temperature=0,
                                                 messages=[{"role": "user", "content": "hi"}])
    assert out.usage is not None and out.usage.completion_tokens >= 1
    last = front.daemon.wait_lines(abandoned, gone + 1)[-1]
    assert "error=client_gone" in last, _access(front, ROUTES[api])[before:]


def test_a_resent_request_reuses_the_chunks_the_first_attempt_finished(front: Front) -> None:
    """Codex's retry: its first /v1/responses stream closed during the prefill, the same request again starts
    where that one stopped. The stream's ``response.in_progress`` keep-alives say how far the prefill came."""
    system = _long_text(8)
    done = 0
    gone = len(front.daemon.wait_lines(_cancelled_line("/v1/responses"), 0))
    with _openai(front).responses.create(model="default", instructions=system, input="What does helper_3 return?",
                                         max_output_tokens=16, stream=True, store=False, temperature=0) as events:
        for event in events:
            if event.type == "response.in_progress":
                progress = (event.model_extra or {}).get("prefill") or {}
                done = int(progress.get("done", 0))
                if done >= 3 * CHUNK:
                    break
    assert done >= 3 * CHUNK, "no keep-alive carried the prefill's progress"
    slot_free(front, timeout_s=120.0)
    # the access line of the abandoned request counts the chunks its prefill finished
    last = front.daemon.wait_lines(_cancelled_line("/v1/responses"), gone + 1)[-1]
    counted = re.search(r"prefilled_tokens=(\d+)", last)
    assert counted is not None and int(counted.group(1)) >= done, (done, last)
    again = _openai(front).responses.create(model="default", instructions=system, input="What does helper_3 return?",
                                            max_output_tokens=16, store=False, temperature=0)
    assert again.usage is not None
    cached = again.usage.input_tokens_details.cached_tokens
    assert cached >= done - CHUNK, (cached, done)
    assert cached < again.usage.input_tokens  # it went on from there


def _sse(front: Front, path: str, body: dict[str, Any], headers: dict[str, str]) -> Iterator[tuple[str, float]]:
    """The raw lines of a streamed reply (comments and every event), each with when it came."""
    with httpx.Client(timeout=600.0) as http, http.stream("POST", f"http://127.0.0.1:{front.port}{path}", json=body,
                                                          headers=headers) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            yield line, time.monotonic()


def _keepalives(api: str, lines: list[tuple[str, float]]) -> list[tuple[dict[str, int], float]]:
    """The keep-alives that carried the prefill's progress, with when each came."""
    out = []
    for line, at in lines:
        progress: dict[str, int] = {}
        if line.startswith("data: {"):
            data = json.loads(line.removeprefix("data: "))
            # chat completions: a chunk with an empty delta; Responses: response.in_progress; Messages: a
            # message_delta that sets nothing (the SDKs drop pings before an agent's watchdog sees them)
            kind = data.get("type", data.get("object"))
            if kind in ("chat.completion.chunk", "response.in_progress", "message_delta"):
                progress = data.get("prefill") or {}
                assert not progress or kind != "chat.completion.chunk" or data["choices"][0]["delta"] == {}, data
                assert not progress or kind != "message_delta" or (
                    data["delta"] == {"stop_reason": None, "stop_sequence": None}
                    and data["usage"] == {"output_tokens": 0}), data
        if progress:
            out.append((progress, at))
    return out


@pytest.mark.parametrize("api", APIS)
def test_a_long_prefill_shows_life_on_every_streamed_api_and_outlasts_every_timeout(front: Front, api: str) -> None:
    """A prefill of 7 s and more, past the lease (4 s) and the client's liveness window, runs to its end; meanwhile the
    stream sends keep-alives with its progress, in the form each API's clients read."""
    system = _long_text(9)
    question = {"role": "user", "content": "What does helper_3 return?"}
    headers = {"Authorization": f"Bearer {API_KEY}", "x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    if api == "chat":
        body: dict[str, Any] = {"model": "default", "messages": [{"role": "system", "content": system}, question],
                                "max_tokens": 4, "stream": True, "temperature": 0}
    elif api == "responses":
        body = {"model": "default", "instructions": system, "input": question["content"], "max_output_tokens": 16,
                "stream": True, "store": False, "temperature": 0}
    else:
        body = {"model": "default", "system": system, "messages": [question], "max_tokens": 4, "stream": True,
                "temperature": 0}
    started = time.monotonic()
    lines = list(_sse(front, ROUTES[api], body, headers))
    ended = time.monotonic()
    if api == "messages":  # a ping at once, as the API does
        kinds = [json.loads(ln.removeprefix("data: "))["type"] for ln, _ in lines if ln.startswith("data: {")]
        assert kinds[:2] == ["message_start", "ping"], kinds[:3]
    alive = _keepalives(api, lines)
    assert ended - started > 6.0  # (the prefill was long enough for a keep-alive to be due)
    assert alive, [ln for ln, _ in lines][:12]
    # the stream began while the prefill ran: its first line came before the prefill's last progress
    assert lines[0][1] < alive[-1][1] and not _keepalives(api, lines[:1]), lines[:3]
    assert all(0 <= p["done"] <= p["total"] for p, _ in alive)
    # it ran to its end: the API's own last event
    text = "\n".join(ln for ln, _ in lines)
    ends = {"chat": ["data: [DONE]"], "responses": ["response.completed", "response.incomplete"],
            "messages": ["message_stop"]}[api]
    assert any(end in text for end in ends), text[-300:]
    assert "error" not in [json.loads(ln.removeprefix("data: ")).get("type") for ln, _ in lines
                           if ln.startswith("data: {")]


def test_the_messages_keepalives_reach_the_sdk_s_caller_and_change_nothing(front: Front) -> None:
    """Claude Code's stream watchdog is reset by the events the Anthropic SDK yields, and the SDK drops ``ping``
    events: the keep-alives of a long prefill must be events the SDK yields (``message_delta``), and the message
    the SDK assembles must read as if they had not come (the stop reason and usage are the final delta's)."""
    system = _long_text(14)  # 11 s and more: two keep-alives at least, whatever the engine's speed
    client = _anthropic(front)
    seen: list[tuple[str, float]] = []
    with client.messages.stream(model="default", system=system, max_tokens=4,
                                messages=[{"role": "user", "content": "What does helper_3 return?"}]) as stream:
        for event in stream:
            seen.append((event.type, time.monotonic()))
        final = stream.get_final_message()
    kinds = [k for k, _ in seen]
    first_block = kinds.index("content_block_start") if "content_block_start" in kinds else len(kinds)
    during = [k for k in kinds[:first_block] if k == "message_delta"]
    assert len(during) >= 2, kinds[:12]  # the prefill ran 11 s and more: keep-alives reached the caller
    before = [at for _, at in seen[:first_block]]
    assert max(b - a for a, b in zip(before, before[1:], strict=False)) < 30  # (every KEEPALIVE_S, loosely)
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens >= 1, final
    assert final.content and all(b.type in ("text", "thinking", "tool_use") for b in final.content), final.content


def test_a_cancel_during_the_prefill_from_another_thread_stops_the_turn(front: Front) -> None:
    """``runtime.Chat``: ``ChatTurn.cancel`` from another thread stops the prefill the turn waits on (the turn
    ends "cancelled"), and the next turn with the same head reuses what was computed."""
    from runtime import Chat, Client

    system = _long_text(8)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    with Client(front.daemon.endpoint, timeout_s=60.0) as c:
        turn = Chat(c, profile="http").begin(messages, max_tokens=2, temperature=0)
        cancelled = _cancelled_prefills(front)

        def cancel_once_prefilling() -> None:  # once the prefill's progress says a chunk is done
            deadline = time.monotonic() + 120
            while (turn.progress is None or turn.progress.done < CHUNK) and time.monotonic() < deadline:
                time.sleep(0.02)
            turn.cancel()

        canceller = threading.Thread(target=cancel_once_prefilling)
        canceller.start()
        result = [e.result for e in turn.events() if e.result is not None][0]
        canceller.join()
        # the prefill itself stopped (the daemon answered it Cancelled): it did not run on to its end
        assert result.finish_reason == "cancelled" and _cancelled_prefills(front) > cancelled
        assert turn.finished
        again = Chat(c, profile="http").send(messages, max_tokens=2, temperature=0)
        assert again.usage.reused_tokens >= CHUNK, again.usage
