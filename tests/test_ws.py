"""The WebSocket protocol (``/v1/ws``) through a real daemon process and its HTTP front, on both engines, driven by
``runtime.ws.WsClient`` over the ``websockets`` library: every message type, the controls (stop, pause and resume,
pause past the limit, modify, regenerate), feedback, the bad paths, a killed client, the API key.

The prefill is slowed with ``--prefill-chunk-delay-ms`` over small chunks, so a long prompt's progress shows; the
prompts here are short otherwise. Greedy replies (``temperature: 0``) are compared token for token.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("websockets")

from modeld.front.ws.protocol import SERVER_MESSAGE  # noqa: E402
from runtime.ws import WsClient, WsError  # noqa: E402
from tests.test_metrics import samples  # noqa: E402
from tests.test_openai_front import Front, slot_free  # noqa: E402

pytestmark = pytest.mark.slow

API_KEY = "ws-key"
#: a paused generation holds the slot this long at most
PAUSE_LIMIT_S = 3
CHUNK = 32
DELAY_MS = 150
MESSAGES = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name the planets of the solar system, one per line."}]


@pytest.fixture(scope="module", params=[pytest.param("llama", marks=pytest.mark.llama),
                                        pytest.param("openvino", marks=pytest.mark.openvino)])
def front(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    pytest.importorskip("llama_cpp" if request.param == "llama" else "openvino_genai")
    with Front(tmp_path_factory.mktemp(f"ws-{request.param}"), "--num-ctx", "4096", "--api-key", API_KEY,
               "--ws-pause-limit", str(PAUSE_LIMIT_S), "--num-batch", str(CHUNK),
               "--prefill-chunk-delay-ms", str(DELAY_MS), backend=request.param) as f:
        yield f


def _url(front: Front) -> str:
    return f"ws://127.0.0.1:{front.port}/v1/ws"


def _client(front: Front, **kw: Any) -> WsClient:
    return WsClient(_url(front), api_key=API_KEY, timeout_s=300.0, **kw)


def _run(c: WsClient, **config: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A generation's messages before its completion, and the completion; each message validated by the front's
    model for its ``type``."""
    seen: list[dict[str, Any]] = []
    done = c.generate(on_message=seen.append, **config)
    for message in seen:
        SERVER_MESSAGE.validate_python(message)
    return seen[:-1], done


def _tokens(messages: list[dict[str, Any]]) -> list[int]:
    return [t for m in messages if m["type"] == "token" for t in m["token_ids"]]


def _greedy(c: WsClient, max_tokens: int = 24) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    return _run(c, messages=MESSAGES, max_tokens=max_tokens, temperature=0, options={"include_token_ids": True})


def test_a_generation_sends_init_tokens_and_completion(front: Front) -> None:
    with _client(front) as c:
        seen, done = _run(c, messages=MESSAGES, max_tokens=16, temperature=0,
                          options={"include_token_ids": True, "include_logprobs": 2, "include_timing": True})
    init = seen[0]
    assert init["type"] == "init" and init["request_id"].startswith("gen_") and init["model"]
    assert init["model_info"]["context_window"] == 4096 and init["model_info"]["digest"].startswith("sha256:")
    assert {"pause", "resume", "modify", "regenerate", "stop", "feedback"} <= set(init["capabilities"])
    tokens = [m for m in seen if m["type"] == "token"]
    assert tokens and all(m["request_id"] == init["request_id"] and m["finished"] is False for m in tokens)
    # positions run on from the prompt's end, one per token
    u = done["usage"]
    assert tokens[0]["position"] == u["prompt_tokens"]
    for a, b in itertools.pairwise(tokens):
        assert b["position"] == a["position"] + len(a["token_ids"])
    assert all(len(m["logprobs"]) == len(m["token_ids"]) for m in tokens)  # (a flushed tail of text: neither)
    assert all(len(lp["top"]) == 2 and lp["logprob"] <= 0 for m in tokens for lp in m["logprobs"])
    assert all("token_ms" in m["timing"] for m in tokens)
    assert done["type"] == "completion" and done["finished"] is True
    assert done["generated_text"] == "".join(m["token"] for m in tokens)
    assert u["completion_tokens"] == len(_tokens(seen)) and u["total_tokens"] == u["prompt_tokens"] + len(_tokens(seen))
    assert done["finish_reason"] in ("stop", "length") and "first_token_ms" in done["timing"]
    # a raw prompt, echoed, and a reply that is not streamed: no token messages
    with _client(front) as c:
        seen, done = _run(c, prompt="def fibonacci(n):", max_tokens=8, temperature=0,
                          options={"stream": False, "echo_prompt": True})
    assert [m["type"] for m in seen] == ["init"]
    assert done["generated_text"].startswith("def fibonacci(n):") and done["usage"]["completion_tokens"] >= 1


