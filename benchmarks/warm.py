"""``make bench`` section ``warm``: what a warm request costs beyond its new tokens, stage by stage.

An agent resends its whole conversation every turn. When nearly all of it is resident, what is left is the fixed
cost around the KV: the front (HTTP, the API's translation), the session's calls over ZeroMQ, rendering the
prompt through the template, tokenizing it, matching it against the tape, the one new token's decode. Here a
conversation is sent once (cold), then again unchanged (warm, one output token), through chat completions, and
the same conversation through the runtime (``runtime.Chat``, what the front runs) with each call timed; the
daemon says what its prefill calls spent rendering and tokenizing (``modeld why``). The front's share is the
HTTP wall time less the runtime's.

Prompts: a ~1k-token one (a short tool-using turn) and a ~20k-token one (a coding agent's long system prompt and
tool list, then a conversation), and, where a ``make agents`` run is on disk (``.cache/agents/runs``; or
``--agents-run``), each agent's largest recorded chat completion. Tokenizing is shown cold (the first send: every
text new) and warm (the resend: the texts kept from the count before the prefill and from the turn before).

The goal: what is left beside the one token's compute (its decode, and its settle into the KV) under 100 ms for
a 20k-token resend, under 15 ms for a 1k-token one. Nothing here asserts a timing.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from harness.daemon import ROOT, DaemonProcess, free_port, wait_http

__all__ = ["conversation", "section"]

#: warm resends timed per prompt (their median is shown)
RESENDS = 5
#: the goals, by prompt size: (tokens at most, ms at most)
GOALS = ((2_000, 15.0), (40_000, 100.0))


def conversation(tools: int, rules: int, turns: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A coding agent's request: a system prompt of ``rules`` rules, ``tools`` tool definitions, ``turns`` turns of
    user and assistant, then a new user message."""
    specs = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Tool {i}: reads, edits or runs something in the repository. " * 6,
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "the file, relative to the repository's root"},
            "content": {"type": "string", "description": "what to write"}}, "required": ["path"]}}}
        for i in range(tools)]
    system = "You are a coding agent working in a repository.\n" + "".join(
        f"Rule {k}: keep changes small, run the tests after each edit, and explain what you changed.\n"
        for k in range(rules))
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Step {t}: look at src/module_{t}.py and fix the failing test."})
        messages.append({"role": "assistant", "content": f"I read src/module_{t}.py; the bug was an off-by-one in "
                                                         f"line {t + 10}, now fixed, and the tests pass."})
    messages.append({"role": "user", "content": "Now run the whole test suite and summarise."})
    return messages, specs


def _recorded(run: Path | None) -> list[tuple[str, dict[str, Any]]]:
    """Each agent's largest recorded chat completion of a ``make agents`` run (newest run when none is named)."""
    if run is None:
        runs = sorted((ROOT / ".cache" / "agents" / "runs").glob("*/agents.json"), key=lambda p: p.stat().st_mtime)
        run = runs[-1].parent if runs else None
    if run is None:
        return []
    out = []
    for agent_dir in sorted(p for p in run.iterdir() if p.is_dir() and p.name != "scratch"):
        best: dict[str, Any] | None = None
        for f in agent_dir.glob("*-v1_chat_completions.json"):
            body = json.loads(f.read_text()).get("request_body")
            if isinstance(body, dict) and (best is None or len(json.dumps(body)) > len(json.dumps(best))):
                best = body
        if best is not None:
            out.append((agent_dir.name, best))
    return out


