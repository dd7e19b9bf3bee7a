"""The decode section of ``make bench``: through the daemon vs in process, plain vs speculative, vs the bandwidth bound.

Per engine, the same three tasks run in process (the backend's own Session,
no wire) and through a real daemon process (the runtime client over ZeroMQ):

* ``prose``  – a free-text answer (nothing to copy: speculation should cost ~nothing);
* ``edit``   – a ~300-token Python file with the request to return it with one
  function renamed, as a chat turn (the agent's edit: the answer repeats the prompt);
* ``edit (continuation)`` – the same file and change as a plain continuation,
  which any model size goes on copying (the mechanism's ceiling on this model).

Each task decodes greedily with speculation off and on (``DecodeConfig.speculative``);
the rate is completion tokens over the decode time the final chunk reports,
the median of ``REPS`` rounds; a round runs every task, mode and side once
(in process and through the daemon alternating), so a slow spell of the
machine lands on all of them. Printed per engine: daemon / in-process decode,
speculative / plain on each task (the median over rounds of the two rates
measured in the same round) with the share of draft tokens kept, and plain
decode as a fraction of the bandwidth bound: the model's weight bytes read once
per token at the memory bandwidth measured here (a numpy copy).

Daemon / in-process decode is judged on its own run of short pairs
(``short_pairs``): ``SHORT_PAIRS`` plain 96-token prose decodes, in process and
through the daemon back to back (each pair ~2 s, the order alternating), half of
them with the daemon's model loaded before the in-process one and half with a
fresh daemon loaded after it, and the geometric mean of the two halves' median
ratios (``order_balanced``): a copy of the model loaded later decodes a few
percent faster here (``measure_both``). A VM's mood drifts over seconds to minutes
(the same in-process decode ran at 90-113 tok/s in consecutive runs here), so
the closer in time the two sides of a pair, the more of it they share: three
such runs in a row read 0.975 / 0.983 / 0.979 on OpenVINO, where the median of
the 15 task pairs below read anything from 0.93 to 1.02 run to run with
nothing changed. Those task pairs are printed beside it (``daemon_ratio``:
the median of the ratios of each (round, task)'s plain decodes, and the ratio
of each side's fastest round per task); the fastest rounds once read 0.84 on
one task against a median of 0.99, as in-process OpenVINO has lucky fast runs
as well as slow spells.

On llama.cpp the edit chat turn also goes to the peers (same GGUF, threads and
messages, streamed over HTTP): llama-cpp-python's own OpenAI server, plain and
with its prompt-lookup drafts (``--draft_model prompt-lookup-decoding``, 4 and
its default 10 tokens per draft), and llama.cpp's ``llama-server``, plain and
with its n-gram drafts (``--spec-type ngram-simple`` and ``ngram-mod``), each
peer's servers taking turns round by round (``peer_rates``). llama-server's rate
is its own ``timings``; the other's is streamed chunks (one per token there)
over the time from the first to the last, so compare a peer's speculative /
plain with ours, not its absolute rate with the daemon's engine-timed one.

Each speculative figure says whether the speculative answer is the plain one,
token for token (``same_answer``): in the engines' default layouts a check's
batch rounds differently from a one-token step, an answer can part from the
plain one at a near-tie, and a ratio of two different answers' rates measures
how copyable each is as much as what speculation gives. The tasks also run
through a daemon serving exact decode (``EXACT_DECODE``: on llama.cpp with
flash attention over a q8_0 cache), where every row computes what a one-token
step does and the answers are the same (``exact_decode_rows``), with what the
mode costs plain decoding.

One prose turn is one answer, and a ratio of five rounds moves by +-5% run to run
here, wider than the 3% prose is judged by. So what speculation costs free text
is also measured in process on twelve prose prompts (``prose_prompt_rows``),
plain and speculative back to back in balanced order, and judged over the
answers that had nothing to copy.

Agents send long prompts, and what a check costs against a step grows with the
context on some engines (``backends.tape.speculate.CheckCosts``), so the prose
task also runs in process after a system prompt of ``LONG_PROMPT_TOKENS`` tokens
(a repository map), plain and speculative, by default and with exact decode,
whose steps cost more over a long past on OpenVINO (``long_prompt_rows``).

Targets (issue: speed): daemon / in-process >= 0.97 on both engines;
speculative >= 2x plain on the edit task on one engine and >= 1.5x on the other,
<= 3% slower on prose.

A bench section is one script: its length is its tasks, its passes and its table.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from backends.bundled import bundled_gguf_path
from benchmarks.agent import peer_server
from benchmarks.common import PREFIX_LINE, sse_chat, text_of_tokens
from contract.types import (
    ChatMessage,
    Config,
    DecodeConfig,
    OpenSessionRequest,
    PrefixInput,
    StreamChunk,
    SuffixInput,
)
from harness.daemon import DaemonProcess
from harness.prompts import EDIT_CONTINUATION, EDIT_TASK

NUM_CTX = 4096
#: repetitions of every (task, mode, side); a round runs each once, so a slow spell of a shared
#: machine spreads over all of them instead of landing on one block
REPS = 5
SYSTEM = "You are a careful coding assistant. Answer directly."
PROSE = "Write a short story about a lighthouse keeper who finds a message in a bottle."
#: (name, the turn, tokens to decode)
TASKS: list[tuple[str, SuffixInput, int]] = [
    ("prose", SuffixInput(messages=[ChatMessage(role="user", content=PROSE)]), 128),
    ("edit", SuffixInput(messages=[ChatMessage(role="user", content=EDIT_TASK)]), 320),
    ("edit (continuation)", SuffixInput(text=EDIT_CONTINUATION, render=False), 320),
]
#: the peer's prompt-lookup draft lengths compared (``--draft_model_num_pred_tokens``; 10 is its default)
PEER_DRAFTS = (4, 10)
#: llama-server's ``--spec-type`` drafts compared (at their default sizes)
LLAMA_SERVER_SPEC = ("ngram-simple", "ngram-mod")
#: rounds of a peer's servers taking turns on the edit turn
PEER_REPS = 3
#: back-to-back pairs of short plain decodes, in process and through the daemon, for daemon / in-process
SHORT_PAIRS = 40
#: tokens each of those decodes (a prose answer runs longer than this)
SHORT_TOKENS = 96
#: the Config of exact decode per engine (docs/speculation.md): a token's logits are the same
#: alone or as a row of a check, so drafts cannot change an answer; llama.cpp takes it with flash
#: attention over a quantized cache, whose kernels are exact
EXACT_DECODE: dict[str, dict[str, Any]] = {
    "llama": {"flash_attn": True, "kv_cache_type": "q8_0", "exact_decode": True},
    "openvino": {"exact_decode": True},
}
#: the agent-length system prompt the prose task also runs after (``long_prompt_rows``)
LONG_PROMPT_TOKENS = 3000
#: free-text turns with nothing given to copy, for what speculation costs prose (``prose_prompt_rows``)
PROSE_PROMPTS = (
    PROSE,
    "Explain how a hash map handles collisions, in plain words.",
    "Describe what a code reviewer should look for in a pull request.",
    "Write a commit message for a change that adds retry logic to an HTTP client.",
    "Why do databases use write-ahead logs? Answer in a few paragraphs.",
    "Summarize the trade-offs between threads and async IO in Python.",
    "Write a short poem about debugging late at night.",
    "What should a new contributor read first in a large open source project?",
    "Explain what a race condition is and how to avoid one.",
    "Describe the difference between a process and a thread.",
    "Give advice to someone learning their first programming language.",
    "Explain why unit tests are useful, with an example of what they catch.",
)
#: rounds of four runs per prompt (two pairs each; P S S P and S P P S by turns)
PROSE_ROUNDS = 4
#: a prose answer whose drafts kept fewer than this share of its tokens had nothing to copy
COPY_SHARE = 0.1


def bandwidth_bytes_per_s() -> float:
    """Memory bandwidth by a numpy copy of 256 MiB (bytes read + written per second, best of 5)."""
    src = np.ones(64 * 2**20, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def prefill_turn(sess: Any, manifest: Any, suffix: SuffixInput, system: str = SYSTEM) -> None:
    """The system prompt, a different short turn (so ``suffix`` is prefilled anew), then ``suffix``."""
    sess.ensure_prefix(PrefixInput(text=system, manifest=manifest))
    sess.prefill_suffix(SuffixInput(text="Hello.", render=False, manifest=manifest))
    sess.prefill_suffix(suffix.model_copy(update={"manifest": manifest}))


def _turn(sess: Any, manifest: Any, suffix: SuffixInput, n: int, speculative: bool,
          ids: list[int] | None = None, system: str = SYSTEM) -> StreamChunk:
    """One decode of ``suffix`` after the system prompt; a different short turn first, so it is prefilled anew.

    The answer's token ids are appended to ``ids`` when given (only then are they asked for: the
    short pairs time the plain stream)."""
    prefill_turn(sess, manifest, suffix, system)
    final: StreamChunk | None = None
    cfg = DecodeConfig(max_tokens=n, temperature=0.0, speculative=speculative, return_token_ids=ids is not None)
    for chunk in sess.decode(cfg):
        if ids is not None:
            ids += chunk.token_ids
        final = chunk
    assert final is not None and final.usage is not None
    return final


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where two answers part (one ending early counts), None if equal."""
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if at is None and len(a) != len(b):
        at = min(len(a), len(b))
    return at


