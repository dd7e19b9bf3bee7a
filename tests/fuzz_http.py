"""``make fuzz`` (HTTP): the fronts driven from their own OpenAPI schema, then the connection attacks, against a
real daemon process; it must never answer 5xx and keep serving.

1. **schemathesis** reads ``/openapi.json`` and sends ``--examples`` generated requests per operation
   (its examples, coverage and fuzzing phases: valid bodies, boundary values, wrong types, missing and
   unknown fields), with the checks ``CHECKS``: no 5xx, and every reply's status, content type and body as the
   route declares them. The counts per route and status come from the
   daemon's own access log, not from the generator.
2. **slowloris**: 50 connections each dribbling a request head a byte at a time while 20 chat requests
   are timed.
3. **descriptor exhaustion**: the daemon runs under a 1,024 open-files limit; 1,200 connections each send half a
   request head; the ZeroMQ side must still serve, HTTP answer 503 past the cap and 200 once they close.
4. **mid-stream disconnects**: 20 streamed chats dropped after their first chunk; the slot must be free
   after each.
5. **images** (``tests.fuzz_images``): ``--image-examples`` generated images, whole and broken, in each API's
   image shape against a second daemon serving a vision model (the reference service has no image encoder).

Prints a table per route (cases, 2xx, 4xx, 5xx) and one per attack; exit status 1 on any 5xx, a
schemathesis failure, a daemon exit or a failed attack.
``python -m tests.fuzz_http [--examples N] [--image-examples N] [--seed S]``.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from harness.daemon import DaemonProcess, free_port, wait_http
from tests import fuzz_images
from tests.test_front_limits import CHAT, HALF_HEAD, _chat, _limit_open_files, half_heads, room_for_connections

ACCESS = re.compile(r"modeld\.access: (\S+) (\S+) (\d{3})\b")


def _status(port: int) -> int:
    """A chat's HTTP status; 0 when the connection failed."""
    try:
        return _chat(port)[0]
    except (OSError, ValueError):
        return 0


