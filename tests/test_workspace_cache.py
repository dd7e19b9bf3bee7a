"""The workspace cache on the real engines (llama.cpp and OpenVINO) and through a real daemon process.

In process, on both engines: a session that switches to another workspace and
back restores the first one's tape from the cache and decodes exactly what the
uninterrupted session decodes; another conversation under the same system
prompt comes back the same way; a different runtime config or template digest
never hits; a state the engine refuses is dropped and the turn is served by
prefill. Through a llama daemon: a restart resumes warm from the disk tier, a
tampered entry is refused while the daemon keeps serving, ``modeld cache
ls|clear`` and ``modeld status`` show it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.bundled import bundled_gguf_path
from backends.tape.cache import SWITCHING_TURNS, cache_key
from contract.interfaces import LoadedModel
from contract.manifest import ContextManifest
from contract.types import ChatMessage, Config, OpenSessionRequest, PrefixInput, SuffixInput
from harness.daemon import ROOT, DaemonProcess
from modeld.state_cache import StateCacheStore
from tests.engine_kit import PARAGRAPH, greedy

A = "You are agent A, the main coder of this repository.\n" + PARAGRAPH * 6
B = "You are agent B, a careful reviewer of diffs.\n" + PARAGRAPH.replace("daemon", "server") * 6
Q1 = "Which component keeps the model resident?"
Q2 = "Review this: the server keeps one model."
Q3 = "And what does the suffix hold?"
LONG_1 = "Here is the failing test output:\n" + "FAILED tests/test_slot.py::test_switch - AssertionError\n" * 24
LONG_2 = "Here is the diff to review:\n" + "+    self.cache.release_ram()  # hand RAM back\n" * 24


def _load(engine: str, cache: StateCacheStore | None, **config: Any) -> LoadedModel:
    from backends.bundled import bundled_gguf_path

    if engine == "llama":
        from backends.llama import LlamaBackend

        backend: Any = LlamaBackend(cache=cache)
    else:
        from backends.openvino import OpenVINOBackend

        backend = OpenVINOBackend(cache=cache)
    req = OpenSessionRequest(path=str(bundled_gguf_path()), config=Config(num_ctx=2048, **config))
    return backend.load(req, lambda _f: None)  # type: ignore[no-any-return]


def ram_cache() -> StateCacheStore:
    return StateCacheStore(None, ram_budget=2**30, disk_budget=0)


def _turn(s: Any, man: ContextManifest, prefix: str, question: str, n: int = 12) -> tuple[Any, Any, list[int]]:
    pre = s.ensure_prefix(PrefixInput(text=prefix, manifest=man))
    suf = s.prefill_suffix(SuffixInput(text=question, role="user", render=True, manifest=man))
    return pre, suf, greedy(s, n)


@pytest.fixture(
    scope="module",
    params=[pytest.param("llama", marks=pytest.mark.llama), pytest.param("openvino", marks=pytest.mark.openvino)],
)
def loaded(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    """One model per engine for the module; each test gives it a fresh cache and an empty KV."""
    pytest.importorskip("llama_cpp" if request.param == "llama" else "openvino_genai")
    m = _load(str(request.param), None)
    yield str(request.param), m
    m.cache = None
    m.close()


@pytest.fixture
def model(loaded: tuple[str, Any]) -> Iterator[Any]:
    m = loaded[1]
    m.clear_kv()
    m.cache = ram_cache()
    m.turns_since_switch = SWITCHING_TURNS + 1  # no switch seen (an earlier test's are another cache's)
    yield m
    m.cache = None


def test_switching_back_restores_and_decodes_as_the_uninterrupted_session(model: Any) -> None:
    m, cache = model, model.cache
    man = m.manifest_defaults()
    s = m.open_session()
    first, _, _ = _turn(s, man, A, Q1)
    assert first.cached_tokens == 0 and first.prefilled_tokens == first.prefix_tokens
    pre_b, _, _ = _turn(s, man, B, Q2)
    assert pre_b.cached_tokens == 0  # B was never seen
    back, suf, got = _turn(s, man, A, Q3, 16)
    # A's whole tape (prefix, question, reply) came back; only the new question is prefilled
    assert back.cached_tokens == back.prefix_tokens == first.prefix_tokens
    assert back.prefilled_tokens == 0 and suf.reused_tokens > 0
    st = cache.status()
    # restored_tokens counts what the resident tape (B's) did not already give: all but the shared opener
    assert st["hits"] == 1 and st["misses"] == 2 and back.prefix_tokens - 16 < st["restored_tokens"] < back.prefix_tokens

    m.cache = None  # the uninterrupted session: A's turns only, from an empty KV, no cache
    m.clear_kv()
    s2 = m.open_session()
    _turn(s2, man, A, Q1)
    _, _, want = _turn(s2, man, A, Q3, 16)
    assert got == want


def test_while_switching_a_finished_turns_tape_is_saved_when_idle_not_on_the_next_switch(model: Any) -> None:
    """After a switch, each finished turn's tape is saved in the slot's idle moment (an agent runs its tools between
    turns), so the next switch only restores; one conversation alone never asks for it, and an operation on the
    session in between takes the idle save back (the tape is no longer the finished turn's)."""
    m, cache = model, model.cache
    man = m.manifest_defaults()
    s = m.open_session()
    _turn(s, man, A, Q1)
    assert not m.idle_pending()  # one conversation, no switch yet: nothing to save while idle
    _turn(s, man, B, Q2)  # A's tape saved before it is dropped: a switch
    assert m.idle_pending()
    saves = cache.status()["saves"]
    m.idle_work()  # B's finished tape (prefix, question, reply)
    assert cache.status()["saves"] == saves + 1 and not m.idle_pending()
    assert cache.covers(cache_key(m, man), m.res.tokens)

    back, _, _ = _turn(s, man, A, Q3)  # back to A: restored; B's tape is in the cache already
    assert back.cached_tokens == back.prefix_tokens
    assert cache.status()["saves"] == saves + 1  # the switch saved nothing
    assert m.idle_pending()
    s.ensure_prefix(PrefixInput(text=A, manifest=man))  # an operation before the idle moment
    assert not m.idle_pending()


def test_another_conversation_under_the_same_prompt_comes_back(model: Any) -> None:
    m = model
    man = m.manifest_defaults()
    s = m.open_session()

    def ask(history: list[ChatMessage]) -> tuple[Any, list[int]]:
        s.ensure_prefix(PrefixInput(text=A, manifest=man))
        suf = s.prefill_suffix(SuffixInput(messages=history, manifest=man))
        return suf, greedy(s, 8)

    one = [ChatMessage(role="user", content=LONG_1)]
    first, reply = ask(one)
    assert first.cached_tokens == 0
    other, _ = ask([ChatMessage(role="user", content=LONG_2)])  # drops conversation one: it is saved first
    assert other.cached_tokens == 0
    text = m.prompt_text(reply)  # type: ignore[attr-defined]
    again, _ = ask([*one, ChatMessage(role="assistant", content=text), ChatMessage(role="user", content=Q3)])
    assert again.cached_tokens > first.suffix_tokens // 2
    assert again.prefilled_tokens < again.suffix_tokens - first.suffix_tokens + 8


def test_a_different_runtime_config_or_template_digest_never_hits(loaded: tuple[str, Any], model: Any) -> None:
    m, cache = model, model.cache
    man = m.manifest_defaults()
    s = m.open_session()
    _turn(s, man, A, Q1)
    assert cache.status()["saves"] >= 1  # A's freshly prefilled prefix

    foreign = man.model_copy(update={"template_digest": "sha256:" + "0" * 64})
    _turn(s, foreign, B, Q2)
    pre = s.ensure_prefix(PrefixInput(text=A, manifest=foreign))
    assert pre.cached_tokens == 0 and pre.prefilled_tokens > pre.prefix_tokens - 16  # B's opener is shared
    pre = s.ensure_prefix(PrefixInput(text=A, manifest=man))  # the entry was there all along
    assert pre.cached_tokens == pre.prefix_tokens

    exact = _load(loaded[0], cache, exact_reuse=True)  # another runtime identity, the same cache
    try:
        pre = exact.open_session().ensure_prefix(PrefixInput(text=A, manifest=exact.manifest_defaults()))
        assert pre.cached_tokens == 0 and pre.prefilled_tokens == pre.prefix_tokens
    finally:
        exact.cache = None
        exact.close()


def test_a_state_the_engine_refuses_is_dropped_and_the_turn_is_prefilled(model: Any) -> None:
    from backends.tape.cache import cache_key

    m, cache = model, model.cache
    man = m.manifest_defaults()
    s = m.open_session()
    tokens = m.tokenize(m.template.render([{"role": "system", "content": A}], None, generation=False),  # type: ignore[attr-defined]
                        bos_policy="")
    garbage = b"not a state of this engine" * 100
    good = s.snapshot()  # bookkeeping of an empty tape, re-dressed as a cache entry for A's tokens
    entry = good.model_copy(update={
        "state": garbage, "state_digest": "sha256:" + hashlib.sha256(garbage).hexdigest(),
        "resident_tokens": len(tokens), "resident_token_ids": tokens, "prefix_tokens": len(tokens), "manifest": man,
    })
    cache.put(cache_key(m, man), entry)  # type: ignore[arg-type]
    pre, _, out = _turn(s, man, A, Q1)
    assert pre.cached_tokens == 0 and pre.prefilled_tokens == pre.prefix_tokens and out
    st = cache.status()
    assert st["rejected"] == 1 and st["last_rejection"]


# --- through a daemon process --------------------------------------------------------------------------
def _cli(d: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "modeld", *args, "--endpoint", d.endpoint],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


@pytest.fixture
def daemon_dir(tmp_path: Path) -> Iterator[Path]:
    pytest.importorskip("llama_cpp")
    yield tmp_path


def _chat(d: DaemonProcess) -> Any:
    with d.client(timeout_s=120.0) as c:
        return c.chat([{"role": "system", "content": A}, {"role": "user", "content": Q1}], max_tokens=8, temperature=0.0)


@pytest.mark.llama
def test_a_restarted_daemon_resumes_warm_and_refuses_a_tampered_entry(daemon_dir: Path) -> None:
    # the bundled model as shipped: the context-extended copy serve loads by default meets a near-tie
    # within these 8 tokens between the cold prefill's batch and the restored tape's one-token step
    flags = ("--model", str(bundled_gguf_path()), "--cache-ram", "256MiB", "--cache-disk", "1GiB")
    with DaemonProcess(daemon_dir, "llama", None, *flags) as d:
        cold = _chat(d)
        assert cold.usage.cached_tokens == 0
    files = list((daemon_dir / "data" / "cache").glob("*.kv"))
    assert len(files) == 1  # the stop saved the resident tape to disk

    with DaemonProcess(daemon_dir, "llama", None, *flags) as d:
        listing = json.loads(_cli(d, "cache", "ls", "--json").stdout)
        assert [e["where"] for e in listing["entries"]] == ["disk"]
        warm = _chat(d)
        assert warm.usage.cached_tokens >= warm.usage.prompt_tokens - 16
        assert warm.usage.prefilled_tokens < 16
        assert warm.message.content == cold.message.content  # greedy, from the restored KV
        status = _cli(d, "status")
        assert "cache hits" in status.stdout and "1 of 1 switches" in status.stdout, status.stdout
        with d.client() as c:
            info = c.describe(OpenSessionRequest())
        assert info.cache_ram_budget_bytes == 256 * 2**20 and 0 < info.cache_ram_bytes <= info.cache_ram_budget_bytes

    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit inside the saved KV
    files[0].write_bytes(bytes(data))
    with DaemonProcess(daemon_dir, "llama", None, *flags) as d:
        again = _chat(d)  # refused, prefilled, served
        assert again.usage.cached_tokens == 0 and again.message.content == cold.message.content
        with d.client() as c:
            cache = c.status().cache
        assert cache is not None and cache["rejected"] == 1 and "digest" in cache["last_rejection"]
        cleared = _cli(d, "cache", "clear")
        assert cleared.returncode == 0 and "cleared" in cleared.stdout
        assert json.loads(_cli(d, "cache", "ls", "--json").stdout)["entries"] == []


def test_cache_ls_says_when_the_cache_is_off(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path, "memory") as d:
        out = _cli(d, "cache", "ls")
        assert out.returncode == 0 and "off" in out.stdout
        assert json.loads(_cli(d, "cache", "clear", "--json").stdout) == {"cleared": 0}
