"""Stored responses (the Responses API's ``store``): each a JSON file in the data dir, pruned by size and age.

A stored response keeps what ``previous_response_id`` needs to continue it:
the conversation in the neutral form (``core.TurnRequest.messages``, the
reply included as an assistant message), the tools it had, and the response
object ``GET /v1/responses/{id}`` returns. Files are 0600 in a 0700
directory; the least recently used go beyond ``max_bytes``, and any older
than ``max_age_s``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["ResponseStore"]

#: 256 MiB of stored responses, kept up to 30 days
DEFAULT_MAX_BYTES = 256 * 2**20
DEFAULT_MAX_AGE_S = 30 * 86400
_ID = re.compile(r"^resp_[0-9a-f]{16,64}$")


class ResponseStore:
    """Stored responses by id; thread-safe; ``root`` None keeps them in memory only (a test, a missing data dir)."""

    def __init__(self, root: Path | None, *, max_bytes: int = DEFAULT_MAX_BYTES, max_age_s: float = DEFAULT_MAX_AGE_S) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._memory: dict[str, dict[str, Any]] = {}
        if root is not None:
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(root, 0o700)

    def _path(self, rid: str) -> Path | None:
        if self.root is None or not _ID.match(rid):
            return None
        return self.root / f"{rid}.json"

    def put(self, rid: str, record: dict[str, Any]) -> None:
        path = self._path(rid)
        with self._lock:
            if path is None:
                self._memory[rid] = record
                return
            data = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            self._prune()

    def get(self, rid: str) -> dict[str, Any] | None:
        path = self._path(rid)
        with self._lock:
            if path is None:
                return self._memory.get(rid)
            try:
                data = path.read_bytes()
                os.utime(path)  # used: the last to be pruned
            except OSError:
                return None
        try:
            record = json.loads(data)
        except ValueError:
            return None
        return record if isinstance(record, dict) else None

    def delete(self, rid: str) -> bool:
        path = self._path(rid)
        with self._lock:
            if path is None:
                return self._memory.pop(rid, None) is not None
            try:
                path.unlink()
            except OSError:
                return False
            return True

    def _prune(self) -> None:
        """Drop files past the age, then the least recently used beyond the size (caller holds the lock)."""
        assert self.root is not None
        now = time.time()
        files = []
        for p in self.root.glob("resp_*.json"):
            with contextlib.suppress(OSError):
                st = p.stat()
                if now - st.st_mtime > self.max_age_s:
                    p.unlink()
                else:
                    files.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            with contextlib.suppress(OSError):
                p.unlink()
                total -= size
