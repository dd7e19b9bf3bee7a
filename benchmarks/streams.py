"""The streams section of ``make bench``: the same generation over the WebSocket protocol and over chat
completions' SSE stream, on both engines.

One daemon per engine serves the bundled model with its HTTP front. A ~600-token system prompt (resident after the
first round) and a short question, greedy, ``MAX_TOKENS`` tokens: each round sends it once over SSE (httpx, the
raw stream) and once over ``/v1/ws`` (``runtime.ws.WsClient``), the order alternating by round. Per protocol: the
median time to the first token and the median gap between tokens (the reply's first to its last token, over the
tokens between). Target (issue: the seeds' streaming protocols): the WebSocket within a few percent of SSE.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import PREFIX_LINE, text_of_tokens
from harness.daemon import DaemonProcess, free_port, wait_http
from runtime.ws import WsClient

ROUNDS = 6
MAX_TOKENS = 64
QUESTION = "Summarise what the helpers above have in common, in a few sentences."


def _sse(port: int, messages: list[dict[str, str]]) -> tuple[float, list[float]]:
    """Seconds to the first content delta, and when each delta came."""
    body = {"model": "default", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    times: list[float] = []
    t0 = time.perf_counter()
    with httpx.Client(timeout=600) as http, http.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions",
                                                        json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                delta = choices[0].get("delta") or {}
                if delta.get("content"):
                    times.append(time.perf_counter())
    return (times[0] - t0) if times else float("nan"), times


def _ws(port: int, messages: list[dict[str, str]]) -> tuple[float, list[float]]:
    times: list[float] = []
    with WsClient(f"ws://127.0.0.1:{port}/v1/ws") as c:
        t0 = time.perf_counter()
        c.generate(messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                   on_message=lambda m: times.append(time.perf_counter()) if m.get("token") else None)
    return (times[0] - t0) if times else float("nan"), times


def _gap_ms(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1) * 1000 if len(times) > 1 else float("nan")


def run(tmp: Path, backend: str, count: Any) -> dict[str, Any]:
    system = text_of_tokens(count, 600, PREFIX_LINE)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    port = free_port()
    out: dict[str, list[float]] = {"sse_ttft": [], "sse_gap": [], "ws_ttft": [], "ws_gap": []}
    with DaemonProcess(tmp / f"streams-{backend}", backend, None, "--num-ctx", "4096",
                       "--http", f"127.0.0.1:{port}").start(wait_state=("Ready",)):
        wait_http(port)
        _sse(port, messages)  # the system prompt resident for every measured round
        for k in range(ROUNDS):
            for name in (("sse", "ws") if k % 2 == 0 else ("ws", "sse")):
                ttft, times = (_sse if name == "sse" else _ws)(port, messages)
                out[f"{name}_ttft"].append(ttft * 1000)
                out[f"{name}_gap"].append(_gap_ms(times))
    return {k: statistics.median(v) for k, v in out.items()}


def section(tmp: Path, count: Any) -> list[tuple[str, Any, str]]:
    rows: list[tuple[str, Any, str]] = []
    for backend in ("llama", "openvino"):
        r = run(tmp, backend, count)
        rows += [
            (f"{backend}: time to first token, SSE / WebSocket", f"{r['sse_ttft']:.0f} / {r['ws_ttft']:.0f} ms",
             f"{r['ws_ttft'] / r['sse_ttft']:.2f}x (median of {ROUNDS}; goal: within a few percent)"),
            (f"{backend}: between tokens, SSE / WebSocket", f"{r['sse_gap']:.1f} / {r['ws_gap']:.1f} ms",
             f"{r['ws_gap'] / r['sse_gap']:.2f}x"),
        ]
    return rows
