"""``make bench`` (``python -m benchmarks``): speed and memory, measured side by side in one run, printed as tables.

Sections (``--sections`` picks some):

* ``llama``    – the daemon (a real process, over ZeroMQ) on a ~2,000-token prefix:
                 cold TTFT, warm TTFT with a new 128-token suffix, decode tok/s
                 against llama-cpp-python in process, snapshot save/restore vs re-prefill,
                 status latency while a decode streams;
* ``peer``     – llama-cpp-python's own OpenAI server and llama.cpp's ``llama-server`` on identical
                 turns (their prompt caches), cold and warm TTFT over HTTP streaming;
* ``openvino`` – the same daemon turns on the OpenVINO backend, next to
                 openvino-genai's own prefix-cached pipeline;
* ``agent``    – a ten-turn tool-using conversation through the chat API on both engines,
                 per-turn TTFT and prefilled tokens, next to llama-cpp-python's server
                 given the same message lists (``benchmarks.agent``);
* ``decode``   – per engine: decode through the daemon vs in process, plain vs speculative
                 decoding on prose, an edit and an edit as a continuation, and plain decode
                 against the bandwidth bound (``benchmarks.decode``);
* ``gemma``    – Gemma 3 270M Q4_K_M (a K-quant with a 512-token sliding window): cold and warm TTFT
                 beside llama-cpp-python's server on the same GGUF, and speculation on the edit turn
                 (target >= 1.5x with the same answer) (``benchmarks.gemma``);
* ``workspaces`` – two and three agents with different system prompts taking turns: the
                 switched-turn TTFT with the workspace cache, after a daemon restart, and
                 llama-cpp-python's server without and with its RAM cache (``benchmarks.workspaces``);
* ``ttft``     – time to first token against the new turn's size (16 to 1,024 tokens after a
                 ~2,000-token prefix), cold and warm, both engines and llama-cpp-python's server
                 on the same message lists (``benchmarks.ttft``); drawn to benchmarks/out/ttft.png
                 (``--docs``: also docs/ttft.png) by ``benchmarks.plot``, figures in ttft.json;
* ``cold``     – the first request: cold prefill tokens/s of 8k, 16k and 22k-token prompts on both engines,
                 beside llama.cpp's ``llama-server`` (built from the pinned sdist on first use) on the same
                 file and threads (``benchmarks.cold``);
* ``vision``   – an image turn cold, the next turn resending the image, and a turn adding another, through the
                 chat API on llama.cpp with the test projector, beside ``llama-server --mmproj`` (``benchmarks.vision``);
* ``warm``     – a resend's fixed cost, stage by stage (front, the session's calls, rendering, tokenizing,
                 the one token): ~1k and ~20k-token conversations and the agents' recorded ones
                 (``benchmarks.warm``);
* ``capacity`` – predicted required bytes vs the daemon's measured RSS growth after a
                 load plus a full prefill of the effective context;
* ``embed``    – embeddings/s, batch 1 and 32, next to sentence-transformers;
* ``vllm``     – the vLLM engine: three agents' interleaved turns against one vLLM server, and against two behind
                 vLLM's router (session-keyed, and round robin), the CPU build installed on first use
                 (``benchmarks.replicas``).

Targets are printed next to the measured ratios; nothing here asserts timings.

Over ~400 lines: the sections' registry, the shared daemon and peer set-up, and the summary table.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import PREFIX_LINE, SUFFIX_LINE, snapshot_vs_reprefill, text_of_tokens
from contract.types import Config, DecodeConfig, LoadModelRequest, OpenSessionRequest, PrefixInput, SuffixInput
from harness.daemon import ROOT, DaemonProcess
from harness.load import cpu_burners
from runtime import Client, RemoteSession
from runtime.wakeups import prompt_wakeups

NUM_CTX = 4096
#: status is polled this often while a decode of this many tokens streams (a few hundred samples: a p99
#: of a few dozen is the maximum)
STATUS_POLL_S = 0.01
STATUS_DECODE_TOKENS = 512
FIRST_TURN = "Why does Handler7 fail on negative input?"


# --- output -------------------------------------------------------------------------------------------------
def table(title: str, rows: list[tuple[str, Any, str]]) -> str:
    """Rows of (metric, value, note) as an aligned text table."""
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.3f}"
        return f"{v:,}" if isinstance(v, int) else str(v)

    cells = [(m, fmt(v), n) for m, v, n in rows]
    w0 = max([len("metric")] + [len(c[0]) for c in cells])
    w1 = max([len("value")] + [len(c[1]) for c in cells])
    lines = [f"## {title}", f"{'metric'.ljust(w0)}  {'value'.rjust(w1)}  note", f"{'-' * w0}  {'-' * w1}  ----"]
    lines += [f"{m.ljust(w0)}  {v.rjust(w1)}  {n}" for m, v, n in cells]
    return "\n".join(lines)


# --- token counting (texts of a known length: benchmarks.common.text_of_tokens) ------------------------

def gguf_token_counter() -> Callable[[str], int]:
    """Count tokens with the bundled model's own tokenizer (vocab only, no weights)."""
    from llama_cpp import Llama

    from backends.bundled import bundled_gguf_path

    vocab = Llama(str(bundled_gguf_path()), vocab_only=True, verbose=False)
    return lambda s: len(vocab.tokenize(s.encode(), add_bos=False, special=True))


