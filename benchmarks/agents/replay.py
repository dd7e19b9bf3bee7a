"""``python -m benchmarks.agents replay RUN``: what the agents of a ``make agents`` run sent, replayed against modeld
and its peers, one output token each: the time to the first token of every request, side by side.

The recording proxy kept every request body an agent sent (``RUN/<agent>/NNN-<route>.json``). Each server is
started fresh on the run's model (the context-extended bundled GGUF, the run's context window, the machine's cores
as threads) and gets the agents' generation requests in the order they ran: chat completions, Responses and
Messages, not streamed, with their output cut to one token (and Claude Code's ``thinking`` left out, which the
bundled model's template ignores). What is timed is each request's wall time as a client sees it, which with one
output token is its prefill. The servers:

* ``modeld``: ``modeld serve --backend auto`` as ``make run`` starts it;
* ``llama-server``: llama.cpp's own server at its defaults (its RAM prompt cache on), one slot (``-np 1``: its
  default splits the window in four, where the agents' first requests do not fit);
* ``llama-cpp-python``: llama-cpp-python's server (chat completions only: the other APIs are counted as missing).

Prints a table per agent: requests, the first request's seconds, the later requests' seconds summed, on each server,
and modeld's ratio to llama-server; then the same seconds split as the goals read them: the requests whose head
(system prompt and tools) the agent sent before, and the cold ones, each agent's apart. Nothing here asserts a
timing.

    python -m benchmarks.agents replay .cache/agents/runs/20261128-003814 [--servers modeld,llama-server]
        [--only codex,claude] [--out replay.json]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from backends.devices import usable_cpus
from benchmarks.agents.daemon import Daemon
from benchmarks.common import served
from harness.daemon import free_port

__all__ = ["ROUTES", "goals", "head", "main", "one_token", "prompt_tokens", "recorded", "repeated_heads"]

#: the generation routes replayed (``count_tokens`` and the probes are not prefills)
ROUTES = ("/v1/chat/completions", "/v1/responses", "/v1/messages")
SERVERS = ("modeld", "llama-server", "llama-cpp-python")
REQUEST_TIMEOUT_S = 1800.0


def recorded(run: Path, only: set[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """{agent: its recorded generation requests in the order sent}, agents in the order the run ran them."""
    meta = json.loads((run / "agents.json").read_text())
    order = [a["agent"] for a in meta.get("agents", []) if isinstance(a, dict) and "agent" in a]
    order += sorted(p.name for p in run.iterdir() if p.is_dir() and p.name not in order and p.name != "scratch")
    out: dict[str, list[dict[str, Any]]] = {}
    for agent in order:
        if only and agent not in only or not (run / agent).is_dir():
            continue
        reqs = []
        for f in sorted((run / agent).glob("*.json")):
            rec = json.loads(f.read_text())
            path = str(rec.get("path", "")).split("?")[0]
            if rec.get("method") == "POST" and path in ROUTES and isinstance(rec.get("request_body"), dict):
                reqs.append({"path": rec["path"], "body": rec["request_body"], "file": f.name})
        if reqs:
            out[agent] = reqs
    return out


def one_token(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The request as replayed: not streamed, one output token."""
    b = dict(body)
    b["stream"] = False
    b.pop("stream_options", None)
    route = path.split("?")[0]
    if route == "/v1/chat/completions":
        b.pop("max_completion_tokens", None)
        b["max_tokens"] = 1
    elif route == "/v1/responses":
        b["max_output_tokens"] = 1
    else:
        b["max_tokens"] = 1
        b.pop("thinking", None)  # a thinking budget must be below max_tokens; the bundled template ignores it
    return b


def head(path: str, body: dict[str, Any]) -> str:
    """What an agent's requests keep from one to the next, in each API's own fields: the system prompt (chat
    completions' leading system and developer messages, Responses' ``instructions`` and leading ones, Messages'
    ``system``) and the tool definitions, as canonical JSON."""
    route = path.split("?")[0]
    if route == "/v1/messages":
        system: Any = body.get("system")
    else:
        items = body.get("messages" if route == "/v1/chat/completions" else "input")
        leading = []
        for item in items if isinstance(items, list) else []:
            if not isinstance(item, dict) or item.get("role") not in ("system", "developer"):
                break
            leading.append(item.get("content"))
        system = [body.get("instructions"), leading]
    return json.dumps([system, body.get("tools")], sort_keys=True, separators=(",", ":"))