def speculation_note(plain: dict[str, Any], spec: dict[str, Any], speedup: float) -> str:
    """What a speculative row says beside its rates: the speedup, the drafts kept, the answer's length,
    and whether it is the plain answer (``plain``/``spec``: one task's entries of ``_measure``)."""
    kept = f"{spec['accepted']:.0f} of {spec['drafted']:.0f} drafted kept" if spec["drafted"] else "no drafts"
    return f"{speedup:.2f}x, {kept}, {spec['tokens']:.0f} tokens, {same_answer(plain['ids'], spec['ids'])}"


def same_answer(plain: list[int], spec: list[int]) -> str:
    """Whether the speculative answer is the plain one, token for token; where they part if not."""
    at = first_difference(plain, spec)
    return "the same answer" if at is None else f"ANSWERS PART at token {at} of {len(plain)}"


def _rate(final: StreamChunk) -> float:
    u = final.usage
    assert u is not None
    return u.completion_tokens / (u.decode_ms / 1000) if u.decode_ms > 0 else 0.0


def paired_median(numerator: list[float], denominator: list[float]) -> float:
    """The median over rounds of one rate over another measured in the same round."""
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True) if b > 0]
    return statistics.median(ratios) if ratios else float("nan")


def daemon_ratio(local: dict[str, list[float]], remote: dict[str, list[float]]) -> tuple[float, float, int]:
    """Daemon / in-process decode from rates by key (task/mode) and round: (median of the paired
    ratios, geometric mean over keys of fastest daemon round / fastest in-process round, pairs)."""
    pairs = [r / lo for key in local for lo, r in zip(local[key], remote[key], strict=True) if lo > 0]
    best = [max(remote[key]) / max(local[key]) for key in local if max(local[key]) > 0]
    if not pairs or not best:
        return float("nan"), float("nan"), 0
    return statistics.median(pairs), float(np.exp(np.mean(np.log(best)))), len(pairs)