# --- daemon turns -----------------------------------------------------------------------------------------------
def first_token_ms(sess: RemoteSession, t0: float, client: Client) -> float:
    stream = sess.decode(DecodeConfig(max_tokens=1, temperature=0.0))
    for chunk in stream:
        if chunk.text or chunk.done:
            break
    ms = (time.perf_counter() - t0) * 1000
    stream.close()
    # The turn ends when the daemon has put the sampled token into the KV; the next
    # timed turn must not pay for this one's tail.
    while client.status().busy_operation:
        time.sleep(0.001)
    return ms


def plain_decode_rate(sess: RemoteSession, tokens: int = 128) -> float:
    """Tokens per second of a greedy decode of ``tokens`` after the session's prefill, from its first token on.
    Plain decoding (the peers' loops have no drafts), counted in tokens: a frame carries the tokens of its
    interval."""
    stamps: list[float] = []
    counts: list[int] = []
    for chunk in sess.decode(DecodeConfig(max_tokens=tokens, temperature=0.0, speculative=False,
                                          return_token_ids=True)):
        if chunk.token_ids:
            stamps.append(time.perf_counter())
            counts.append(len(chunk.token_ids))
    return sum(counts[1:]) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0


def loaded_note(r: dict[str, Any]) -> str:
    return (f"the same decode beside two CPU-bound processes: {r['loaded_decode_tok_s'] / r['decode_tok_s']:.2f}x "
            "the quiet one (docs/engines.md, \"Threads on a busy machine\", has the figures to compare)")


