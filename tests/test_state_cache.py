"""The workspace cache store (``modeld.state_cache``): lookup, budgets, LRU, the disk tier and its verification.

Entries here are synthetic snapshots (no engine): what the store does with
them does not depend on what the state bytes mean. The engines' side (restore
then decode equals the uninterrupted session) is in ``test_workspace_cache.py``.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from pathlib import Path

import pytest

from contract.manifest import ContextManifest
from contract.types import SessionSnapshot
from modeld.state_cache import StateCacheStore, entry_id

KEY_A = "sha256:" + "a" * 64
KEY_B = "sha256:" + "b" * 64
MAN = ContextManifest(backend="llama", model_digest="sha256:" + "d" * 64)


def snap(tokens: list[int], state_size: int = 1000, fill: int = 7) -> SessionSnapshot:
    state = bytes([fill % 256]) * state_size
    return SessionSnapshot(
        state=state,
        state_kind="kv",
        state_digest="sha256:" + hashlib.sha256(state).hexdigest(),
        backend="llama",
        resident_tokens=len(tokens),
        prefix_tokens=min(3, len(tokens)),
        num_ctx=4096,
        resident_token_ids=tokens,
        stable_text="system",
        manifest=MAN,
    )


def wait_written(cache: StateCacheStore, n: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while cache.status()["disk_entries"] < n:
        assert time.monotonic() < deadline, cache.status()
        time.sleep(0.01)


def ram_only(budget: int) -> StateCacheStore:
    return StateCacheStore(None, ram_budget=budget, disk_budget=0)


# --- lookup ----------------------------------------------------------------------------------------------
def test_lookup_picks_the_longest_common_prefix_under_the_key() -> None:
    c = ram_only(10**6)
    c.put(KEY_A, snap([1, 2, 3, 4, 5, 6]))
    c.put(KEY_A, snap([1, 2, 9, 9]))
    c.put(KEY_B, snap([1, 2, 3, 4, 5, 6, 7, 8]))  # longer, but under another key
    found = c.lookup(KEY_A, [1, 2, 3, 4, 5, 99], min_len=0, max_tokens=100)
    assert found is not None
    got, covered = found
    assert covered == 5 and got.resident_token_ids == [1, 2, 3, 4, 5, 6]


def test_lookup_needs_more_than_min_len_and_skips_entries_longer_than_the_context() -> None:
    c = ram_only(10**6)
    c.put(KEY_A, snap([1, 2, 3, 4, 5, 6]))
    assert c.lookup(KEY_A, [1, 2, 3, 4], min_len=4, max_tokens=100) is None
    assert c.lookup(KEY_A, [1, 2, 3, 4], min_len=3, max_tokens=100) is not None
    assert c.lookup(KEY_A, [1, 2, 3, 4], min_len=0, max_tokens=5) is None
    st = c.status()
    assert (st["hits"], st["misses"], st["hit_rate"]) == (1, 2, pytest.approx(1 / 3))


def test_a_lookup_that_does_not_count_misses_leaves_the_rate_alone() -> None:
    c = ram_only(10**6)
    assert c.lookup(KEY_A, [1, 2], min_len=0, max_tokens=100, count_miss=False) is None
    assert c.status()["misses"] == 0 and c.status()["hit_rate"] is None


def test_an_entry_that_extends_another_replaces_it_and_a_covered_put_adds_nothing() -> None:
    c = ram_only(10**6)
    c.put(KEY_A, snap([1, 2, 3]))
    c.put(KEY_A, snap([1, 2, 3, 4, 5]))
    assert [e.tokens for e in c.entries()] == [5]
    c.put(KEY_A, snap([1, 2, 3, 4]))  # covered by the longer entry
    assert [e.tokens for e in c.entries()] == [5]
    assert c.covers(KEY_A, [1, 2, 3, 4]) and not c.covers(KEY_A, [1, 2, 4]) and not c.covers(KEY_B, [1, 2])
    c.put(KEY_B, snap([1, 2, 3]))  # another key is another entry
    assert sorted(e.tokens for e in c.entries()) == [3, 5]


# --- the RAM budget ----------------------------------------------------------------------------------------
def test_the_ram_budget_holds_and_evicts_least_recently_used_first() -> None:
    one = snap([1]).state.__len__() + 8 + len("system")  # what one entry of 1 token holds
    c = ram_only(2 * one + 10)
    c.put(KEY_A, snap([1]))
    c.put(KEY_A, snap([2]))
    assert c.lookup(KEY_A, [1], min_len=0, max_tokens=10) is not None  # [1] is now the most recent
    c.put(KEY_A, snap([3]))
    st = c.status()
    assert st["ram_bytes"] <= st["ram_budget_bytes"] and st["ram_entries"] == 2
    assert c.lookup(KEY_A, [2], min_len=0, max_tokens=10) is None  # the least recently used went
    assert c.lookup(KEY_A, [1], min_len=0, max_tokens=10) is not None
    assert st["evictions"] == 1


def test_ram_gives_up_a_conversations_older_state_before_another_conversations_newest() -> None:
    """A parent and two sub-agents, each its newest state; the parent's history rewritten (a compaction) left an
    older state of it, used more recently than the searcher's. Over budget, the parent's older state goes, not the
    searcher's only one; without names the least recently used goes."""
    one = snap([1]).state.__len__() + 8 + len("system")
    for named in (True, False):
        c = ram_only(4 * one + 10)

        def put(tokens: list[int], who: str) -> None:
            c.put(KEY_A, snap(tokens), conversation=who if named else "")  # noqa: B023 (used at once)

        put([5], "searcher")
        put([1], "parent")  # the parent's state before its history was rewritten
        put([7], "reviewer")
        put([2], "parent")  # the parent's history after: it does not extend [1]
        put([8], "newcomer")  # one over the budget
        left = {t for t in (1, 2, 5, 7, 8) if c.covers(KEY_A, [t])}
        st = c.status()
        assert st["ram_entries"] == 4 and st["evictions"] == 1
        if named:
            assert left == {2, 5, 7, 8}, left  # the parent's older state went
            assert {e.conversation for e in c.entries()} == {"searcher", "reviewer", "parent", "newcomer"}
        else:
            assert left == {1, 2, 7, 8}, left  # least recently used: the searcher's only state


