"""``make soak``: a long run against real daemon processes; memory, descriptors and the slot must stay put.

Four phases:

1. a memory-backend daemon: ``--cycles`` session cycles (open, prefix, suffix,
   a short decode, close), with vanished clients mixed in — a client process
   SIGKILLed mid-decode, and one SIGSTOPped while it holds the slot (its lease
   runs out; it is then killed);
2. the same over HTTP: ``--http-turns`` requests through chat completions
   (plain and streamed), Responses and Messages (plain and streamed) on one
   keep-alive connection, and every 100 turns a 200 MB body sent with a declared
   length and one sent chunked (each must be refused 413);
3. the same over the WebSocket protocol: ``--ws-generations`` generations on one connection, paused and
   resumed, stopped after their first token, modified midway, every 50th connection dropped mid-generation;
4. a llama.cpp daemon: ``--turns`` turns of one conversation in one session;
5. the disconnect sweep (``tests.turn_sweep``) on a llama.cpp daemon beside two CPU-bound processes: ``--sweep N``
   instants per API and mode, a client gone at each; the slot must serve the next client within 2 s and the
   resend must find what was done.

Prints per phase: RSS at the start, the middle and the end (less the bytes the
workspace cache holds in RAM: those are bounded by its budget, not a leak), open descriptors at
the start and the end, how long the slot took to come free after each vanished
client (the lease is ``LEASE_S``), and errors by class. Exit status 1 when RSS
grows over 5% from the middle to the end, descriptors grow, or a vanished client
keeps the slot past its lease + 2 s.
``python -m tests.soak_daemon [--cycles N] [--http-turns N] [--ws-generations N] [--turns N] [--sweep N] [--skip-llama]``.
"""

from __future__ import annotations

import argparse
import collections
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from contract.errors import ModeldError
from contract.types import DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from harness.daemon import DaemonProcess, free_port, streaming_client, wait_http

LEASE_S = 2.0
MODEL = OpenSessionRequest(model_name="soak", type="memory", path="/models/soak")


def _slot_free_after(d: DaemonProcess, proc: subprocess.Popen[str], how: str) -> float:
    with d.client(timeout_s=30.0) as c:
        t0 = time.monotonic()
        if how == "kill":
            proc.send_signal(signal.SIGKILL)
        else:
            proc.send_signal(signal.SIGSTOP)  # alive but silent: its lease must run out
        while c.status().session_open:
            if time.monotonic() - t0 > 60:
                break
            time.sleep(0.05)
        free = time.monotonic() - t0
    proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    return free


def _usage(d: DaemonProcess) -> tuple[float, int]:
    """The daemon's RSS less what its workspace cache holds in RAM by design (MiB), and its open descriptors."""
    assert d.proc is not None
    p = psutil.Process(d.proc.pid)
    with d.client(timeout_s=30.0) as c:
        cache = c.status().cache
    held = cache["ram_bytes"] if cache else 0
    return (p.memory_info().rss - held) / 2**20, p.num_fds()