def daemon_turns(d: DaemonProcess, system: str, suffixes: list[str]) -> dict[str, Any]:
    """Cold turn, then one warm turn per suffix (the median is reported), decode, status, snapshot."""
    out: dict[str, Any] = {}
    with d.client(timeout_s=600.0) as c:
        sess = c.open_session(OpenSessionRequest())
        m = sess.manifest(profile="bench-" + uuid.uuid4().hex[:8])
        t0 = time.perf_counter()
        p = sess.ensure_prefix(PrefixInput(text=system, manifest=m))
        sess.prefill_suffix(SuffixInput(text=FIRST_TURN, manifest=m))
        out["cold_ttft_ms"] = first_token_ms(sess, t0, c)
        out["prefix_tokens"] = p.prefix_tokens
        warm: list[float] = []
        for suffix in suffixes:
            t0 = time.perf_counter()
            p = sess.ensure_prefix(PrefixInput(text=system, manifest=m))
            q = sess.prefill_suffix(SuffixInput(text=suffix, manifest=m))
            warm.append(first_token_ms(sess, t0, c))
        out["warm_all_ms"] = warm
        out["warm_ttft_ms"] = statistics.median(warm)
        out["warm_reused"] = p.reused_tokens
        out["warm_suffix_tokens"] = q.suffix_tokens
        # steady decode through the daemon
        sess.ensure_prefix(PrefixInput(text=system, manifest=m))
        sess.prefill_suffix(SuffixInput(text=FIRST_TURN, manifest=m))
        status_ms: list[float] = []
        stop = threading.Event()

        def poll_status(prompt: bool) -> None:
            if prompt:  # a client that asks for prompt wake-ups on its own thread too (runtime.wakeups)
                prompt_wakeups()
            with d.client(timeout_s=10.0) as pc:
                while not stop.is_set():
                    s0 = time.perf_counter()
                    pc.status()
                    status_ms.append((time.perf_counter() - s0) * 1000)
                    time.sleep(STATUS_POLL_S)

        # Decode speed alone first: on two cores a status poller would steal time.
        out["decode_tok_s"] = plain_decode_rate(sess)
        # The same decode beside two CPU-bound processes: a user's machine with other work on it, where the
        # engine's threads must share the cores (what the threads' spin and the engine's priority decide).
        sess.ensure_prefix(PrefixInput(text=system, manifest=m))
        sess.prefill_suffix(SuffixInput(text=FIRST_TURN, manifest=m))
        with cpu_burners(2):
            out["loaded_decode_tok_s"] = plain_decode_rate(sess)
        # Then status latency while another decode streams: long enough for a p99 of a few hundred samples; a
        # plain client thread, then one that asks for prompt wake-ups
        for prompt in (False, True):
            sess.prefill_suffix(SuffixInput(text=FIRST_TURN, manifest=m))
            status_ms.clear()
            stop.clear()
            poller = threading.Thread(target=poll_status, args=(prompt,))
            poller.start()
            for _chunk in sess.decode(DecodeConfig(max_tokens=STATUS_DECODE_TOKENS, temperature=0.0)):
                pass
            stop.set()
            poller.join()
            key = "status_prompt" if prompt else "status"
            out[f"{key}_p50_ms"] = statistics.median(status_ms) if status_ms else float("nan")
            out[f"{key}_p99_ms"] = (statistics.quantiles(status_ms, n=100, method="inclusive")[98]
                                    if len(status_ms) > 1 else float("nan"))
            out[f"{key}_max_ms"] = max(status_ms) if status_ms else float("nan")
            out[f"{key}_samples"] = len(status_ms)
        # snapshot save/restore vs recomputing
        out.update(snapshot_vs_reprefill(sess, system, FIRST_TURN, m, sess.manifest(profile="bench-other")))
        sess.close()
    return out


def status_note(r: dict[str, Any]) -> str:
    met = "(met)" if r["status_p99_ms"] <= 5 else "(MISSED)"
    return (f"p99 {r['status_p99_ms']:.1f} ms, target <= 5 {met}; max {r['status_max_ms']:.1f} ms; "
            f"{r['status_samples']} samples from a client polling every {STATUS_POLL_S * 1000:.0f} ms; "
            f"the client's thread asking for prompt wake-ups (runtime.wakeups): p50 {r['status_prompt_p50_ms']:.1f}, "
            f"p99 {r['status_prompt_p99_ms']:.1f} ms")


def warm_note(r: dict[str, Any]) -> str:
    runs = ", ".join(f"{ms:.0f}" for ms in r["warm_all_ms"])
    return f"median of {runs}; reused {r['warm_reused']}, new suffix {r['warm_suffix_tokens']} tokens"


