"""The TTFT-by-suffix-size section of ``make bench``: what a resident prefix saves, by the size of what is new.

An agent's turn is a large stable prefix (system prompt, tools, repository map)
and a new part that is small: a question, a diff, a tool's output. Here the
prefix is a ~2,000-token repository map and the new user turn has 16, 64, 256
or 1,024 tokens:

* **cold** – a prefix the engine has never seen (each size gets its own, so
  nothing of it is resident): the whole prompt is prefilled;
* **warm** – the same prefix resident, another new turn of the same size (the
  median of ``WARM_TURNS``): only the new turn and the template's glue are prefilled.

The same message lists go to modeld on both engines (``runtime.Chat`` over
ZeroMQ, the bundled model) and, with the same ``openai`` SDK code as the agent
section (``benchmarks.agent.sdk_turns``), to llama-cpp-python's own server (its
longest-common-prefix cache) and to llama.cpp's ``llama-server`` at its defaults
(its RAM prompt cache on); same GGUF, context and threads. Before the first
measured turn each side answers one short unrelated turn, so no one-off start-up
cost lands on the first cold figure. The daemons run with the workspace cache
off: a cold turn here is a plain prefill (the cache's own costs and gains are
the workspaces section's).

``section()`` returns the figures as a dict that ``benchmarks.plot.plot_ttft``
draws and ``rows()`` turns into the printed table.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.agent import REPLY_TOKENS, peer_server, sdk_turns
from benchmarks.common import PREFIX_LINE, text_of_exact_tokens, text_of_tokens
from harness.daemon import DaemonProcess
from runtime import Chat

SUFFIX_SIZES = (16, 64, 256, 1024)
PREFIX_TOKENS = 2000
WARM_TURNS = 3
N_CTX = 4096
#: the series, in the order they are measured and drawn
MODELD_LLAMA = "modeld, llama.cpp backend"
MODELD_OPENVINO = "modeld, OpenVINO backend"
PEER = "llama-cpp-python's server"
LLAMA_SERVER = "llama.cpp's llama-server"
WARM_UP = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]

Messages = list[dict[str, Any]]


def conversations(count: Callable[[str], int]) -> list[tuple[int, list[Messages]]]:
    """Per suffix size: the cold turn's message list, then the warm turns' (same prefix, other new turns)."""
    out: list[tuple[int, list[Messages]]] = []
    for size in SUFFIX_SIZES:
        system = text_of_tokens(count, PREFIX_TOKENS, f"[workspace {size}] " + PREFIX_LINE)
        turns = [text_of_exact_tokens(count, size, f"[turn {k}] test_{{i}} failed") for k in range(1 + WARM_TURNS)]
        out.append((size, [[{"role": "system", "content": system}, {"role": "user", "content": t}] for t in turns]))
    return out


def _series(sizes: list[int], ttft: list[list[float]], prefilled: list[list[float]] | None) -> dict[str, Any]:
    """One line of the plot: per size the cold turn (the first) and the warm turns' median."""
    return {
        "cold_ms": [t[0] for t in ttft],
        "warm_ms": [statistics.median(t[1:]) for t in ttft],
        "warm_all_ms": [t[1:] for t in ttft],
        "cold_prefilled": [p[0] for p in prefilled] if prefilled else None,
        "warm_prefilled": [statistics.median(p[1:]) for p in prefilled] if prefilled else None,
    }


def run_modeld(tmp: Path, backend: str, convs: list[tuple[int, list[Messages]]]) -> dict[str, Any]:
    """The turns through the chat API of a fresh daemon on the bundled model."""
    args = ("--num-ctx", str(N_CTX), "--cache-ram", "0", "--cache-disk", "0")
    ttft: list[list[float]] = []
    prefilled: list[list[float]] = []
    with (
        DaemonProcess(tmp / f"ttft-{backend}", backend, None, *args).start(wait_state=("Ready",)) as d,
        d.client(timeout_s=600.0) as c,
        Chat(c, profile="ttft") as chat,
    ):
        chat.send(WARM_UP, max_tokens=REPLY_TOKENS, temperature=0.0)
        for _size, lists in convs:
            results = [chat.send(m, max_tokens=REPLY_TOKENS, temperature=0.0) for m in lists]
            # a reply whose first token has no text has no TTFT (0.0): not a figure
            ttft.append([r.timing.ttft_ms or math.nan for r in results])
            prefilled.append([float(r.usage.prefilled_tokens) for r in results])
    return _series([s for s, _ in convs], ttft, prefilled)


