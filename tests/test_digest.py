"""The small JSON maps beside the models (content digests, draft check costs) under concurrent writers.

Several processes share ``.cache/models``: daemons, ``modeld prepare``, a test run's workers. Each adds its
own entries; none may lose another's (a read-modify-write race did: the file held one writer's table).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from backends.digest import file_digest, load_json_map, merge_json_map
from harness.daemon import ROOT

WRITER = """
import sys
from pathlib import Path
from backends.digest import merge_json_map
path, who = Path(sys.argv[1]), sys.argv[2]
for i in range(40):
    merge_json_map(path, {f"{who}-{i}": i})
"""


def test_concurrent_writers_lose_no_entry(tmp_path: Path) -> None:
    path = tmp_path / "map.json"
    merge_json_map(path, {"first": 0})
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(w)], cwd=ROOT) for w in range(4)]
    assert all(p.wait(120) == 0 for p in procs)
    data = load_json_map(path)
    assert data == {"first": 0, **{f"{w}-{i}": i for w in range(4) for i in range(40)}}


def test_a_digest_is_kept_beside_the_others(tmp_path: Path) -> None:
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"a" * 10)
    b.write_bytes(b"b" * 10)
    cache = tmp_path / "cache"
    da, db = file_digest(a, cache), file_digest(b, cache)
    kept = load_json_map(cache / "digests.json")
    assert sorted(kept.values()) == sorted([da, db]) and da != db
