"""The first request: cold prefill of an agent-sized prompt (8k, 16k and 22k tokens) on both engines, beside
llama.cpp's own ``llama-server`` on the same file and threads.

Each server serves the context-extended bundled GGUF (``make run``'s model) with a 32,768-token window and
the machine's cores as threads; each request is a chat completion with one output token and a system prompt
nobody sent before (a new head line), so nothing is reused. The figure is prompt tokens over the request's
wall time, as a client sees it. ``llama-server`` runs one slot (``-np 1``: its default splits the window in
four, where a 22k prompt does not fit). Nothing here asserts a timing.
"""

from __future__ import annotations

import http.client
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import PREFIX_LINE, text_of_tokens
from harness.daemon import DaemonProcess, free_port, wait_http

__all__ = ["LENGTHS", "rows", "section"]

#: the agents' first requests: OpenCode ~8k, Codex ~10k, Qwen Code ~19k, Claude Code ~22k tokens
LENGTHS = (8192, 16384, 22528)
NUM_CTX = 32768
REQUEST_TIMEOUT_S = 1800.0


def _post(port: int, path: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """The request's wall time in seconds and its JSON reply."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        t0 = time.perf_counter()
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json", "Authorization": "Bearer none"})
        r = c.getresponse()
        raw = r.read()
        took = time.perf_counter() - t0
    finally:
        c.close()
    if r.status != 200:
        raise RuntimeError(f"{path}: HTTP {r.status}: {raw[:300]!r}")
    return took, json.loads(raw)


def _cold(port: int, prompts: dict[int, str]) -> dict[int, tuple[int, float]]:
    """Per length: (prompt tokens, seconds) of a one-token chat completion on a prompt nobody sent before."""
    out: dict[int, tuple[int, float]] = {}
    for n, text in prompts.items():
        head = f"# workspace {uuid.uuid4().hex}\n"
        body = {"model": "default", "max_tokens": 1, "temperature": 0, "stream": False,
                "messages": [{"role": "system", "content": head + text}, {"role": "user", "content": "Summarize."}]}
        took, reply = _post(port, "/v1/chat/completions", body)
        out[n] = (int(reply["usage"]["prompt_tokens"]), took)
    return out


def _modeld(tmp: Path, backend: str, model: Path, prompts: dict[int, str]) -> dict[int, tuple[int, float]]:
    port = free_port()
    d = DaemonProcess(tmp / f"cold-{backend}", backend, None, "--model", str(model), "--num-ctx", str(NUM_CTX),
                      "--http", f"127.0.0.1:{port}")
    d.start(ready_timeout_s=900, wait_state=("Ready",))
    try:
        wait_http(port, "/health", timeout_s=300.0)
        return _cold(port, prompts)
    finally:
        d.stop()


def _llama_server(model: Path, prompts: dict[int, str], log: Path) -> dict[int, tuple[int, float]]:
    from benchmarks import llama_server

    with llama_server.serving(model, NUM_CTX, log) as port:
        return _cold(port, prompts)


def section(tmp: Path, count: Callable[[str], int]) -> dict[str, dict[int, tuple[int, float]]]:
    """{server: {length: (prompt tokens, seconds)}}; a server that could not run is left out (and said why)."""
    from backends.bundled import served_bundled_gguf
    from benchmarks import llama_server

    model = served_bundled_gguf()
    prompts = {n: text_of_tokens(count, n - 40, PREFIX_LINE) for n in LENGTHS}  # (the template and head: ~40)
    out: dict[str, dict[int, tuple[int, float]]] = {}
    out["modeld llama.cpp"] = _modeld(tmp, "llama", model, prompts)
    out["modeld OpenVINO"] = _modeld(tmp, "openvino", model, prompts)
    out[llama_server.NAME] = _llama_server(model, prompts, tmp / "llama-server.log")
    return out


def rows(r: dict[str, dict[int, tuple[int, float]]]) -> list[tuple[str, Any, str]]:
    """The table's rows: tokens/s per server and length, and each engine against llama-server."""
    peer = next((v for k, v in r.items() if k.startswith("llama-server")), None)
    out: list[tuple[str, Any, str]] = []
    for name, got in r.items():
        for n, (tokens, secs) in got.items():
            note = f"{tokens:,} prompt tokens in {secs:.1f} s"
            if peer is not None and name in ("modeld llama.cpp", "modeld OpenVINO") and n in peer:
                ptok, psecs = peer[n]
                note += f"; {(tokens / secs) / (ptok / psecs):.2f}x llama-server's tokens/s"
            out.append((f"{name}, ~{n // 1024}k tokens: tokens/s", tokens / secs, note))
    return out