def test_an_entry_larger_than_the_budget_is_not_kept() -> None:
    c = ram_only(500)
    c.put(KEY_A, snap([1, 2], state_size=1000))
    assert c.entries() == [] and c.status()["ram_bytes"] == 0 and c.status()["saves"] == 0


def test_fit_ram_shrinks_an_automatic_budget_only() -> None:
    auto = StateCacheStore(None, ram_budget=None, disk_budget=0)
    auto.put(KEY_A, snap([1, 2]))
    auto.fit_ram(600)  # half of the spare memory: below one entry
    assert auto.status()["ram_budget_bytes"] == 300 and auto.entries() == []
    fixed = ram_only(10**6)
    fixed.fit_ram(600)
    assert fixed.status()["ram_budget_bytes"] == 10**6


# --- the disk tier -----------------------------------------------------------------------------------------
def test_entries_are_written_back_to_private_files_and_survive_a_restart(tmp_path: Path) -> None:
    d = tmp_path / "cache"
    c = StateCacheStore(d, ram_budget=10**6, disk_budget=10**6)
    original = snap([5, 6, 7, 8], fill=3)
    c.put(KEY_A, original, conversation="agent-7")
    c.drain()
    # write-back: RAM holds it, nothing is written while it stays there
    assert c.status()["disk_written_bytes"] == 0 and list(d.iterdir()) == []
    c.close()  # a stop writes what only RAM holds
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    files = list(d.iterdir())
    assert [f.name for f in files] == [entry_id(KEY_A, [5, 6, 7, 8]) + ".kv"]
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert c.status()["disk_written_bytes"] == files[0].stat().st_size

    again = StateCacheStore(d, ram_budget=10**6, disk_budget=10**6)
    assert [(e.tokens, e.where, e.conversation) for e in again.entries()] == [(4, "disk", "agent-7")]
    found = again.lookup(KEY_A, [5, 6, 7, 8, 9], min_len=0, max_tokens=100)
    assert found is not None and found[1] == 4
    assert found[0] == original  # the same bytes and bookkeeping
    assert again.entries()[0].where == "ram+disk"  # promoted on use
    again.close()


