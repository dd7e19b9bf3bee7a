"""``make fuzz``: generated frames against a real daemon process; it must answer every one and keep serving.

Hypothesis draws requests from the wire schema and breaks them: random frames,
truncated or garbage msgpack, unknown ops and protocol tags, wrong frame counts,
hostile bodies for every operation (wrong types, huge and negative numbers,
deep nesting, unknown fields, made-up session ids), oversized bodies and
payload frames. Each message is followed by a ``status`` probe on the same
socket: a hang is a probe without an answer within ``HANG_S``. Every ``error``
reply must carry a registered code. At the end a normal turn must be served.

Prints a table: frames sent, replies by kind, errors by code, exits, hangs, RSS
before and after. Exit status 1 on any exit, hang, unregistered code or failed
final turn. ``python -m tests.fuzz_daemon [--examples N] [--backend memory|llama]``.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import psutil
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contract import wire
from contract.errors import REGISTRY
from contract.types import OpenSessionRequest, PrefixInput, SuffixInput
from contract.wire import Kind, Op
from harness.daemon import DaemonProcess

HANG_S = 10.0
OPS = [op.value.encode() for op in Op]

# --- what a hostile client sends --------------------------------------------------------------------
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1), st.floats(allow_nan=True),
    st.text(max_size=64), st.binary(max_size=64),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=6)),
                      max_leaves=30)
field_names = st.sampled_from(sorted({name for schema in wire.SCHEMAS.values() for name in schema.request.model_fields}))
bodies = st.dictionaries(st.one_of(field_names, st.text(max_size=16)), values, max_size=8)


def _packed(body: Any) -> bytes:
    try:
        return bytes(msgpack.packb(body, use_bin_type=True))
    except (TypeError, ValueError, OverflowError):
        return b"\xc1"  # msgpack's "never used" byte: an unparsable body


@st.composite
def messages(draw: st.DrawFn) -> list[bytes]:
    # oversized messages are 64 MiB each: one in a hundred keeps a 10,000-message run to minutes
    oversized = draw(st.integers(0, 99)) == 0
    kind = "oversized" if oversized else draw(st.sampled_from(
        ["hostile-body"] * 6 + ["garbage"] * 2 + ["truncated"] * 2 + ["payloads"] * 2
        + ["unknown-op", "frame-count", "protocol"]))
    op = draw(st.sampled_from(OPS))
    rid = draw(st.binary(min_size=1, max_size=24))
    body = draw(bodies)
    if kind == "hostile-body":
        if draw(st.booleans()):
            body["session_id"] = draw(st.sampled_from(["", "x" * 40, "../../etc", "\x00"]))
        return [wire.PROTOCOL, op, rid, _packed(body)]
    if kind == "garbage":
        return draw(st.lists(st.binary(max_size=256), min_size=0, max_size=8))
    if kind == "truncated":
        data = _packed(body)
        return [wire.PROTOCOL, op, rid, data[: draw(st.integers(0, max(0, len(data) - 1)))]]
    if kind == "unknown-op":
        return [wire.PROTOCOL, draw(st.binary(max_size=40)), rid, _packed(body)]
    if kind == "frame-count":
        return [wire.PROTOCOL, op, rid][: draw(st.integers(0, 3))]
    if kind == "oversized":
        return [wire.PROTOCOL, op, rid, b"\x00" * (wire.MAX_BODY_BYTES + draw(st.integers(1, 1024)))]
    if kind == "payloads":
        n = draw(st.integers(1, wire.MAX_PAYLOAD_FRAMES + 2))
        return [wire.PROTOCOL, op, rid, _packed(body), *[draw(st.binary(max_size=4096)) for _ in range(n)]]
    return [draw(st.binary(max_size=8)), op, rid, _packed(body)]


class Fuzzer:
    def __init__(self, d: DaemonProcess) -> None:
        self.d = d
        self.ctx = zmq.Context()
        self.sock = self._socket()
        self.sent = 0
        self.kinds: collections.Counter[str] = collections.Counter()
        self.codes: collections.Counter[int] = collections.Counter()
        self.unregistered: list[Any] = []
        self.hangs = 0

    def _socket(self) -> zmq.Socket[bytes]:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.d.endpoint)
        return s

    def send(self, frames: list[bytes]) -> None:
        self.sent += 1
        try:
            self.sock.send_multipart(frames or [b""])  # a DEALER cannot send zero frames: one empty frame
        except zmq.ZMQError:
            pass
        probe = b"probe-%d" % self.sent
        self.sock.send_multipart(wire.encode_request(Op.STATUS, probe, {}))
        deadline = time.monotonic() + HANG_S
        while True:
            if not self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                self.hangs += 1
                self.sock.close(0)
                self.sock = self._socket()  # a fresh connection for the next message
                return
            try:
                msg = wire.decode_reply(self.sock.recv_multipart())
            except Exception as exc:  # a reply the codec cannot read is itself a finding
                self.unregistered.append(f"unreadable reply: {exc}")
                continue
            self.kinds[msg.kind.value if msg.kind is not None else "?"] += 1
            if msg.kind is Kind.ERROR:
                code = msg.body.get("code") if isinstance(msg.body, dict) else None
                self.codes[code] += 1  # type: ignore[index]
                if code not in REGISTRY:
                    self.unregistered.append(msg.body)
            if msg.request_id == probe:
                return


def _normal_turn(d: DaemonProcess) -> bool:
    with d.client(timeout_s=120.0) as c:
        req = OpenSessionRequest(type=d.backend, path="/models/fuzz" if d.backend == "memory" else "")
        if d.backend != "memory":
            req = OpenSessionRequest(type=d.backend)
        sess = c.open_session(req)
        try:
            sess.ensure_prefix(PrefixInput(text="You are terse."))
            sess.prefill_suffix(SuffixInput(text="Say hi.", role="user", render=d.backend != "memory"))
            return any(chunk.text for chunk in sess.decode())
        finally:
            sess.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make fuzz", description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=10_000, help="generated messages (default 10,000)")
    p.add_argument("--backend", default="memory", choices=("memory", "llama", "openvino"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="modeld-fuzz-") as tmp:
        extra = ("--model", "/models/fuzz", "--model-name", "fuzz") if args.backend == "memory" else ()
        d = DaemonProcess(Path(tmp), args.backend, None, *extra).start(wait_state=("Ready",))
        assert d.proc is not None
        proc = psutil.Process(d.proc.pid)
        rss0 = proc.memory_info().rss
        fuzz = Fuzzer(d)
        t0 = time.monotonic()

        @settings(max_examples=args.examples, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck))
        @given(messages())
        def run(frames: list[bytes]) -> None:
            fuzz.send(frames)

        run()
        seconds = time.monotonic() - t0
        alive = d.proc.poll() is None
        rss1 = proc.memory_info().rss if alive else 0
        served = alive and _normal_turn(d)
        code = d.stop()
        fuzz.sock.close(0)
        fuzz.ctx.term()
    rows = [
        ("backend", args.backend),
        ("messages sent", f"{fuzz.sent:,} in {seconds:.0f} s (each followed by a status probe)"),
        ("replies by kind", ", ".join(f"{k} {n:,}" for k, n in sorted(fuzz.kinds.items()))),
        ("errors by code", ", ".join(f"{REGISTRY[c].__name__ if c in REGISTRY else c} {n:,}" for c, n in sorted(fuzz.codes.items(), key=lambda x: str(x[0])))),
        ("unregistered or unreadable replies", len(fuzz.unregistered)),
        ("daemon exits", 0 if alive else 1),
        ("hangs (no answer to the probe within 10 s)", fuzz.hangs),
        ("RSS before / after", f"{rss0 / 2**20:.1f} / {rss1 / 2**20:.1f} MiB ({(rss1 - rss0) / 2**20:+.1f} MiB)"),
        ("a normal turn afterwards", "served" if served else "FAILED"),
        ("exit status on SIGTERM", code),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows))
    ok = alive and served and not fuzz.hangs and not fuzz.unregistered and code == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