def repeated_heads(reqs: list[dict[str, Any]]) -> list[bool]:
    """Per request: whether the agent sent its head (``head``) before, in an earlier request of the run."""
    seen: set[str] = set()
    out = []
    for r in reqs:
        h = head(r["path"], r["body"])
        out.append(h in seen)
        seen.add(h)
    return out


def goals(results: dict[str, dict[str, list[tuple[int, float, int]]]],
          requests: dict[str, list[dict[str, Any]]]) -> str:
    """The requests split as the goals read them, seconds summed per server: those whose head the agent sent before
    and the cold ones (every other: a first request, a sub-agent's or a title request's own system prompt), each
    agent's cold ones apart. Only requests every server answered 200 are summed, so each sum is over the same work."""
    servers = list(results)
    lines = [f"| requests | n | {' | '.join(f'{s} (s)' for s in servers)} |"
             + (" modeld / llama-server |" if "modeld" in results and "llama-server" in results else "")]
    lines.append("|" + "---|" * (lines[0].count("|") - 1))

    def answered(server: str, agent: str, i: int) -> bool:
        rows = results[server].get(agent, [])
        return i < len(rows) and rows[i][0] == 200

    def row(label: str, picked: list[tuple[str, int]]) -> None:
        ok = [(a, i) for a, i in picked if all(answered(s, a, i) for s in servers)]
        sums = {s: sum(results[s][a][i][1] for a, i in ok) for s in servers}
        text = f"| {label} | {len(ok)}" + ("" if len(ok) == len(picked) else f" of {len(picked)}")
        text += " | " + " | ".join(f"{sums[s]:.1f}" for s in servers) + " |"
        if "modeld" in sums and "llama-server" in sums:
            text += f" {sums['modeld'] / sums['llama-server']:.2f}x |" if sums["llama-server"] else " - |"
        lines.append(text)

    flags = {a: repeated_heads(reqs) for a, reqs in requests.items()}
    row("head sent before", [(a, i) for a, f in flags.items() for i, rep in enumerate(f) if rep])
    row("cold, all agents", [(a, i) for a, f in flags.items() for i, rep in enumerate(f) if not rep])
    for agent, f in flags.items():
        row(f"cold, {agent}", [(agent, i) for i, rep in enumerate(f) if not rep])
    return "\n".join(lines)


def prompt_tokens(reply: Any) -> int:
    """The prompt's tokens as the server counted them (its usage, in each API's own fields; 0 when it says none).

    Servers render the same request to different prompts: a template without tool support may leave the tool
    definitions out (llama-server's jinja rendering of the bundled ChatML template does), so the seconds of two
    servers compare only beside their token counts."""
    usage = reply.get("usage") if isinstance(reply, dict) else None
    if not isinstance(usage, dict):
        return 0
    if "prompt_tokens" in usage:
        return int(usage["prompt_tokens"] or 0)
    return sum(int(usage.get(k) or 0) for k in ("input_tokens", "cache_read_input_tokens",
                                                "cache_creation_input_tokens"))


