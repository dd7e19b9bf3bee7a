"""The alternating-workspace section of ``make bench``: agents with different system prompts taking turns.

Two and then three agents, each with its own ~2k-token system prompt (a repo
map of its own repository, or a reviewer's brief), take turns A B A B … (A B C
A B C …). Each turn sends the agent's whole conversation so far plus one short
new user message, as an agent does. Every turn after an agent's first is a
*switched* turn: the slot last held another agent's tape.

The same message lists go to modeld (the chat API over ZeroMQ, default
workspace cache) and, through the ``openai`` SDK, to llama-cpp-python's server
without and with its RAM state cache (``--cache true --cache_type ram``), and to
llama.cpp's ``llama-server`` at its defaults (its RAM prompt cache on), same GGUF
and threads. Then the daemon is restarted on the same data directory and
the first agent's next turn is sent: it should come back from the disk tier.

Between turns each agent runs its tools: ``TOOL_RUN_S`` of quiet after every
reply, before the next request, for every server alike (an agent never sends
its next turn the instant a reply ends; modeld saves a finished turn's tape in
that moment while the slot switches between conversations, so the next switch
only restores).

Targets (issue: workspace cache): a switched turn <= 5% of a cold prefill on
llama.cpp, <= 0.5x the peer's (and llama-server's) switched turn with its RAM
cache; after a restart, the first turn of a cached workspace <= 10% of cold and
<= 0.5x llama-server's (a restarted llama-server holds nothing).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.agent import peer_server, run_llama_server, sdk_turns
from benchmarks.common import text_of_tokens
from harness.daemon import DaemonProcess
from runtime import Chat

N_CTX = 4096
PROMPT_TOKENS = 1900
REPLY_TOKENS = 16
ROUNDS = 3
#: the quiet after each reply before the agent's next request (its tool run), for every server alike
TOOL_RUN_S = 0.5
#: one line template per agent: each system prompt is its own repository (or brief)
AGENT_LINES = [
    "src/app/module_{i}.py: class Handler{i}(Base): def run(self, x): return x * {i}",
    "lib/store/table_{i}.rs: pub fn get_{i}(db: &Db, k: u64) -> Option<Row> {{ db.find({i}, k) }}",
    "review rule {i}: flag any change to file_{i}.go that drops an error returned by call_{i}()",
]
QUESTIONS = ["What is the entry point?", "Which test covers it?", "What should change first?", "Anything risky?"]


def systems(count: Any) -> list[str]:
    return [f"You are agent {'ABC'[k]}.\n" + text_of_tokens(count, PROMPT_TOKENS, line) for k, line in enumerate(AGENT_LINES)]


def run_modeld(d: DaemonProcess, prompts: list[str], order: list[int]) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]], dict[int, list[dict[str, Any]]]]:
    """The turns through the chat API; the message lists sent, what each turn measured, the histories after."""
    histories = {a: [{"role": "system", "content": prompts[a]}] for a in set(order)}
    asked = dict.fromkeys(histories, 0)
    sent: list[list[dict[str, Any]]] = []
    rows: list[dict[str, Any]] = []
    with d.client(timeout_s=600.0) as c, Chat(c, profile="workspaces") as chat:
        for a in order:
            histories[a].append({"role": "user", "content": QUESTIONS[asked[a] % len(QUESTIONS)]})
            asked[a] += 1
            sent.append([dict(m) for m in histories[a]])
            r = chat.send(histories[a], max_tokens=REPLY_TOKENS, temperature=0.0)
            rows.append({"agent": a, "first": asked[a] == 1, "ttft_ms": r.timing.ttft_ms, "cached": r.usage.cached_tokens,
                         "prefilled": r.usage.prefilled_tokens, "prompt": r.usage.prompt_tokens})
            histories[a].append({"role": "assistant", "content": r.message.content or ""})
            time.sleep(TOOL_RUN_S)
    return sent, rows, histories


def _peer(tmp: Path, model: Path, sent: list[list[dict[str, Any]]], *flags: str) -> list[float]:
    with peer_server(tmp, model, N_CTX, *flags) as port:
        return [r["ttft_ms"] for r in sdk_turns(f"http://127.0.0.1:{port}/v1", str(model), sent, tools=None, pause_s=TOOL_RUN_S)]


def _llama_server(tmp: Path, model: Path, sent: list[list[dict[str, Any]]], log: str) -> list[float]:
    """The message lists through llama-server at its defaults (its RAM prompt cache on): a fresh process."""
    return [r["ttft_ms"] for r in run_llama_server(tmp, model, N_CTX, sent, tools=None, log=log, pause_s=TOOL_RUN_S)]


def section(tmp: Path, backend: str, count: Any, *, with_peer: bool) -> list[tuple[str, Any, str]]:
    from backends.bundled import bundled_gguf_path

    model = bundled_gguf_path()
    prompts = systems(count)
    out: list[tuple[str, Any, str]] = []
    figures: dict[int, dict[str, float]] = {}
    restart_hist: list[dict[str, Any]] = []
    restart_ms = 0.0
    for n in (2, 3):
        order = [k % n for k in range(n * ROUNDS)]
        home = tmp / f"ws-{backend}-{n}"
        args = ("--model", str(model), "--num-ctx", str(N_CTX))
        with DaemonProcess(home, backend, None, *args).start(wait_state=("Ready",)) as d:
            sent, rows, histories = run_modeld(d, prompts, order)
        cold = statistics.median(r["ttft_ms"] for r in rows if r["first"])
        switched = [r for r in rows if not r["first"]]
        med = statistics.median(r["ttft_ms"] for r in switched)
        hits = sum(r["cached"] > 0 for r in switched)
        figures[n] = {"cold": cold, "switched": med}
        out.append((f"{n} agents: cold turn TTFT ms (median)", cold, f"each agent's first turn, ~{PROMPT_TOKENS}-token prompt"))
        out.append((f"{n} agents: switched turn TTFT ms (median)", med,
                    f"{len(switched)} turns, {hits} restored from the cache; prefilled median "
                    f"{statistics.median(r['prefilled'] for r in switched):.0f} tokens"))
        ratio = med / cold
        target = "target <= 0.05 " if backend == "llama" else ""
        out.append((f"{n} agents: switched / cold", ratio, target + ("(met)" if ratio <= 0.05 else "(MISSED)") if target else ""))
        if n == 2:
            # a restart on the same data directory: agent A's next turn from the disk tier
            # (the model is loaded before the clock starts: the turn is measured, not the load)
            restarted = DaemonProcess(home, backend, None, *args).start(wait_state=("Ready",))
            with restarted as d, d.client(timeout_s=600.0) as c, Chat(c, profile="workspaces") as chat:
                hist = histories[0] + [{"role": "user", "content": "One more thing: where is the config?"}]
                r = chat.send(hist, max_tokens=REPLY_TOKENS, temperature=0.0)
            restart_hist, restart_ms = hist, r.timing.ttft_ms
            after = r.timing.ttft_ms / cold
            out.append(("after a restart: first turn TTFT ms", r.timing.ttft_ms,
                        f"cached {r.usage.cached_tokens}, prefilled {r.usage.prefilled_tokens} of {r.usage.prompt_tokens} "
                        f"prompt tokens; {after:.3f}x cold; "
                        "target <= 0.10 " + ("(met)" if after <= 0.10 else "(MISSED)")))
        if with_peer:
            plain = _peer(tmp, model, sent)
            cached = _peer(tmp, model, sent, "--cache", "true", "--cache_type", "ram")
            firsts = [k for k, r in enumerate(rows) if r["first"]]
            rest = [k for k in range(len(rows)) if k not in firsts]
            p_plain = statistics.median(plain[k] for k in rest)
            p_cached = statistics.median(cached[k] for k in rest)
            out.append((f"{n} agents: peer switched TTFT ms, no cache", p_plain, "llama-cpp-python server, same message lists and threads"))
            out.append((f"{n} agents: peer switched TTFT ms, RAM cache", p_cached, "--cache true --cache_type ram"))
            vs = med / p_cached
            out.append((f"{n} agents: modeld / peer with RAM cache", vs, "target <= 0.5 " + ("(met)" if vs <= 0.5 else "(MISSED)")))
            ls = _llama_server(tmp, model, sent, f"ws-llama-server-{n}.log")
            p_ls = statistics.median(ls[k] for k in rest)
            out.append((f"{n} agents: llama-server switched TTFT ms", p_ls,
                        "llama.cpp's server at its defaults (RAM prompt cache on), same message lists and threads"))
            vs = med / p_ls
            out.append((f"{n} agents: modeld / llama-server", vs, "target <= 0.5 " + ("(met)" if vs <= 0.5 else "(MISSED)")))
            if n == 2 and restart_hist:
                # a restarted llama-server holds nothing: agent A's next turn is its whole history, cold
                (ls_restart,) = _llama_server(tmp, model, [restart_hist], "ws-llama-server-restart.log")
                vs = restart_ms / ls_restart
                out.append(("after a restart: modeld / llama-server", vs,
                            f"llama-server restarted: {ls_restart:,.0f} ms (its cache is in RAM only); "
                            "target <= 0.5 " + ("(met)" if vs <= 0.5 else "(MISSED)")))
    return out
