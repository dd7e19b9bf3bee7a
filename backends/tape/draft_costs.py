"""Measuring what a draft's check costs on a loaded model, once per model and machine.

The draft policy (``backends.tape.speculate``) needs what a check of ``r`` rows costs against a plain
one-token step, and how that grows with the context. It depends on the engine, its kernels, the threads
and the CPU, so it is timed on a throwaway context (a short one, then a longer one when the window
has room), taking the fastest of ``REPS`` interleaved rounds, and then fixed, so drafts are a function
of the tape and answers repeat. It is timed while the slot is idle after the load, not in it: on a busy
machine the timing takes minutes, which a load (and the agent's first request behind it) would wait for;
until it is done, drafts are priced by the prior. The table is kept on disk (``draft-costs.json`` in the model
cache directory) under a key naming the engine, its version, the model's layout (``layout_digest``: the
same weights under another chat template share a table), the kernels' settings and the CPU, not the
context size: a restarted daemon drafts as before and measures nothing. A missing,
unreadable or unwritable file only means measuring again; a table timed in a window too small for the
longer context is replaced by the first load whose window has room. Why each of these, with the
measurements: ``docs/speculation.md``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contract import interrupt
from contract.manifest import canonical_digest
from contract.types import DecodeConfig

from ..bundled import model_cache_dir
from ..devices import usable_cpus
from ..digest import load_json_map, merge_json_map
from .speculate import MAX_DRAFT, CheckCosts

if TYPE_CHECKING:
    from .decoding import DecodeSteps
    from .model import TapeModel

__all__ = ["FILE_NAME", "FIXED_ENV", "cost_key", "fixed_costs", "kept_costs", "measure", "measure_costs", "table_dir"]

log = logging.getLogger("modeld.speculate")

#: bump when the measurement changes, so tables measured the old way are not reused
METHOD_VERSION = 4
#: the check sizes timed; others are interpolated (the largest is a full draft's check)
TIMED_ROWS = (2, 4, 8, MAX_DRAFT + 1)
#: timed rounds per row count (the fastest is kept)
REPS = 5
#: tokens of context the checks run on
CONTEXT_TOKENS = 64
#: and the longer context they run on again, for how their cost grows with the context (an
#: agent's prompt is thousands of tokens); a smaller window measures at what it holds, from
#: ``MIN_LONG_CONTEXT_TOKENS`` on (below that, growth is not measured)
LONG_CONTEXT_TOKENS = 2048
MIN_LONG_CONTEXT_TOKENS = 512
#: the text the throwaway context is made of
_FILLER = (
    "def area(width, height):\n    return width * height\n\n"
    "The function above multiplies two numbers and returns the result to its caller. "
)
FILE_NAME = "draft-costs.json"
#: the context size, as each engine's runtime identity names it: not part of a table's key (a daemon
#: restarted with another window drafts as before and measures nothing)
CONTEXT_KEYS = ("num_ctx", "n_ctx")
#: a measurement is taken again when it is implausible (``plausible``), at most this many times in all
MEASURE_ATTEMPTS = 2
#: steps a check may cost beyond its row count before the table counts as disturbed
PLAUSIBLE_SLACK = 0.5


def cost_key(m: TapeModel) -> str:
    """What a cost table is valid for: the engine and its kernels' settings, the model and the CPU."""
    identity = {k: v for k, v in m.reuse_identity().items() if k not in (*CONTEXT_KEYS, "exact_reuse")}
    identity |= m.cost_identity()
    return canonical_digest(
        {
            "method": METHOD_VERSION,
            "backend": m.backend_name,
            "engine": m.engine_version(),
            "model": m.layout_digest(),
            "runtime": identity,
            "cpu": cpu_name(),
            "cores": usable_cpus(),
        }
    )


