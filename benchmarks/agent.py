"""The agent-trace section of ``make bench``: a ten-turn tool-using conversation, modeld next to the peer.

The trace is what a coding agent sends: a ~2k-token system prompt (a repo map)
with three tools, a question, then per turn the model's own reply fed back —
every other reply followed by a tool call and its result (100–400 tokens), the
rest by a user follow-up. The same message lists go through the runtime chat
API (``runtime.Chat``, over ZeroMQ) and, with the same GGUF and thread count,
to llama-cpp-python's own OpenAI server (streamed over HTTP, its
longest-common-prefix cache). The model is the tool-capable fixture (the
bundled weights under a tool-aware template) so both render the tools.

Per turn: time to first token on both sides, and modeld's prefilled tokens
against the new message's tokens. Also: modeld's time over its engine's own
work for the turn (prefill + first token, as the daemon measured them), and
how many default-mode turns answer differently from a cold prefill of the same
history (exact mode answers alike by construction; tested in the suite).
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import text_of_tokens
from runtime import Chat
from tests.daemon_proc import DaemonProcess

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


def _peer_ttft(port: int, messages: list[dict[str, Any]]) -> float:
    body = json.dumps({"messages": messages, "tools": TOOLS, "max_tokens": REPLY_TOKENS, "temperature": 0, "stream": True})
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    ttft = float("nan")
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data:") and ('"content"' in line or '"tool_calls"' in line) and '"content":null' not in line.replace(" ", ""):
            ttft = (time.perf_counter() - t0) * 1000
            break
    for _ in resp:  # let the reply finish: the peer caches the whole turn, as an agent would wait for it
        pass
    conn.close()
    return ttft


def start_peer(tmp: Path, model: Path, n_ctx: int, port: int) -> subprocess.Popen[bytes]:
    threads = str(os.cpu_count() or 1)
    log = (tmp / f"peer-{port}.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.peer_server", "--model", str(model), "--n_ctx", str(n_ctx),
         "--n_threads", threads, "--n_threads_batch", threads, "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/v1/models")
            if c.getresponse().status == 200:
                return proc
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"llama_cpp.server did not start; see {log.name}")
        time.sleep(0.3)


def run_peer(tmp: Path, model: Path, n_ctx: int, port: int, sent: list[list[dict[str, Any]]]) -> list[float]:
    proc = start_peer(tmp, model, n_ctx, port)
    try:
        return [_peer_ttft(port, messages) for messages in sent]
    finally:
        proc.terminate()
        proc.wait(30)


def summarise(backend: str, rows: list[dict[str, Any]], peer: list[float] | None, differ: int, replayed: int) -> list[tuple[str, Any, str]]:
    """The section's table rows."""
    out: list[tuple[str, Any, str]] = []
    met = 0
    for k, r in enumerate(rows):
        new = r["prompt"] - (rows[k - 1]["prompt"] + rows[k - 1]["completion"]) if k else r["prompt"]
        ok = k == 0 or r["prefilled"] <= new + 16
        met += ok and k > 0
        peer_note = f"; peer {peer[k]:,.0f} ms" if peer else ""
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
        out.append(("peer turn-1 TTFT ms", peer[0], f"modeld {rows[0]['ttft_ms']:,.0f} ms (both cold)"))
    over = [r["ttft_ms"] / r["engine_ms"] - 1 for r in rows[1:] if r["engine_ms"] > 0]
    if over:
        med = statistics.median(over)
        out.append(("daemon time over the engine's prefill", f"{med * 100:.1f}%",
                    "client TTFT vs the engine's prefill + first token as the daemon timed them (median); target <= 5% " + ("(met)" if med <= 0.05 else "(MISSED)")))
    out.append(("default mode: turns unlike a cold prefill", f"{differ}/{replayed}",
                "greedy replies when decoded tokens' KV is reused (Config.exact_reuse recomputes them)"))
    return out


def section(tmp: Path, backend: str, count: Any, *, turns: int = 10, replay: int = 6, with_peer: bool = True) -> list[tuple[str, Any, str]]:
    from tests.fixtures import tool_gguf

    model = tool_gguf()
    system = text_of_tokens(count, 1800, "src/pkg/module_{i}.py: class Handler{i}(Base): def run(self, x): return x * {i}")
    n_ctx = 8192
    with DaemonProcess(tmp / f"agent-{backend}", backend, None, "--model", str(model), "--num-ctx", str(n_ctx)) as d:
        sent, rows = run_modeld(d, count, system, turns)
        differ = 0
        for k in range(min(replay, turns)):
            differ += cold_reply(d, sent[k]) != rows[k]["reply"]
    peer: list[float] | None = None
    if with_peer:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        peer = run_peer(tmp, model, n_ctx, port, sent)
    return summarise(backend, rows, peer, differ, min(replay, turns))
