"""A turn never outlives its client: disconnects swept over the whole life of a long turn, on every API.

For each API (chat completions, Responses, Messages, ``/v1/completions``, the WebSocket), streamed and not, a
client sends a long request and goes away at one instant of its turn's life: queued behind another turn, inside
the stable prefix's prefill, inside the conversation's, in the first decode steps, or mid-decode. The instant is
found by reading the daemon's status (the running turn names its client's address, its phase and how far it
came), never by a clock, so the sweep means the same on a fast machine and a loaded one. After every disconnect:

* the slot serves the next client at once: a short request sent at the disconnect holds the slot within
  ``FREE_S`` of it (of the other turn's end, when the disconnect came while queued);
* the same request sent again finds at least what was done at the disconnect, less one chunk: the prefill's
  finished chunks stayed, in the KV or (the next client took the slot meanwhile) in the workspace cache. (The
  cache keeps tapes of ``SAVE_MIN_TOKENS`` or more, 256: a shorter head costs less to compute again than to keep,
  so the instants inside a prefix come after that many tokens.)

``tests/test_turn_lifetime.py`` runs it in the suite with one instant per API and mode (the instants rotate over
the phases, so every phase is hit); ``make soak`` runs it with many (``tests.soak_daemon --sweep N``).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from backends.tape.cache import SAVE_MIN_TOKENS
from contract.types import DaemonStatus, RunningTurn
from harness.daemon import DaemonProcess

#: the daemon's prefill chunk (``--num-batch``) and how long each is held back: a prefill of a few seconds (small
#: chunks: an instant deep in a phase costs the sweep few tokens to compute, on a loaded machine)
CHUNK = 32
DELAY_MS = 100
#: the serve flags the sweep needs beside the model's
SERVE_ARGS = ("--num-ctx", "4096", "--num-batch", str(CHUNK), "--prefill-chunk-delay-ms", str(DELAY_MS),
              "--lease", "3")
#: the stable prefix is about this many chunks, the conversation after it about ``CONVERSATION_CHUNKS``
PREFIX_CHUNKS = 14
CONVERSATION_CHUNKS = 4
#: the acceptance: the next client holds the slot within this long of the disconnect
FREE_S = 2.0
#: the reply the long request asks for (sampled, so the model writes on: a mid-decode instant needs a decode)
REPLY = {"max_tokens": 160, "temperature": 0.8, "seed": 7}
#: a mid-decode instant: after this many tokens of the reply
MID_DECODE_TOKENS = 24

PHASES = ("queued", "prefix", "conversation", "first_tokens", "mid_decode")
#: (API, streamed); the WebSocket always streams
MODES = (("chat", True), ("chat", False), ("responses", True), ("responses", False), ("messages", True),
         ("messages", False), ("completions", True), ("completions", False), ("ws", True))
ROUTES = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages",
          "completions": "/v1/completions", "ws": "/v1/ws"}


@dataclass(frozen=True)
class Case:
    api: str
    stream: bool
    phase: str
    #: how deep into the phase: a prefill's chunk (counted from the phase's start), or decode tokens
    depth: int

    def __str__(self) -> str:
        return f"{self.api}/{'stream' if self.stream else 'plain'}/{self.phase}@{self.depth}"


def plan(per_mode: int) -> list[Case]:
    """``per_mode`` instants for each (API, streamed), rotated over the phases so every phase is hit whatever the
    count, and spread over each phase's depth."""
    cases: list[Case] = []
    for m, (api, stream) in enumerate(MODES):
        for i in range(per_mode):
            k = m + i * len(MODES)
            phase = PHASES[k % len(PHASES)]
            spread = (k // len(PHASES)) % 4
            depth = {"queued": 0, "prefix": SAVE_MIN_TOKENS // CHUNK + spread, "conversation": 1 + spread % (CONVERSATION_CHUNKS - 1),
                     "first_tokens": 1, "mid_decode": MID_DECODE_TOKENS + 8 * spread}[phase]
            cases.append(Case(api, stream, phase, depth))
    return cases


@dataclass
class Outcome:
    case: Case
    #: the context's tokens of the prompt at the disconnect (what the resend must find, less a chunk)
    done_at: int = 0
    #: seconds from the disconnect (or the other turn's end) until the next client held the slot
    free_s: float = float("nan")
    #: the resend: its prompt and what it found cached
    resend_prompt: int = 0
    resend_cached: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        return (f"{self.case!s:<36} done {self.done_at:>5}  next client after {self.free_s:5.2f} s  resend found "
                f"{self.resend_cached:>5} of {self.resend_prompt:>5}" + (f"  FAILED: {'; '.join(self.problems)}"
                                                                        if self.problems else ""))


def _text(chunks: int, tag: str) -> str:
    """About ``chunks`` prefill chunks of code (a helper is about 20 tokens), headed by a line no other request
    had."""
    lines = [f"# {tag} {uuid.uuid4().hex}"]
    lines += [f"def helper_{i}(value):\n    return value * {i} + {i % 7}\n" for i in range(chunks * CHUNK // 20)]
    return "\n".join(lines)


STORY = "Now write a long story about a dragon and a knight, at least five hundred words, with many details."


class Sweep:
    """The sweep against one daemon process with its HTTP front on ``port``."""

    def __init__(self, daemon: DaemonProcess, port: int, api_key: str = "none") -> None:
        self.daemon = daemon
        self.port = port
        self.api_key = api_key
        self._status = daemon.client(timeout_s=30.0)

    def close(self) -> None:
        self._status.close()

    # --- the requests ------------------------------------------------------------------------------------------
    def body(self, api: str, system: str, user: str, *, stream: bool, reply: dict[str, Any]) -> dict[str, Any]:
        """``api``'s request: ``system`` as its stable prefix, ``user`` after it."""
        n, t, seed = reply["max_tokens"], reply["temperature"], reply["seed"]
        if api == "chat":
            return {"model": "default", "messages": [{"role": "system", "content": system},
                                                     {"role": "user", "content": user}],
                    "max_tokens": n, "temperature": t, "seed": seed, "stream": stream}
        if api == "responses":
            return {"model": "default", "instructions": system, "input": user, "max_output_tokens": n,
                    "temperature": t, "store": False, "stream": stream}
        if api == "messages":
            return {"model": "default", "system": system, "messages": [{"role": "user", "content": user}],
                    "max_tokens": n, "temperature": t, "stream": stream}
        if api == "completions":
            return {"model": "default", "prompt": f"{system}\n\n{user}\n", "max_tokens": n, "temperature": t,
                    "seed": seed, "stream": stream}
        return {"type": "config", "model": "default",
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                "parameters": {"max_tokens": n, "temperature": t, "seed": seed}}

    def _headers(self) -> dict[str, str]:
        return {"content-type": "application/json", "authorization": f"Bearer {self.api_key}",
                "x-api-key": self.api_key, "anthropic-version": "2023-06-01"}

    def send(self, api: str, body: dict[str, Any]) -> tuple[Callable[[], None], str]:
        """Send without reading the reply; returns how to go away (close the connection) and the client's
        address as the daemon's status names it."""
        if api == "ws":
            from websockets.sync.client import connect

            # (entered, as websockets asks of a connection closed explicitly)
            ws = connect(f"ws://127.0.0.1:{self.port}/v1/ws",
                         additional_headers={"Authorization": f"Bearer {self.api_key}"}).__enter__()
            ws.send(json.dumps(body))
            return ws.close, f"127.0.0.1:{ws.socket.getsockname()[1]}"
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request("POST", ROUTES[api], body=json.dumps(body).encode(), headers=self._headers())
        assert conn.sock is not None
        return conn.close, f"127.0.0.1:{conn.sock.getsockname()[1]}"

    def complete(self, api: str, body: dict[str, Any]) -> dict[str, Any]:
        """Send and read the whole reply: the reply's body (the WebSocket's ``completion``); AssertionError for an
        error reply."""
        if api == "ws":
            from runtime.ws import WsClient

            with WsClient(f"ws://127.0.0.1:{self.port}/v1/ws", api_key=self.api_key) as c:
                c.send(body)
                for message in c.messages():
                    if message.get("type") == "completion":
                        return message
            raise AssertionError("the WebSocket ended before its completion")
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            conn.request("POST", ROUTES[api], body=json.dumps({**body, "stream": False}).encode(),
                         headers=self._headers())
            r = conn.getresponse()
            data = r.read()
            assert r.status == 200, (r.status, data[:500])
            out: dict[str, Any] = json.loads(data)
            return out
        finally:
            conn.close()

    @staticmethod
    def cached(api: str, reply: dict[str, Any]) -> tuple[int, int]:
        """(prompt tokens, of them found cached) as each API's reply says it."""
        u = reply["usage"]
        if api in ("chat", "completions"):
            return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]
        if api == "responses":
            return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]
        if api == "messages":
            read = u.get("cache_read_input_tokens") or 0
            return u["input_tokens"] + read + (u.get("cache_creation_input_tokens") or 0), read
        return u["prompt_tokens"], u["cached_tokens"]

    # --- watching the slot -------------------------------------------------------------------------------------
    def status(self) -> DaemonStatus:
        return self._status.status()

    def turn_of(self, who: str) -> RunningTurn | None:
        """The running turn when it is ``who``'s (a client address), else None."""
        t = self.status().turn
        return t if t is not None and t.client.endswith(f" from {who}") else None

    def wait(self, what: str, condition: Callable[[DaemonStatus], bool], timeout_s: float = 300.0) -> DaemonStatus:
        """Poll status until ``condition`` holds (a ceiling for a turn that never gets there, which fails)."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status()
            if condition(st):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"never saw {what}; status: {st.turn}\n{self.daemon.log()[-2000:]}")
            time.sleep(0.01)

    def wait_free(self, timeout_s: float = 300.0) -> None:
        self.wait("the slot free", lambda st: not st.session_open and not st.busy_operation and not st.waiting,
                  timeout_s)

    # --- one case ----------------------------------------------------------------------------------------------
    def run(self, case: Case) -> Outcome:
        out = Outcome(case)
        self.wait_free()
        system = _text(PREFIX_CHUNKS, "sweep")
        user = _text(CONVERSATION_CHUNKS, "conversation") + "\n\n" + STORY
        body = self.body(case.api, system, user, stream=case.stream, reply=REPLY)
        holder: threading.Thread | None = None
        holder_done = threading.Event()
        holder_end = [0.0]
        if case.phase == "queued":  # another turn holds the slot: a prefill of a few chunks, one token
            hold = self.body("chat", _text(3, "holder"), "hi", stream=False, reply={**REPLY, "max_tokens": 1})

            def run_holder() -> None:
                try:
                    self.complete("chat", hold)
                finally:
                    holder_end[0] = time.monotonic()
                    holder_done.set()

            holder = threading.Thread(target=run_holder)
            holder.start()
            self.wait("the holder's turn", lambda st: st.turn is not None and st.turn.phase == "prefill")
        leave, who = self.send(case.api, body)
        at = self._instant(case, who)
        out.done_at = at
        leave()
        t0 = time.monotonic()
        # the next client, sent at the disconnect: another workspace (its own stable prefix), one token
        nxt = self.body("chat", "You add numbers. " + uuid.uuid4().hex, "2 + 2 =", stream=False,
                        reply={**REPLY, "max_tokens": 1})
        result: list[dict[str, Any] | BaseException] = []

        def run_next() -> None:
            try:
                result.append(self.complete("chat", nxt))
            except BaseException as exc:  # (reported below)
                result.append(exc)

        sent_next = threading.Thread(target=run_next)
        sent_next.start()
        label = ""
        while sent_next.is_alive():
            t = self.status().turn
            if t is not None and t.operation and not t.client.endswith(f" from {who}") and (
                    holder is None or holder_done.is_set()):
                label = t.client
                break
            time.sleep(0.01)
        out.free_s = time.monotonic() - max(t0, holder_end[0]) if label else float("nan")
        sent_next.join()
        if holder is not None:
            holder.join()
        if not result or isinstance(result[0], BaseException):
            out.problems.append(f"the next client failed: {result[0] if result else 'no reply'}")
        elif not label:
            out.problems.append("the next client never showed in status (it ran too fast to see?)")
        elif out.free_s > FREE_S:
            out.problems.append(f"the next client held the slot {out.free_s:.2f} s after the disconnect")
        # the same request again: it finds what the first attempt computed, less one chunk
        resend = self.body(case.api, system, user, stream=False, reply={**REPLY, "max_tokens": 1})
        out.resend_prompt, out.resend_cached = self.cached(case.api, self.complete(case.api, resend))
        if out.resend_cached < out.done_at - CHUNK:
            out.problems.append(f"the resend found {out.resend_cached} tokens cached, the first attempt had "
                                f"{out.done_at} in the context")
        return out

    def _instant(self, case: Case, who: str) -> int:
        """Wait for ``case``'s instant of the turn sent from ``who``; the context's tokens of its prompt then."""
        if case.phase == "queued":
            self.wait("the request queued", lambda st: st.waiting >= 1)
            return 0
        seen: list[RunningTurn] = []

        def reached(st: DaemonStatus) -> bool:
            t = st.turn
            if t is None or not t.client.endswith(f" from {who}"):
                return False
            if t.phase == "prefill" and t.total:
                seen.append(t)
            if case.phase == "prefix":  # (a raw completion has no stable prefix: the first chunks of its prompt)
                in_prefix = t.operation == "ensure_prefix" or case.api == "completions"
                return t.phase == "prefill" and in_prefix and t.done >= case.depth * CHUNK
            if case.phase == "conversation":
                return t.phase == "prefill" and t.operation == "prefill_suffix" and (
                    t.done - t.reused >= case.depth * CHUNK if case.api != "completions"
                    else t.done >= (PREFIX_CHUNKS + case.depth) * CHUNK)
            return t.phase == "decode" and t.done >= case.depth
        self.wait(f"{case}'s instant", reached)
        if case.phase in ("first_tokens", "mid_decode"):
            return max((t.total for t in seen), default=0)  # the whole prompt was prefilled
        return seen[-1].done if seen else 0


def sweep(daemon: DaemonProcess, port: int, cases: list[Case], api_key: str = "none") -> Iterator[Outcome]:
    """Run ``cases`` one after the other on the daemon (its HTTP front on ``port``)."""
    s = Sweep(daemon, port, api_key)
    try:
        for case in cases:
            yield s.run(case)
    finally:
        s.close()