def section_llama(tmp: Path, texts: dict[str, Any], peer: dict[str, float]) -> str:
    from benchmarks.llama import measure as measure_in_process

    with DaemonProcess(tmp / "llama", "llama", None, "--num-ctx", str(NUM_CTX)) as d:
        r = daemon_turns(d, texts["system"], texts["suffixes"])
    inproc = measure_in_process(num_ctx=NUM_CTX)
    ratio = r["warm_ttft_ms"] / r["cold_ttft_ms"]
    dec = r["decode_tok_s"] / inproc["plain_decode_tok_s"] if inproc.get("plain_decode_tok_s") else float("nan")
    rows = [
        ("prefix tokens", r["prefix_tokens"], "stable prefix, one repo-map line per module"),
        ("cold TTFT ms (daemon)", r["cold_ttft_ms"], "empty KV: prefix + turn + first token, over ZeroMQ"),
        ("warm TTFT ms (daemon)", r["warm_ttft_ms"], warm_note(r)),
        ("warm / cold", ratio, "target <= 0.100 " + ("(met)" if ratio <= 0.1 else "(MISSED)")),
        ("decode tok/s (daemon)", r["decode_tok_s"], "128 greedy tokens, streamed"),
        ("decode tok/s, loaded (daemon)", r["loaded_decode_tok_s"], loaded_note(r)),
        ("decode tok/s (llama-cpp-python in process)", inproc["plain_decode_tok_s"], "Llama.generate on the same context"),
        ("daemon / in-process decode", dec, "one decode each, seconds apart: a VM's drift moves it by 10-20%; the "
         "decode section's paired, load-order balanced figure is the one to judge (target >= 0.97)"),
        ("snapshot save ms", r["snapshot_save_ms"], f"{r['snapshot_tokens']} tokens, {r['snapshot_bytes']:,} bytes incl. transfer"),
        ("snapshot restore ms", r["snapshot_restore_ms"], "bytes sent back over the wire"),
        ("re-prefill ms", r["reprefill_ms"], "recomputing the same context instead"),
        ("status p50 ms during decode", r["status_p50_ms"], status_note(r)),
        ("in-process cold TTFT ms", inproc["cold_ttft_ms"], "backend without the wire"),
        ("in-process warm TTFT ms", inproc["warm_ttft_ms"], ""),
    ]
    if peer:
        rows += [
            ("peer cold TTFT ms", peer["peer_cold"], "llama-cpp-python server, same turns"),
            ("peer warm TTFT ms", peer["peer_warm"], ""),
            ("modeld warm / peer warm", r["warm_ttft_ms"] / peer["peer_warm"], "below 1.0: modeld is faster"),
            ("modeld cold / peer cold", r["cold_ttft_ms"] / peer["peer_cold"], ""),
            ("modeld warm / llama-server warm", r["warm_ttft_ms"] / peer["llama_server_warm"], "below 1.0: modeld is faster"),
            ("modeld cold / llama-server cold", r["cold_ttft_ms"] / peer["llama_server_cold"], ""),
        ]
    return table("llama.cpp backend (bundled SmolLM2-135M Q4_1, n_ctx 4096)", rows)


# --- the peer: llama-cpp-python's own server ---------------------------------------------------------------------
def _sse_ttft(port: int, system: str, user: str) -> float:
    body = json.dumps(
        {
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 1,
            "temperature": 0,
            "stream": True,
        }
    )
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    ttft = float("nan")
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        choices = json.loads(line[5:]).get("choices") or [{}]
        # the first text: llama-server's first chunk carries the role and a null content
        if choices[0].get("delta", {}).get("content"):
            ttft = (time.perf_counter() - t0) * 1000
            break
    conn.close()
    return ttft


def _peer_turns(port: int, texts: dict[str, Any]) -> tuple[float, float]:
    """A server's cold TTFT on the first turn and its median warm TTFT on the three new suffixes."""
    cold = _sse_ttft(port, texts["system"], FIRST_TURN)
    return cold, statistics.median(_sse_ttft(port, texts["system"], suffix) for suffix in texts["suffixes"])


def section_peer(tmp: Path, texts: dict[str, Any]) -> tuple[str, dict[str, float]]:
    from backends.bundled import bundled_gguf_path
    from benchmarks import llama_server
    from benchmarks.agent import peer_server

    with peer_server(tmp, bundled_gguf_path(), NUM_CTX) as port:
        cold, warm = _peer_turns(port, texts)
    with llama_server.serving(bundled_gguf_path(), NUM_CTX, tmp / "peer-llama-server.log") as port:
        ls_cold, ls_warm = _peer_turns(port, texts)
    return table(
        "peers: llama-cpp-python server (python -m llama_cpp.server) and llama.cpp's llama-server, same turns over HTTP "
        "streaming",
        [
            ("cold TTFT ms (peer)", cold, "first content token"),
            ("warm TTFT ms (peer)", warm, "its longest-common-prefix cache, new ~128-token suffixes (median of 3)"),
            ("warm / cold (peer)", warm / cold, ""),
            ("cold TTFT ms (llama-server)", ls_cold, f"{llama_server.NAME} at its defaults, one slot"),
            ("warm TTFT ms (llama-server)", ls_warm, "its slot's prefix and RAM prompt cache, the same suffixes"),
            ("warm / cold (llama-server)", ls_warm / ls_cold, ""),
        ],
    ), {"peer_cold": cold, "peer_warm": warm, "llama_server_cold": ls_cold, "llama_server_warm": ls_warm}


