"""The session-operations section of ``make bench``: forks and prefill-only scoring, on both engines.

* **Fork.** An 8k-token session (a system prompt, then a repository map appended at an offset) is forked at its
  end and the fork asks a short question (14 tokens on the bundled model): the time from ``fork`` to the question prefilled, against a session
  that computes the same 8k tokens and question from nothing (another manifest profile, so nothing resident or
  cached is reused).
* **Switching.** The source and a fork of it at 6k that went its own way for 1k tokens take turns four times each,
  each turn appending a short question: the median turn (the other's tail restored from the workspace cache,
  then the question prefilled), against re-prefilling that session's context.
* **Scoring.** A 2k-token suffix prefilled with ``logprobs: 5`` (every row's log-softmax and top 5, as an
  evaluation harness asks) against the same suffix prefilled plainly, in prompt tokens per second.

Targets (issue: salience's sessions): a fork's first prefill and a switch cost a small fraction of re-prefilling;
scoring runs near plain prefill speed.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import PREFIX_LINE, SUFFIX_LINE, text_of_tokens
from contract.manifest import ContextManifest
from contract.types import OpenSessionRequest, PrefixInput, SuffixInput
from harness.daemon import DaemonProcess
from runtime import RemoteSession

N_CTX = 9216
SESSION_TOKENS = 8000
FORK_AT = 6000
OWN_TOKENS = 1000
SCORED_TOKENS = 2000
ROUNDS = 4
SYSTEM = "You are a careful coding assistant working in this repository."


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _session(sess: RemoteSession, profile: str, body: list[int], length: int) -> tuple[ContextManifest, float]:
    """``sess`` holding the system prompt then ``body`` up to ``length`` tokens, under ``profile``; (manifest, ms)."""
    m = sess.manifest(profile=profile)
    t0 = time.perf_counter()
    prefix = sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m)).prefix_tokens
    sess.prefill_suffix(SuffixInput(tokens=body[: length - prefix], offset=prefix, manifest=m))
    return m, _ms(t0)


def _ask(sess: RemoteSession, m: Any, tokens: list[int]) -> tuple[float, Any]:
    at = sess.explain_context().resident_tokens
    t0 = time.perf_counter()
    st = sess.prefill_suffix(SuffixInput(tokens=tokens, offset=at, manifest=m))
    return _ms(t0), st


def run(tmp: Path, backend: str, count: Any) -> dict[str, Any]:
    repo_map = text_of_tokens(count, SESSION_TOKENS + 200, PREFIX_LINE)
    own = text_of_tokens(count, OWN_TOKENS + 100, SUFFIX_LINE)
    scored = text_of_tokens(count, SCORED_TOKENS, "[scored] " + SUFFIX_LINE)
    r: dict[str, Any] = {}
    d = DaemonProcess(tmp / f"sessions-{backend}", backend, None, "--num-ctx", str(N_CTX))
    with d, d.client(timeout_s=1800.0) as c:
        sess = c.open_session(OpenSessionRequest())
        body = sess.tokenize("\n" + repo_map)
        question = sess.tokenize("\nWhich module handles the requests? Name the file and the class.")
        m, r["cold_ms"] = _session(sess, "bench-sessions", body, SESSION_TOKENS)

        t0 = time.perf_counter()
        fork = sess.fork(SESSION_TOKENS)
        _, st = _ask(fork, m, question)
        r["fork_ms"], r["fork_prefilled"] = _ms(t0), st.prefilled_tokens
        fork.close()

        # the source and a fork at 6k with 1k of its own, taking turns
        fork = sess.fork(FORK_AT)
        _ask(fork, m, sess.tokenize("\n" + own)[:OWN_TOKENS])
        turns: list[float] = []
        prefilled: list[int] = []
        restored: list[int] = []
        for i in range(ROUNDS):
            for s in (sess, fork):
                ms, st = _ask(s, m, sess.tokenize(f"\nQuestion {i}: what changed in module {i}?"))
                turns.append(ms)
                prefilled.append(st.prefilled_tokens)
                restored.append(st.cached_tokens)
        r["switch_ms"] = statistics.median(turns)
        r["switch_prefilled"] = max(prefilled)
        r["switch_restored"] = min(restored)
        r["switch_context"] = FORK_AT + OWN_TOKENS
        fork.close()

        # the same context from nothing, for the switch's comparison (another profile: nothing is reused)
        _, r["recold_ms"] = _session(sess, "bench-sessions-cold", body, FORK_AT + OWN_TOKENS)

        # scoring against plain prefill of the same suffix, each on a fresh profile
        text = sess.tokenize("\n" + scored)[:SCORED_TOKENS]
        for name, k in (("plain", None), ("scored", 5)):
            m2 = sess.manifest(profile=f"bench-scoring-{name}")
            sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m2))
            t0 = time.perf_counter()
            st = sess.prefill_suffix(SuffixInput(tokens=text, offset=sess.explain_context().resident_tokens,
                                                 logprobs=k, manifest=m2))
            r[f"{name}_tok_s"] = st.prefilled_tokens / (_ms(t0) / 1000)
        sess.close()
    return r


def rows(r: dict[str, Any], backend: str) -> list[tuple[str, Any, str]]:
    return [
        (f"{backend}: {SESSION_TOKENS:,}-token session from nothing, ms", r["cold_ms"], "ensure_prefix + append"),
        (f"{backend}: fork at {SESSION_TOKENS:,} + a question, ms", r["fork_ms"],
         f"prefilled {r['fork_prefilled']} tokens (the question); {r['fork_ms'] / r['cold_ms']:.3f}x re-prefilling"),
        (f"{backend}: switch between two forks, median turn ms", r["switch_ms"],
         f"{r['switch_context']:,}-token contexts sharing {FORK_AT:,}; prefilled <= {r['switch_prefilled']} tokens a "
         f"turn, >= {r['switch_restored']} restored; {r['switch_ms'] / r['recold_ms']:.3f}x re-prefilling "
         f"({r['recold_ms']:,.0f} ms)"),
        (f"{backend}: scoring {SCORED_TOKENS:,} tokens (logprobs 5), tokens/s", r["scored_tok_s"],
         f"plain prefill {r['plain_tok_s']:,.0f} tokens/s: {r['scored_tok_s'] / r['plain_tok_s']:.2f}x"),
    ]


def section(tmp: Path, count: Any) -> list[tuple[str, Any, str]]:
    out: list[tuple[str, Any, str]] = []
    for backend in ("llama", "openvino"):
        out += rows(run(tmp, backend, count), backend)
    return out
