"""The streams section of ``make bench``: the same generation over chat completions' SSE stream, the WebSocket
protocol and Evergreen over gRPC, on both engines.

One daemon per engine serves the bundled model with its HTTP front and ``--grpc``. One user text, ~600 tokens of
code and a short question (resident after the first round), greedy, ``MAX_TOKENS`` tokens: each round sends it
once over SSE (httpx, the raw stream), once over ``/v1/ws`` (``runtime.ws.WsClient``) and once over gRPC
(``runtime.evergreen.EvergreenClient``), the same tokens and the same reply on all three, the order rotating by
round, each client's connection opened once before the rounds. Per protocol: the median time to the first
token and the median gap between tokens (the reply's first to its last piece, over the pieces between). Target
(issue: the seeds' streaming protocols): the WebSocket and gRPC within a few percent of SSE.
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
from runtime.evergreen import EvergreenClient
from runtime.ws import WsClient

ROUNDS = 12
MAX_TOKENS = 64
QUESTION = "Summarise what the helpers above have in common, in a few sentences."


def _sse(http: httpx.Client, port: int, messages: list[dict[str, str]]) -> tuple[float, list[float]]:
    """Seconds to the first content delta, and when each delta came."""
    body = {"model": "default", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    times: list[float] = []
    t0 = time.perf_counter()
    with http.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                delta = choices[0].get("delta") or {}
                if delta.get("content"):
                    times.append(time.perf_counter())
    return (times[0] - t0) if times else float("nan"), times


def _ws(ws: WsClient, messages: list[dict[str, str]]) -> tuple[float, list[float]]:
    times: list[float] = []
    t0 = time.perf_counter()
    ws.generate(messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                on_message=lambda m: times.append(time.perf_counter()) if m.get("token") else None)
    return (times[0] - t0) if times else float("nan"), times


def _grpc(client: EvergreenClient, messages: list[dict[str, str]]) -> tuple[float, list[float]]:
    times: list[float] = []
    s = client.session()
    t0 = time.perf_counter()
    s.send(s.generate("prompt", "reply", {"max_tokens": MAX_TOKENS, "temperature": 0}),
           s.text("prompt", "\n\n".join(m["content"] for m in messages)))
    while True:
        m = next(s._replies)
        f = m.node_fragment
        if f.chunk_fragment.data:
            times.append(time.perf_counter())
        if not f.continued:
            break
    s.close()
    return (times[0] - t0) if times else float("nan"), times


def _gap_ms(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1) * 1000 if len(times) > 1 else float("nan")


def run(tmp: Path, backend: str, count: Any) -> dict[str, Any]:
    system = text_of_tokens(count, 600, PREFIX_LINE)
    # one user text, which Evergreen's nodes give as they are: the three send the same tokens and, greedy, get the
    # same reply (a system turn would part the gRPC prompt from the others' at its first tokens, and each switch
    # between them would restore a prompt from the workspace cache inside the time measured)
    messages = [{"role": "user", "content": f"{system}\n\n{QUESTION}"}]
    port, grpc_port = free_port(), free_port()
    out: dict[str, list[float]] = {f"{n}_{k}": [] for n in ("sse", "ws", "grpc") for k in ("ttft", "gap")}
    with DaemonProcess(tmp / f"streams-{backend}", backend, None, "--num-ctx", "4096", "--http",
                       f"127.0.0.1:{port}", "--grpc", f"127.0.0.1:{grpc_port}").start(wait_state=("Ready",)):
        wait_http(port)
        # each client's connection is opened once, as an agent's or an editor's client keeps it: a time runs from
        # the request's send (a fresh httpx client alone costs ~30 ms of TLS set-up before it sends anything)
        with httpx.Client(timeout=600) as http, WsClient(f"ws://127.0.0.1:{port}/v1/ws") as ws, \
                EvergreenClient(f"127.0.0.1:{grpc_port}") as grpc:
            runs = {"sse": lambda: _sse(http, port, messages), "ws": lambda: _ws(ws, messages),
                    "grpc": lambda: _grpc(grpc, messages)}
            names = list(runs)
            for name in names:  # each protocol's prompt resident for every measured round
                runs[name]()
            for k in range(ROUNDS):
                for name in names[k % 3:] + names[:k % 3]:
                    ttft, times = runs[name]()
                    out[f"{name}_ttft"].append(ttft * 1000)
                    out[f"{name}_gap"].append(_gap_ms(times))
    return {k: statistics.median(v) for k, v in out.items()}


def section(tmp: Path, count: Any) -> list[tuple[str, Any, str]]:
    rows: list[tuple[str, Any, str]] = []
    for backend in ("llama", "openvino"):
        r = run(tmp, backend, count)
        for name, label in (("ws", "WebSocket"), ("grpc", "gRPC")):
            rows += [
                (f"{backend}: time to first token, SSE / {label}", f"{r['sse_ttft']:.0f} / {r[name + '_ttft']:.0f} ms",
                 f"{r[name + '_ttft'] / r['sse_ttft']:.2f}x (median of {ROUNDS}; goal: within a few percent)"),
                (f"{backend}: between tokens, SSE / {label}", f"{r['sse_gap']:.1f} / {r[name + '_gap']:.1f} ms",
                 f"{r[name + '_gap'] / r['sse_gap']:.2f}x"),
            ]
    return rows