def memory_phase(tmp: Path, cycles: int) -> dict[str, object]:
    d = DaemonProcess(tmp / "memory", "memory", None, "--model", "/models/soak", "--model-name", "soak",
                      "--lease", str(LEASE_S), "--memory-token-delay-ms", "1").start(wait_state=("Ready",))
    errors: collections.Counter[str] = collections.Counter()
    frees: list[tuple[str, float]] = []
    try:
        rss0, fds0 = _usage(d)
        rss_mid = 0.0
        with d.client(timeout_s=30.0) as c:
            for k in range(cycles):
                if k and k % (cycles // 4 or 1) == 0:
                    how = "kill" if (k // (cycles // 4 or 1)) % 2 else "stop"
                    frees.append((how, _slot_free_after(d, streaming_client(d.endpoint, MODEL), how)))
                if k == cycles // 2:
                    rss_mid = _usage(d)[0]
                try:
                    sess = c.open_session(MODEL.model_copy(update={"queue_timeout_s": 30.0}))
                    try:
                        sess.ensure_prefix(PrefixInput(text=f"system {k % 7}"))
                        sess.prefill_suffix(SuffixInput(text=f"turn {k}"))
                        for _ in sess.decode(DecodeConfig(max_tokens=4)):
                            pass
                    finally:
                        sess.close()
                except ModeldError as exc:
                    errors[type(exc).__name__] += 1
        rss1, fds1 = _usage(d)
    finally:
        d.stop()
    return {"rss": (rss0, rss_mid, rss1), "fds": (fds0, fds1), "frees": frees, "errors": errors, "count": cycles}


def llama_phase(tmp: Path, turns: int, *extra: str) -> dict[str, object]:
    d = DaemonProcess(tmp / "llama", "llama", None, "--num-ctx", "8192", *extra).start(wait_state=("Ready",))
    errors: collections.Counter[str] = collections.Counter()
    try:
        rss0, fds0 = _usage(d)
        rss_mid = 0.0
        with d.client(timeout_s=120.0) as c:
            history = [{"role": "system", "content": "You are terse."}]
            for k in range(turns):
                if k == turns // 2:
                    rss_mid = _usage(d)[0]
                history.append({"role": "user", "content": f"Turn {k}: name a prime number."})
                if len(history) > 40:  # keep the conversation inside the context
                    history = history[:1] + history[-20:]
                try:
                    r = c.chat(history, max_tokens=8, temperature=0.0)
                    history.append({"role": "assistant", "content": r.message.content or ""})
                except ModeldError as exc:
                    errors[type(exc).__name__] += 1
                    history.pop()
        rss1, fds1 = _usage(d)
    finally:
        d.stop()
    return {"rss": (rss0, rss_mid, rss1), "fds": (fds0, fds1), "frees": [], "errors": errors, "count": turns}


def http_phase(tmp: Path, turns: int) -> dict[str, object]:
    """HTTP turns through every API on a memory daemon, with refused 200 MB bodies (declared and chunked) mixed in."""
    import http.client
    import json

    from harness.daemon import free_port, wait_http
    from tests.test_front_limits import _post_big

    port = free_port()
    d = DaemonProcess(tmp / "http", "memory", None, "--model", "/models/soak", "--model-name", "soak",
                      "--http", f"127.0.0.1:{port}", "--memory-token-delay-ms", "1").start(wait_state=("Ready",))
    errors: collections.Counter[str] = collections.Counter()
    messages = [{"role": "user", "content": "Name a prime."}]
    requests = [
        ("/v1/chat/completions", {"model": "soak", "messages": messages, "max_tokens": 4}),
        ("/v1/chat/completions", {"model": "soak", "messages": messages, "max_tokens": 4, "stream": True}),
        ("/v1/responses", {"model": "soak", "input": "Name a prime.", "max_output_tokens": 4, "store": False}),
        ("/v1/messages", {"model": "claude", "messages": messages, "max_tokens": 4}),
        ("/v1/messages", {"model": "claude", "messages": messages, "max_tokens": 4, "stream": True}),
    ]
    try:
        wait_http(port)
        rss0, fds0 = _usage(d)
        rss_mid = 0.0
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for k in range(turns):
            if k == turns // 2:
                rss_mid = _usage(d)[0]
            if k and k % 100 == 0:
                for chunked in (False, True):
                    if not _post_big(port, 200 << 20, chunked).startswith(b"HTTP/1.1 413"):
                        errors["200 MB body not refused 413"] += 1
            path, body = requests[k % len(requests)]
            try:
                conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
                r = conn.getresponse()
                r.read()
                if r.status != 200:
                    errors[f"HTTP {r.status}"] += 1
            except OSError as exc:
                errors[type(exc).__name__] += 1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.close()
        rss1, fds1 = _usage(d)
    finally:
        d.stop()
    return {"rss": (rss0, rss_mid, rss1), "fds": (fds0, fds1), "frees": [], "errors": errors, "count": turns}


def ws_phase(tmp: Path, generations: int) -> dict[str, object]:
    """WebSocket generations on a memory daemon: plain ones, paused and resumed, stopped after their first token,
    modified midway, and every 50th connection dropped in the middle of a generation (a new one takes over)."""
    from harness.daemon import free_port, wait_http
    from runtime.ws import WsClient, WsError

    port = free_port()
    d = DaemonProcess(tmp / "ws", "memory", None, "--model", "/models/soak", "--model-name", "soak",
                      "--http", f"127.0.0.1:{port}", "--memory-token-delay-ms", "1").start(wait_state=("Ready",))
    errors: collections.Counter[str] = collections.Counter()
    url = f"ws://127.0.0.1:{port}/v1/ws"
    messages = [{"role": "user", "content": "Name the primes below fifty, one by one."}]
    try:
        wait_http(port)
        rss0, fds0 = _usage(d)
        rss_mid = 0.0
        client = WsClient(url, timeout_s=60.0)
        # the start is taken after a dropped connection: a generation that begins while the dropped one's turn is
        # still closing takes a second pooled daemon client (the front keeps up to 8 idle), which is not a leak
        warm = min(generations // 2, 60)
        for k in range(generations):
            if k == warm and warm:
                rss0, fds0 = _usage(d)
            if k == generations // 2:
                rss_mid = _usage(d)[0]
            kind = ("plain", "pause", "stop", "modify")[k % 4]
            dropped = k % 50 == 49
            try:
                client.config(messages=messages, max_tokens=200, temperature=0)
                tokens = 0
                for m in client.messages():
                    if m["type"] == "status" and m["operation"] == "paused":
                        time.sleep(0.05)
                        client.control("resume")
                    if m["type"] != "token":
                        continue
                    tokens += 1
                    if dropped:
                        client.close()  # gone in the middle: the next generation is on a new connection
                        break
                    if tokens == 2 and kind != "plain":
                        client.control(kind, **({"temperature": 0.8, "seed": k} if kind == "modify" else {}))
                if dropped:
                    client = WsClient(url, timeout_s=60.0)
            except (WsError, OSError, TimeoutError) as exc:
                errors[getattr(exc, "code", "") or type(exc).__name__] += 1
                client.close()
                client = WsClient(url, timeout_s=60.0)
        client.close()
        deadline = time.monotonic() + 30
        with d.client(timeout_s=10.0) as c:
            while c.status().session_open and time.monotonic() < deadline:
                time.sleep(0.05)
            if c.status().session_open:
                errors["slot still held at the end"] += 1
        rss1, fds1 = _usage(d)
    finally:
        d.stop()
    return {"rss": (rss0, rss_mid, rss1), "fds": (fds0, fds1), "frees": [], "errors": errors, "count": generations}


def sweep_phase(tmp: Path, per_mode: int) -> bool:
    """The disconnect sweep (``tests.turn_sweep``) with ``per_mode`` instants per API and mode on a llama.cpp
    daemon, two CPU-bound processes beside it; one line per instant, then the slowest slot hand-over."""
    from harness.load import cpu_burners
    from tests.turn_sweep import SERVE_ARGS, Sweep, plan

    port = free_port()
    d = DaemonProcess(tmp / "sweep", "llama", None, "--http", f"127.0.0.1:{port}", *SERVE_ARGS)
    outcomes = []
    d.start(wait_state=("Ready",))
    try:
        wait_http(port)
        with cpu_burners(2):
            sweep = Sweep(d, port)
            try:
                for case in plan(per_mode):
                    out = sweep.run(case)
                    print(out.line(), flush=True)
                    outcomes.append(out)
            finally:
                sweep.close()
    finally:
        d.stop()
    failed = [o for o in outcomes if not o.ok]
    slowest = max((o.free_s for o in outcomes), default=0.0)
    print(f"disconnect sweep: {len(outcomes)} instants, {len(failed)} failed; the next client held the slot at most "
          f"{slowest:.2f} s after a disconnect", flush=True)
    return not failed


def _report(name: str, r: dict[str, object]) -> bool:
    rss0, mid, rss1 = r["rss"]  # type: ignore[misc]
    fds0, fds1 = r["fds"]  # type: ignore[misc]
    frees: list[tuple[str, float]] = r["frees"]  # type: ignore[assignment]
    errors: collections.Counter[str] = r["errors"]  # type: ignore[assignment]
    growth = (rss1 - mid) / mid if mid else 0.0
    late = [f for _, f in frees if f > LEASE_S + 2]
    rows = [
        (f"{name}: {'cycles' if name == 'memory backend' else 'generations' if 'WebSocket' in name else 'turns'}",
         f"{r['count']:,}"),
        (f"{name}: RSS less the cache's RAM, start / middle / end",
         f"{rss0:.1f} / {mid:.1f} / {rss1:.1f} MiB (middle to end {growth * 100:+.1f}%)"),
        (f"{name}: open descriptors start / end", f"{fds0} / {fds1}"),
        (f"{name}: errors by class", ", ".join(f"{k} {v}" for k, v in errors.items()) or "none"),
    ]
    if frees:
        rows.append((f"{name}: slot free after a vanished client (lease {LEASE_S:.0f} s)",
                     ", ".join(f"{how} {f:.1f} s" for how, f in frees)))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows), flush=True)
    return growth <= 0.05 and fds1 <= fds0 + 2 and not late and not errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make soak", description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=2000)
    p.add_argument("--turns", type=int, default=300)
    p.add_argument("--http-turns", type=int, default=1000, help="HTTP turns (every API; 200 MB bodies every 100)")
    p.add_argument("--ws-generations", type=int, default=500,
                   help="WebSocket generations (paused, stopped, modified; a connection dropped every 50)")
    p.add_argument("--sweep", type=int, default=6, metavar="N",
                   help="the disconnect sweep: N instants per API and mode on llama.cpp (0: none)")
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--no-cache", action="store_true", help="the llama.cpp daemon without its workspace cache")
    args = p.parse_args(argv)
    ok = True
    with tempfile.TemporaryDirectory(prefix="modeld-soak-") as tmp:
        ok &= _report("memory backend", memory_phase(Path(tmp), args.cycles))
        ok &= _report("memory backend over HTTP", http_phase(Path(tmp), args.http_turns))
        ok &= _report("memory backend over the WebSocket", ws_phase(Path(tmp), args.ws_generations))
        if not args.skip_llama:
            extra = ("--cache-ram", "0", "--cache-disk", "0") if args.no_cache else ()
            ok &= _report("llama.cpp", llama_phase(Path(tmp), args.turns, *extra))
            if args.sweep:
                ok &= sweep_phase(Path(tmp), args.sweep)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