@pytest.mark.llama
def test_every_token_message_is_one_token_on_a_loaded_machine(tmp_path: Path) -> None:
    """Two CPU-bound processes beside the daemon, whose frames carry many decode steps each (a 400 ms stream
    interval: however fast or slow the machine): every token message of a 200-token generation is one token (its
    text, its one id, its logprob), at consecutive positions, and they are the greedy tokens chat completions
    gives for the same conversation."""
    from harness.load import cpu_burners

    pytest.importorskip("llama_cpp")
    with Front(tmp_path, "--num-ctx", "4096", "--api-key", API_KEY, "--stream-interval-ms", "400",
               backend="llama") as front:
        with cpu_burners(2):
            with _client(front) as c:
                seen, done = _run(c, messages=MESSAGES, max_tokens=200, temperature=0,
                                  options={"include_token_ids": True, "include_logprobs": 1})
            chat = front.sdk(API_KEY).chat.completions.create(model="default", messages=MESSAGES, max_tokens=200,
                                                              temperature=0, logprobs=True)
    tokens = [m for m in seen if m["type"] == "token"]
    assert tokens and all(len(m["token_ids"]) == 1 and m["token_id"] == m["token_ids"][0] for m in tokens)
    assert all(len(m["logprobs"]) == 1 and m["logprobs"][0]["token_id"] == m["token_id"] for m in tokens)
    positions = [m["position"] for m in tokens]
    assert positions == list(range(done["usage"]["prompt_tokens"], done["usage"]["prompt_tokens"] + len(tokens)))
    assert done["generated_text"] == "".join(m["token"] for m in tokens)
    # chat completions' greedy tokens for the same conversation, token by token (their bytes: the API names no ids)
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content is not None
    assert [t.bytes for t in chat.choices[0].logprobs.content] == [m["logprobs"][0]["bytes"] for m in tokens]
    assert chat.choices[0].message.content == done["generated_text"]


def test_a_long_prompt_reports_its_prefill_and_a_waiting_client_hears_it_is_queued(front: Front) -> None:
    long = [{"role": "system", "content": "\n".join(f"def helper_{i}(v):\n    return v * {i}" for i in range(60))},
            {"role": "user", "content": f"What does helper_7 return? ({time.time()})"}]
    with _client(front) as a, _client(front) as b:
        a.config(messages=long, max_tokens=4, temperature=0)
        first = a.recv()
        assert first["type"] == "init"
        progress: list[dict[str, Any]] = []
        # b comes while a prefills: it waits for the slot and says so
        b.config(messages=MESSAGES, max_tokens=4, temperature=0)
        for m in a.messages():
            if m["type"] == "status" and m["operation"] == "prefill":
                progress.append(m)
        assert progress, "no prefill progress while a long prompt was prefilled"
        assert all(0 <= p["progress"] <= 100 and p["tokens_done"] <= p["tokens_total"] for p in progress)
        waited = [m for m in b.messages() if m["type"] == "status" and m["operation"] == "queued"]
        assert waited and waited[0]["waiting"] >= 0


def test_pause_then_resume_gives_the_greedy_reply_without_a_pause(front: Front) -> None:
    with _client(front) as c:
        plain, done_plain = _greedy(c)
        assert len(_tokens(plain)) > 8  # (the reply goes on past where it is paused)
        c.config(messages=MESSAGES, max_tokens=24, temperature=0, options={"include_token_ids": True})
        seen: list[dict[str, Any]] = []
        paused_at = None
        for m in c.messages():
            seen.append(m)
            if m["type"] == "token" and len(seen) == 4:
                c.control("pause")
            if m["type"] == "status" and m["operation"] == "paused":
                paused_at = m["position"]
                time.sleep(2.0)
                c.control("resume")
    assert paused_at is not None, "the generation never paused"
    resumed = [m for m in seen if m["type"] == "status" and m["operation"] == "resumed"]
    assert resumed and resumed[0]["position"] == paused_at
    done = seen[-1]
    assert _tokens(seen[:-1]) == _tokens(plain)
    assert done["generated_text"] == done_plain["generated_text"]
    assert done["usage"]["completion_tokens"] == done_plain["usage"]["completion_tokens"]


def test_a_pause_past_the_limit_ends_with_a_recoverable_error_and_the_next_client_runs(front: Front) -> None:
    with _client(front) as a, _client(front) as b:
        a.config(messages=MESSAGES, max_tokens=200, temperature=0)
        paused = None
        with pytest.raises(WsError) as err:
            for m in a.messages():
                if m["type"] == "token" and paused is None:
                    paused = False
                    a.control("pause")
                elif m["type"] == "status" and m["operation"] == "paused":
                    paused = True
                    b.config(messages=MESSAGES, max_tokens=4, temperature=0)  # waits behind the paused one
        assert paused is True
        assert err.value.code == "pause_limit" and err.value.recoverable and err.value.kind == "timeout"
        # the other client's generation ran once the paused one ended
        done = list(b.messages())[-1]
        assert done["usage"]["completion_tokens"] >= 1
        # and the connection that was paused serves another generation
        _, again = _greedy(a, 4)
        assert again["usage"]["completion_tokens"] >= 1