# --- OpenVINO -------------------------------------------------------------------------------------------------------
def section_openvino(tmp: Path, texts: dict[str, Any]) -> str:
    with DaemonProcess(tmp / "ov", "openvino", None, "--num-ctx", str(NUM_CTX)) as d:
        r = daemon_turns(d, texts["system"], texts["suffixes"])
    rows: list[tuple[str, Any, str]] = [
        ("prefix tokens", r["prefix_tokens"], ""),
        ("cold TTFT ms (daemon)", r["cold_ttft_ms"], ""),
        ("warm TTFT ms (daemon)", r["warm_ttft_ms"], warm_note(r)),
        ("warm / cold", r["warm_ttft_ms"] / r["cold_ttft_ms"],
         "target <= 0.100 " + ("(met)" if r["warm_ttft_ms"] / r["cold_ttft_ms"] <= 0.1 else "(MISSED)")),
        ("decode tok/s (daemon)", r["decode_tok_s"], ""),
        ("decode tok/s, loaded (daemon)", r["loaded_decode_tok_s"], loaded_note(r)),
        ("status p50 ms during decode", r["status_p50_ms"], status_note(r)),
        ("snapshot save ms", r["snapshot_save_ms"], f"{r['snapshot_bytes']:,} bytes"),
        ("snapshot restore ms", r["snapshot_restore_ms"], ""),
        ("re-prefill ms", r["reprefill_ms"], ""),
    ]
    from benchmarks.openvino import measure as measure_in_process

    ref = measure_in_process(measure_conversion=False)
    engine_cold = ref["cold_prefix_ms"] + ref["cold_suffix_ms"]
    rows += [
        ("in-process cold / warm TTFT ms", f"{ref['cold_ttft_ms']:.0f} / {ref['warm_ttft_ms']:.0f}",
         f"backend without the wire; warm/cold {ref['warm_ttft_ms'] / ref['cold_ttft_ms']:.3f}"),
        ("prefill only: warm suffix / cold prompt", ref["warm_suffix_ms"] / engine_cold,
         f"{ref['warm_suffix_ms']:.0f} ms for {ref['warm_suffix_tokens']} tokens after the prefix vs "
         f"{engine_cold:.0f} ms for {ref['cold_prefilled_tokens']}: the engine's own floor for the ratio"),
        ("model load ms", ref["load_ms"], "compile + shape-bucket warm-up"),
    ]
    pc_cold, pc_warm = ref.get("genai_pa_cold_ttft_ms"), ref.get("genai_pa_warm_ttft_ms")
    if pc_warm:
        rows += [
            ("openvino-genai prefix-cached cold TTFT ms", pc_cold, f"LLMPipeline PA, {ref.get('genai_pa_prompt_tokens')} prompt tokens"),
            ("openvino-genai prefix-cached warm TTFT ms", pc_warm, "SchedulerConfig.enable_prefix_caching"),
            ("daemon warm / pipeline warm", r["warm_ttft_ms"] / pc_warm,
             "target <= 1.2 " + ("(met)" if r["warm_ttft_ms"] / pc_warm <= 1.2 else "(MISSED)")),
            ("openvino-genai decode tok/s", ref.get("genai_pa_decode_tok_per_s"), ""),
        ]
    return table("OpenVINO backend (bundled SmolLM2-135M, IR)", rows)


# --- capacity ---------------------------------------------------------------------------------------------------------
def section_capacity(tmp: Path, backend: str) -> str:
    count = gguf_token_counter()
    # The workspace cache is off: its RAM tier keeps a copy of a saved prefix's state (~93 MB for this
    # prefix) under its own budget (--cache-ram), which is not the model's and would count here.
    with DaemonProcess(tmp / f"cap-{backend}", backend, None, "--no-preload", "--cache-ram", "0", "--cache-disk", "0") as d, \
            d.client(timeout_s=900.0) as c:
        from backends.bundled import bundled_gguf_path

        assert d.proc is not None
        proc = psutil.Process(d.proc.pid)
        req = OpenSessionRequest(path=str(bundled_gguf_path()), type=backend, config=Config(num_ctx=NUM_CTX))
        info = c.describe(req)
        rss0 = proc.memory_info().rss
        c.load_model(LoadModelRequest(**req.model_dump(exclude={"queue_timeout_s", "switch", "client"})))
        sess = c.open_session(OpenSessionRequest())
        m = sess.manifest(profile="capacity")
        fill = text_of_tokens(count, info.effective_context - 64, PREFIX_LINE)
        st = sess.ensure_prefix(PrefixInput(text=fill, manifest=m))
        rss1 = proc.memory_info().rss
        sess.close()
    grown = rss1 - rss0
    err = (grown - info.required_bytes) / info.required_bytes
    return table(
        f"capacity ({backend}): predicted vs measured",
        [
            ("effective context", info.effective_context, info.reason),
            ("kv bytes per token", info.kv_bytes_per_token, ""),
            ("predicted required bytes", info.required_bytes, "weights + overhead + kv x context"),
            ("measured RSS growth", grown, f"after load + prefill of {st.resident_tokens} tokens"),
            ("error", f"{err * 100:+.1f}%", "target within +-20% " + ("(met)" if abs(err) <= 0.2 else "(MISSED)")),
        ],
    )