def short_pairs(sides: dict[str, tuple[Any, Any]], pairs: int = SHORT_PAIRS, tokens: int = SHORT_TOKENS) -> list[float]:
    """Daemon / in-process decode of ``pairs`` short prose answers run back to back, the order alternating
    (``sides``: ``local`` and ``remote``); one ratio per pair."""
    prose = TASKS[0][1]
    ratios: list[float] = []
    for i in range(pairs):
        got: dict[str, float] = {}
        for side in ("local", "remote") if i % 2 == 0 else ("remote", "local"):
            sess, manifest = sides[side]
            got[side] = _rate(_turn(sess, manifest, prose, tokens, False))
        if got["local"] > 0:
            ratios.append(got["remote"] / got["local"])
    return ratios


def _measure(sides: dict[str, tuple[Any, Any]], tasks: list[tuple[str, SuffixInput, int]] = TASKS,
             system: str = SYSTEM) -> dict[str, dict[str, dict[str, Any]]]:
    """Per side, task and mode: decode tok/s (median, and every round's in ``rates``), tokens,
    drafted/accepted and the answer's token ids (``ids``) of the last run (``tasks`` after ``system``).

    The sides take turns run by run (in process, daemon, in process, …), so a
    slower spell of a shared machine lands on both instead of on one side's block;
    odd rounds reverse the order within each pair, so neither side always runs second.
    """
    rates: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
    last: dict[str, dict[str, StreamChunk]] = {side: {} for side in sides}
    answers: dict[str, dict[str, list[int]]] = {side: {} for side in sides}
    for rep in range(REPS):
        order = list(sides.items()) if rep % 2 == 0 else list(reversed(sides.items()))
        for name, suffix, n in tasks:
            for spec in (False, True):
                key = f"{name}/{'spec' if spec else 'plain'}"
                for side, (sess, manifest) in order:
                    answers[side][key] = []
                    final = _turn(sess, manifest, suffix, n, spec, answers[side][key], system)
                    rates[side].setdefault(key, []).append(_rate(final))
                    last[side][key] = final
    out: dict[str, dict[str, dict[str, Any]]] = {side: {} for side in sides}
    for side in sides:
        for key, values in rates[side].items():
            u = last[side][key].usage
            assert u is not None
            out[side][key] = {
                "tok_s": statistics.median(values),
                "rates": values,
                "tokens": u.completion_tokens,
                "drafted": u.drafted_tokens,
                "accepted": u.accepted_tokens,
                "ids": answers[side][key],
            }
    return out