def test_ram_eviction_writes_the_entry_to_disk(tmp_path: Path) -> None:
    c = StateCacheStore(tmp_path / "c", ram_budget=1100, disk_budget=10**6)
    c.put(KEY_A, snap([1, 2]))
    c.put(KEY_A, snap([3, 4]))  # evicts [1, 2] from RAM: only then is it written
    wait_written(c, 1)
    st = c.status()
    assert st["ram_entries"] == 1 and st["disk_entries"] == 1 and st["evictions"] == 0
    assert st["disk_written_bytes"] == st["disk_bytes"] > 0
    found = c.lookup(KEY_A, [1, 2], min_len=0, max_tokens=10)
    assert found is not None and found[0].resident_token_ids == [1, 2]
    c.close()


def test_a_conversation_extending_one_tape_writes_nothing_until_it_leaves_ram(tmp_path: Path) -> None:
    c = StateCacheStore(tmp_path / "c", ram_budget=10**6, disk_budget=10**6)
    tape = list(range(1, 9))
    for turn in range(5):
        tape += [100 + turn] * 3
        c.put(KEY_A, snap(list(tape)))  # each turn's save replaces the one before (it extends it)
    c.drain()
    st = c.status()
    assert st["ram_entries"] == 1 and st["disk_written_bytes"] == 0
    c.close()
    assert c.status()["disk_entries"] == 1  # the last state only


def test_a_state_a_few_tokens_past_a_file_is_not_written(tmp_path: Path) -> None:
    c = StateCacheStore(tmp_path / "c", ram_budget=10**6, disk_budget=10**6)
    c.put(KEY_A, snap(list(range(1, 301))))
    c.release_ram()  # written: 300 tokens on disk
    wait_written(c, 1)
    written = c.status()["disk_written_bytes"]
    c.put(KEY_A, snap(list(range(1, 311))))  # 10 tokens more: RAM holds it, the file stays
    c.release_ram()
    c.drain()
    st = c.status()
    assert st["disk_written_bytes"] == written and st["disk_entries"] == 1
    found = c.lookup(KEY_A, list(range(1, 320)), min_len=0, max_tokens=1000)
    assert found is not None and found[1] == 300  # the file restores all but the last few
    c.put(KEY_A, snap(list(range(1, 601))))  # 300 more: worth its own file
    c.close()
    assert c.status()["disk_written_bytes"] > written and c.status()["disk_entries"] == 1



def test_the_disk_budget_prunes_least_recently_used_files(tmp_path: Path) -> None:
    d = tmp_path / "c"
    c = StateCacheStore(d, ram_budget=0, disk_budget=3600)  # room for two ~1.7 kB files
    for i in range(3):
        c.put(KEY_A, snap([10 + i]))
        # every write done before the next put (the third's is what prunes: waiting for two files on disk returned
        # before it, on a loaded machine, where the writer runs niced)
        c.drain()
        time.sleep(0.02)  # (the next entry used later than this one, on any clock)
    st = c.status()
    assert st["disk_bytes"] <= 3600 and st["disk_entries"] == 2
    assert sum(f.stat().st_size for f in d.iterdir()) == st["disk_bytes"]
    assert c.lookup(KEY_A, [10], min_len=0, max_tokens=10) is None  # the oldest went
    assert c.lookup(KEY_A, [12], min_len=0, max_tokens=10) is not None
    c.close()


