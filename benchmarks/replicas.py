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

Then throughput (``throughput``): 1, 2 and 4 agents at once, each in a thread of its own, each its own conversation
(``THROUGHPUT_TURNS`` turns of up to ``THROUGHPUT_REPLY`` tokens, greedy), through modeld's OpenAI API against
modeld's llama.cpp engine (one slot: the agents' turns take turns in it), the vLLM engine on one server (``serve
--sessions 4``: the turns run at once and the server batches them) and on two behind the router. Per run: the
completion tokens of all turns over the wall time from the first request to the last reply, and the median turn.
Every agent's system prompt is computed once before the runs (not measured): they measure turns after a cached
prompt, as an agent's are. The llama.cpp runs come first, before the servers start, so that they share the cores
with nothing (an idle CPU server polls).
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

from benchmarks.workspaces import PROMPT_TOKENS, QUESTIONS, systems
from harness import vllm_server
from harness.daemon import DaemonProcess, free_port, wait_http

N_CTX = 4096
#: agents at once in the throughput runs, turns each, and the reply length asked of every turn
CONCURRENT = (1, 2, 4)
THROUGHPUT_TURNS = 3
THROUGHPUT_REPLY = 32
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


def _agent(sdk: Any, prompt: str, name: str, start: threading.Barrier, out: list[dict[str, Any]]) -> None:
    """One agent's conversation of ``THROUGHPUT_TURNS`` turns, each recorded in ``out``."""
    history = [{"role": "system", "content": prompt}]
    start.wait()
    for k in range(THROUGHPUT_TURNS):
        history.append({"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]})
        t0 = time.perf_counter()
        r = sdk.chat.completions.create(model="default", messages=history, max_tokens=THROUGHPUT_REPLY, temperature=0,
                                        extra_headers={"x-session-id": name})
        out.append({"agent": name, "s": time.perf_counter() - t0,
                    "tokens": r.usage.completion_tokens if r.usage is not None else 0})
        history.append({"role": "assistant", "content": r.choices[0].message.content or ""})


def _at_once(base_url: str, prompts: list[str], n: int) -> dict[str, Any]:
    """``n`` agents' conversations at once through the OpenAI API at ``base_url``: tokens per second of them all."""
    import openai

    turns: list[dict[str, Any]] = []
    start = threading.Barrier(n + 1)
    with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=1800) as sdk:
        agents = [threading.Thread(target=_agent, args=(sdk, prompts[k], f"agent-{k}", start, turns))
                  for k in range(n)]
        for t in agents:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in agents:
            t.join()
        wall = time.perf_counter() - t0
    if len(turns) != n * THROUGHPUT_TURNS:
        raise RuntimeError(f"{n} agents at once: {len(turns)} of {n * THROUGHPUT_TURNS} turns answered")
    tokens = sum(t["tokens"] for t in turns)
    return {"agents": n, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "turn_s": statistics.median(t["s"] for t in turns)}


def _throughput(tmp: Path, name: str, backend: str, prompts: list[str], *args: str) -> list[dict[str, Any]]:
    """The runs of ``CONCURRENT`` agents at once on one daemon. Each agent's system prompt is computed once first,
    one agent after another and not measured (the engine's cache holds it then: the llama.cpp engine's workspace
    cache, the server's prefix cache), so that every run measures agents' turns after their prompts, not first
    sights of them."""
    import openai

    port = free_port()
    with DaemonProcess(tmp / f"at-once-{name}", backend, None, "--num-ctx", str(N_CTX), "--http", f"127.0.0.1:{port}",
                       *args).start(wait_state=("Ready",)):
        wait_http(port)
        base = f"http://127.0.0.1:{port}/v1"
        with openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=1800) as sdk:
            for k in range(max(CONCURRENT)):
                sdk.chat.completions.create(model="default", max_tokens=1, temperature=0, messages=[
                    {"role": "system", "content": prompts[k]}, {"role": "user", "content": QUESTIONS[0]}],
                    extra_headers={"x-session-id": f"agent-{k}"})
        return [_at_once(base, prompts, n) for n in CONCURRENT]


def throughput_rows(series: dict[str, list[dict[str, Any]]]) -> list[tuple[str, Any, str]]:
    out: list[tuple[str, Any, str]] = []
    for name, runs in series.items():
        one = runs[0]["tok_s"]
        for r in runs:
            out.append((f"{name}: {r['agents']} at once, tokens/s", f"{r['tok_s']:.1f}",
                        f"{r['tokens']} tokens in {r['wall_s']:.1f} s ({r['tok_s'] / one:.2f}x one agent); "
                        f"median turn {r['turn_s']:.1f} s"))
    return out


def section(tmp: Path, count: Any) -> tuple[list[tuple[str, Any, str]], dict[str, Any]]:
    """The interleaved trace's rows, and the throughput runs (``{"series": {name: runs}, ...}``, for the plot)."""
    vllm_server.ensure_venv()
    model = vllm_server.ensure_hf_model()
    prompts = systems(count)[:AGENTS]
    many = [*systems(count), *(f"You are agent {k}.\n" + p.split("\n", 1)[1] for k, p in enumerate(systems(count)))]
    series: dict[str, list[dict[str, Any]]] = {}
    series["modeld, llama.cpp engine"] = _throughput(tmp, "llama", "llama", many)
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
        series["modeld, vLLM engine, one server"] = _throughput(tmp, "vllm-one", "vllm", many,
                                                                 "--engine-option", f"engine_url={urls[0]}")
        with vllm_server.VllmRouter(urls, policy="consistent_hash", log_path=tmp / "router-at-once.log") as router:
            series["modeld, vLLM engine, two servers + router"] = _throughput(
                tmp, "vllm-two", "vllm", many, "--engine-option", f"engine_url={router.base_url}")
    return out, {"series": series, "turns": THROUGHPUT_TURNS, "reply_tokens": THROUGHPUT_REPLY,
                 "prompt_tokens": PROMPT_TOKENS}