@contextmanager
def _timed_calls() -> Iterator[dict[str, float]]:
    """The runtime client's calls timed by operation (ms, summed) while the block runs."""
    from contract.wire import Kind
    from runtime import client as rc

    spent: dict[str, float] = {}
    originals = (rc.Client.request, rc.Client._await, rc.Client.receive)
    last_data = [0.0]
    inside = [False]  # (a unary call awaits its reply too: counted as its own operation, not as a prefill)

    def request(self: Any, op: Any, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        inside[0] = True
        try:
            return originals[0](self, op, *a, **kw)
        finally:
            inside[0] = False
            spent[op.value] = spent.get(op.value, 0.0) + (time.perf_counter() - t0) * 1000

    def await_(self: Any, rid: bytes, *a: Any, **kw: Any) -> Any:  # (the prefills: ``_stoppable`` awaits them)
        t0 = time.perf_counter()
        try:
            return originals[1](self, rid, *a, **kw)
        finally:
            if not inside[0]:
                key = "prefill calls"
                spent[key] = spent.get(key, 0.0) + (time.perf_counter() - t0) * 1000

    def receive(self: Any, rid: bytes, *a: Any, **kw: Any) -> Any:  # (a decode's frames: the gap before its end)
        msg = originals[2](self, rid, *a, **kw)
        now = time.perf_counter()
        if msg.kind is Kind.DATA:
            last_data[0] = now
        elif msg.kind is Kind.END and last_data[0]:
            spent["end after data"] = (now - last_data[0]) * 1000
        return msg

    rc.Client.request, rc.Client._await, rc.Client.receive = request, await_, receive  # type: ignore[method-assign]
    try:
        yield spent
    finally:
        rc.Client.request, rc.Client._await, rc.Client.receive = originals  # type: ignore[method-assign]


def _stages(d: DaemonProcess, port: int, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
    """One prompt: cold, then warm resends over HTTP and through the runtime, and the daemon's own figures."""
    from runtime import Chat

    body = {"model": "default", "messages": messages, "max_tokens": 1, "temperature": 0,
            **({"tools": tools} if tools else {})}
    out: dict[str, Any] = {}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=3600.0) as http, d.client(timeout_s=600.0) as c:
        t0 = time.perf_counter()
        r = http.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        out["cold_s"] = time.perf_counter() - t0
        out["tokens"] = r.json()["usage"]["prompt_tokens"]
        cold = c.why(1)[-1]
        out["tokenize_cold_ms"] = cold.tokenize_ms
        warm_http, whys = [], []
        for _ in range(RESENDS):
            t0 = time.perf_counter()
            r = http.post("/v1/chat/completions", json=body)
            warm_http.append((time.perf_counter() - t0) * 1000)
            r.raise_for_status()
            whys.append(c.why(1)[-1])
        out["cached"] = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        out["http_ms"] = statistics.median(warm_http)
        out["render_ms"] = statistics.median(w.render_ms for w in whys)
        out["tokenize_ms"] = statistics.median(w.tokenize_ms for w in whys)
        out["daemon_prefill_ms"] = statistics.median(w.prefill_ms for w in whys)
        runs: list[tuple[float, dict[str, float]]] = []
        for _ in range(RESENDS):
            with _timed_calls() as spent:
                t0 = time.perf_counter()
                turn = Chat(c, profile="http").begin(messages, tools or None, max_tokens=1, temperature=0)
                for event in turn.events():
                    if event.result is not None:  # (the daemon's: from the decode's start to its token)
                        spent["decode"] = event.result.timing.first_token_ms
                total = (time.perf_counter() - t0) * 1000
            runs.append((total, dict(spent)))
        total, spent = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
        out["runtime_ms"] = total
        out["calls"] = spent
        # a close's round trip where no decode ran before it: what a close after the reply takes beyond it is
        # the engine evaluating the reply's token into the KV (the settle: part of that token's compute)
        closes = []
        for _ in range(RESENDS):
            with _timed_calls() as bare:
                Chat(c, profile="http").begin(messages, tools or None, max_tokens=1, temperature=0).close()
            closes.append(bare.get("close", 0.0))
        out["bare_close_ms"] = statistics.median(closes)
        out.update(_tokenizing(http, messages, tools))
    return out


def _tokenizing(http: httpx.Client, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, float]:
    """What the tokenization rule costs (``/tokenize``, less the round trip of an empty text): before, only the
    text after the parting point was tokenized (here: the last message); now the whole prompt is, or found kept
    when it was tokenized lately (the resend)."""
    def timed(text: Callable[[], str]) -> float:
        """The median ms of ``RESENDS`` ``/tokenize`` calls, each of the text ``text()`` gives."""
        ms = []
        for _ in range(RESENDS):
            body = {"content": text()}
            t0 = time.perf_counter()
            http.post("/tokenize", json=body).raise_for_status()
            ms.append((time.perf_counter() - t0) * 1000)
        return statistics.median(ms)

    whole = json.dumps(tools) + "".join(str(m.get("content") or "") for m in messages)
    tail = str(messages[-1].get("content") or "")
    base = timed(lambda: "")
    # (a head nobody sent before: the text is tokenized, not found kept)
    fresh = timed(lambda: f"{time.perf_counter_ns()}\n{whole}")
    return {"tok_tail_ms": max(0.0, timed(lambda: tail) - base), "tok_whole_ms": max(0.0, fresh - base),
            "tok_kept_ms": max(0.0, timed(lambda: whole) - base)}


def _row(name: str, r: dict[str, Any]) -> str:
    calls: dict[str, float] = r["calls"]
    decode = calls.get("decode", 0.0)
    # the settle is waited for by the decode's end frame or by the close, whichever the daemon sends after it
    settle = calls.get("end after data", 0.0) + max(0.0, calls.get("close", 0.0) - r["bare_close_ms"])
    left = r["http_ms"] - decode - settle
    goal = next((ms for limit, ms in GOALS if r["tokens"] <= limit), None)
    met = "" if goal is None else f" (goal <= {goal:.0f}: {'met' if left <= goal else 'MISSED'})"
    front = r["http_ms"] - r["runtime_ms"]
    prefill = calls.get("prefill calls", 0.0)
    return (f"| {name} | {r['tokens']:,} ({r['cached']:,} cached) | {r['cold_s']:.1f} s | {r['http_ms']:.0f} "
            f"| {decode:.0f} + {settle:.0f} | **{left:.0f}**{met} | {front:.0f} | {calls.get('open', 0.0):.0f} "
            f"| {calls.get('count_tokens', 0.0):.0f} "
            f"| {prefill:.0f} (render {r['render_ms']:.1f}, tokenize {r['tokenize_ms']:.1f}) "
            f"| {r['bare_close_ms']:.0f} "
            f"| {r['tok_tail_ms']:.1f} / {r['tok_whole_ms']:.1f} / {r['tok_kept_ms']:.1f} |")


def section(tmp: Path, agents_run: Path | None = None, backends: tuple[str, ...] = ("llama", "openvino"),
            log: Callable[[str], None] = print, synthetic: bool = True) -> str:
    prompts: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]]]] = [
        ("~1k tokens", *conversation(tools=2, rules=8, turns=3)),
        ("~20k tokens", *conversation(tools=24, rules=260, turns=40)),
    ] if synthetic else []
    prompts += [(f"{agent}'s largest", body.get("messages", []), body.get("tools") or [])
                for agent, body in _recorded(agents_run)]
    lines = ["## warm: a resend's fixed cost, stage by stage (one output token; median of "
             f"{RESENDS} resends; ms)", "",
             "| prompt | tokens | cold | warm resend, HTTP | its one token | what is left | front | open | count "
             "| prefix + suffix calls (daemon's render, tokenize) | close | tokenize: tail (before) / whole, new "
             "/ whole, kept |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for backend in backends:
        port = free_port()
        d = DaemonProcess(tmp / f"warm-{backend}", backend, None, "--http", f"127.0.0.1:{port}", "--num-ctx",
                          "32768").start(wait_state=("Ready",))
        try:
            wait_http(port)
            for name, messages, tools in prompts:
                try:
                    r = _stages(d, port, messages, tools)
                except httpx.HTTPStatusError as exc:  # (a recorded prompt past the window: said, not hidden)
                    lines.append(f"| {backend}: {name} | refused: {exc.response.status_code} "
                                 f"{exc.response.text[:80]} |")
                    continue
                lines.append(_row(f"{backend}: {name}", r))
                log(lines[-1])
        finally:
            d.stop()
    lines += ["", "its one token = the engine's compute of the reply's token: the decode's (the daemon's first-token "
              "time) + its settle (evaluated into the KV before the decode's end frame goes out: the gap between the "
              "reply's frame and the end frame, and what the close then takes beyond a close with no decode before "
              "it; a reply that ends with the model's end token has none); what is left = the HTTP wall time less both (the goal's "
              "figure: rendering, tokenizing, matching, the calls, the front); close = a close's own round trip; front = the HTTP wall time less the runtime's for the same conversation; count = the "
              "prompt's size checked before the prefill; the prefix and suffix calls are ZeroMQ round trips that "
              "render, tokenize, match against the tape and prefill what is new (here: nothing or the template's "
              "last tokens). Tokenize: ``/tokenize`` less an empty text's round trip, for the last message alone "
              "(what the rule before tokenized), the whole prompt's text new, and the same text again (kept)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile

    p = argparse.ArgumentParser(prog="python -m benchmarks.warm", description=__doc__.split("\n\n")[0])
    p.add_argument("--agents-run", type=Path, help="a make agents run directory (default: the newest)")
    p.add_argument("--backends", default="llama,openvino")
    p.add_argument("--agents-only", action="store_true", help="only the agents' recorded requests")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="modeld-warm-") as tmp:
        print(section(Path(tmp), args.agents_run, tuple(args.backends.split(",")), log=lambda line: None,
                      synthetic=not args.agents_only))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
