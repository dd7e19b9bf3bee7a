"""The agent-trace section of ``make bench``: a ten-turn tool-using conversation, modeld next to the peer.

The trace is what a coding agent sends: a ~2k-token system prompt (a repo map)
with three tools, a question, then per turn the model's own reply fed back —
every other reply followed by a tool call and its result (100–400 tokens), the
rest by a user follow-up. The trace runs through the runtime chat API
(``runtime.Chat``, over ZeroMQ); then the same message lists go, with the same
``openai`` SDK code (streamed), to llama-cpp-python's own OpenAI server (same
GGUF and thread count, its longest-common-prefix cache) and to a fresh modeld
through its OpenAI-compatible HTTP front. The model is the tool-capable fixture (the
bundled weights under a tool-aware template) so both render the tools.

Per turn: time to first token on both sides, and modeld's prefilled tokens
against the new message's tokens. Also: modeld's time over its engine's own
work for the turn (prefill + first token, as the daemon measured them), and
how many default-mode turns answer differently from a cold prefill of the same
history (exact mode answers alike by construction; tested in the suite).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from backends.devices import usable_cpus
from benchmarks.common import served, text_of_tokens
from harness.daemon import DaemonProcess, free_port
from runtime import Chat

REPLY_TOKENS = 32
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite, or one test.",
                                      "parameters": {"type": "object", "properties": {"select": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "grep", "description": "Search the repository for a pattern.",
                                      "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]}}},
]
QUESTIONS = [
    "Why does test_handler_7 fail on negative input?",
    "Which module defines Handler7, and what does run() return for x = -3?",
    "Propose the smallest fix and say which test proves it.",
    "Is the same bug anywhere else in the repository?",
    "Summarise the change for the commit message.",
]
TOOL_LINE = "{i:04d}: ok tests/test_handler_{i}.py::test_run_{i} PASSED in 0.0{i}s"


def trace_turn_messages(count: Any, turn: int, reply: str) -> list[dict[str, Any]]:
    """What the agent appends after the model's reply to turn ``turn`` (0-based)."""
    if turn % 2 == 0:
        name = TOOLS[(turn // 2) % len(TOOLS)]["function"]["name"]
        call = {"id": f"call_{turn}", "type": "function", "function": {"name": name, "arguments": json.dumps({"path": f"src/pkg/module_{turn}.py"})}}
        result = text_of_tokens(count, 100 + 60 * turn, TOOL_LINE)  # 100..400 tokens
        return [
            {"role": "assistant", "content": reply, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "name": name, "content": result},
        ]
    return [{"role": "assistant", "content": reply}, {"role": "user", "content": QUESTIONS[(turn // 2 + 1) % len(QUESTIONS)]}]


def run_modeld(d: DaemonProcess, count: Any, system: str, turns: int) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
    """The trace through the chat API; returns each request's message list and what each turn measured."""
    history: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[0]}]
    sent: list[list[dict[str, Any]]] = []
    rows: list[dict[str, Any]] = []
    with d.client(timeout_s=600.0) as c, Chat(c, profile="agent-" + uuid.uuid4().hex[:8]) as chat:
        for k in range(turns):
            sent.append([dict(m) for m in history])
            r = chat.send(history, tools=TOOLS, max_tokens=REPLY_TOKENS, temperature=0.0)
            rows.append(
                {
                    "ttft_ms": r.timing.ttft_ms,
                    "prompt": r.usage.prompt_tokens,
                    "reused": r.usage.reused_tokens,
                    "prefilled": r.usage.prefilled_tokens,
                    "completion": r.usage.completion_tokens,
                    "engine_ms": r.timing.prefill_ms + r.timing.first_token_ms,
                    "reply": r.message.content or "",
                }
            )
            history += trace_turn_messages(count, k, r.message.content or "")
    return sent, rows


def cold_reply(d: DaemonProcess, messages: list[dict[str, Any]]) -> str:
    """The reply to a cold turn of the same history (another profile: nothing is reused)."""
    with d.client(timeout_s=600.0) as c, Chat(c, profile="cold-" + uuid.uuid4().hex[:8]) as chat:
        r = chat.send(messages, tools=TOOLS, max_tokens=REPLY_TOKENS, temperature=0.0)
        return r.message.content or ""


def sdk_turns(
    base_url: str, model: str, sent: list[list[dict[str, Any]]], tools: list[dict[str, Any]] | None = TOOLS,
    *, pause_s: float = 0.0,
) -> list[dict[str, float]]:
    """Each message list through the official ``openai`` SDK, streamed: time to first token and usage.

    The same code for modeld's HTTP front and for the peer; a turn's reply is read
    to the end before the next request, as an agent does, and ``pause_s`` passes
    after it (the agent running its tools).
    """
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    out: list[dict[str, float]] = []
    try:
        for messages in sent:
            t0 = time.perf_counter()
            first = float("nan")
            prompt = cached = float("nan")
            extra: dict[str, Any] = {"tools": tools} if tools else {}
            stream = client.chat.completions.create(  # type: ignore[call-overload]
                model=model, messages=messages, max_tokens=REPLY_TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True}, **extra,
            )
            for chunk in stream:
                if chunk.choices and first != first:  # NaN: nothing yet
                    delta = chunk.choices[0].delta
                    if delta.content or delta.tool_calls:
                        first = (time.perf_counter() - t0) * 1000
                if chunk.usage is not None:
                    prompt = chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    cached = details.cached_tokens if details is not None and details.cached_tokens is not None else float("nan")
            out.append({"ttft_ms": first, "prompt": prompt, "cached": cached})
            time.sleep(pause_s)
    finally:
        client.close()
    return out


def responses_items(messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """A chat message list as the Responses API carries it: the system text as ``instructions``, the rest as items."""
    instructions = ""
    items: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content")
        if role == "system":
            instructions = content or ""
        elif role == "user":
            items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": content}]})
        elif role == "assistant":
            if content:
                items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": content}]})
            for call in m.get("tool_calls") or []:
                items.append({"type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
                              "arguments": call["function"]["arguments"]})
        elif role == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": content})
    return instructions, items


def responses_turns(base_url: str, model: str, sent: list[list[dict[str, Any]]], *, stateful: bool) -> list[dict[str, float]]:
    """The message lists through the official SDK's ``responses``, streamed: stateless (the whole input every
    turn, ``store: false``, as Codex sends) or stateful (``previous_response_id`` and only what is new: the
    tool call and its output or the next question; the reply is the stored response's own)."""
    import openai

    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    out: list[dict[str, float]] = []
    previous: str | None = None
    try:
        for k, messages in enumerate(sent):
            instructions, items = responses_items(messages)
            extra: dict[str, Any] = {"store": stateful}
            if stateful and previous is not None:
                new = [m for m in messages[len(sent[k - 1]) :]]
                new[0] = {**new[0], "content": None}  # the reply itself is the stored response's
                extra["previous_response_id"] = previous
                items = responses_items(new)[1]
            t0 = time.perf_counter()
            first = float("nan")
            prompt = cached = float("nan")
            stream = client.responses.create(model=model, instructions=instructions, input=items, tools=tools,  # type: ignore[arg-type]
                                             max_output_tokens=REPLY_TOKENS, temperature=0, stream=True, **extra)
            event: Any
            for event in stream:
                if first != first and event.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
                    first = (time.perf_counter() - t0) * 1000
                if event.type in ("response.completed", "response.incomplete"):
                    usage = event.response.usage
                    previous = event.response.id
                    if usage is not None:
                        prompt, cached = usage.input_tokens, usage.input_tokens_details.cached_tokens
            out.append({"ttft_ms": first, "prompt": prompt, "cached": cached})
    finally:
        client.close()
    return out


@contextlib.contextmanager
def peer_server(tmp: Path, model: Path, n_ctx: int, *extra: str) -> Iterator[int]:
    """llama-cpp-python's OpenAI server on a free loopback port, with the daemon's thread count; yields the port.

    ``extra``: more server flags (e.g. ``--cache true --cache_type ram``)."""
    port = free_port()
    threads = str(usable_cpus())  # its own default is half the cores
    argv = [sys.executable, "-m", "benchmarks.peer_server", "--model", str(model), "--n_ctx", str(n_ctx),
            "--n_threads", threads, "--n_threads_batch", threads, "--host", "127.0.0.1", "--port", str(port), *extra]
    with served(argv, tmp / f"peer-{port}.log", port, path="/v1/models", timeout_s=120.0):
        yield port


def run_peer(tmp: Path, model: Path, n_ctx: int, sent: list[list[dict[str, Any]]]) -> list[float]:
    with peer_server(tmp, model, n_ctx) as port:
        return [r["ttft_ms"] for r in sdk_turns(f"http://127.0.0.1:{port}/v1", str(model), sent)]


def run_llama_server(tmp: Path, model: Path, n_ctx: int, sent: list[list[dict[str, Any]]], *,
                     tools: list[dict[str, Any]] | None = TOOLS, log: str = "agent-llama-server.log",
                     pause_s: float = 0.0) -> list[dict[str, float]]:
    """The message lists through a fresh llama.cpp llama-server at its defaults (``benchmarks.llama_server.serving``),
    its output in ``tmp / log``."""
    from benchmarks import llama_server

    with llama_server.serving(model, n_ctx, tmp / log) as port:
        return sdk_turns(f"http://127.0.0.1:{port}/v1", str(model), sent, tools=tools, pause_s=pause_s)


def run_front(tmp: Path, backend: str, model: Path, n_ctx: int, port: int, sent: list[list[dict[str, Any]]],
              api: str = "chat") -> list[dict[str, float]]:
    """The same message lists through modeld's HTTP front (a fresh daemon: turn 1 is cold again), by chat
    completions (``api="chat"``) or the Responses API, stateless (``"responses"``) or with
    ``previous_response_id`` (``"responses-stateful"``)."""
    args = ("--model", str(model), "--model-name", "agent", "--num-ctx", str(n_ctx), "--http", f"127.0.0.1:{port}")
    d = DaemonProcess(tmp / f"agent-front-{api}-{backend}", backend, None, *args).start(wait_state=("Ready",))
    try:
        url = f"http://127.0.0.1:{port}/v1"
        if api == "chat":
            return sdk_turns(url, "agent", sent)
        return responses_turns(url, "agent", sent, stateful=api == "responses-stateful")
    finally:
        d.stop()


def summarise(
    backend: str,
    rows: list[dict[str, Any]],
    peer: list[float] | None,
    differ: int,
    replayed: int,
    front: list[dict[str, float]] | None = None,
    llama: list[dict[str, float]] | None = None,
) -> list[tuple[str, Any, str]]:
    """The section's table rows (``llama``: llama-server's turns, beside llama-cpp-python's server's ``peer``)."""
    out: list[tuple[str, Any, str]] = []
    met = 0
    for k, r in enumerate(rows):
        new = r["prompt"] - (rows[k - 1]["prompt"] + rows[k - 1]["completion"]) if k else r["prompt"]
        ok = k == 0 or r["prefilled"] <= new + 16
        met += ok and k > 0
        peer_note = f"; peer {peer[k]:,.0f} ms" if peer else ""
        if front:
            peer_note += f"; modeld over HTTP {front[k]['ttft_ms']:,.0f} ms (cached {front[k]['cached']:.0f})"
        if llama:
            peer_note += f"; llama-server {llama[k]['ttft_ms']:,.0f} ms (prompt {llama[k]['prompt']:.0f})"
        out.append((f"turn {k + 1} TTFT ms", r["ttft_ms"],
                    f"prompt {r['prompt']}, reused {r['reused']}, prefilled {r['prefilled']} (new {new}){peer_note}"))
    warm = [r["ttft_ms"] for r in rows[1:]]
    out.append(("turns 2+ prefilled <= new + 16", f"{met}/{len(rows) - 1}", "target: all " + ("(met)" if met == len(rows) - 1 else "(MISSED)")))
    out.append(("median warm-turn TTFT ms (modeld)", statistics.median(warm), f"{backend}, turns 2-{len(rows)}"))
    if peer:
        peer_warm = statistics.median(peer[1:])
        ratio = statistics.median(warm) / peer_warm
        out.append(("median warm-turn TTFT ms (peer)", peer_warm, "llama-cpp-python server, same message lists and threads"))
        out.append(("modeld / peer warm TTFT", ratio, "target <= 0.80 " + ("(met)" if ratio <= 0.8 else "(MISSED)")))
        if front:
            sdk_warm = statistics.median(r["ttft_ms"] for r in front[1:])
            out.append(("median warm-turn TTFT ms (modeld, OpenAI SDK)", sdk_warm,
                        f"the same SDK code against modeld's HTTP front: {sdk_warm / peer_warm:.3f}x the peer"))
        out.append(("peer turn-1 TTFT ms", peer[0], f"modeld {rows[0]['ttft_ms']:,.0f} ms (both cold)"))
    if llama:
        ls_warm = statistics.median(r["ttft_ms"] for r in llama[1:])
        ratio = statistics.median(warm) / ls_warm
        out.append(("median warm-turn TTFT ms (llama-server)", ls_warm,
                    "llama.cpp's server at its defaults (RAM prompt cache on), same message lists, file and threads"))
        out.append(("modeld / llama-server warm TTFT", ratio, "target <= 0.50 " + ("(met)" if ratio <= 0.5 else "(MISSED)")))
        out.append(("llama-server turn-1 TTFT ms", llama[0]["ttft_ms"],
                    f"prompt {llama[0]['prompt']:.0f} tokens; modeld {rows[0]['ttft_ms']:,.0f} ms, {rows[0]['prompt']} "
                    "tokens (both cold)"))
    over = [r["ttft_ms"] / r["engine_ms"] - 1 for r in rows[1:] if r["engine_ms"] > 0]
    if over:
        med = statistics.median(over)
        out.append(("daemon time over the engine's prefill", f"{med * 100:.1f}%",
                    "client TTFT vs the engine's prefill + first token as the daemon timed them (median); target <= 5% " + ("(met)" if med <= 0.05 else "(MISSED)")))
    out.append(("default mode: turns unlike a cold prefill", f"{differ}/{replayed}",
                "greedy replies when decoded tokens' KV is reused (Config.exact_reuse recomputes them)"))
    return out


def section(tmp: Path, backend: str, count: Any, *, turns: int = 10, replay: int = 6, with_peer: bool = True) -> list[tuple[str, Any, str]]:
    from harness.fixtures import tool_gguf

    model = tool_gguf()
    system = text_of_tokens(count, 1800, "src/pkg/module_{i}.py: class Handler{i}(Base): def run(self, x): return x * {i}")
    n_ctx = 8192
    with DaemonProcess(tmp / f"agent-{backend}", backend, None, "--model", str(model), "--num-ctx", str(n_ctx)) as d:
        sent, rows = run_modeld(d, count, system, turns)
        written_trace = _disk_written(d)
        differ = 0
        for k in range(min(replay, turns)):
            differ += cold_reply(d, sent[k]) != rows[k]["reply"]
        written_all = _disk_written(d)
    cache_dir = d.tmp / "data" / "cache"
    on_disk = sum(p.stat().st_size for p in cache_dir.glob("*.kv")) if cache_dir.is_dir() else 0
    peer: list[float] | None = None
    front: list[dict[str, float]] | None = None
    llama: list[dict[str, float]] | None = None
    if with_peer:
        peer = run_peer(tmp, model, n_ctx, sent)
        llama = run_llama_server(tmp, model, n_ctx, sent)
        front = run_front(tmp, backend, model, n_ctx, free_port(), sent)
    out = summarise(backend, rows, peer, differ, min(replay, turns), front, llama)
    if front:
        chat_warm = statistics.median(r["ttft_ms"] for r in front[1:])
        for api, what in (("responses", "stateless, the whole input each turn"),
                          ("responses-stateful", "previous_response_id, only the new items")):
            got = run_front(tmp, backend, model, n_ctx, free_port(), sent, api=api)
            warm = statistics.median(r["ttft_ms"] for r in got[1:])
            cached = sum(r["cached"] for r in got[1:]) / max(1.0, sum(r["prompt"] for r in got[1:]))
            ratio = warm / chat_warm
            out.append((f"{api} / chat completions warm TTFT", ratio,
                        f"{what}: median {warm:,.0f} ms against {chat_warm:,.0f} ms, cached {cached:.2f} of turns 2+'s "
                        "input; target within 5% " + ("(met)" if abs(ratio - 1) <= 0.05 else "(MISSED)")))
    out.append(("workspace cache disk writes per turn", f"{written_trace / turns / 2**20:.1f} MiB",
                 f"during the {turns}-turn trace (one conversation); with {min(replay, turns)} cold replays of other "
                 f"conversations {written_all / 2**20:.1f} MiB in all; after the stop {on_disk / 2**20:.1f} MiB on disk"))
    return out


def _disk_written(d: DaemonProcess) -> int:
    """Bytes the daemon process has written so far (``write_chars``: its cache files, blobs and log lines; the
    same count whatever the cache's policy, so policies compare)."""
    import psutil

    assert d.proc is not None
    return int(psutil.Process(d.proc.pid).io_counters().write_chars)