def section_embed() -> str:
    from benchmarks.embed import bench as embeddings_per_second

    r = embeddings_per_second(batch_sizes=(1, 32))
    rows: list[tuple[str, Any, str]] = []
    for engine, e in r["engines"].items():
        for batch, rate in e.get("rate", {}).items():
            rows.append((f"{engine} batch {batch} (embeddings/s)", float(rate), ""))
        if e.get("min_cosine") is not None:
            rows.append((f"{engine} min cosine vs sentence-transformers", float(e["min_cosine"]), ""))
    return table(f"embeddings (all-MiniLM-L6-v2, {r['texts']} texts)", rows)


def section_agent(tmp: Path, count: Callable[[str], int]) -> str:
    from benchmarks import agent

    llama = agent.section(tmp, "llama", count, with_peer=True)
    ov = agent.section(tmp, "openvino", count, with_peer=False)
    head = "agent trace: 10 turns, ~2k-token system + 3 tools, tool results 100-400 tokens, the model's replies fed back"
    return table(head + " — llama.cpp backend vs llama-cpp-python's server", llama) + "\n\n" + table(
        head + " — OpenVINO backend", ov
    )


def section_decode(tmp: Path) -> str:
    from benchmarks import decode

    bandwidth = decode.bandwidth_bytes_per_s()
    head = "decode: through the daemon vs in process, plain vs speculative (prompt lookup)"
    return "\n\n".join(
        table(f"{head} — {engine}", decode.section(tmp, engine, bandwidth)) for engine in ("llama", "openvino")
    )


def section_workspaces(tmp: Path, count: Callable[[str], int]) -> str:
    from benchmarks import workspaces

    head = f"alternating workspaces: agents with different ~{workspaces.PROMPT_TOKENS}-token system prompts taking turns"
    return table(head + " — llama.cpp backend vs llama-cpp-python's server", workspaces.section(tmp, "llama", count, with_peer=True)) + (
        "\n\n" + table(head + " — OpenVINO backend", workspaces.section(tmp, "openvino", count, with_peer=False))
    )


def section_ttft(tmp: Path, count: Callable[[str], int], *, docs: bool) -> str:
    from benchmarks import plot, ttft

    r = ttft.section(tmp, count)
    plot.OUT_DIR.mkdir(parents=True, exist_ok=True)
    plot.TTFT_JSON.write_text(json.dumps(r, indent=2) + "\n")
    written = plot.plot_ttft(r, [plot.TTFT_PNG, plot.DOCS_TTFT_PNG] if docs else [plot.TTFT_PNG])
    head = f"TTFT by new-turn size after a ~{ttft.PREFIX_TOKENS}-token prefix (plot: {', '.join(map(str, written))})"
    return table(head, ttft.rows(r))


def section_cold(tmp: Path, count: Callable[[str], int]) -> str:
    from benchmarks import cold

    head = f"the first request: cold prefill of an agent-sized prompt, {cold.NUM_CTX:,}-token window, one output token"
    return table(head, cold.rows(cold.section(tmp, count)))


def section_sessions(tmp: Path, count: Callable[[str], int]) -> str:
    from benchmarks import sessions

    head = "session operations: forks of an 8k-token session and prefill-only scoring, against re-prefilling"
    return table(head, sessions.section(tmp, count))


def section_streams(tmp: Path, count: Callable[[str], int]) -> str:
    from benchmarks import streams

    head = f"streams: one greedy {streams.MAX_TOKENS}-token reply over SSE, the WebSocket and gRPC"
    return table(head, streams.section(tmp, count))