def cpu_name() -> str:
    """The CPU's model name (Linux), else what the platform module says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: a fixed table instead of a measured one: check costs in plain steps for 1..MAX_DRAFT + 1 rows, as JSON (e.g.
#: ``[1, 1.05, 1.1, …]``). For tests that assert drafting, whose answer must not hang on how busy the machine was
#: during the load's timing; the table is then not measured (status says a prior)
FIXED_ENV = "MODELD_DRAFT_COSTS"


def table_dir() -> Path:
    """The folder whose ``FILE_NAME`` keeps the measured tables, one entry per model layout and machine: the model
    cache. (Looked up at each load and timing, so a test of the timing can keep its table apart.)"""
    return model_cache_dir()


def fixed_costs() -> CheckCosts | None:
    """The table ``MODELD_DRAFT_COSTS`` gives, None when it is not set; a malformed one is refused (ValueError)."""
    raw = os.environ.get(FIXED_ENV, "").strip()
    if not raw:
        return None
    try:
        return CheckCosts([float(c) for c in json.loads(raw)])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{FIXED_ENV} must be a JSON list of {MAX_DRAFT + 1} positive costs: {exc}") from None


def kept_costs(m: TapeModel, cache_dir: Path | None) -> CheckCosts | None:
    """The check costs a load drafts by without timing anything: the table kept in ``cache_dir`` for this
    model and machine (the prior where the window is too small for drafts to matter); None: none is kept,
    so they are still to be measured (``measure_costs``)."""
    rows = m.check_rows(max(TIMED_ROWS))
    if m.num_ctx < rows + 2:
        return CheckCosts.prior()  # a context this small leaves drafts little room anyway
    stored = _load(cache_dir).get(cost_key(m))
    if stored is None or (not _grows(stored) and _longest(m) >= MIN_LONG_CONTEXT_TOKENS):
        return None  # (the second: timed in a window too small to see the growth this window can measure)
    try:
        costs = CheckCosts(stored["costs"], stored["growth"], stored["switch"])
    except (TypeError, ValueError, KeyError, IndexError):
        log.warning("ignoring a malformed draft cost table in %s", cache_dir)
        return None
    log.info("draft check costs (in plain steps, kept from an earlier load): %s", costs)
    return costs


def measure_costs(m: TapeModel, cache_dir: Path | None) -> CheckCosts | None:
    """Time the checks on a model with nothing resident and keep the table in ``cache_dir``.

    It prefills a throwaway context (a short one, then a longer one) and clears
    the KV again: a prefill of ``LONG_CONTEXT_TOKENS`` tokens once per model and
    machine. The daemon runs it while the slot is idle, not in the load
    (``TapeModelBase.idle_work``): inside an ``interrupt.interruptible`` scope a
    request that arrives stops it between two timed checks or prefill chunks
    (``Cancelled``), with the KV cleared and nothing kept. A table that stays
    implausible (another program held the cores) gives None: drafts keep the
    prior until the next load.
    """
    key = cost_key(m)
    longest = _longest(m)
    t0 = time.perf_counter()
    for _attempt in range(MEASURE_ATTEMPTS):
        short, switch = measure(m)
        longer: dict[int, float] | None = None
        if longest >= MIN_LONG_CONTEXT_TOKENS:
            longer, _ = measure(m, context=longest)
        costs = CheckCosts.from_points(short, m.check_rows, longer, longest - CONTEXT_TOKENS, switch)
        costs = CheckCosts(
            [round(c, 2) for c in costs.table()], [round(g, 3) for g in costs.growth()], round(costs.switch(), 3)
        )
        if plausible(costs):
            break
        log.warning("draft check costs measured while other work held the cores (%s); measuring again", costs)
    else:
        # kept in memory only: the next load measures again, on a quieter machine
        log.warning("draft check costs stayed disturbed; drafts are priced by the prior until the next load")
        return None
    log.info("draft check costs measured in %.2f s (in plain steps): %s", time.perf_counter() - t0, costs)
    if cache_dir is not None:
        _save(cache_dir, {key: {"costs": costs.table(), "growth": costs.growth(), "switch": costs.switch(),
                                "context": longest if longest >= MIN_LONG_CONTEXT_TOKENS else 0}})
    return costs


def _longest(m: TapeModel) -> int:
    """The longer context the checks are timed on again, as the window allows."""
    return min(LONG_CONTEXT_TOKENS, m.num_ctx - m.check_rows(max(TIMED_ROWS)) - 1)


def _grows(stored: dict[str, Any]) -> bool:
    """Whether a kept table was timed on a longer context too (tables kept before ``context`` was: yes)."""
    return bool(stored.get("context", LONG_CONTEXT_TOKENS)) if isinstance(stored, dict) else True


def plausible(costs: CheckCosts) -> bool:
    """Whether a measured table can be a quiet machine's: a check of ``r`` rows never costs more than ``r``
    one-token steps on the same kernels (it reads the weights once); more means another program took the
    cores during the timing, and such a table, kept on disk, would price drafts wrongly on every later load."""
    return all(c <= rows + PLAUSIBLE_SLACK for rows, c in enumerate(costs.table(), start=1))


def measure(m: TapeModel, reps: int | None = None, context: int = CONTEXT_TOKENS) -> tuple[dict[int, float], float]:
    """What a check of each timed row count costs after ``context`` tokens, in plain steps there
    ({rows: steps}, 1 -> 1.0; each timed after a check of its own size), and what the evaluation
    after a change of row count loses (the switch, in steps: the mean of the way into a check
    after a step and the way back)."""
    reps = REPS if reps is None else reps
    rows = sorted({m.check_rows(r) for r in TIMED_ROWS})
    filler = m.tokenize(_FILLER)
    n = max(1, min(context, m.num_ctx - max(rows) - 1))
    context_tokens = (filler * (n // max(len(filler), 1) + 1))[:n]
    same: dict[int, list[float]] = {r: [] for r in [1, *rows]}
    into: dict[int, list[float]] = {r: [] for r in rows}
    back: dict[int, list[float]] = {r: [] for r in rows}
    steps: DecodeSteps | None = None
    try:
        # a request that arrives stops it between chunks; inside a prefill's window, so that a slower machine on
        # demand (``serve --prefill-chunk-delay-ms``) slows it as it slows a request's prefill
        with interrupt.prefilling(0, len(context_tokens)):
            m.set_kv(context_tokens, 0)
        steps = m.decode_steps(DecodeConfig(max_tokens=1, temperature=0.0))
        steps.start()
        token = steps.sample()
        for rep in range(reps + 1):
            for r in rows:
                interrupt.check("draft cost measurement")
                # each run ends on a step, so the next one's first step follows a step (the first
                # round, untimed, follows the prefill)
                timed = [_time_check(steps, token, k) for k in (1, r, r, 1)]
                if rep:  # the first round is untimed: a new shape allocates
                    same[1].append(timed[0])
                    into[r].append(timed[1])
                    same[r].append(timed[2])
                    back[r].append(timed[3])
    finally:
        if steps is not None:
            steps.close()
        m.clear_kv()
    step = min(same[1])
    switch = statistics.median(
        (min(into[r]) - min(same[r]) + min(back[r]) - step) / 2 for r in rows
    )
    return {r: min(t) / step for r, t in same.items()}, switch / step


def _time_check(steps: DecodeSteps, token: int, rows: int) -> float:
    """Seconds to evaluate ``rows`` rows and sample each, as the decode loop does; rolled back after."""
    t0 = time.perf_counter()
    if rows == 1:
        steps.feed(token)
        steps.sample()
    else:
        steps.verify([token] * rows)
        for i in range(rows):
            steps.sample_row(i)
    seconds = time.perf_counter() - t0
    steps.rollback(rows)
    return seconds


def _load(cache_dir: Path | None) -> dict[str, Any]:
    return load_json_map(cache_dir / FILE_NAME) if cache_dir is not None else {}


def _save(cache_dir: Path, entries: dict[str, Any]) -> None:
    try:
        merge_json_map(cache_dir / FILE_NAME, entries)
    except OSError as exc:
        # measuring again at the next load is always correct
        log.warning("could not keep the draft cost table in %s: %s", cache_dir, exc)