def _post(port: int, path: str, body: dict[str, Any]) -> tuple[int, float, int]:
    """(status, seconds, prompt tokens) of one request."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        t0 = time.perf_counter()
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json", "Authorization": "Bearer none",
                                                   "x-api-key": "none", "anthropic-version": "2023-06-01"})
        r = c.getresponse()
        raw = r.read()
        took = time.perf_counter() - t0
    except OSError:
        return 0, time.perf_counter() - t0, 0
    finally:
        c.close()
    try:
        tokens = prompt_tokens(json.loads(raw)) if r.status == 200 else 0
    except ValueError:
        tokens = 0
    return r.status, took, tokens


@contextmanager
def _server(name: str, model: Path, context: int, outdir: Path) -> Iterator[int]:
    threads = str(usable_cpus())
    port = free_port()
    if name == "llama-server":
        from benchmarks import llama_server

        with llama_server.serving(model, context, outdir / "replay-llama-server.log") as p:
            yield p
    elif name == "llama-cpp-python":
        argv = [sys.executable, "-m", "benchmarks.peer_server", "--model", str(model), "--n_ctx", str(context),
                "--n_threads", threads, "--n_threads_batch", threads, "--port", str(port)]
        with served(argv, outdir / "replay-llama-cpp-python.log", port, path="/v1/models") as p:  # (no /health)
            yield p
    else:
        modeld = str(Path(sys.executable).with_name("modeld"))
        from backends.bundled import served_bundled_gguf

        # make run's model unless another was asked for (the tool-template copy)
        named = [] if model == served_bundled_gguf() else ["--model", str(model)]
        daemon = Daemon(modeld, outdir / "replay-modeld.log", extra=["--num-ctx", str(context), *named])
        # one loop for the daemon's whole life, running beside the requests: it reads the daemon's log pipe
        loop = asyncio.new_event_loop()
        runner = threading.Thread(target=loop.run_forever, name="replay-daemon", daemon=True)
        runner.start()
        try:
            asyncio.run_coroutine_threadsafe(daemon.start(timeout=900.0), loop).result()
            try:
                yield daemon.port
            finally:
                asyncio.run_coroutine_threadsafe(daemon.stop(), loop).result()
        finally:
            loop.call_soon_threadsafe(loop.stop)
            runner.join(10)
            loop.close()


def replay(server: str, requests: dict[str, list[dict[str, Any]]], model: Path, context: int,
           outdir: Path) -> dict[str, list[tuple[int, float, int]]]:
    """{agent: [(status, seconds, prompt tokens) per request]} on a fresh ``server``."""
    out: dict[str, list[tuple[int, float, int]]] = {}
    with _server(server, model, context, outdir) as port:
        for agent, reqs in requests.items():
            out[agent] = []
            for r in reqs:
                status, secs, tokens = _post(port, r["path"], one_token(r["path"], r["body"]))
                out[agent].append((status, secs, tokens))
                print(f"replay: {server:16} {agent:10} {r['file']:28} HTTP {status} {secs:7.1f} s {tokens:6} tokens",
                      file=sys.stderr, flush=True)
    return out


def table(results: dict[str, dict[str, list[tuple[int, float, int]]]]) -> str:
    """Per agent and server: requests answered, the first request's seconds and prompt tokens, the later ones'
    seconds summed."""
    servers = list(results)
    agents = list(next(iter(results.values())))
    head = f"| agent | requests | {' | '.join(f'{s}: first (its tokens), later (s)' for s in servers)} |"
    if "modeld" in results and "llama-server" in results:
        head += " modeld / llama-server: first, later |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def cell(rows: list[tuple[int, float, int]]) -> tuple[str, float | None, float | None]:
        if not rows or rows[0][0] != 200:
            return f"HTTP {rows[0][0] if rows else '-'}", None, None
        later = [s for st, s, _ in rows[1:] if st == 200]
        bad = sum(1 for st, _, _ in rows if st != 200)
        note = f" ({bad} not 200)" if bad else ""
        return f"{rows[0][1]:.1f} ({rows[0][2]:,}), {sum(later):.1f}{note}", rows[0][1], sum(later)

    for agent in agents:
        cells = {s: cell(results[s].get(agent, [])) for s in servers}
        row = f"| {agent} | {len(next(iter(results.values()))[agent])} | " + " | ".join(c[0] for c in cells.values()) + " |"
        if "modeld" in cells and "llama-server" in cells:
            (_, mf, ml), (_, pf, pl) = cells["modeld"], cells["llama-server"]
            ratio = (f"{mf / pf:.2f}x" if mf and pf else "-", f"{ml / pl:.2f}x" if ml and pl else "-")
            row += f" {ratio[0]}, {ratio[1]} |"
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.agents replay", description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a make agents run's directory (.cache/agents/runs/TIME)")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"which of {', '.join(SERVERS)} (default: all)")
    p.add_argument("--only", default="", help="these agents (comma-separated)")
    p.add_argument("--out", type=Path, default=None, help="write the seconds per request as JSON here")
    p.add_argument("--tool-template", action="store_true",
                   help="serve a copy of the model whose chat template renders tools (the same weights): every server "
                        "then prefills the tool definitions, which a server that drops what the bundled template "
                        "cannot express leaves out")
    args = p.parse_args(argv)
    from backends.bundled import served_bundled_gguf

    meta = json.loads((args.run / "agents.json").read_text())
    context = int(meta.get("context") or 32768)
    requests = recorded(args.run, set(args.only.split(",")) if args.only else None)
    if not requests:
        print(f"no recorded generation requests under {args.run}", file=sys.stderr)
        return 2
    model = served_bundled_gguf()
    if args.tool_template:
        from harness.fixtures import tool_gguf

        model = tool_gguf(src=model)
    results = {}
    for server in [s for s in args.servers.split(",") if s]:
        if server not in SERVERS:
            p.error(f"unknown server {server!r}: one of {', '.join(SERVERS)}")
        results[server] = replay(server, requests, model, context, args.run)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"replayed {sum(len(r) for r in requests.values())} requests of {len(requests)} agents from {args.run}, "
          f"one output token each, context {context}, {usable_cpus()} threads")
    print(table(results))
    print()
    print(goals(results, requests))
    return 0