def _operations(port: int) -> list[tuple[str, str, re.Pattern[str]]]:
    """(method, path template, path pattern) of every operation the served schema lists."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/openapi.json")
    paths = json.loads(c.getresponse().read())["paths"]
    c.close()
    return [(method.upper(), p, re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(p)) + "$"))
            for p, ops in paths.items() for method in ops]


#: what every reply is checked for: no 5xx, a status the route declares, its declared content type, and a body
#: that validates against the schema the route declares for that status (``modeld.front``'s reply models)
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance", "response_schema_conformance")


def schema_run(port: int, examples: int, seed: int, out: Path) -> tuple[int, str]:
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if exe is None:
        return 2, "schemathesis is not installed (make fuzz installs the fuzz extra)"
    cmd = [exe, "run", f"http://127.0.0.1:{port}/openapi.json", "--checks", ",".join(CHECKS),
           "--max-examples", str(examples), "--phases", "examples,coverage,fuzzing", "--continue-on-failure",
           "--seed", str(seed), "--no-color", "--request-timeout", "60", "--suppress-health-check", "all"]
    with out.open("w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False, cwd=out.parent).returncode
    summary = [ln.strip() for ln in out.read_text().splitlines() if re.search(r"\d+ generated|failures?|passed", ln)]
    return rc, "; ".join(summary[-2:])


def slowloris(port: int) -> tuple[bool, str]:
    stop = threading.Event()

    def dribble() -> None:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            return
        try:
            for b in HALF_HEAD:
                if stop.is_set():
                    return
                s.sendall(bytes([b]))
                time.sleep(0.1)
        except OSError:
            pass  # closed by the front's head deadline: what it is for
        finally:
            s.close()

    threads = [threading.Thread(target=dribble, daemon=True) for _ in range(50)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    took = []
    for _ in range(20):
        t0 = time.monotonic()
        status = _status(port)
        took.append(time.monotonic() - t0)
        if status != 200:
            stop.set()
            return False, f"a chat during the attack got {status}"
    stop.set()
    took.sort()
    return max(took) < 5.0, f"20 chats beside 50 dribbling connections: median {took[10] * 1000:.0f} ms, max {took[-1] * 1000:.0f} ms"


def exhaustion(d: DaemonProcess, port: int) -> tuple[bool, str]:
    cannot = room_for_connections(1200)
    if cannot:
        return True, f"skipped: {cannot}"
    busy = 0
    socks = half_heads(port, 1200)
    try:
        for s in socks[-200:]:
            s.settimeout(5)
            try:
                busy += s.recv(64).startswith(b"HTTP/1.1 503")
            except OSError:
                pass
        with d.client(timeout_s=10.0) as c:
            zmq_ok = c.status().state.value == "Ready"
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 10
    while (status := _status(port)) != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    ok = zmq_ok and status == 200 and busy > 0
    return ok, (f"1,200 half heads under a 1,024 limit: {busy} of the last 200 answered 503, ZeroMQ "
                f"{'served' if zmq_ok else 'FAILED'}, HTTP {status} after they closed")


def disconnects(d: DaemonProcess, port: int) -> tuple[bool, str]:
    freed = []
    body = json.dumps({**CHAT, "max_tokens": 4000, "stream": True}).encode()
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        s.recv(4096)  # the head and the first chunk
        s.close()
        t0 = time.monotonic()
        with d.client(timeout_s=10.0) as c:
            while c.status().session_open and time.monotonic() - t0 < 10:
                time.sleep(0.02)
        freed.append(time.monotonic() - t0)
    freed.sort()
    return freed[-1] < 5.0 and _status(port) == 200, (f"20 streams dropped after the first chunk: slot free after "
                                                   f"median {freed[10] * 1000:.0f} ms, max {freed[-1] * 1000:.0f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=1000, help="schemathesis examples per operation")
    ap.add_argument("--image-examples", type=int, default=300, help="generated image cases (0: none)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="modeld-fuzz-http-") as tmp_name:
        tmp = Path(tmp_name)
        port = free_port()
        d = DaemonProcess(tmp, "memory", None, "--model", "/models/ref", "--model-name", "ref",
                          "--http", f"127.0.0.1:{port}", "--http-header-timeout", "5", "--memory-token-delay-ms", "1")
        d.preexec = _limit_open_files
        d.start(wait_state=("Ready",))
        assert d.proc is not None
        wait_http(port)
        proc = psutil.Process(d.proc.pid)
        operations = _operations(port)
        rss0 = proc.memory_info().rss
        t0 = time.monotonic()
        rc, summary = schema_run(port, args.examples, args.seed, tmp / "schemathesis.log")
        seconds = time.monotonic() - t0
        rss1 = proc.memory_info().rss if d.proc.poll() is None else 0
        generated = d.log()  # what schemathesis sent (the attacks' requests come after)
        attacks = [("slowloris", *slowloris(port)), ("descriptor exhaustion", *exhaustion(d, port)),
                   ("mid-stream disconnects", *disconnects(d, port))]
        alive = d.proc.poll() is None
        served = alive and _status(port) == 200
        code = d.stop()
        if rc != 0:
            print((tmp / "schemathesis.log").read_text()[-6000:])
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for method, path, status in ACCESS.findall(generated):
        route = next((f"{m} {r}" for m, r, pattern in operations if m == method and pattern.match(path.split("?", 1)[0])),
                     "(methods and paths the schema does not list)")
        counts[route][f"{status[0]}xx"] += 1
    width = max([len(k) for k in counts] + [5])
    print(f"{'route'.ljust(width)}  {'cases':>6}  {'2xx':>6}  {'4xx':>6}  {'5xx':>4}")
    for key in sorted(counts):
        c = counts[key]
        print(f"{key.ljust(width)}  {sum(c.values()):>6,}  {c['2xx']:>6,}  {c['4xx']:>6,}  {c['5xx']:>4}")
    errors = sum(c["5xx"] for c in counts.values())
    images_ok, image_rows = fuzz_images.fuzz(args.image_examples, args.seed) if args.image_examples else (True, [])
    rows = [
        ("schemathesis", f"exit {rc} in {seconds:.0f} s: {summary}"),
        *[(name, f"{'ok' if ok else 'FAILED'}: {what}") for name, ok, what in attacks],
        ("5xx answers", errors),
        ("daemon exits", 0 if alive else 1),
        ("RSS before / after schemathesis", f"{rss0 / 2**20:.1f} / {rss1 / 2**20:.1f} MiB ({(rss1 - rss0) / 2**20:+.1f} MiB)"),
        ("a normal chat afterwards", "served" if served else "FAILED"),
        ("exit status on SIGTERM", code),
        *image_rows,
    ]
    w = max(len(k) for k, _ in rows)
    print("\n".join(f"{k.ljust(w)}  {v}" for k, v in rows))
    ok = rc == 0 and not errors and alive and served and code == 0 and all(a[1] for a in attacks) and images_ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
