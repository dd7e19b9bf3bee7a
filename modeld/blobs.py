"""Content-addressed snapshot blobs on disk (sha256 names, files 0600, directory 0700)."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from contract.errors import InvalidArgument, SnapshotRejected

_ID = re.compile(r"^sha256:[0-9a-f]{64}$")


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(root, 0o700)

    def _path(self, state_id: str) -> Path:
        if not _ID.match(state_id):
            raise InvalidArgument(f"state id {state_id[:80]!r} is not a sha256 content address")
        return self.root / state_id.split(":", 1)[1]

    def put(self, data: bytes) -> str:
        state_id = "sha256:" + hashlib.sha256(data).hexdigest()
        path = self._path(state_id)
        if not path.exists():
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        return state_id

    def get(self, state_id: str) -> bytes:
        path = self._path(state_id)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise SnapshotRejected(f"no snapshot blob {state_id}") from None
        if "sha256:" + hashlib.sha256(data).hexdigest() != state_id:
            raise SnapshotRejected(f"snapshot blob {state_id} is corrupt on disk")
        return data

    def delete(self, state_id: str) -> bool:
        path = self._path(state_id)
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False