def test_the_disk_tier_stays_within_its_budget_while_a_file_is_written(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Room is made before a file is written: the directory (the file being written included) never holds more
    than the budget."""
    d = tmp_path / "c"
    seen: list[int] = []
    replace = os.replace

    def measured(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        seen.append(sum(f.stat().st_size for f in d.iterdir()))  # the finished temporary file and the others
        replace(src, dst)

    monkeypatch.setattr(os, "replace", measured)
    c = StateCacheStore(d, ram_budget=0, disk_budget=3600)  # room for two ~1.7 kB files
    for i in range(5):
        c.put(KEY_A, snap([20 + i]))
        wait_written(c, min(i + 1, 2))
        deadline = time.monotonic() + 5
        while len(seen) < i + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    c.close()
    assert len(seen) == 5 and max(seen) <= 3600, seen


def test_files_that_are_not_cache_entries_are_reported_and_left_alone(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    d, f = _one_file(tmp_path)
    (d / "notes.txt").write_text("mine")
    (d / "sub").mkdir()
    with caplog.at_level("WARNING", logger="modeld.cache"):
        c = StateCacheStore(d, ram_budget=0, disk_budget=10**6)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "2 entries that are not cache files" in said and "notes.txt" in said and "sub" in said, said
    st = c.status()
    assert st["disk_entries"] == 1 and st["disk_bytes"] == f.stat().st_size and st["rejected"] == 0
    assert (d / "notes.txt").read_text() == "mine" and (d / "sub").is_dir()
    c.close()


def _one_file(tmp_path: Path) -> tuple[Path, Path]:
    d = tmp_path / "c"
    c = StateCacheStore(d, ram_budget=0, disk_budget=10**6)
    c.put(KEY_A, snap([1, 2, 3, 4]))
    wait_written(c, 1)
    c.close()
    return d, next(d.iterdir())


def test_a_tampered_state_byte_is_refused_dropped_and_reported(tmp_path: Path) -> None:
    d, f = _one_file(tmp_path)
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x01  # inside the state bytes
    f.write_bytes(bytes(data))
    c = StateCacheStore(d, ram_budget=0, disk_budget=10**6)
    assert c.status()["disk_entries"] == 1  # the header still reads; the content is checked on use
    assert c.lookup(KEY_A, [1, 2, 3, 4], min_len=0, max_tokens=10) is None
    st = c.status()
    assert st["rejected"] == 1 and "digest" in st["last_rejection"] and st["disk_entries"] == 0
    assert not f.exists()


@pytest.mark.parametrize("damage", ["tokens", "truncated", "foreign", "mode"])
def test_a_file_that_is_not_a_valid_entry_is_dropped_at_start(tmp_path: Path, damage: str) -> None:
    d, f = _one_file(tmp_path)
    if damage == "tokens":  # the header names other tokens than the file's name says
        f.write_bytes(f.read_bytes().replace(b"[1,2,3,4]", b"[1,2,3,5]"))
    elif damage == "truncated":
        f.write_bytes(f.read_bytes()[:-10])
    elif damage == "foreign":
        f.write_bytes(os.urandom(4096))
    else:
        os.chmod(f, 0o644)
    c = StateCacheStore(d, ram_budget=0, disk_budget=10**6)
    st = c.status()
    assert st["disk_entries"] == 0 and st["rejected"] == 1 and st["last_rejection"]
    assert not f.exists()
    assert c.lookup(KEY_A, [1, 2, 3, 4], min_len=0, max_tokens=10) is None
    c.close()


def test_clear_and_release_ram(tmp_path: Path) -> None:
    d = tmp_path / "c"
    c = StateCacheStore(d, ram_budget=10**6, disk_budget=10**6)
    c.put(KEY_A, snap([1, 2]))
    c.put(KEY_B, snap([3, 4]))
    c.release_ram()  # before a model load: written to disk, then out of RAM
    wait_written(c, 2)
    st = c.status()
    assert st["ram_entries"] == 0 and st["ram_bytes"] == 0 and st["disk_entries"] == 2
    assert c.clear() == 2
    assert list(d.iterdir()) == [] and c.entries() == [] and c.status()["disk_bytes"] == 0
    c.close()


def test_release_ram_without_a_disk_tier_forgets_the_entries() -> None:
    c = ram_only(10**6)
    c.put(KEY_A, snap([1, 2]))
    c.release_ram()
    assert c.entries() == [] and c.lookup(KEY_A, [1, 2], min_len=0, max_tokens=10) is None