def order_balanced(first: list[float], second: list[float]) -> float:
    """Daemon / in process with the load order cancelled: the geometric mean of the median ratio with the
    daemon's model loaded first and the median with it loaded second (see ``measure_both``)."""
    if not first or not second:
        return float("nan")
    return math.sqrt(statistics.median(first) * statistics.median(second))


def _daemon(tmp: Path, engine: str, name: str, *flags: str) -> DaemonProcess:
    d = DaemonProcess(tmp / name, engine, None, "--num-ctx", str(NUM_CTX), "--cache-ram", "0", "--cache-disk", "0", *flags)
    return d.start(ready_timeout_s=900, wait_state=("Ready",))


def measure_both(tmp: Path, engine: str) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, list[float]], int]:
    """The tasks in process and through a daemon process, interleaved; the short pairs' daemon / in-process
    ratios (``short_pairs``) by load order; and the model's weight bytes.

    The in-process model is loaded with the config the daemon resolved (threads,
    context). Of two copies of one OpenVINO model on this machine, the one loaded
    later decoded ~2-4% faster, in one process or two (in process first, daemons
    after: 1.036 ± 0.005; daemon first: 0.94-0.97; a second, third and fourth copy in
    one process 1.017-1.024 × the first), so the short pairs run in two halves:
    the daemon started first (``daemon first``), then a fresh daemon started after
    the in-process model (``daemon second``); ``order_balanced`` cancels the order.
    """
    d = _daemon(tmp, engine, f"decode-{engine}")
    try:
        with d.client(timeout_s=600.0) as c:
            active = c.status().active
            assert active is not None
            req = OpenSessionRequest(path=str(bundled_gguf_path()), config=active.config)
            backend = _backend(engine)
            weights = int(backend.describe(req).weights_bytes)
            model = backend.load(req, lambda _f: None)
            remote = c.open_session(OpenSessionRequest())
            try:
                local = (model.open_session(), model.manifest_defaults().model_copy(update={"profile": "bench-decode"}))
                sides = {"local": local, "remote": (remote, remote.manifest(profile="bench-decode"))}
                shorts = {"daemon first": short_pairs(sides, SHORT_PAIRS // 2)}
                both = _measure(sides)
                remote.close()
                d.stop()
                d = _daemon(tmp, engine, f"decode-{engine}-second")
                with d.client(timeout_s=600.0) as c2:
                    remote = c2.open_session(OpenSessionRequest())
                    sides = {"local": local, "remote": (remote, remote.manifest(profile="bench-decode"))}
                    shorts["daemon second"] = short_pairs(sides, SHORT_PAIRS // 2)
                    remote.close()
                return both, shorts, weights
            finally:
                model.close()
    finally:
        d.stop()


def _peer_decode(port: int, messages: list[dict[str, str]], n: int) -> float:
    """One streamed chat completion from a peer server; decode tok/s: the server's own figure where it reports one
    (llama-server's ``timings.predicted_per_second``: its drafts may send several tokens in one chunk), else streamed
    chunks (one per token on llama-cpp-python's server) over the time between its first and last."""
    body = {"messages": messages, "max_tokens": n, "temperature": 0, "stream": True}
    stamps: list[float] = []
    reported = 0.0
    for event in sse_chat(port, body, timeout_s=600):
        reported = float((event.get("timings") or {}).get("predicted_per_second") or reported)
        choices = event.get("choices") or [{}]
        if choices[0].get("delta", {}).get("content"):
            stamps.append(time.perf_counter())
    if reported:
        return reported
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else 0.0


def _peer_servers(tmp: Path) -> dict[str, dict[str, Any]]:
    """Per peer, its servers by mode: llama-cpp-python's server plain and with its prompt-lookup drafts of each
    length in ``PEER_DRAFTS``; llama-server plain and with each of ``LLAMA_SERVER_SPEC`` (context managers that
    yield a port)."""
    from benchmarks import llama_server

    model = bundled_gguf_path()
    cpp = {"plain": partial(peer_server, tmp, model, NUM_CTX)} | {
        f"lookup {k}": partial(peer_server, tmp, model, NUM_CTX, "--draft_model", "prompt-lookup-decoding",
                               "--draft_model_num_pred_tokens", str(k))
        for k in PEER_DRAFTS
    }
    ls = {"plain": partial(llama_server.serving, model, NUM_CTX, tmp / "decode-llama-server-plain.log")} | {
        spec: partial(llama_server.serving, model, NUM_CTX, tmp / f"decode-llama-server-{spec}.log", "--spec-type", spec)
        for spec in LLAMA_SERVER_SPEC
    }
    return {"llama-cpp-python's server": cpp, llama_server.NAME: ls}


def peer_rates(tmp: Path, rounds: int = PEER_REPS) -> dict[str, dict[str, list[float]]]:
    """The edit chat turn through each peer (``_peer_servers``), plain and speculative: one server per mode, a
    peer's servers taking turns round by round (decode tok/s per round, keyed by peer, then mode)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": EDIT_TASK}]
    n = next(n for name, _s, n in TASKS if name == "edit")
    out: dict[str, dict[str, list[float]]] = {}
    for peer, servers in _peer_servers(tmp).items():
        rates: dict[str, list[float]] = {key: [] for key in servers}
        with contextlib.ExitStack() as stack:
            ports = {key: stack.enter_context(start()) for key, start in servers.items()}
            for port in ports.values():
                _peer_decode(port, messages, 8)  # the prompt prefilled once; every round after reuses it
            for rep in range(rounds):
                order = list(ports.items()) if rep % 2 == 0 else list(reversed(ports.items()))
                for key, port in order:
                    rates[key].append(_peer_decode(port, messages, n))
        out[peer] = rates
    return out


def peer_rows(rates: dict[str, dict[str, list[float]]], ours: float) -> list[tuple[str, Any, str]]:
    """Each peer's row: its rates, and its speculative / plain next to the daemon's (``ours``)."""
    rows: list[tuple[str, Any, str]] = []
    for peer, modes in rates.items():
        plain = modes["plain"]
        speedups = ", ".join(f"{key} {paired_median(values, plain):.2f}x" for key, values in modes.items() if key != "plain")
        rows.append((
            f"edit: {peer} plain / " + " / ".join(k for k in modes if k != "plain") + " tok/s",
            " / ".join(f"{statistics.median(v):.1f}" for v in modes.values()),
            f"same turn, model and threads (median of {len(plain)}); its speculative / plain: {speedups}; "
            f"modeld's: {ours:.2f}x",
        ))
    return rows


def _backend(engine: str) -> Any:
    if engine == "llama":
        from backends.llama import LlamaBackend

        return LlamaBackend()
    from backends.openvino import OpenVINOBackend

    return OpenVINOBackend()


def exact_flags(engine: str) -> tuple[str, ...]:
    """``EXACT_DECODE`` as ``modeld serve`` flags."""
    flags: list[str] = []
    for key, value in EXACT_DECODE[engine].items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return tuple(flags)


def _token_count(model: Any, text: str) -> int:
    return len(model.tokenize(text))


def long_prompt_rows(engine: str) -> list[tuple[str, Any, str]]:
    """The prose task in process after a ``LONG_PROMPT_TOKENS``-token system prompt, plain and
    speculative, ``REPS`` rounds (``_measure``): by default, then with exact decode."""
    rows: list[tuple[str, Any, str]] = []
    name = TASKS[0][0]
    default_plain = 0.0
    for mode, settings in (("", {}), ("exact decode", EXACT_DECODE[engine])):
        req = OpenSessionRequest(path=str(bundled_gguf_path()), config=Config(num_ctx=NUM_CTX, **settings))
        model = _backend(engine).load(req, lambda _f: None)
        try:
            count = partial(_token_count, model)
            system = SYSTEM + "\nRepository map:\n" + text_of_tokens(count, LONG_PROMPT_TOKENS, PREFIX_LINE)
            sess = model.open_session()
            manifest = model.manifest_defaults().model_copy(update={"profile": "bench-long"})
            got = _measure({"local": (sess, manifest)}, TASKS[:1], system)["local"]
            context = len(model.res.tokens)
        finally:
            model.close()
        plain, spec = got[f"{name}/plain"], got[f"{name}/spec"]
        note = speculation_note(plain, spec, paired_median(spec["rates"], plain["rates"]))
        if mode:
            note += f"; plain decode {plain['tok_s'] / default_plain:.2f}x the default's"
        default_plain = default_plain or plain["tok_s"]
        rows.append((f"{name} after a {LONG_PROMPT_TOKENS:,}-token prompt: plain / speculative tok/s "
                     f"({mode + ', ' if mode else ''}in process)", f"{plain['tok_s']:.1f} / {spec['tok_s']:.1f}",
                     f"{note}; ~{context:,} tokens of context at the end; target <= 3% slower"))
    return rows


def prose_pairs(sess: Any, manifest: Any, prompts: tuple[str, ...] = PROSE_PROMPTS, rounds: int = PROSE_ROUNDS,
                tokens: int = 128) -> list[dict[str, Any]]:
    """Each prompt decoded plain (P) and speculative (S) in ``rounds`` rounds of P S S P and S P P S by
    turns, each run paired with its neighbour: a drift of the machine's speed lands on both sides of a
    pair, and each mode runs in each position equally often. Per prompt: the pairs' speculative / plain
    ``ratios``, the speculative answer's ``kept`` and ``drafted`` tokens and whether it ``copied``
    itself (kept ``COPY_SHARE`` of its tokens or more), and whether both modes gave the ``same`` answer."""
    answers: list[dict[str, Any]] = []
    for text in prompts:
        suffix = SuffixInput(messages=[ChatMessage(role="user", content=text)])
        ids: dict[bool, list[int]] = {False: [], True: []}
        ratios: list[float] = []
        usage = None
        for rnd in range(rounds):
            order = (False, True, True, False) if rnd % 2 == 0 else (True, False, False, True)
            rates: list[float] = []
            for i, spec in enumerate(order):
                # the answers' ids are asked for in the first pair only (both modes alike)
                final = _turn(sess, manifest, suffix, tokens, spec, ids[spec] if rnd == 0 and i < 2 else None)
                rates.append(_rate(final))
                if spec:
                    usage = final.usage
            for a, b in ((0, 1), (2, 3)):  # neighbours: one speculative run and one plain
                spec_rate, plain_rate = (rates[a], rates[b]) if order[a] else (rates[b], rates[a])
                ratios.append(spec_rate / plain_rate if plain_rate > 0 else float("nan"))
        assert usage is not None
        answers.append({"ratios": ratios, "kept": usage.accepted_tokens, "drafted": usage.drafted_tokens,
                        "copied": usage.accepted_tokens >= COPY_SHARE * usage.completion_tokens,
                        "same": first_difference(ids[False], ids[True]) is None})
    return answers


def prose_rows(answers: list[dict[str, Any]]) -> list[tuple[str, Any, str]]:
    """The table's rows for ``prose_pairs``: judged over the answers that had nothing to copy."""
    name = f"prose, {len(answers)} prompts: speculative / plain (in process)"
    shown = "; ".join(
        f"{statistics.median(a['ratios']):.3f} ({a['kept']}/{a['drafted']} kept"
        f"{', copies itself' if a['copied'] else ''}{'' if a['same'] else ', answers part'})"
        for a in answers
    )
    every = statistics.median(r for a in answers for r in a["ratios"])
    judged = [r for a in answers if not a["copied"] for r in a["ratios"]]
    if not judged:
        return [(name, "n/a", f"every answer copied itself (all pairs {every:.3f}): {shown}")]
    median = statistics.median(judged)
    worst = min(statistics.median(a["ratios"]) for a in answers if not a["copied"])
    verdict = "met" if median >= 0.97 else "MISSED"
    return [
        (name, f"{median:.3f}",
         f"median of {len(judged)} back-to-back pairs over the {sum(not a['copied'] for a in answers)} answers "
         f"with nothing to copy (quartiles {np.quantile(judged, 0.25):.3f}-{np.quantile(judged, 0.75):.3f}; "
         f"worst answer's median {worst:.3f}); target >= 0.97 ({verdict})"),
        ("  per prompt: median of its pairs (drafts)", f"all {every:.3f}", shown),
    ]


def prose_prompt_rows(engine: str) -> list[tuple[str, Any, str]]:
    """What speculation costs free text, in process: ``PROSE_PROMPTS`` through ``prose_pairs``.

    One prose turn's ratio over five rounds moved by +-5% run to run here, wider than the 3% it is
    judged by, and back-to-back plain runs of one prompt ranged 78-106 tok/s; over twelve answers and
    their pairs a single answer's luck (a lone draft at a chance match) shows as what it is. A small
    model's prose often repeats itself, which drafts then copy: the judged figure is over the answers
    that had nothing to copy; the rest are shown beside it.
    """
    req = OpenSessionRequest(path=str(bundled_gguf_path()), config=Config(num_ctx=NUM_CTX))
    model = _backend(engine).load(req, lambda _f: None)
    try:
        manifest = model.manifest_defaults().model_copy(update={"profile": "bench-prose"})
        answers = prose_pairs(model.open_session(), manifest, tokens=TASKS[0][2])
    finally:
        model.close()
    return prose_rows(answers)


def exact_decode_rows(tmp: Path, engine: str, default: dict[str, dict[str, Any]]) -> list[tuple[str, Any, str]]:
    """The tasks through a daemon serving exact decode (``EXACT_DECODE``), plain vs speculative, and its
    plain rates against ``default`` (the default daemon's figures)."""
    d = _daemon(tmp, engine, f"decode-{engine}-exact", *exact_flags(engine))
    try:
        with d.client(timeout_s=600.0) as c:
            active = c.status().active
            assert active is not None
            assert {key: getattr(active.config, key) for key in EXACT_DECODE[engine]} == EXACT_DECODE[engine]
            sess = c.open_session(OpenSessionRequest())
            got = _measure({"remote": (sess, sess.manifest(profile="bench-exact"))})["remote"]
            sess.close()
    finally:
        d.stop()
    rows: list[tuple[str, Any, str]] = []
    costs = []
    for name, _suffix, _n in TASKS:
        plain, spec = got[f"{name}/plain"], got[f"{name}/spec"]
        rows.append((f"{name}: plain / speculative tok/s, exact decode (daemon)",
                     f"{plain['tok_s']:.1f} / {spec['tok_s']:.1f}",
                     speculation_note(plain, spec, paired_median(spec["rates"], plain["rates"]))))
        costs.append(f"{name} {plain['tok_s'] / default[f'{name}/plain']['tok_s']:.2f}")
    rows.append(("plain decode, exact / default (daemon)", ", ".join(costs),
                 "medians of two daemons run one after the other (noisier than a pair)"))
    return rows


def section(tmp: Path, engine: str, bandwidth: float) -> list[tuple[str, Any, str]]:
    both, shorts, weights = measure_both(tmp, engine)
    local, remote = both["local"], both["remote"]
    rows: list[tuple[str, Any, str]] = []
    plain_local, plain_remote = local["prose/plain"]["tok_s"], remote["prose/plain"]["tok_s"]
    rows.append(("decode tok/s, prose, in process / daemon", f"{plain_local:.1f} / {plain_remote:.1f}", "medians"))
    short = order_balanced(shorts["daemon first"], shorts["daemon second"])
    verdict = "(met)" if short >= 0.97 else "(MISSED)"
    halves = "; ".join(
        f"{order} {statistics.median(r):.3f} (quartiles {np.quantile(r, 0.25):.3f}-{np.quantile(r, 0.75):.3f})"
        for order, r in shorts.items() if r
    )
    rows.append(("daemon / in-process decode, plain", f"{short:.3f}",
                 f"load order balanced: {halves}, {len(shorts['daemon first'])} back-to-back pairs of "
                 f"{SHORT_TOKENS}-token decodes each; target >= 0.97 {verdict}"))
    plain_keys = [key for key in local if key.endswith("/plain")]
    median, fastest, n = daemon_ratio({k: local[k]["rates"] for k in plain_keys},
                                      {k: remote[k]["rates"] for k in plain_keys})
    rows.append(("daemon / in-process decode, the tasks' pairs", f"{median:.3f} / {fastest:.3f}",
                 f"median of {n} pairs of the tasks below / fastest rounds (daemon loaded first; seconds to "
                 "minutes apart: noisier)"))
    speedups: dict[str, float] = {}
    for name, _suffix, _n in TASKS:
        plain, spec = remote[f"{name}/plain"], remote[f"{name}/spec"]
        speedup = speedups[name] = paired_median(spec["rates"], plain["rates"])
        target = ("one answer; the target (<= 3% slower) is judged on the prose prompts below" if name == "prose"
                  else "target >= 2x (one engine), >= 1.5x (the other)")
        rows.append((f"{name}: plain / speculative tok/s (daemon)", f"{plain['tok_s']:.1f} / {spec['tok_s']:.1f}",
                     f"{speculation_note(plain, spec, speedup)}; {target}"))
        lspeed = paired_median(local[f"{name}/spec"]["rates"], local[f"{name}/plain"]["rates"])
        rows.append((f"{name}: speculative / plain in process", f"{lspeed:.2f}x", ""))
    rows += prose_prompt_rows(engine)
    rows += long_prompt_rows(engine)
    rows += exact_decode_rows(tmp, engine, remote)
    if engine == "llama":
        rows += peer_rows(peer_rates(tmp), speedups["edit"])
    bound = bandwidth / weights if weights else float("nan")
    rows.append(("bandwidth bound tok/s (weights / bandwidth)", f"{bound:.0f}",
                 f"{weights / 2**20:.0f} MiB of weights at {bandwidth / 2**30:.1f} GiB/s; "
                 f"plain decode is {plain_remote / bound:.1%} of it"))
    return rows


def main() -> None:  # pragma: no cover - a manual entry point
    import json
    import tempfile

    bw = bandwidth_bytes_per_s()
    with tempfile.TemporaryDirectory() as tmp:
        for engine in os.environ.get("ENGINES", "llama,openvino").split(","):
            print(json.dumps({"engine": engine, "rows": section(Path(tmp), engine, bw)}, indent=1))


if __name__ == "__main__":
    main()