def run_peer(tmp: Path, convs: list[tuple[int, list[Messages]]]) -> dict[str, Any]:
    """The same message lists, in the same order, to llama-cpp-python's server."""
    from backends.bundled import bundled_gguf_path

    model = bundled_gguf_path()
    sent = [WARM_UP] + [m for _size, lists in convs for m in lists]
    with peer_server(tmp, model, N_CTX) as port:
        rows = sdk_turns(f"http://127.0.0.1:{port}/v1", str(model), sent, tools=None)[1:]
    per = 1 + WARM_TURNS
    ttft = [[r["ttft_ms"] for r in rows[k * per:(k + 1) * per]] for k in range(len(convs))]
    return _series([s for s, _ in convs], ttft, None)


def run_llama_server(tmp: Path, convs: list[tuple[int, list[Messages]]]) -> dict[str, Any]:
    """The same message lists, in the same order, to llama.cpp's llama-server at its defaults (its RAM cache on)."""
    from backends.bundled import bundled_gguf_path
    from benchmarks.agent import run_llama_server as through

    sent = [WARM_UP] + [m for _size, lists in convs for m in lists]
    rows = through(tmp, bundled_gguf_path(), N_CTX, sent, tools=None, log="ttft-llama-server.log")[1:]
    per = 1 + WARM_TURNS
    ttft = [[r["ttft_ms"] for r in rows[k * per:(k + 1) * per]] for k in range(len(convs))]
    return _series([s for s, _ in convs], ttft, None)


def section(tmp: Path, count: Callable[[str], int], *, with_openvino: bool = True, with_peer: bool = True) -> dict[str, Any]:
    """Measure every series; the dict ``benchmarks.plot.plot_ttft`` draws."""
    convs = conversations(count)
    series: dict[str, Any] = {MODELD_LLAMA: run_modeld(tmp, "llama", convs)}
    if with_openvino:
        series[MODELD_OPENVINO] = run_modeld(tmp, "openvino", convs)
    if with_peer:
        series[PEER] = run_peer(tmp, convs)
        series[LLAMA_SERVER] = run_llama_server(tmp, convs)
    return {
        "suffix_tokens": list(SUFFIX_SIZES),
        "prefix_tokens": count(convs[0][1][0][0]["content"]),
        "warm_turns": WARM_TURNS,
        "model": "SmolLM2-135M-Instruct Q4_1 (bundled)",
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "series": series,
    }


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the architecture: the figures depend on it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.machine()


def rows(r: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """The printed table: per series and size, cold and warm TTFT and what was prefilled."""
    out: list[tuple[str, Any, str]] = []
    for name, s in r["series"].items():
        for k, size in enumerate(r["suffix_tokens"]):
            cold, warm = s["cold_ms"][k], s["warm_ms"][k]
            note = f"warm/cold {warm / cold:.3f}; warm runs " + ", ".join(f"{ms:,.0f}" for ms in s["warm_all_ms"][k])
            if s.get("warm_prefilled"):
                note += f"; prefilled cold {s['cold_prefilled'][k]:.0f}, warm {s['warm_prefilled'][k]:.0f} tokens"
            out.append((f"{name}: {size}-token turn, cold / warm TTFT ms", f"{cold:,.0f} / {warm:,.0f}", note))
    for peer_name, label in ((PEER, "llama-cpp-python's server"), (LLAMA_SERVER, "llama-server")):
        if peer_name in r["series"] and MODELD_LLAMA in r["series"]:
            peer, ours = r["series"][peer_name], r["series"][MODELD_LLAMA]
            ratios = ", ".join(f"{size}: {w / p:.2f}" for size, w, p in zip(r["suffix_tokens"], ours["warm_ms"], peer["warm_ms"], strict=True))
            out.append((f"modeld llama.cpp / {label}, warm", ratios, "by new-turn tokens; below 1.0: modeld is faster"))
    return out
