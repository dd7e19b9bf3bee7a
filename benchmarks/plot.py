"""Plots of ``make bench`` figures, drawn from the numbers a run measured.

``plot_ttft`` draws the TTFT-by-suffix-size section (``benchmarks.ttft``): time
to first token (ms, log scale) against the new turn's size (tokens, log scale),
cold and warm, for every series the run measured. matplotlib's Agg canvas
renders straight to a file: no display, no GUI toolkit, no global pyplot state.

``python -m benchmarks.plot [JSON] [--out PNG …]`` draws it again from the JSON a
``make bench`` run wrote (default ``benchmarks/out/ttft.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

OUT_DIR = Path(__file__).resolve().parent / "out"
TTFT_JSON = OUT_DIR / "ttft.json"
TTFT_PNG = OUT_DIR / "ttft.png"
DOCS_TTFT_PNG = Path(__file__).resolve().parent.parent / "docs" / "ttft.png"
THROUGHPUT_JSON = OUT_DIR / "throughput.json"
THROUGHPUT_PNG = OUT_DIR / "throughput.png"
DOCS_THROUGHPUT_PNG = Path(__file__).resolve().parent.parent / "docs" / "throughput.png"

#: one colour per series (the name benchmarks.ttft gives it); others take the cycle's next
_COLOURS = {
    "modeld, llama.cpp backend": "#1f6fb4",
    "modeld, OpenVINO backend": "#2a9d3f",
    "llama-cpp-python's server": "#d0582a",
}


def _ms(v: float, _pos: object = None) -> str:
    return f"{v / 1000:g} s" if v >= 1000 else f"{v:g} ms"


def _save(fig: Figure, paths: Sequence[Path]) -> list[Path]:
    """``fig`` as a PNG at each of ``paths``; returns them."""
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    return list(paths)


def plot_ttft(results: dict[str, Any], paths: Sequence[Path]) -> list[Path]:
    """Draw the TTFT-by-suffix-size figure of ``results`` into each of ``paths`` (PNG); returns them."""
    sizes = results["suffix_tokens"]
    fig = Figure(figsize=(8.0, 5.6), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, s in results["series"].items():
        colour = _COLOURS.get(name)
        (warm,) = ax.plot(sizes, s["warm_ms"], marker="o", linewidth=2.2, color=colour, label=f"{name}, warm")
        ax.plot(sizes, s["cold_ms"], marker="o", linestyle="--", linewidth=1.6, color=warm.get_color(),
                markerfacecolor="white", label=f"{name}, cold")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))  # 100 ms, 200 ms, 500 ms, 1 s …
    ax.yaxis.set_major_formatter(FuncFormatter(_ms))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("new tokens in the turn (after the stable prefix)")
    ax.set_ylabel("time to first token (log scale)")
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", axis="y", alpha=0.12)
    fig.suptitle(f"Time to first token after a {results['prefix_tokens']:,}-token prefix", fontsize=12)
    ax.set_title(
        "cold: the prefix is prefilled too; warm: the prefix is resident, only the new turn is prefilled\n"
        f"{results['model']}; {results['machine']}; {results['date']}; warm: median of {results['warm_turns']} turns",
        fontsize=8.5, color="#555555",
    )
    # one column per series (the legend fills columns first: warm above cold)
    fig.legend(loc="outside lower center", ncol=max(1, len(results["series"])), fontsize=8.5, frameon=False)
    return _save(fig, paths)


def plot_throughput(results: dict[str, Any], paths: Sequence[Path]) -> list[Path]:
    """Draw the agents-at-once figure of the ``vllm`` section (``benchmarks.replicas``): tokens per second of all
    the agents' turns against how many agents run at once, one line per setup; returns ``paths``."""
    fig = Figure(figsize=(7.2, 4.8), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    agents: list[int] = []
    for name, runs in results["series"].items():
        agents = [r["agents"] for r in runs]
        ax.plot(agents, [r["tok_s"] for r in runs], marker="o", linewidth=2.2, label=name)
    ax.set_xticks(agents, [str(n) for n in agents])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("agents at once (each its own conversation)")
    ax.set_ylabel("completion tokens per second, all agents")
    ax.grid(True, alpha=0.35)
    fig.suptitle("Agents at once: throughput", fontsize=12)
    ax.set_title(f"{results['turns']} turns each of up to {results['reply_tokens']} tokens after a "
                 f"~{results['prompt_tokens']:,}-token system prompt; {results.get('machine', '')}",
                 fontsize=8.5, color="#555555")
    fig.legend(loc="outside lower center", ncol=1, fontsize=8.5, frameon=False)
    return _save(fig, paths)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plot", description="Draw the TTFT plot again from a bench run's JSON.")
    p.add_argument("json", nargs="?", type=Path, default=TTFT_JSON, help=f"the figures (default {TTFT_JSON})")
    p.add_argument("--out", type=Path, action="append", default=None, help=f"PNG to write (repeatable; default {TTFT_PNG})")
    args = p.parse_args(argv)
    try:
        results = json.loads(args.json.read_text())
    except (OSError, ValueError) as exc:
        print(f"benchmarks.plot: cannot read {args.json}: {exc} (run `make bench` first)", file=sys.stderr)
        return 1
    for path in plot_ttft(results, args.out or [TTFT_PNG]):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
