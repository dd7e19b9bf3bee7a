"""Content-addressed snapshot blobs on disk (sha256 names, files 0600, directory 0700), pruned to a budget.

A client's ``snapshot`` stores the state here and gets its ``state_id``; a later
``restore`` may name it. The daemon cannot know whether a client still holds
an id, so the store does not grow forever: after every ``put`` it deletes blobs
older than ``max_age_s`` and then the least recently used ones (a ``get``
refreshes a blob's time) until the total fits ``max_bytes``. A restore naming a
pruned blob fails with ``SnapshotRejected`` ("no snapshot blob"); the client
still has the bytes if it asked for them (``include_state``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
import time
from pathlib import Path

from contract.errors import InvalidArgument, SnapshotRejected
from contract.types import BlobStatus

from .defaults import DEFAULT_BLOB_BYTES

_ID = re.compile(r"^sha256:[0-9a-f]{64}$")
_NAME = re.compile(r"^[0-9a-f]{64}$")

DEFAULT_MAX_AGE_S = 7 * 24 * 3600.0


class BlobStore:
    def __init__(self, root: Path, *, max_bytes: int = DEFAULT_BLOB_BYTES, max_age_s: float = DEFAULT_MAX_AGE_S) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._pruned = 0
        #: blobs and bytes on disk, as the last ``prune`` counted them (``stats`` reads these: status is
        #: polled often, and a directory walk per poll grows with the store)
        self._count = self._bytes = 0
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(root, 0o700)
        self.prune()

    def _path(self, state_id: str) -> Path:
        if not _ID.match(state_id):
            raise InvalidArgument(f"state id {state_id[:80]!r} is not a sha256 content address")
        return self.root / state_id.split(":", 1)[1]

    def put(self, data: bytes) -> str:
        state_id = "sha256:" + hashlib.sha256(data).hexdigest()
        path = self._path(state_id)
        if path.exists():
            with contextlib.suppress(OSError):
                os.utime(path)
        else:
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        self.prune(keep=path.name)
        return state_id

    def get(self, state_id: str) -> bytes:
        path = self._path(state_id)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise SnapshotRejected(f"no snapshot blob {state_id} (never stored, or pruned)") from None
        if "sha256:" + hashlib.sha256(data).hexdigest() != state_id:
            raise SnapshotRejected(f"snapshot blob {state_id} is corrupt on disk")
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: pruned last
        return data

    def _files(self) -> list[tuple[float, int, Path]]:
        out: list[tuple[float, int, Path]] = []
        for p in self.root.iterdir():
            if not _NAME.match(p.name):
                continue
            with contextlib.suppress(OSError):
                st = p.stat()
                out.append((st.st_mtime, st.st_size, p))
        return sorted(out)

    def prune(self, keep: str = "") -> int:
        """Delete blobs past ``max_age_s``, then the least recently used until ``max_bytes`` holds; returns how many."""
        with self._lock:
            files = self._files()
            now = time.time()
            total = sum(size for _, size, _ in files)
            gone = 0
            for mtime, size, path in files:
                if path.name == keep:
                    continue
                if now - mtime <= self.max_age_s and total <= self.max_bytes:
                    break  # oldest first: everything after is younger and the total fits
                path.unlink(missing_ok=True)
                total -= size
                gone += 1
            self._pruned += gone
            self._count, self._bytes = len(files) - gone, total
            return gone

    def stats(self) -> BlobStatus:
        """What ``status`` shows: blobs, bytes, the budget, the age limit, how many were pruned since start."""
        with self._lock:
            return {
                "blobs": self._count,
                "bytes": self._bytes,
                "max_bytes": self.max_bytes,
                "max_age_s": self.max_age_s,
                "pruned": self._pruned,
            }