def section_vision(tmp: Path, count: Callable[[str], int]) -> str:
    from benchmarks import vision

    head = (f"vision: an image turn after a ~{vision.PREFIX_TOKENS}-token prefix, then resent, then another image "
            f"(test projector, median of {vision.RUNS})")
    return table(head, vision.rows(vision.section(tmp, count)))


def section_vllm(tmp: Path, count: Callable[[str], int], *, docs: bool) -> str:
    from benchmarks import plot, replicas
    from benchmarks.ttft import cpu_name

    rows, at_once = replicas.section(tmp, count)
    at_once["machine"] = f"{cpu_name()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}"
    plot.OUT_DIR.mkdir(parents=True, exist_ok=True)
    plot.THROUGHPUT_JSON.write_text(json.dumps(at_once, indent=2) + "\n")
    written = plot.plot_throughput(at_once, [plot.THROUGHPUT_PNG, plot.DOCS_THROUGHPUT_PNG] if docs else [plot.THROUGHPUT_PNG])
    head = (f"vLLM engine: {replicas.AGENTS} agents' interleaved turns ({replicas.ROUNDS} each), one server and two "
            "behind vllm-router")
    head_at_once = (f"agents at once: {', '.join(map(str, replicas.CONCURRENT))} agents, {replicas.THROUGHPUT_TURNS} "
                    f"turns each, modeld's llama.cpp engine against its vLLM engine (plot: {', '.join(map(str, written))})")
    return table(head, rows) + "\n\n" + table(head_at_once, replicas.throughput_rows(at_once["series"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description="The make bench tables.")
    p.add_argument("--sections", default="peer,llama,openvino,decode,gemma,agent,workspaces,sessions,streams,ttft,cold,vision,warm,capacity,embed,vllm",
                   help="comma-separated, in order")
    p.add_argument("--docs", action="store_true", help="also write the TTFT plot to docs/ttft.png (docs/benchmarks.md shows it)")
    args = p.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    # every daemon's turns are timed after its draft costs are (a first load on this machine times them when idle)
    DaemonProcess.wait_for_costs = True
    count = gguf_token_counter()
    texts: dict[str, Any] = {
        "system": text_of_tokens(count, 2000, PREFIX_LINE),
        # three different new turns of ~128 tokens; warm figures are their median
        "suffixes": [text_of_tokens(count, 128, f"[run {k}] " + SUFFIX_LINE) for k in range(3)],
    }
    print(f"modeld bench — {psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.1f} GiB, "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n", flush=True)
    extra: dict[str, Any] = {}
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="modeld-bench-") as tmpd:
        tmp = Path(tmpd)
        for name in sections:
            try:
                if name == "llama":
                    print(section_llama(tmp, texts, extra), flush=True)
                elif name == "peer":
                    out, vals = section_peer(tmp, texts)
                    extra.update(vals)
                    print(out, flush=True)
                elif name == "openvino":
                    print(section_openvino(tmp, texts), flush=True)
                elif name == "capacity":
                    print(section_capacity(tmp, "llama"), flush=True)
                    print(section_capacity(tmp, "openvino"), flush=True)
                elif name == "embed":
                    print(section_embed(), flush=True)
                elif name == "agent":
                    print(section_agent(tmp, count), flush=True)
                elif name == "decode":
                    print(section_decode(tmp), flush=True)
                elif name == "gemma":
                    from benchmarks import gemma

                    print(gemma.section(tmp, texts), flush=True)
                elif name == "workspaces":
                    print(section_workspaces(tmp, count), flush=True)
                elif name == "ttft":
                    print(section_ttft(tmp, count, docs=args.docs), flush=True)
                elif name == "cold":
                    print(section_cold(tmp, count), flush=True)
                elif name == "sessions":
                    print(section_sessions(tmp, count), flush=True)
                elif name == "vision":
                    print(section_vision(tmp, count), flush=True)
                elif name == "streams":
                    print(section_streams(tmp, count), flush=True)
                elif name == "vllm":
                    print(section_vllm(tmp, count, docs=args.docs), flush=True)
                elif name == "warm":
                    from benchmarks import warm

                    print(warm.section(tmp), flush=True)
                else:
                    print(f"## {name}: unknown section")
                    failed.append(name)
            except Exception:
                # the other sections still run; the exit status reports the failure
                print(f"## {name}: FAILED\n{traceback.format_exc()}", flush=True)
                failed.append(name)
            print()
    if failed:
        print(f"failed sections: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