def test_modify_changes_the_reply_from_the_next_token(front: Front) -> None:
    with _client(front) as c:
        plain, _ = _greedy(c, 32)
        c.config(messages=MESSAGES, max_tokens=32, temperature=0, options={"include_token_ids": True})
        seen: list[dict[str, Any]] = []
        for m in c.messages():
            seen.append(m)
            if m["type"] == "token" and sum(x["type"] == "token" for x in seen) == 3:
                c.control("modify", temperature=1.5, seed=11)
    modified = [m for m in seen if m["type"] == "status" and m["operation"] == "modified"]
    assert modified and modified[0]["parameters"]["temperature"] == 1.5
    done = seen[-1]
    start = done["usage"]["prompt_tokens"]
    cut = modified[0]["position"] - start  # tokens written before the new parameters applied
    got, greedy = _tokens(seen[:-1]), _tokens(plain)
    assert got[:cut] == greedy[:cut]
    if len(greedy) > cut + 8:
        assert got[cut:] != greedy[cut:len(got)], "the continuation stayed greedy at temperature 1.5"


def test_regenerate_runs_the_config_again_on_its_resident_prompt(front: Front) -> None:
    with _client(front) as c:
        c.config(messages=MESSAGES, max_tokens=64, temperature=0)
        ended = []
        for m in c.messages():
            if m["type"] == "token" and not ended:
                ended.append(m)
                c.control("regenerate")
        first = m
        assert first["finish_reason"] in ("cancelled", "stop", "length")
        second = [m for m in c.messages()]
    init, done = second[0], second[-1]
    assert init["type"] == "init" and init["request_id"] != first["request_id"]
    u = done["usage"]
    # the prompt was all resident (at most its last token computed again before sampling)
    assert u["cached_tokens"] >= u["prompt_tokens"] - 1 and u["prefilled_tokens"] <= 1, u


def test_stop_ends_the_generation_within_a_few_tokens(front: Front) -> None:
    with _client(front) as c:
        c.config(messages=MESSAGES, max_tokens=400, temperature=0, options={"include_token_ids": True})
        seen: list[dict[str, Any]] = []
        at_stop = None
        for m in c.messages():
            seen.append(m)
            if m["type"] == "token" and at_stop is None:
                at_stop = len(_tokens(seen))
                c.control("stop")
    done = seen[-1]
    assert done["finish_reason"] in ("cancelled", "stop"), done
    if done["finish_reason"] == "cancelled":
        # what was already on its way when the stop came (a frame holds up to the stream interval's tokens)
        assert done["usage"]["completion_tokens"] - (at_stop or 0) <= 8, done["usage"]
        assert done["usage"]["completion_tokens"] == len(_tokens(seen[:-1]))
    slot_free(front)


