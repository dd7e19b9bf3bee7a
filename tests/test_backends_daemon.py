"""The conformance suite against the real backends, through a real daemon process.

One parametrized suite: every scenario runs against the llama.cpp and the
OpenVINO backend serving the bundled model, over ZeroMQ, the way an agent
uses them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.bundled import bundled_gguf_path
from backends.tape.draft_costs import FILE_NAME, FIXED_ENV
from contract import wire
from contract.errors import Cancelled, FrameTooLarge, InvalidArgument, ShuttingDown
from contract.messages import CancelReply, CancelRequest, EnsurePrefixRequest
from contract.types import (
    DecodeConfig,
    EmbedRequest,
    OpenSessionRequest,
    PrefixInput,
    SlotState,
    StreamChunk,
    StructuredOutputConfig,
    SuffixInput,
)
from contract.wire import Kind, Op
from harness.daemon import ROOT, DaemonProcess, kernel_takes_custom_slices, thread_nices, thread_slices, wait_until
from harness.prompts import EDIT_CONTINUATION
from runtime import Client, RemoteSession

from .conformance import SCENARIOS, SYSTEM, TURN_1, Target, fresh_profile, manifest_for
from .engine_kit import CHEAP_CHECKS, take
from .test_metrics import samples

BACKENDS = ["llama", "openvino"]
#: the bundled model as shipped, not the context-extended copy plain ``serve`` loads: the greedy
#: answers these tests compare across kernel paths were measured on it, and the copy's answers meet
#: a near-tie (end of text against a newline) inside the edit's 64 tokens
BUNDLED = ("--model", str(bundled_gguf_path()))


def engine_daemon(request: pytest.FixtureRequest, tmp: pytest.TempPathFactory, num_ctx: int) -> Iterator[DaemonProcess]:
    """A module fixture's daemon on the engine ``request`` names, serving the bundled model at ``num_ctx``."""
    d = DaemonProcess(tmp.mktemp(request.param), request.param, None, *BUNDLED, "--num-ctx", str(num_ctx))
    d.env[FIXED_ENV] = CHEAP_CHECKS  # its tests speculate by default, as a quiet machine would price the checks
    d.start(ready_timeout_s=600, wait_state=("Ready",))
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module", params=BACKENDS)
def backend_proc(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon per engine for the module."""
    yield from engine_daemon(request, tmp_path_factory, 2048)


@pytest.fixture
def backend_daemon(backend_proc: DaemonProcess) -> DaemonProcess:
    """The module's daemon, started again should a test before this one have stopped it (the SIGTERM test
    below stops it, and runs last on its engine; were it to run earlier, the next test gets a new daemon)."""
    if backend_proc.proc is not None and backend_proc.proc.poll() is not None:
        backend_proc.stop()
        backend_proc.start(ready_timeout_s=600, wait_state=("Ready",))
    return backend_proc


@pytest.fixture
def target(backend_daemon: DaemonProcess) -> Iterator[Target]:
    with backend_daemon.client(timeout_s=300.0) as c:
        yield Target(backend_daemon.backend, c, OpenSessionRequest(), partial_reuse=True)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_scenario(target: Target, scenario: str) -> None:
    SCENARIOS[scenario](target)


def test_status_names_backend_and_runtime(backend_daemon: DaemonProcess) -> None:
    with backend_daemon.client() as c:
        st = c.status()
    assert st.backend == backend_daemon.backend
    assert st.backend_version and st.backend_version[0].isdigit(), st.backend_version
    assert st.active is not None and st.active.digest.startswith("sha256:")
    assert st.active.effective_context == 2048


def test_a_closed_decode_stream_stops_the_decode_and_frees_the_slot(backend_daemon: DaemonProcess) -> None:
    with backend_daemon.client(timeout_s=120.0) as c:
        sess = c.open_session(OpenSessionRequest())
        m = manifest_for(sess, fresh_profile())
        sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
        sess.prefill_suffix(SuffixInput(text=TURN_1, manifest=m))
        # one token per engine step, so a frame's interval is at least a step (a frame carries the steps
        # of its 20 ms; a speculative step would yield a burst: its cancel is tested below)
        stream = sess.decode(DecodeConfig(max_tokens=500, temperature=0.0, speculative=False))
        for seen, _chunk in enumerate(stream, 1):
            if seen == 3:
                break
        stream.close()  # type: ignore[attr-defined]
        deadline = time.monotonic() + 60.0  # a hang's bound, not a speed: the machine may be busy
        while c.status().busy_operation == "decode":
            assert time.monotonic() < deadline, "the decode went on after its stream was closed"
            time.sleep(0.002)
        # The worker notices the cancel between tokens: the decode ends long before its 500 tokens. How many it
        # made after the close depends on how busy the machine is (the cancel's round trip against a step), so
        # the bound is counted in tokens and loose; the latency itself is make fuzz's figure (a dropped stream's
        # slot free within milliseconds), not a test's.
        rep = sess.explain_context()
        assert rep.resident_tokens < rep.prefix_tokens + 100
        sess.prefill_suffix(SuffixInput(text="Next turn.", manifest=m))
        assert any(ch.done for ch in sess.decode(DecodeConfig(max_tokens=4)))
        sess.close()
        assert c.status().state is SlotState.READY


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")
def test_the_engine_threads_run_nicer_than_the_io_thread_when_asked(
    backend_daemon: DaemonProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """By default every thread keeps the daemon's priority (a niced engine loses the cores to any busy program);
    with ``--engine-nice 10`` the model worker lowers its priority before the engine starts its threads, so they
    inherit it, and the IO thread (the process's main thread) keeps the daemon's."""
    assert backend_daemon.proc is not None
    plain = thread_nices(backend_daemon.proc.pid)
    # (the workspace cache's disk writer runs nicer by design: modeld.state_cache)
    assert sum(nice != plain[backend_daemon.proc.pid] for nice in plain.values()) <= 1, plain
    niced = DaemonProcess(tmp_path_factory.mktemp("nice"), backend_daemon.backend, None, *BUNDLED, "--num-ctx", "512",
                          "--engine-nice", "10", "--speculative", "off")
    niced.start(ready_timeout_s=600, wait_state=("Ready",))
    try:
        _check_niced(niced)
    finally:
        niced.stop()


def test_the_message_threads_ask_for_prompt_wake_ups_and_the_engine_threads_do_not(
    backend_daemon: DaemonProcess,
) -> None:
    """The IO thread (the process's main thread) and ZeroMQ's I/O threads ask for the shortest slice, so that woken
    during a decode they take a core from the engine's threads at once (``runtime.wakeups``); no other thread has
    it, the engine's included (they are made by the model worker, before or after, never by the IO thread)."""
    from runtime.wakeups import SLICE_US

    if not kernel_takes_custom_slices():
        pytest.skip("this kernel has no custom slices (Linux 6.12 on)")
    assert backend_daemon.proc is not None
    pid = backend_daemon.proc.pid
    _decode_a_little(backend_daemon)  # the engine's threads exist once it decoded
    slices = thread_slices(pid)
    short = {tid for tid, (_, ns) in slices.items() if ns == SLICE_US * 1000}
    carriers = {tid for tid, (name, _) in slices.items() if tid == pid or name.startswith("ZMQbg/IO")}
    # (pyzmq's zero-copy frames, a snapshot's bytes say, start a context of its own for their garbage collector:
    # its I/O thread carries no message and keeps the default)
    assert pid in short and len(short) >= 2 and short <= carriers, [(tid, *slices[tid]) for tid in short ^ carriers]
    assert len(slices) - len(short) >= 3, slices  # the model worker and the engine's own threads, as they were


def _decode_a_little(backend_daemon: DaemonProcess) -> None:
    """A prefix, a turn and four decoded tokens on a session of its own, closed after."""
    with backend_daemon.client(timeout_s=120.0) as c:
        sess = c.open_session(OpenSessionRequest())
        m = manifest_for(sess, fresh_profile())
        sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
        sess.prefill_suffix(SuffixInput(text=TURN_1, manifest=m))
        assert any(ch.done for ch in sess.decode(DecodeConfig(max_tokens=4)))
        sess.close()


def _check_niced(backend_daemon: DaemonProcess) -> None:
    _decode_a_little(backend_daemon)
    assert backend_daemon.proc is not None
    pid = backend_daemon.proc.pid
    nices = thread_nices(pid)
    io = nices[pid]
    lowered = [tid for tid, nice in nices.items() if nice == io + 10]
    # the model worker, the embedding worker and at least one thread of the engine's own pool
    assert len(lowered) >= 3, nices
    assert all(nice in (io, io + 10) for nice in nices.values()), nices


def _counter(text: str, name: str, result: str) -> float:
    return samples(text).get((name, (("result", result),)), 0.0)


#: tokens a pass closed after 30 may decode: the bundled model's continuation of the edit runs all of
#: them on both engines (measured), so a tape shorter than that was stopped by the cancel
LONG_PASS = 1024


def test_speculation_through_the_daemon(backend_daemon: DaemonProcess) -> None:
    """Greedy answers are the same with and without drafts; usage and metrics count them; cancel stops one."""
    with backend_daemon.client(timeout_s=300.0) as c:
        sess = c.open_session(OpenSessionRequest())
        m = manifest_for(sess, fresh_profile())

        def edit(**cfg: object) -> tuple[list[int], StreamChunk]:
            sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
            sess.prefill_suffix(SuffixInput(text="Hello.", render=False, manifest=m))  # the edit is prefilled anew
            sess.prefill_suffix(SuffixInput(text=EDIT_CONTINUATION, render=False, manifest=m))
            chunks = list(sess.decode(DecodeConfig(max_tokens=64, return_token_ids=True, **cfg)))
            return [t for ch in chunks for t in ch.token_ids], chunks[-1]

        before, drafts_before = c.metrics(), c.status().speculation
        plain, plain_final = edit(speculative=False)
        spec, final = edit()  # the daemon's default: on
        assert spec == plain and len(plain) == 64
        assert plain_final.usage is not None and plain_final.usage.drafted_tokens == 0
        assert final.usage is not None and final.usage.accepted_tokens > 0.5 * final.usage.drafted_tokens > 10
        after, drafts_after = c.metrics(), c.status().speculation
        moved = {kind: _counter(after, "modeld_draft_tokens_total", kind) - _counter(before, "modeld_draft_tokens_total", kind)
                 for kind in ("accepted", "rejected")}
        assert moved == {"accepted": final.usage.accepted_tokens,
                         "rejected": final.usage.drafted_tokens - final.usage.accepted_tokens}
        # status shows the costs the drafts were priced by (kept, timed while idle, or the prior until then:
        # test_a_daemon_times_its_draft_costs_while_idle), and counts the drafts
        assert drafts_before is not None and drafts_after is not None
        assert drafts_after.enabled
        costs = drafts_after.check_costs
        assert list(costs) == ["2", "4", "8", "16"] and 1.0 <= costs["2"] <= costs["4"] <= costs["8"] <= costs["16"]
        assert (drafts_after.drafted_tokens - drafts_before.drafted_tokens,
                drafts_after.accepted_tokens - drafts_before.accepted_tokens) == (
                    final.usage.drafted_tokens, final.usage.accepted_tokens)
        # closing the stream mid-speculation stops it; the tape holds what the daemon had streamed. The
        # pass may run far longer than what is taken: a copy drafts 15 tokens a check from its first
        # token, so 64 tokens can be decoded before a cancel sent after 30 reaches the worker
        sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
        sess.prefill_suffix(SuffixInput(text=EDIT_CONTINUATION, render=False, manifest=m))
        prompt = sess.explain_context().resident_tokens
        got = take(sess.decode(DecodeConfig(max_tokens=LONG_PASS, return_token_ids=True)), 30)
        while c.status().busy_operation:  # the cancel reaches the worker after close returns
            time.sleep(0.005)
        seen = min(len(got), len(plain))
        assert got[:seen] == plain[:seen]
        assert prompt + len(got) <= sess.explain_context().resident_tokens < prompt + LONG_PASS
        assert edit() == (plain, final) or edit()[0] == plain  # and the session serves on
        sess.close()


@pytest.mark.llama
def test_a_daemon_times_its_draft_costs_while_idle(tmp_path: Path) -> None:
    """A first load on a machine (no table kept) is Ready before its draft check costs are timed: the model
    worker times them while the slot is idle. A request that arrives meanwhile is served, the timing stopped
    for it (and left pending: the tape it leaves is resident). A daemon left idle times them to the end and
    keeps them, so the next load reads them and times nothing (on a machine whose cores other programs held
    through the timing, it keeps nothing, and the next load times again). Each chunk of a prefill, the timing's
    own included, is held back 3 s: the timing cannot end before the request arrives."""
    cache = tmp_path / "models"

    def start(name: str, *extra: str) -> DaemonProcess:
        d = DaemonProcess(tmp_path / name, "llama", None, *BUNDLED, "--num-ctx", "1024", *extra)
        d.env["MODELD_MODEL_CACHE"] = str(cache)
        d.env[FIXED_ENV] = ""  # the timing is the subject: not the suite's fixed table (tests/conftest.py)
        return d.start(ready_timeout_s=600, wait_state=("Ready",))

    first = start("first", "--prefill-chunk-delay-ms", "3000")
    try:
        with first.client(timeout_s=300.0) as c:
            st = c.status()
            assert st.state is SlotState.READY and st.speculation is not None
            assert st.speculation.pending and not st.speculation.measured
            sess = c.open_session(OpenSessionRequest())
            m = manifest_for(sess, fresh_profile())
            sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
            sess.prefill_suffix(SuffixInput(text=TURN_1, manifest=m))
            assert [ch for ch in sess.decode(DecodeConfig(max_tokens=4)) if ch.done]
            sess.close()
            st = c.status()
            assert st.speculation is not None and st.speculation.pending and not st.speculation.measured
        assert "idle work (draft cost timing) stopped for a request" in first.log()
        assert not (cache / FILE_NAME).exists()
    finally:
        first.stop()

    with start("idle") as idle, idle.client(timeout_s=60.0) as c:
        wait_until(lambda: not c.status().speculation.pending, "the draft costs timed",  # type: ignore[union-attr]
                   timeout_s=900, poll_s=0.5)
        timed = c.status().speculation
        log = idle.log()
    assert timed is not None and timed.check_costs
    if not timed.measured:
        # Other programs held the cores through every attempt (a loaded machine: the table said a check of r rows
        # cost more than r steps): nothing is kept, and the next load times again rather than read a wrong table.
        assert "draft check costs stayed disturbed" in log and not (cache / FILE_NAME).exists()
        with start("again") as again, again.client(timeout_s=60.0) as c:
            assert c.status().speculation.pending  # type: ignore[union-attr]
        return
    assert len(json.loads((cache / FILE_NAME).read_text())) == 1

    with start("again") as again, again.client(timeout_s=60.0) as c:
        kept = c.status().speculation
    assert kept is not None and kept.measured and not kept.pending and kept.check_costs == timed.check_costs


@pytest.mark.parametrize(
    ("backend", "flags", "settings"),
    [
        # the layout keeps the file's weights: the engine option says the same, and reaches status as given
        ("llama", ("--flash-attn", "--kv-cache-type", "q8_0", "--exact-decode", "--engine-option", "extra_bufts=false"),
         "flash attention, KV cache q8_0, exact decode, extra_bufts=false"),
        ("openvino", ("--exact-decode",), "exact decode"),
    ],
)
def test_a_daemon_with_exact_rows_answers_alike_with_drafts(
    tmp_path_factory: pytest.TempPathFactory, backend: str, flags: tuple[str, ...], settings: str
) -> None:
    """``--exact-decode`` (llama.cpp: with the layout whose rows are exact, flash attention over a
    q8_0 cache, and an engine option) reaches the preloaded model and status names the settings; then a 240-token edit
    answers the same, token for token, with and without drafts (the bench's edit, past 512 keys)."""
    d = DaemonProcess(tmp_path_factory.mktemp("exact-rows"), backend, None, *BUNDLED, "--num-ctx", "2048", *flags)
    d.env[FIXED_ENV] = CHEAP_CHECKS  # drafting asserted: a fixed table, not one timed on a busy machine
    d.start(ready_timeout_s=600, wait_state=("Ready",))
    try:
        out = subprocess.run([sys.executable, "-m", "modeld", "status", "--endpoint", d.endpoint],
                             capture_output=True, text=True, timeout=60, cwd=ROOT, check=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
        shown = [line.split(None, 1)[1] for line in out.splitlines() if line.startswith("settings ")]
        assert shown == [settings], out
        speculation = [line.split(None, 1)[1] for line in out.splitlines() if line.startswith("speculation ")]
        # exact rows: sampled decodes draft by default too, and status says why (llama.cpp: its load's probe)
        assert len(speculation) == 1 and speculation[0].startswith(
            "on for greedy and sampled decodes; a check of 2 / 4 / 8 / 16 rows"), out
        assert speculation[0].endswith("a prior (not measured)"), out  # the fixed table
        exact = [line.split(None, 2)[2] for line in out.splitlines() if line.startswith("exact rows ")]
        if backend == "llama":
            assert len(exact) == 1 and exact[0].startswith("yes: probed at load: "), out
            assert "equal bit for bit" in exact[0], out
        else:
            assert exact == ["yes"], out
        with d.client(timeout_s=300.0) as c:
            active = c.status().active
            assert active is not None
            assert active.config.exact_decode
            assert (active.config.flash_attn, active.config.kv_cache_type) == (
                ("--flash-attn" in flags, "q8_0") if backend == "llama" else (False, ""))
            sess = c.open_session(OpenSessionRequest())
            m = manifest_for(sess, fresh_profile())

            system = SYSTEM + "\n" + "\n".join(LONG_SYSTEM.splitlines()[1:16])  # ~450 tokens

            def edit(speculative: bool) -> tuple[list[int], StreamChunk]:
                sess.ensure_prefix(PrefixInput(text=system, manifest=m))
                sess.prefill_suffix(SuffixInput(text="Hello.", render=False, manifest=m))
                sess.prefill_suffix(SuffixInput(text=EDIT_CONTINUATION, render=False, manifest=m))
                assert sess.explain_context().resident_tokens > 512
                chunks = list(sess.decode(DecodeConfig(max_tokens=240, return_token_ids=True, speculative=speculative)))
                return [t for ch in chunks for t in ch.token_ids], chunks[-1]

            plain, _ = edit(False)
            spec, final = edit(True)
            assert final.usage is not None and final.usage.accepted_tokens > 0.5 * final.usage.drafted_tokens > 20
            assert spec == plain and len(plain) > 150
            sess.close()
    finally:
        d.stop()


def test_restore_state_is_bounded_by_the_model(backend_daemon: DaemonProcess) -> None:
    """State bytes larger than the loaded model (weights and KV) are refused before the worker sees them."""
    with backend_daemon.client(timeout_s=120.0) as c:
        resident = c.status().active.resident_bytes  # type: ignore[union-attr]
        sess = c.open_session(OpenSessionRequest())
        m = manifest_for(sess, fresh_profile())
        sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
        snap = sess.snapshot()
        assert 0 < len(snap.state) < resident
        with pytest.raises(FrameTooLarge) as exc:
            sess.restore(snap.model_copy(update={"state": bytes(resident + 1)}))
        assert exc.value.details["limit"] == resident
        sess.restore(snap)  # a real state of this model still restores
        assert sess.explain_context().resident_tokens == snap.resident_tokens
        sess.close()


def test_cli_run_twice_is_warm(backend_daemon: DaemonProcess) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MODELD_ENDPOINT": backend_daemon.endpoint}
    system = f"You are a terse assistant for project {fresh_profile()}."

    def run(prompt: str) -> dict[str, object]:
        out = subprocess.run(
            [sys.executable, "-m", "modeld", "run", "--system", system, prompt, "--max-tokens", "8", "--json"],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)  # type: ignore[no-any-return]

    first = run("Say hi.")
    second = run("Say bye.")
    # The first run shares at most the template header with earlier prompts.
    assert first["prefix"]["reused_tokens"] < first["prefix"]["prefix_tokens"]
    assert second["prefix"]["reused_tokens"] == second["prefix"]["prefix_tokens"]
    assert second["prefix"]["prefilled_tokens"] == 0
    assert second["usage"]["completion_tokens"] > 0


def test_embed_while_a_chat_session_decodes(backend_daemon: DaemonProcess) -> None:
    """An embed call mid-decode succeeds; the stream continues; the next turn is fully warm."""
    with backend_daemon.client(timeout_s=300.0) as chat, backend_daemon.client(timeout_s=300.0) as tools:
        sess = chat.open_session(OpenSessionRequest())
        m = manifest_for(sess, fresh_profile())
        pre = sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
        sess.prefill_suffix(SuffixInput(text=TURN_1, manifest=m))
        stream = sess.decode(DecodeConfig(max_tokens=40, temperature=0.0))
        before = [next(stream), next(stream)]
        res = tools.embed(EmbedRequest(texts=["def parse_config(path): ...", "how is the config file parsed?"]))
        assert res.dims == 384 and len(res.vectors) == 2
        for v in res.vectors:
            assert abs(sum(x * x for x in v) - 1.0) < 1e-3
        assert tools.status().embedding["loaded"] is True
        after = list(stream)
        assert after and after[-1].done and not before[-1].done
        assert after[-1].usage is not None and after[-1].usage.completion_tokens >= len(before)
        warm = sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
        assert warm.reused_tokens == warm.prefix_tokens == pre.prefix_tokens
        sess.close()


def test_cli_embed_json(backend_daemon: DaemonProcess) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MODELD_ENDPOINT": backend_daemon.endpoint}
    out = subprocess.run(
        [sys.executable, "-m", "modeld", "embed", "--json", "first text", "zweiter Text ✓"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    vectors = json.loads(out.stdout)["vectors"]
    assert len(vectors) == 2 and all(len(v) == 384 for v in vectors)
    too_long = subprocess.run(
        [sys.executable, "-m", "modeld", "embed", "word " * 2000],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )
    assert too_long.returncode == 1 and "ContextOverflow" in too_long.stderr


def test_structured_output_through_the_daemon(backend_daemon: DaemonProcess) -> None:
    """A JSON-schema constraint holds on both backends; a bad grammar is a typed error and the session goes on."""
    schema = {
        "type": "object",
        "properties": {"file": {"type": "string", "maxLength": 20}, "ok": {"type": "boolean"}},
        "required": ["file", "ok"],
        "additionalProperties": False,
    }
    with backend_daemon.client(timeout_s=300.0) as c:
        sess = c.open_session(OpenSessionRequest())
        m = manifest_for(sess, fresh_profile())
        sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
        sess.prefill_suffix(SuffixInput(text="Report on slot.py as JSON.", manifest=m))
        so = StructuredOutputConfig(json_schema=json.dumps(schema))
        chunks = list(sess.decode(DecodeConfig(max_tokens=60, structured_output=so)))
        assert chunks[-1].finish_reason == "stop"
        obj = json.loads("".join(ch.text for ch in chunks))
        assert set(obj) == {"file", "ok"} and isinstance(obj["ok"], bool) and len(obj["file"]) <= 20
        with pytest.raises(InvalidArgument, match="grammar"):
            list(sess.decode(DecodeConfig(structured_output=StructuredOutputConfig(grammar="root ::= ("))))
        sess.prefill_suffix(SuffixInput(text="Now say hi.", manifest=m))
        assert list(sess.decode(DecodeConfig(max_tokens=4)))[-1].done
        sess.close()


# --- interrupting a long prefill -------------------------------------------------------------------------------------
#: ~1,600 tokens (the daemons here have 2,048): several prefill chunks on both engines, seconds on llama.cpp
LONG_SYSTEM = SYSTEM + "\n" + "\n".join(f"src/pkg/module_{i}.py: class Handler{i}(Base): def run(self, x): return x * {i}" for i in range(60))


def _start_prefix(c: Client, sess: RemoteSession, prefix: PrefixInput) -> bytes:
    """Send ensure_prefix without waiting; returns once the daemon is working on it."""
    rid = c.send(Op.ENSURE_PREFIX, EnsurePrefixRequest.of(sess.session_id, prefix))
    while c.status().busy_operation != "ensure_prefix":
        assert not c.waiting(rid), "ensure_prefix ended before it could be interrupted"
        time.sleep(0.002)
    return rid


def test_cancel_stops_a_cold_prefill(backend_daemon: DaemonProcess) -> None:
    """A cancelled ensure_prefix ends with Cancelled instead of finishing: no prefix is resident, and the chunks
    it had finished stay for the next prefill of the same text (an agent's retry), which goes on from there."""
    with backend_daemon.client(timeout_s=300.0) as c:
        sess = c.open_session(OpenSessionRequest())
        m = manifest_for(sess, fresh_profile())
        rid = _start_prefix(c, sess, PrefixInput(text=LONG_SYSTEM, manifest=m))
        assert c.request(Op.CANCEL, CancelRequest(request_id=rid), CancelReply).cancelled
        reply = c.receive(rid)
        assert reply.kind is Kind.ERROR
        assert isinstance(wire.error_of(reply), Cancelled)
        rep = sess.explain_context()
        assert rep.prefix_tokens == 0 and rep.manifest_digest == ""  # no prefix: the head of one, at most
        kept = rep.resident_tokens
        st = sess.ensure_prefix(PrefixInput(text=LONG_SYSTEM, manifest=m))  # the daemon serves on
        assert st.reused_tokens >= kept and st.prefilled_tokens == st.prefix_tokens - st.reused_tokens > 0
        sess.prefill_suffix(SuffixInput(text=TURN_1, manifest=m))
        assert list(sess.decode(DecodeConfig(max_tokens=4)))[-1].done
        sess.close()


def test_interrupted_client_call_cancels_the_prefill(backend_daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while waiting for ensure_prefix sends a cancel: the daemon stops the prefill for nobody."""
    with backend_daemon.client(timeout_s=300.0) as c, backend_daemon.client(timeout_s=30.0) as watcher:
        sess = c.open_session(OpenSessionRequest())
        m = manifest_for(sess, fresh_profile())
        real_recv = c.receive

        def interrupted(rid: bytes, timeout_s: float | None = None, on_progress: object = None) -> object:
            deadline = time.monotonic() + 60
            while watcher.status().busy_operation != "ensure_prefix" and time.monotonic() < deadline:
                time.sleep(0.002)
            raise KeyboardInterrupt

        monkeypatch.setattr(c, "receive", interrupted)
        with pytest.raises(KeyboardInterrupt):
            sess.ensure_prefix(PrefixInput(text=LONG_SYSTEM, manifest=m))
        monkeypatch.setattr(c, "receive", real_recv)
        while watcher.status().busy_operation:
            time.sleep(0.005)
        assert sess.explain_context().prefix_tokens == 0  # stopped, not finished
        assert sess.ensure_prefix(PrefixInput(text=LONG_SYSTEM, manifest=m)).prefilled_tokens > 0  # (the rest)
        sess.close()


# last in the module: it stops its daemon, which the module's other llama tests share
@pytest.mark.parametrize("backend_proc", ["llama"], indirect=True)
def test_sigterm_during_a_prefill_stops_it(backend_daemon: DaemonProcess) -> None:
    """Shutdown does not wait for a long cold prefill: the caller gets ShuttingDown and the daemon exits 0."""
    d = backend_daemon
    logged = len(d.log())
    with d.client(timeout_s=120.0) as c:
        sess = c.open_session(OpenSessionRequest())
        m = manifest_for(sess, fresh_profile())
        rid = _start_prefix(c, sess, PrefixInput(text=LONG_SYSTEM, manifest=m))
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        reply = c.receive(rid)
        assert reply.kind is Kind.ERROR and isinstance(wire.error_of(reply), ShuttingDown), reply.body
        assert d.proc.wait(60) == 0
    assert "modeld stopped" in d.log()[logged:]
