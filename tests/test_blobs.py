"""The snapshot blob store (``modeld.blobs``): content addresses, private files, pruning by size and age."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from contract.errors import InvalidArgument, SnapshotRejected
from modeld.blobs import BlobStore


def _age(store: BlobStore, state_id: str, seconds: float) -> None:
    path = store.root / state_id.split(":", 1)[1]
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_put_get_round_trip_with_private_files(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "b")
    sid = store.put(b"state bytes")
    assert store.get(sid) == b"state bytes"
    assert stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "b" / sid.split(":")[1]).stat().st_mode) == 0o600
    with pytest.raises(InvalidArgument):
        store.get("../../etc/passwd")


def test_the_size_budget_prunes_least_recently_used_and_keeps_the_new_blob(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "b", max_bytes=250)
    a, b = store.put(b"a" * 100), store.put(b"b" * 100)
    _age(store, a, 20)
    _age(store, b, 10)
    store.get(a)  # a is now the most recently used
    c = store.put(b"c" * 100)  # 300 bytes > 250: the least recently used (b) goes
    assert store.get(a) and store.get(c)
    with pytest.raises(SnapshotRejected, match="pruned"):
        store.get(b)
    st = store.stats()
    assert st["blobs"] == 2 and st["bytes"] == 200 and st["pruned"] == 1
    big = store.put(b"d" * 400)  # larger than the budget alone: it stays, everything else goes
    assert store.get(big) and store.stats()["blobs"] == 1


def test_old_blobs_are_pruned_by_age(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "b", max_age_s=3600)
    old, young = store.put(b"old"), store.put(b"young")
    _age(store, old, 7200)
    store.put(b"new")
    assert store.get(young) == b"young"
    with pytest.raises(SnapshotRejected):
        store.get(old)


def test_a_restart_prunes_what_outgrew_the_limits(tmp_path: Path) -> None:
    first = BlobStore(tmp_path / "b")
    sid = first.put(b"x" * 100)
    _age(first, sid, 10 * 86400)
    again = BlobStore(tmp_path / "b", max_age_s=86400)
    assert again.stats()["blobs"] == 0 and again.stats()["pruned"] == 1
