"""Content digests of model files, cached so a large model is not rehashed on every load.

The cache key is (resolved path, size, mtime_ns); any change to the file makes a
new key. The cache lives in memory and, when ``cache_dir`` is given, in a small
JSON file so a daemon restart does not rehash either.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

_CHUNK = 4 * 1024 * 1024
DIGESTS_FILE = "digests.json"
_lock = threading.Lock()
_memo: dict[tuple[str, int, int], str] = {}


def _key(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns)


def file_digest(path: str | os.PathLike[str], cache_dir: Path | None = None) -> str:
    """``sha256:<hex>`` of the file's bytes."""
    p = Path(path)
    key = _key(p)
    with _lock:
        if key in _memo:
            return _memo[key]
    disk = _load_disk(cache_dir)
    skey = "|".join(map(str, key))
    if skey in disk:
        digest = disk[skey]
    else:
        h = hashlib.sha256()
        with p.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        digest = "sha256:" + h.hexdigest()
        if cache_dir is not None:
            _save_disk(cache_dir, {skey: digest})
    with _lock:
        _memo[key] = digest
    return digest


def files_digest(paths: list[Path], cache_dir: Path | None = None) -> str:
    """One digest over several files (an IR directory): sha256 of their names and digests."""
    h = hashlib.sha256()
    for p in sorted(paths, key=lambda x: x.name):
        h.update(p.name.encode() + b"\0" + file_digest(p, cache_dir).encode() + b"\n")
    return "sha256:" + h.hexdigest()


def _load_disk(cache_dir: Path | None) -> dict[str, str]:
    return load_json_map(cache_dir / DIGESTS_FILE) if cache_dir is not None else {}


def _save_disk(cache_dir: Path, data: dict[str, str]) -> None:
    try:
        merge_json_map(cache_dir / DIGESTS_FILE, data)
    except OSError:
        pass  # the cache is an optimisation; hashing again is always correct


def load_json_map(path: Path) -> dict[str, Any]:
    """A JSON object from a file; {} when missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_json_map(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` with ``data`` atomically (a reader sees the old file or the new one); raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(json.dumps(data, indent=0, sort_keys=True))
    os.replace(tmp, path)


def merge_json_map(path: Path, updates: dict[str, Any]) -> None:
    """Add ``updates`` to the map in ``path`` (read, merged and replaced under an exclusive lock on a file beside
    it): processes sharing the cache (daemons, a test run's workers, ``modeld prepare``) never lose each other's
    entries to a read-modify-write race. Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.with_name(path.name + ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        data = load_json_map(path)
        data.update(updates)
        save_json_map(path, data)