def _metrics(front: Front) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    req = urllib.request.Request(f"http://127.0.0.1:{front.port}/metrics",
                                 headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return samples(r.read().decode())


def test_feedback_lands_in_the_log_and_the_metrics(front: Front) -> None:
    before = _metrics(front).get(("modeld_ws_feedback_total", (("rating", "negative"),)), 0.0)
    with _client(front) as c:
        _, done = _greedy(c, 4)
        c.feedback(-0.5, "too long", position=3)
        ack = c.recv()
        assert ack == {"type": "status", "request_id": done["request_id"], "operation": "feedback", "message": "recorded"}
        c.feedback(2.0)  # out of range: refused, nothing logged
        bad = c.recv()
        assert bad["type"] == "error" and bad["code"] == "invalid_message" and bad["recoverable"] is False
    assert _metrics(front)[("modeld_ws_feedback_total", (("rating", "negative"),))] == before + 1
    log = (front.daemon.tmp / "data" / "feedback.jsonl").read_text().splitlines()
    entry = json.loads(log[-1])
    assert entry["request_id"] == done["request_id"] and entry["rating"] == -0.5 and entry["text"] == "too long"
    assert entry["position"] == 3 and entry["digest"].startswith("sha256:") and entry["model"]
    listed = subprocess.run([sys.executable, "-m", "modeld", "feedback", "--data-dir", str(front.daemon.tmp / "data"),
                             "--json", "--last", "1"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and json.loads(listed.stdout) == entry


@pytest.mark.parametrize("raw, code", [
    ("{not json", "invalid_json"),
    (json.dumps({"type": "launch"}), "invalid_message"),
    (json.dumps({"type": "control", "action": "stop"}), "no_generation"),
    (json.dumps({"type": "control", "action": "resume"}), "no_generation"),
    (json.dumps({"type": "config", "messages": MESSAGES, "parameters": {"temprature": 1}}), "invalid_message"),
    (json.dumps({"type": "config", "prompt": "a", "messages": MESSAGES}), "invalid_message"),
    (json.dumps({"type": "feedback", "rating": 1}), "no_generation"),
])
def test_a_bad_message_is_a_typed_error_and_the_connection_serves_on(front: Front, raw: str, code: str) -> None:
    with _client(front) as c:
        c._ws.send(raw)
        err = c.recv()
        assert err["type"] == "error" and err["code"] == code and err["recoverable"] is False, err
        assert err["error"] == "invalid_request" and err["recovery_action"]
        _, done = _greedy(c, 2)
        assert done["usage"]["completion_tokens"] >= 1


def test_a_second_config_while_one_runs_is_refused_and_the_first_goes_on(front: Front) -> None:
    with _client(front) as c:
        c.config(messages=MESSAGES, max_tokens=32, temperature=0)
        c.config(messages=MESSAGES, max_tokens=4, temperature=0)
        refused: list[dict[str, Any]] = []
        done = None
        while done is None:
            m = c.recv()
            if m["type"] == "error":
                refused.append(m)
            elif m["type"] == "completion":
                done = m
        assert [e["code"] for e in refused] == ["generation_running"] and refused[0]["recoverable"] is True
        assert done["usage"]["completion_tokens"] >= 1


_KILLED = """
import sys, time
from runtime.ws import WsClient
c = WsClient(sys.argv[1], api_key=sys.argv[2])
c.config(messages=[{"role": "user", "content": "Write a long story about a lighthouse."}], max_tokens=2000,
         temperature=0)
for m in c.messages():
    if m["type"] == "token":
        print(m["request_id"], flush=True)
        time.sleep(3600)
"""


def killed_client(front: Front, code: str, *args: str) -> str:
    """Run ``code`` as a client process until it prints its first line (its request is running then: the slot is
    held), SIGKILL it, and wait until the slot is free; the line."""
    with subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True,
                          cwd=Path(__file__).resolve().parent.parent, env={**os.environ, "PYTHONPATH": "."}) as proc:
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline().strip()
            with front.daemon.client(timeout_s=10.0) as d:
                assert d.status().session_open
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            slot_free(front)
        finally:
            if proc.poll() is None:
                proc.kill()
    return first


def test_a_killed_client_frees_the_slot(front: Front) -> None:
    rid = killed_client(front, _KILLED, _url(front), API_KEY)
    assert rid.startswith("gen_")
    # the generation was cut short when its client went, not run on to its 2,000 tokens
    line = front.daemon.wait_lines(lambda ln: f"ws {rid} " in ln)[-1]
    assert "finish=cancelled error=client_gone" in line, line


def test_the_api_key_is_required(front: Front) -> None:
    import websockets.exceptions  # (a submodule: "import websockets" alone may not have loaded it)

    with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
        WsClient(_url(front), api_key="wrong")
    assert refused.value.response.status_code == 403
    # no key in the header: the first message must carry it
    with WsClient(_url(front), timeout_s=30.0) as c:
        c.config(messages=MESSAGES, max_tokens=2)
        err = c.recv()
        assert err["code"] == "invalid_api_key" and err["error"] == "unauthorized" and err["recoverable"] is False
        with pytest.raises(websockets.exceptions.ConnectionClosed):
            c.recv()
    with _client(front, key_in_header=False) as c:
        assert c.recv()["operation"] == "authenticated"
        _, done = _greedy(c, 2)
        assert done["usage"]["completion_tokens"] >= 1


def test_the_message_schema_is_published(front: Front) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{front.port}/v1/ws/schema",
                                 headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        schema = json.loads(r.read())
    client = json.dumps(schema["client"])
    server = json.dumps(schema["server"])
    for kind in ("auth", "config", "control", "feedback"):
        assert f'"{kind}"' in client
    for kind in ("init", "token", "completion", "status", "error"):
        assert f'"{kind}"' in server


def test_controls_from_another_thread_while_reading(front: Front) -> None:
    """The client's reads on one thread, its controls from another (the way a UI drives it)."""
    with _client(front) as c:
        c.config(messages=MESSAGES, max_tokens=300, temperature=0)
        got_token = threading.Event()

        def stopper() -> None:
            got_token.wait(120)
            c.control("stop")

        t = threading.Thread(target=stopper)
        t.start()
        for m in c.messages():
            if m["type"] == "token":
                got_token.set()
        t.join()
    assert m["type"] == "completion" and m["finish_reason"] in ("cancelled", "stop")
