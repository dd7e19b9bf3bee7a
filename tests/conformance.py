"""The conformance suite: one set of scenarios run against every implementation.

Each scenario drives a ``Service`` (MemoryService in process, the runtime client
talking to a real daemon process, a real backend) through the contract and
returns what it observed, so a test can also check that two implementations
observed the *same* thing. Assertions here hold for every implementation;
token counts are compared only against the implementation's own reports.

Every scenario uses a fresh ``profile`` in its manifest, so whatever an earlier
scenario left resident in a shared daemon cannot make it warm by accident.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from contract.errors import (
    ContextOverflow,
    InvalidArgument,
    ManifestMismatch,
    OffsetDrift,
    SessionClosed,
    SnapshotRejected,
)
from contract.manifest import ContextManifest
from contract.types import (
    ChatMessage,
    DecodeConfig,
    OpenSessionRequest,
    PrefixInput,
    StreamChunk,
    SuffixInput,
    ToolCall,
    ToolCallFunction,
)

SYSTEM = (
    "You are a careful coding assistant. The repository is a Python daemon that serves a model over "
    "ZeroMQ. Answer briefly and precisely; prefer small diffs; cite file names."
)
TURN_1 = "What does the slot service do?"
TURN_2 = "Summarise the test plan in one line."


@dataclass
class Target:
    name: str
    service: Any
    request: OpenSessionRequest
    #: whether ensure_prefix keeps the token LCP of an edited prefix (real backends)
    partial_reuse: bool = True


def manifest_for(sess: Any, profile: str, **overrides: str) -> ContextManifest:
    defaults = dict(getattr(sess, "manifest_defaults", {}) or {})
    return ContextManifest(**{**defaults, "profile": profile, **overrides})


def fresh_profile() -> str:
    return "conf-" + uuid.uuid4().hex[:12]


def greedy(sess: Any, n: int) -> tuple[str, StreamChunk]:
    parts: list[str] = []
    final: StreamChunk | None = None
    # the daemon's default (drafts on greedy passes): the same tape gives the same tokens (tests.engine_kit.greedy)
    for chunk in sess.decode(DecodeConfig(max_tokens=n, temperature=0.0)):
        if chunk.done:
            final = chunk
        else:
            parts.append(chunk.text)
    assert final is not None, "a decode stream must end with a done chunk"
    return "".join(parts), final


def scenario_warm_cold(t: Target) -> dict[str, Any]:
    sess = t.service.open_session(t.request)
    try:
        m = manifest_for(sess, fresh_profile())
        cold = sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
        assert cold.reused_tokens == 0
        assert cold.prefilled_tokens == cold.prefix_tokens > 0
        assert cold.resident_tokens == cold.prefix_tokens
        warm = sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
        assert warm.reused_tokens == warm.prefix_tokens == cold.prefix_tokens
        assert warm.prefilled_tokens == 0
        assert warm.stable_token_hash == cold.stable_token_hash
        assert warm.stable_byte_hash == cold.stable_byte_hash
        assert warm.manifest_digest == m.digest() == cold.manifest_digest
        return {"cold": cold.model_dump(exclude={"prefill_ms"}), "warm": warm.model_dump(exclude={"prefill_ms"})}
    finally:
        sess.close()


def scenario_manifest_change(t: Target) -> dict[str, Any]:
    sess = t.service.open_session(t.request)
    try:
        profile = fresh_profile()
        m = manifest_for(sess, profile)
        first = sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
        out: dict[str, Any] = {"first": first.prefix_tokens}
        # A manifest naming another model is refused outright, state untouched.
        with pytest.raises(ManifestMismatch):
            sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=manifest_for(sess, profile, model_digest="sha256:" + "1" * 64)))
        assert sess.explain_context().resident_tokens == first.resident_tokens
        flipped_bos = "add" if m.bos_policy != "add" else "none"
        for field in ("template_digest", "runtime_digest", "bos_policy"):
            value = flipped_bos if field == "bos_policy" else "sha256:" + uuid.uuid4().hex
            changed = manifest_for(sess, profile, **{field: value})
            st = sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=changed))
            assert st.reused_tokens == 0, field
            assert st.prefilled_tokens == st.prefix_tokens == first.prefix_tokens, field
            back = sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
            assert back.reused_tokens == 0, f"returning from {field} must be cold too"
            out[field] = st.reused_tokens
        # The stable byte hash is content, not identity: it never gates reuse.
        hashed = m.model_copy(update={"stable_byte_hash": "sha256:" + uuid.uuid4().hex})
        st = sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=hashed))
        assert st.reused_tokens == st.prefix_tokens
        # An edited stable tail: the common part is kept only by real backends.
        edited = sess.ensure_prefix(PrefixInput(text=SYSTEM[:-20] + "cite line numbers.", manifest=m))
        if t.partial_reuse:
            assert 0 < edited.reused_tokens < first.prefix_tokens
        else:
            assert edited.reused_tokens == 0
        assert edited.reused_tokens + edited.prefilled_tokens == edited.prefix_tokens
        out["edited"] = edited.model_dump(exclude={"prefill_ms"})
        return out
    finally:
        sess.close()


def scenario_suffix_and_decode(t: Target) -> dict[str, Any]:
    sess = t.service.open_session(t.request)
    try:
        m = manifest_for(sess, fresh_profile())
        pre = sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
        suf = sess.prefill_suffix(SuffixInput(text=TURN_1, manifest=m))
        assert suf.suffix_tokens > 0
        assert suf.prefix_tokens == pre.prefix_tokens
        assert suf.resident_tokens == pre.prefix_tokens + suf.suffix_tokens
        report = sess.explain_context()
        assert suf.available_tokens == report.num_ctx - suf.resident_tokens
        text, final = greedy(sess, 8)
        assert final.usage is not None
        assert final.finish_reason in ("length", "stop")
        n = final.usage.completion_tokens
        assert 0 < n <= 8
        if final.finish_reason == "length":
            assert n == 8
        assert final.usage.prompt_tokens == suf.resident_tokens
        after = sess.explain_context()
        assert after.resident_tokens == suf.resident_tokens + n, "decode appends what it generated"
        assert after.prefix_tokens == pre.prefix_tokens
        # A second suffix replaces the first: the stable prefix is untouched.
        suf2 = sess.prefill_suffix(SuffixInput(text=TURN_2, manifest=m))
        assert suf2.prefix_tokens == pre.prefix_tokens
        # A suffix under another identity is refused, and nothing changes.
        before = sess.explain_context()
        with pytest.raises(ManifestMismatch):
            sess.prefill_suffix(SuffixInput(text=TURN_2, manifest=manifest_for(sess, "other-profile")))
        assert sess.explain_context().resident_tokens == before.resident_tokens
        # Overflow is refused with numbers, never truncated.
        with pytest.raises(ContextOverflow) as exc:
            sess.prefill_suffix(SuffixInput(text="overflow " * (report.num_ctx + 10), manifest=m))
        assert exc.value.details.get("num_ctx") == report.num_ctx
        assert sess.explain_context().resident_tokens == before.resident_tokens
        return {
            "prefix": pre.model_dump(exclude={"prefill_ms"}),
            "suffix": suf.model_dump(exclude={"prefill_ms"}),
            "text": text,
            "completion_tokens": n,
        }
    finally:
        sess.close()


def scenario_cancel(t: Target) -> dict[str, Any]:
    sess = t.service.open_session(t.request)
    try:
        m = manifest_for(sess, fresh_profile())
        pre = sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
        suf = sess.prefill_suffix(SuffixInput(text=TURN_1, manifest=m))
        stream = sess.decode(DecodeConfig(max_tokens=200, temperature=0.0))
        taken = 0
        for chunk in stream:
            assert not chunk.done
            taken += 1
            if taken == 2:
                break
        stream.close()  # type: ignore[attr-defined]
        rep = sess.explain_context()
        assert rep.resident_tokens >= suf.resident_tokens + 1
        assert rep.resident_tokens < suf.resident_tokens + 200, "cancel must stop generation"
        # The session is usable and warm afterwards.
        again = sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
        assert again.reused_tokens == pre.prefix_tokens
        sess.prefill_suffix(SuffixInput(text=TURN_2, manifest=m))
        _, final = greedy(sess, 3)
        assert final.usage is not None and final.usage.completion_tokens > 0
        return {"taken": taken}
    finally:
        sess.close()


def scenario_snapshot_restore(t: Target) -> dict[str, Any]:
    sess = t.service.open_session(t.request)
    try:
        m = manifest_for(sess, fresh_profile())
        sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
        sess.prefill_suffix(SuffixInput(text=TURN_1, manifest=m))
        snap = sess.snapshot()
        assert snap.resident_tokens == len(snap.resident_token_ids)
        assert snap.state, "a snapshot carries state bytes (or a replay tape)"
        expected, _ = greedy(sess, 8)
        # Unrelated turns move the resident state somewhere else entirely.
        other = manifest_for(sess, fresh_profile())
        sess.ensure_prefix(PrefixInput(text="An unrelated system prompt about cooking.", manifest=other))
        sess.prefill_suffix(SuffixInput(text="How long do I boil an egg?", manifest=other))
        greedy(sess, 4)
        sess.restore(snap)
        rep = sess.explain_context()
        assert rep.resident_tokens == snap.resident_tokens
        assert rep.prefix_tokens == snap.prefix_tokens
        restored, _ = greedy(sess, 8)
        assert restored == expected, "decode after restore must equal decode right after the snapshot"
        # Refusals: tampered bytes, wrong window, inconsistent counts; state untouched.
        before = sess.explain_context()
        flipped = bytes([snap.state[0] ^ 0xFF]) + snap.state[1:]
        for bad in (
            snap.model_copy(update={"state": flipped}),
            snap.model_copy(update={"num_ctx": snap.num_ctx + 1}),
            snap.model_copy(update={"resident_tokens": snap.resident_tokens + 1}),
            snap.model_copy(update={"manifest": snap.manifest.model_copy(update={"model_digest": "sha256:" + "0" * 64})}),
        ):
            with pytest.raises(SnapshotRejected):
                sess.restore(bad)
            assert sess.explain_context().resident_tokens == before.resident_tokens
        return {"expected": expected, "snapshot_tokens": snap.resident_tokens}
    finally:
        sess.close()


def scenario_close(t: Target) -> dict[str, Any]:
    sess = t.service.open_session(t.request)
    m = manifest_for(sess, fresh_profile())
    first = sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
    sess.close()
    sess.close()  # idempotent
    with pytest.raises(SessionClosed):
        sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
    # The KV stays resident: the next session on the same model starts warm.
    nxt = t.service.open_session(t.request)
    try:
        again = nxt.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
        assert again.reused_tokens == first.prefix_tokens
        return {"reused": again.reused_tokens}
    finally:
        nxt.close()


def _conversation(reply: str) -> list[ChatMessage]:
    """A tool loop after the system prompt: question, a tool call, its result, the answer, a follow-up."""
    call = ToolCall(id="call_1", function=ToolCallFunction(name="read_file", arguments='{"path": "modeld/slot.py"}'))
    return [
        ChatMessage(role="user", content=TURN_1),
        ChatMessage(role="assistant", content=None, tool_calls=[call]),
        ChatMessage(role="tool", content="class SlotService: one model slot, one holder.", tool_call_id="call_1", name="read_file"),
        ChatMessage(role="assistant", content=reply),
        ChatMessage(role="user", content=TURN_2),
    ]


def _chat_turn(sess: Any, m: ContextManifest, messages: list[ChatMessage], n: int = 6) -> tuple[Any, str]:
    sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
    st = sess.prefill_suffix(SuffixInput(messages=messages, manifest=m))
    text, _ = greedy(sess, n)
    return st, text


def scenario_conversation_append(t: Target) -> dict[str, Any]:
    """A request that resends the history plus one message prefills only what is new."""
    sess = t.service.open_session(t.request)
    try:
        m = manifest_for(sess, fresh_profile())
        history = _conversation("It serves one model to one holder.")
        first, reply = _chat_turn(sess, m, history)
        assert first.reused_tokens == 0 and first.prefilled_tokens == first.suffix_tokens > 0
        resident = sess.explain_context().resident_tokens
        history += [ChatMessage(role="assistant", content=reply), ChatMessage(role="user", content="And the tests?")]
        second, _ = _chat_turn(sess, m, history)
        # everything resident before — the model's own reply included — is reused
        assert second.reused_tokens >= resident - second.prefix_tokens - 1
        assert second.reused_tokens + second.prefilled_tokens == second.suffix_tokens
        assert second.prefilled_tokens < first.suffix_tokens
        return {"first": first.model_dump(exclude={"prefill_ms"}), "second": second.model_dump(exclude={"prefill_ms"})}
    finally:
        sess.close()


def scenario_conversation_edit(t: Target) -> dict[str, Any]:
    """Editing an earlier message drops reuse to the edit point; new tools change the prefix; bad messages are refused."""
    sess = t.service.open_session(t.request)
    try:
        m = manifest_for(sess, fresh_profile())
        history = _conversation("It serves one model to one holder.")
        first, _ = _chat_turn(sess, m, history)
        edited = [history[0].model_copy(update={"content": TURN_1 + " Be brief."}), *history[1:]]
        st, _ = _chat_turn(sess, m, edited)
        assert 0 < st.reused_tokens < first.suffix_tokens  # up to the edit, not past it
        assert st.reused_tokens + st.prefilled_tokens == st.suffix_tokens
        # bad conversations are refused before anything runs; the session keeps serving
        before = sess.explain_context()
        for bad in (
            [ChatMessage(role="assistant", content=None)],
            [ChatMessage(role="user", content="q"), ChatMessage(role="tool", content="r", tool_call_id="nobody")],
        ):
            with pytest.raises(InvalidArgument):
                sess.prefill_suffix(SuffixInput.model_construct(messages=bad, manifest=m, text="", render=True))
            assert sess.explain_context().resident_tokens == before.resident_tokens
        again, _ = _chat_turn(sess, m, edited)
        assert again.reused_tokens > 0
        # new tools change the prefix: nothing computed after the old one is reused
        tools = '[{"type": "function", "function": {"name": "grep", "parameters": {}}}]'
        sess.ensure_prefix(PrefixInput(text=SYSTEM, tools=tools, manifest=m))
        changed = sess.prefill_suffix(SuffixInput(messages=edited, manifest=m))
        assert changed.reused_tokens == 0 and changed.prefilled_tokens == changed.suffix_tokens
        return {"edited": st.model_dump(exclude={"prefill_ms"})}
    finally:
        sess.close()


def scenario_count_tokens(t: Target) -> dict[str, Any]:
    """count_tokens says what a prompt comes to without touching the KV, and what of it is resident."""
    sess = t.service.open_session(t.request)
    try:
        m = manifest_for(sess, fresh_profile())
        history = _conversation("It serves one model to one holder.")
        prefix, suffix = PrefixInput(text=SYSTEM, manifest=m), SuffixInput(messages=history, manifest=m)
        before = sess.explain_context()
        cold = sess.count_tokens(prefix, suffix)
        assert sess.explain_context() == before  # nothing prefilled, nothing dropped
        assert cold.prefix_tokens > 0 and cold.prompt_tokens > cold.prefix_tokens and cold.num_ctx == before.num_ctx
        sess.ensure_prefix(prefix)
        st = sess.prefill_suffix(suffix)
        assert cold.prompt_tokens == st.prefix_tokens + st.suffix_tokens == sess.explain_context().resident_tokens
        warm = sess.count_tokens(prefix, suffix)
        assert warm.prompt_tokens == cold.prompt_tokens and warm.resident_tokens == warm.prompt_tokens
        return {"cold": cold.model_dump(), "warm": warm.model_dump()}
    finally:
        sess.close()


def scenario_offsets(t: Target) -> dict[str, Any]:
    """Appends at the resident length a client was told: token ids after a decode, a drifted view refused with both
    lengths (nothing changes, and the right offset then succeeds), a bad id refused, truncating back."""
    sess = t.service.open_session(t.request)
    try:
        m = manifest_for(sess, fresh_profile())
        sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
        asked = sess.prefill_suffix(SuffixInput(text=TURN_1, manifest=m))
        _, final = greedy(sess, 6)
        assert final.usage is not None
        told = final.usage.resident_tokens
        assert told == asked.resident_tokens + final.usage.completion_tokens == sess.explain_context().resident_tokens
        more = sess.tokenize(" Then?")
        with pytest.raises(OffsetDrift) as drift:  # the view from before the decode
            sess.prefill_suffix(SuffixInput(tokens=more, offset=asked.resident_tokens, manifest=m))
        assert drift.value.details == {"offset": asked.resident_tokens, "resident_tokens": told}
        assert sess.explain_context().resident_tokens == told
        with pytest.raises(InvalidArgument):
            sess.prefill_suffix(SuffixInput(tokens=[*more, 10**9], offset=told, manifest=m))
        st = sess.prefill_suffix(SuffixInput(tokens=more, offset=told, manifest=m))
        assert st.resident_tokens == told + len(more) and st.prefilled_tokens == len(more)
        back = sess.prefill_suffix(SuffixInput(tokens=more, offset=asked.resident_tokens, truncating=True, manifest=m))
        assert back.resident_tokens == asked.resident_tokens + len(more) == sess.explain_context().resident_tokens
        return {"drift": drift.value.details, "appended": len(more)}
    finally:
        sess.close()


def scenario_fork(t: Target) -> dict[str, Any]:
    """A fork at a position inside the conversation: its context is the source's head, its first append computes
    only the new tokens, the source goes on from where it was without computing the shared head again, the fork
    answers as a session given the same tokens from nothing does, and a fork inside the stable prefix or past the
    context is refused."""
    sess = t.service.open_session(t.request)
    forks: list[Any] = []
    try:
        m = manifest_for(sess, fresh_profile())
        sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m))
        head = sess.prefill_suffix(SuffixInput(text=TURN_1, manifest=m)).resident_tokens
        tail = sess.tokenize(" And the workspace cache, what does it keep?")
        whole = sess.prefill_suffix(SuffixInput(tokens=tail, offset=head, manifest=m)).resident_tokens
        prefix_len = sess.explain_context().prefix_tokens
        with pytest.raises(InvalidArgument) as inside:
            sess.fork(prefix_len - 1)
        assert inside.value.details["prefix_tokens"] == prefix_len
        with pytest.raises(InvalidArgument):
            sess.fork(whole + 1)
        fork = sess.fork(head)
        forks.append(fork)
        assert fork.explain_context().resident_tokens == head
        assert sess.explain_context().resident_tokens == whole  # the source is untouched
        more = sess.tokenize(" Which file?")
        st = fork.prefill_suffix(SuffixInput(tokens=more, offset=head, manifest=m))
        assert st.resident_tokens == head + len(more) and st.prefilled_tokens == len(more)
        forked, _ = greedy(fork, 6)
        st = sess.prefill_suffix(SuffixInput(tokens=more, offset=whole, manifest=m))
        # back to the source: what the two share is never computed again (a tail this short is not worth a cache
        # entry, so an engine computes it again; a long one is restored: tests/test_fork.py)
        assert st.resident_tokens == whole + len(more)
        assert len(more) <= st.prefilled_tokens <= whole - head + len(more)
        source, _ = greedy(sess, 6)
        # the fork again, where it was (its reply included), and a drifted view of it refused
        at = fork.explain_context().resident_tokens
        with pytest.raises(OffsetDrift):
            fork.prefill_suffix(SuffixInput(tokens=more, offset=head, manifest=m))
        # (its own short tail, past the head, may be computed again as the source's was)
        assert len(more) <= fork.prefill_suffix(SuffixInput(tokens=more, offset=at, manifest=m)).prefilled_tokens \
            <= at - head + len(more)
        for f in forks:
            f.close()
        forks.clear()
        # a session given the fork's tokens from nothing answers as the fork did
        m2 = manifest_for(sess, fresh_profile())
        sess.ensure_prefix(PrefixInput(text=SYSTEM, manifest=m2))
        fresh = sess.prefill_suffix(SuffixInput(text=TURN_1, manifest=m2))
        assert fresh.resident_tokens == head
        sess.prefill_suffix(SuffixInput(tokens=more, offset=head, manifest=m2))
        again, _ = greedy(sess, 6)
        assert again == forked
        return {"head": head, "whole": whole, "fork": forked, "source": source}
    finally:
        for f in forks:
            f.close()
        sess.close()


SCENARIOS: dict[str, Callable[[Target], dict[str, Any]]] = {
    "fork": scenario_fork,
    "offsets": scenario_offsets,
    "count_tokens": scenario_count_tokens,
    "conversation_append": scenario_conversation_append,
    "conversation_edit": scenario_conversation_edit,
    "warm_cold": scenario_warm_cold,
    "manifest_change": scenario_manifest_change,
    "suffix_and_decode": scenario_suffix_and_decode,
    "cancel": scenario_cancel,
    "snapshot_restore": scenario_snapshot_restore,
    "close": scenario_close,
}
