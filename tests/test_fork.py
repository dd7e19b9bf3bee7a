"""Forks at the acceptance sizes, on both engines, through a real daemon and the runtime client.

A fork (``Session.fork``) is a second session on the slot whose context is the source's head. The two share the
model's one KV: the fork's first prefill computes only what it appends, and switching back to a source whose tail
the fork dropped restores that tail from the workspace cache. ``modeld_prompt_tokens_total`` counts what every
prefill computed, a switch's included, so "the shared part is never prefilled again" is read off the daemon.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from contract.errors import ModelBusy
from contract.manifest import ContextManifest
from contract.types import DecodeConfig, OpenSessionRequest, PrefixInput, SlotState, SuffixInput
from harness.daemon import ROOT, DaemonProcess
from runtime import Client, RemoteSession

from .conformance import SYSTEM, fresh_profile, manifest_for
from .test_backends_daemon import BACKENDS, engine_daemon
from .test_metrics import samples

pytest.importorskip("llama_cpp")
pytest.importorskip("openvino")

#: a long text to take tokens from: this project's own source, as an agent's context holds it
BODY = "\n\n".join((ROOT / p).read_text() for p in (*sorted(f"contract/types/{f.name}" for f in (ROOT / "contract/types").glob("*.py")),
                                                     "contract/errors.py", "modeld/slot.py"))
QUESTION = "\nWhich class holds the slot's sessions? Answer with its name."


@pytest.fixture(scope="module", params=BACKENDS)
def daemon(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from engine_daemon(request, tmp_path_factory, 5120)


def _greedy(sess: RemoteSession, n: int = 16) -> list[int]:
    out: list[int] = []
    for chunk in sess.decode(DecodeConfig(max_tokens=n, temperature=0.0, return_token_ids=True)):
        out.extend(chunk.token_ids or [])
    return out


def _prefilled(c: Client) -> float:
    return samples(c.metrics())[("modeld_prompt_tokens_total", (("kind", "prefilled"),))]


def _session_of(c: Client, length: int) -> tuple[RemoteSession, list[int], int, ContextManifest]:
    """A session whose context is the system prompt then this project's source, ``length`` tokens in all."""
    sess = c.open_session(OpenSessionRequest())
    m = manifest_for(sess, fresh_profile())
    prefix = sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m)).prefix_tokens
    body = sess.tokenize(BODY)[: length - prefix]
    assert len(body) == length - prefix, "the source text is too short for this test"
    st = sess.prefill_suffix(SuffixInput(tokens=body, offset=prefix, manifest=m))
    assert st.resident_tokens == length
    return sess, body, prefix, m


def test_a_fork_answers_as_a_fresh_session_and_computes_only_what_it_appends(daemon: DaemonProcess) -> None:
    """A 2,000-token session forked at 1,500: the fork's first prefill computes only its question, its greedy answer
    is that of a session given the same 1,500 tokens and question from nothing, the source goes on from 2,000 with
    its dropped tail restored from the workspace cache, and the fork outlives its source on the slot."""
    with daemon.client(timeout_s=300.0) as c:
        sess, body, prefix, man = _session_of(c, 2000)
        fork = sess.fork(1500)
        assert fork.explain_context().resident_tokens == 1500 and sess.explain_context().resident_tokens == 2000
        question = sess.tokenize(QUESTION)
        before = _prefilled(c)
        st = fork.prefill_suffix(SuffixInput(tokens=question, offset=1500, manifest=man))
        assert (st.prefilled_tokens, st.reused_tokens) == (len(question), 1500 - prefix)
        assert _prefilled(c) - before == len(question)
        answer = _greedy(fork)

        # back to the source: its 500 tokens past the fork come from the workspace cache, not from a prefill
        before = _prefilled(c)
        st = sess.prefill_suffix(SuffixInput(tokens=question, offset=2000, manifest=man))
        assert st.resident_tokens == 2000 + len(question)
        assert st.prefilled_tokens == len(question) and st.cached_tokens >= 500, st
        assert _prefilled(c) - before == len(question)
        _greedy(sess, 4)

        # the source closed, the fork holds the slot on its own: another client waits, the fork goes on
        sess.close()
        with Client(daemon.endpoint, timeout_s=30.0) as other, pytest.raises(ModelBusy):
            other.open_session(OpenSessionRequest(queue_timeout_s=0.5))
        at = fork.explain_context().resident_tokens
        assert fork.prefill_suffix(SuffixInput(text=" Why?", render=False, offset=at, manifest=man)).resident_tokens > at
        fork.close()
        assert c.status().state is SlotState.READY

        # the same 1,500 tokens and question from nothing (another profile: nothing resident or cached is reused)
        fresh = c.open_session(OpenSessionRequest())
        try:
            m2 = fresh.manifest(profile=fresh_profile())
            assert fresh.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m2)).reused_tokens == 0
            st = fresh.prefill_suffix(SuffixInput(tokens=body[: 1500 - prefix] + question, offset=prefix, manifest=m2))
            assert st.reused_tokens == 0 and st.resident_tokens == 1500 + len(question)
            assert _greedy(fresh) == answer
        finally:
            fresh.close()


def test_alternating_two_forks_never_prefills_what_they_share(daemon: DaemonProcess) -> None:
    """A 2,000-token session and a fork of it at 1,500 that went its own way for 400 tokens, taking turns four
    times each: every turn computes its own question and nothing else; the other's context comes back from the
    workspace cache at each switch."""
    with daemon.client(timeout_s=300.0) as c:
        sess, _, _, man = _session_of(c, 2000)
        fork = sess.fork(1500)
        own = sess.tokenize(BODY[::-1])[:400]  # the fork's own 400 tokens (the cache keeps 256 and more)
        assert fork.prefill_suffix(SuffixInput(tokens=own, offset=1500, manifest=man)).prefilled_tokens == 400
        restored = c.status().cache["restored_tokens"]
        before = _prefilled(c)
        asked = 0
        try:
            for i in range(4):
                for s in (sess, fork):
                    q = sess.tokenize(f"\nQuestion {i}: what does line {i + 1} say?")
                    at = s.explain_context().resident_tokens
                    st = s.prefill_suffix(SuffixInput(tokens=q, offset=at, manifest=man))
                    assert st.prefilled_tokens == len(q) and st.resident_tokens == at + len(q), st
                    asked += len(q)
            assert _prefilled(c) - before == asked
            assert c.status().cache["restored_tokens"] - restored >= 8 * 400  # each switch restored the other
        finally:
            fork.close()
            sess.close()
