"""The ``vllm`` section of ``make bench``: modeld on the vLLM engine, one server, and two behind vLLM's router.

Three agents with different ~1,900-token system prompts (the ``workspaces`` section's) take turns A B C A B C …,
each turn its whole conversation so far plus a short new user message, through modeld's OpenAI API; each request
names its agent's conversation (``x-session-id``, as OpenCode names its sessions). The same trace runs against:

- one vLLM server (``engine_url`` the server);
- two servers behind ``vllm-router --policy consistent_hash``: the daemon sends each request's route (its
  conversation) in ``X-Session-ID``, and the router keeps a route on one server;
- the same two behind ``--policy round_robin``, which ignores the route: what a router that is not session-aware
  costs a conversation.

Per configuration: the agents' first turns and the switched turns (median TTFT), the share of a switched turn's
prompt the server's prefix cache held (the daemon's ``cached_tokens``, which is vLLM's own count), and where each
agent's turns ran: the servers' own finished-request counters (``vllm:request_success_total``) read around every
turn. Every server runs ``--dtype float32`` on the CPU build (``harness.vllm_server``, installed on first use), and
each configuration starts from empty prefix caches (``/reset_prefix_cache``).

Not measured: agents served side by side. The daemon runs one turn at a time on every engine; a vLLM server's
batching of concurrent agents is not reachable through it yet.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from benchmarks.workspaces import QUESTIONS, systems
from harness import vllm_server
from harness.daemon import DaemonProcess, free_port, wait_http

N_CTX = 4096
REPLY_TOKENS = 16
ROUNDS = 3
AGENTS = 3
#: the quiet after each reply before the agent's next request (its tool run)
TOOL_RUN_S = 0.5


def _finished(url: str) -> float:
    """A server's count of finished requests (all finish reasons)."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    return sum(float(m.group(1)) for m in re.finditer(r"^vllm:request_success_total(?:{[^}]*})? (\S+)$", text, re.M))


def _turns(base_url: str, servers: list[str], prompts: list[str]) -> list[dict[str, Any]]:
    """The trace through modeld's OpenAI API, streamed; per turn its agent, TTFT, prompt and cached tokens, and the
    servers (indices into ``servers``) whose finished-request count grew during it."""
    import openai

    order = [k % AGENTS for k in range(AGENTS * ROUNDS)]
    histories = {a: [{"role": "system", "content": prompts[a]}] for a in range(AGENTS)}
    asked = dict.fromkeys(histories, 0)
    rows: list[dict[str, Any]] = []
    with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=1200) as sdk:
        for a in order:
            histories[a].append({"role": "user", "content": QUESTIONS[asked[a] % len(QUESTIONS)]})
            asked[a] += 1
            before = [_finished(s) for s in servers]
            t0 = time.perf_counter()
            first = float("nan")
            text, usage = "", None
            stream = sdk.chat.completions.create(  # type: ignore[call-overload]
                model="default", messages=histories[a], max_tokens=REPLY_TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_headers={"x-session-id": f"agent-{'ABC'[a]}"},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if first != first:  # NaN: nothing yet
                        first = (time.perf_counter() - t0) * 1000
                    text += chunk.choices[0].delta.content
                usage = chunk.usage or usage
            ran = _settled_growth(servers, before)
            details = usage.prompt_tokens_details if usage is not None else None
            rows.append({"agent": a, "first": asked[a] == 1, "ttft_ms": first,
                         "prompt": usage.prompt_tokens if usage is not None else 0,
                         "cached": (details.cached_tokens or 0) if details is not None else 0, "servers": ran})
            histories[a].append({"role": "assistant", "content": text})
            time.sleep(TOOL_RUN_S)
    return rows


def _settled_growth(servers: list[str], before: list[float]) -> set[int]:
    """The servers whose finished-request count grew since ``before``, once the counts stop moving (a server's
    metrics trail its engine by a moment)."""
    last: list[float] = []
    for _ in range(20):
        now = [_finished(s) for s in servers]
        if now == last:
            break
        last = now
        time.sleep(0.5)
    return {k for k, (b, n) in enumerate(zip(before, last, strict=True)) if n > b}


def _run(tmp: Path, name: str, engine_url: str, servers: list[str], prompts: list[str]) -> list[dict[str, Any]]:
    for url in servers:  # every configuration starts from empty prefix caches
        httpx.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()
    port = free_port()
    args = ("--engine-option", f"engine_url={engine_url}", "--num-ctx", str(N_CTX), "--http", f"127.0.0.1:{port}")
    with DaemonProcess(tmp / name, "vllm", None, *args).start(wait_state=("Ready",)):
        wait_http(port)
        return _turns(f"http://127.0.0.1:{port}/v1", servers, prompts)


def _rows(label: str, turns: list[dict[str, Any]], replicas: int) -> list[tuple[str, Any, str]]:
    firsts = [t for t in turns if t["first"]]
    switched = [t for t in turns if not t["first"]]
    share = statistics.median(t["cached"] / t["prompt"] for t in switched if t["prompt"])
    out: list[tuple[str, Any, str]] = [
        (f"{label}: first turn TTFT ms (median)", statistics.median(t["ttft_ms"] for t in firsts),
         f"{len(firsts)} agents' first turns, ~{statistics.median(t['prompt'] for t in firsts):.0f}-token prompts"),
        (f"{label}: switched turn TTFT ms (median)", statistics.median(t["ttft_ms"] for t in switched),
         f"{len(switched)} turns after another agent's"),
        (f"{label}: switched turn prompt cached (median)", f"{share:.0%}",
         "the server's prefix cache, as the daemon reports it (cached_tokens)"),
    ]
    if replicas > 1:
        homes = {a: set().union(*(t["servers"] for t in turns if t["agent"] == a)) for a in range(AGENTS)}
        kept = sum(len(h) == 1 for h in homes.values())
        where = ", ".join(f"{'ABC'[a]}: {'+'.join(str(s) for s in sorted(h)) or '?'}" for a, h in homes.items())
        out.append((f"{label}: agents whose turns all ran on one server", f"{kept} of {AGENTS}",
                    f"servers each agent's turns ran on ({where})"))
    return out


def section(tmp: Path, count: Any) -> list[tuple[str, Any, str]]:
    vllm_server.ensure_venv()
    model = vllm_server.ensure_hf_model()
    prompts = systems(count)[:AGENTS]
    out: list[tuple[str, Any, str]] = []
    with ExitStack() as stack:
        # (dev mode: its /reset_prefix_cache empties the prefix cache between configurations)
        made = [vllm_server.VllmServer(model, log_path=tmp / f"vllm-{k}.log", extra_args=("--dtype", "float32"),
                                       extra_env={"VLLM_SERVER_DEV_MODE": "1"}) for k in range(2)]
        starting = [threading.Thread(target=s.start) for s in made]
        for s, t in zip(made, starting, strict=True):
            stack.callback(s.stop)
            t.start()
        for t in starting:
            t.join()
        if not all(s.proc is not None and s.startup_s is not None for s in made):
            raise RuntimeError("a vLLM server did not start: " + " | ".join(s.log_tail(5) for s in made))
        urls = [s.base_url for s in made]
        out += _rows("one server", _run(tmp, "one", urls[0], urls[:1], prompts), 1)
        for policy in ("consistent_hash", "round_robin"):
            with vllm_server.VllmRouter(urls, policy=policy, log_path=tmp / f"router-{policy}.log") as router:
                turns = _run(tmp, policy, router.base_url, urls, prompts)
            out += _rows(f"two servers, router {policy}", turns, 2)
    return out
