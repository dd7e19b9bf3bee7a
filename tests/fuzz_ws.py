"""``make fuzz`` (WebSocket): ``/v1/ws`` driven with messages generated from its own JSON Schema, against a real
daemon process; it must never fail internally, never drop a connection for a bad message, and never keep the slot.

The client messages' schema (``GET /v1/ws/schema``) is walked into hypothesis strategies: valid messages of every
kind (bounds, enums, optional fields), and the same mutated (a field of the wrong type, an unknown field, a missing
required one, another JSON value altogether, text that is not JSON). Each case is sent on a connection that stays
open across cases; after each, the server's replies are read until it is quiet or a generation completed (a
running one is stopped). Counted: replies by type and error code, ``internal_error`` replies, connections the server
closed, the daemon's exit, the slot left held at the end.
``python -m tests.fuzz_ws [--examples N] [--seed S]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from harness.daemon import DaemonProcess, free_port, wait_http
from runtime.ws import WsClient

#: how long a case's replies are read once the server is quiet
QUIET_S = 0.3
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                     max_leaves=10)
_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "x"]),
                                            "content": st.text(max_size=40) | _JSON}), max_size=3)


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    return _resolve(schema, schema["$defs"][ref.rsplit("/", 1)[-1]]) if ref else node


def strategy(schema: dict[str, Any], node: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values the schema ``node`` admits (its bounds and its edges), for the subset of JSON Schema pydantic writes
    for the messages."""
    node = _resolve(schema, node)
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    for key in ("anyOf", "oneOf"):
        if key in node:
            return st.one_of([strategy(schema, n) for n in node[key]])
    kind = node.get("type")
    if kind == "string":
        return st.text(max_size=min(int(node.get("maxLength", 60)), 60))
    if kind == "integer":
        return st.integers(min_value=node.get("minimum", -(2**40)), max_value=node.get("maximum", 2**40))
    if kind == "number":
        return st.floats(min_value=node.get("minimum"), max_value=node.get("maximum"), allow_nan=False,
                         allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = node.get("items", {})
        if items.get("type") == "object" and items.get("additionalProperties") is True:
            return _MESSAGES
        return st.lists(strategy(schema, items), max_size=3)
    if kind == "object" or "properties" in node:
        props = node.get("properties", {})
        required = set(node.get("required", []))
        if not props:
            return st.dictionaries(st.text(max_size=8), _JSON, max_size=3)
        return st.fixed_dictionaries({k: strategy(schema, v) for k, v in props.items() if k in required},
                                     optional={k: strategy(schema, v) for k, v in props.items() if k not in required})
    return _JSON


def cases(schema: dict[str, Any]) -> st.SearchStrategy[str]:
    """A message as sent: valid, mutated, another JSON value, or not JSON."""
    valid = strategy(schema, {"oneOf": schema["oneOf"]}) if "oneOf" in schema else strategy(schema, schema)

    @st.composite
    def mutated(draw: st.DrawFn) -> Any:
        msg = dict(draw(valid))
        how = draw(st.sampled_from(["wrong type", "unknown field", "missing field"]))
        keys = [k for k in msg if k != "type"]
        if how == "wrong type" and keys:
            msg[draw(st.sampled_from(keys))] = draw(_JSON)
        elif how == "unknown field":
            msg[draw(st.text(min_size=1, max_size=8))] = draw(_JSON)
        elif keys:
            del msg[draw(st.sampled_from(keys))]
        return msg

    return st.one_of(valid.map(json.dumps), mutated().map(json.dumps), _JSON.map(json.dumps),
                     st.text(max_size=40))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    replies: collections.Counter[str] = collections.Counter()
    closed = [0]
    with tempfile.TemporaryDirectory(prefix="modeld-fuzz-ws-") as tmp_name:
        port = free_port()
        d = DaemonProcess(Path(tmp_name), "memory", None, "--model", "/models/ref", "--model-name", "ref",
                          "--http", f"127.0.0.1:{port}", "--memory-token-delay-ms", "1", "--ws-pause-limit", "1")
        d.start(wait_state=("Ready",))
        assert d.proc is not None
        wait_http(port)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/ws/schema", timeout=30) as r:
            schema = json.loads(r.read())["client"]
        url = f"ws://127.0.0.1:{port}/v1/ws"
        conn = [WsClient(url, timeout_s=30.0)]

        def drain(c: WsClient) -> None:
            """The case's replies, until quiet or its generation ended (a running one is stopped)."""
            running = False
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    m = c.recv(timeout_s=QUIET_S)
                except TimeoutError:
                    if not running:
                        return
                    c.control("stop")
                    continue
                kind = m.get("type", "?")
                replies[f"{kind} {m.get('code', '')}".strip() if kind == "error" else kind] += 1
                if kind == "init":
                    running = True
                elif kind in ("completion", "error") and m.get("request_id"):
                    running = False

        @seed(args.seed)
        @settings(max_examples=args.examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(cases(schema))
        def run(raw: str) -> None:
            c = conn[0]
            try:
                c._ws.send(raw)
                drain(c)
            except Exception:  # the server closed the connection: counted, and a new one goes on
                closed[0] += 1
                c.close()
                conn[0] = WsClient(url, timeout_s=30.0)

        t0 = time.monotonic()
        run()
        seconds = time.monotonic() - t0
        conn[0].close()
        alive = d.proc.poll() is None
        held = True
        deadline = time.monotonic() + 30
        with d.client(timeout_s=10.0) as c:
            while (held := c.status().session_open) and time.monotonic() < deadline:
                time.sleep(0.05)
        code = d.stop()
    internal = sum(v for k, v in replies.items() if "Internal" in k or "internal" in k)
    print(f"{'reply':<40}  {'count':>7}")
    for key, value in sorted(replies.items()):
        print(f"{key:<40}  {value:>7,}")
    rows = [("cases", f"{args.examples:,} in {seconds:.0f} s"), ("internal errors", internal),
            ("connections the server closed", closed[0]), ("daemon exits", 0 if alive else 1),
            ("slot held at the end", "yes" if held else "no"), ("exit status on SIGTERM", code)]
    w = max(len(k) for k, _ in rows)
    print("\n".join(f"{k.ljust(w)}  {v}" for k, v in rows))
    return 0 if not internal and not closed[0] and alive and not held and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
