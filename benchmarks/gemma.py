"""The ``gemma`` section of ``make bench``: Gemma 3 270M in Q4_K_M, the K-quant, sliding-window model.

* TTFT, cold and warm, through a daemon serving the GGUF (``modeld serve --model GEMMA``; ``auto`` picks
  llama.cpp, as OpenVINO cannot convert it) next to llama-cpp-python's own server and llama.cpp's
  ``llama-server`` (its built-in ``gemma`` template) on the same GGUF, turns and threads (its ``gemma`` chat format, as the file carries no template, with the system text at the head of
  the user turn as the ``gemma3`` template puts it: that format drops a system message). The prefix (~2,000 tokens of the
  bundled tokenizer) is four times the 512-token sliding window, so a warm turn that kept only the window
  would show as a cold one.
* Speculation on a K-quant: the decode section's edit turn (return a ~300-token file with one function
  renamed), greedy, plain and with prompt-lookup drafts, through the daemon in its default layout and with
  exact decode (flash attention over a q8_0 cache, where a check computes what one-token steps do, so the
  answer is the plain one by construction). Target (real-models issue): >= 1.5x with the same answer.
  Whether this model's rows are exact is the load's probe's (``backends.llama.probe``): where it finds them
  apart on this CPU the exact-decode daemon is refused, the row says so, and the same layout is measured
  without the promise.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from backends.bundled import gemma_gguf_path
from benchmarks import llama_server
from benchmarks.agent import peer_server
from benchmarks.decode import TASKS, _rate, _turn, exact_flags, paired_median, same_answer
from benchmarks.run import FIRST_TURN, _sse_ttft, daemon_turns, table, warm_note
from contract.types import OpenSessionRequest
from harness.daemon import DaemonProcess

NUM_CTX = 4096
#: rounds of plain and speculative decodes of the edit turn (the order alternating by round)
ROUNDS = 3


def _daemon(tmp: Path, name: str, *flags: str) -> DaemonProcess:
    return DaemonProcess(tmp / name, "auto", None, "--model", str(gemma_gguf_path()), "--model-name", "gemma",
                         "--num-ctx", str(NUM_CTX), "--cache-ram", "0", "--cache-disk", "0", *flags)


def edit_speedup(d: DaemonProcess) -> dict[str, Any]:
    """The edit turn, plain and speculative, ``ROUNDS`` times each through ``d``: rates, the paired median
    speedup, drafts kept, and whether the two answers are one."""
    name, suffix, n = next(t for t in TASKS if t[0] == "edit")
    rates: dict[bool, list[float]] = {False: [], True: []}
    ids: dict[bool, list[int]] = {False: [], True: []}
    drafted = accepted = 0
    with d.client(timeout_s=900.0) as c:
        sess = c.open_session(OpenSessionRequest())
        man = sess.manifest(profile="bench-gemma")
        for r in range(ROUNDS):
            for spec in (False, True) if r % 2 == 0 else (True, False):
                got: list[int] = []
                final = _turn(sess, man, suffix, n, spec, got if r == 0 else None)
                rates[spec].append(_rate(final))
                if r == 0:
                    ids[spec] = got
                if spec and final.usage is not None:
                    drafted += final.usage.drafted_tokens
                    accepted += final.usage.accepted_tokens
        sess.close()
    return {"plain": statistics.median(rates[False]), "spec": statistics.median(rates[True]),
            "speedup": paired_median(rates[True], rates[False]), "same": same_answer(ids[False], ids[True]),
            "kept": f"{accepted} of {drafted} drafted kept", "tokens": len(ids[False])}


def section(tmp: Path, texts: dict[str, Any]) -> str:
    with _daemon(tmp, "gemma-ttft") as d:
        r = daemon_turns(d, texts["system"], texts["suffixes"])
        with d.client(timeout_s=60.0) as c:
            st = c.status()
    # the peer's gemma chat format drops a system message (Gemma has no system turn); the gemma3 template
    # puts the system text at the head of the first user turn, so the peer is sent it there
    with peer_server(tmp, gemma_gguf_path(), NUM_CTX, "--chat_format", "gemma") as port:
        peer_cold = _sse_ttft(port, "", f"{texts['system']}\n\n{FIRST_TURN}")
        peer_warm = statistics.median(_sse_ttft(port, "", f"{texts['system']}\n\n{s}") for s in texts["suffixes"])
    # llama-server likewise, with its built-in gemma template (the file carries none; with its jinja on, a
    # --chat-template NAME is read as the template's text, so the prompt would be the word "gemma")
    with llama_server.serving(gemma_gguf_path(), NUM_CTX, tmp / "gemma-llama-server.log", "--no-jinja",
                              "--chat-template", "gemma") as port:
        ls_cold = _sse_ttft(port, "", f"{texts['system']}\n\n{FIRST_TURN}")
        ls_warm = statistics.median(_sse_ttft(port, "", f"{texts['system']}\n\n{s}") for s in texts["suffixes"])
    ratio = r["warm_ttft_ms"] / r["cold_ttft_ms"]
    rows: list[tuple[str, Any, str]] = [
        ("engine (auto)", st.backend, st.backend_reason),
        ("chat template", st.active.chat_template if st.active else "", ""),
        ("prefix tokens", r["prefix_tokens"], "four times the 512-token sliding window"),
        ("cold TTFT ms (daemon)", r["cold_ttft_ms"], "empty KV: prefix + turn + first token, over ZeroMQ"),
        ("warm TTFT ms (daemon)", r["warm_ttft_ms"], warm_note(r)),
        ("warm / cold", ratio, "target <= 0.100 " + ("(met)" if ratio <= 0.1 else "(MISSED)")),
        ("cold TTFT ms (peer)", peer_cold, "llama-cpp-python's server, same GGUF and turns, over HTTP streaming"),
        ("warm TTFT ms (peer)", peer_warm, "its longest-common-prefix cache (median of 3)"),
        ("modeld warm / peer warm", r["warm_ttft_ms"] / peer_warm, "below 1.0: modeld is faster"),
        ("cold TTFT ms (llama-server)", ls_cold, f"{llama_server.NAME} at its defaults, same GGUF and turns"),
        ("warm TTFT ms (llama-server)", ls_warm, "its slot's prefix and RAM prompt cache (median of 3)"),
        ("modeld warm / llama-server warm", r["warm_ttft_ms"] / ls_warm, "below 1.0: modeld is faster"),
        ("decode tok/s (daemon)", r["decode_tok_s"], "128 greedy tokens, streamed"),
    ]
    layouts: list[tuple[str, tuple[str, ...]]] = [("default layout", ()), ("exact decode", exact_flags("llama"))]
    for label, flags in layouts:
        try:
            with _daemon(tmp, f"gemma-edit-{len(flags)}", *flags) as d:
                e = edit_speedup(d)
        except RuntimeError as exc:
            refusal = next((line for line in str(exc).splitlines() if "UnsupportedFeature" in line), "")
            if "--exact-decode" not in flags or not refusal:
                raise
            rows.append(("edit (exact decode)", "refused at load", refusal.strip()[-400:]))
            layouts.append(("flash attention, q8_0 cache, no exact decode",
                            tuple(f for f in flags if f != "--exact-decode")))
            continue
        met = "(met)" if e["speedup"] >= 1.5 and e["same"] == "the same answer" else "(MISSED)"
        rows.append((f"edit: plain / speculative tok/s ({label})", f"{e['plain']:.1f} / {e['spec']:.1f}",
                     f"{e['speedup']:.2f}x, {e['kept']}, {e['tokens']} tokens, {e['same']}; "
                     f"target >= 1.5x with the same answer {met}"))
    return table(f"Gemma 3 270M Q4_K_M (sliding window 512, n_ctx {NUM_CTX})", rows)
