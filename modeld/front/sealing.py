"""Blobs the front hands a client and reads back: integrity-protected, so an echo reproduces the earlier turn.

Anthropic's ``thinking`` blocks carry a ``signature`` and the Responses API's
``reasoning`` items an ``encrypted_content``; clients send them back on the
next turn unchanged. The front fills both with an HMAC-SHA256 over what it
gave out, under a key kept in the data dir (``http.key``, 0600), so a value
it did not issue, or one changed on the way, is recognised and not trusted,
and values survive a restart.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any

__all__ = ["Sealer"]

_PREFIX = "mdv1"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Sealer:
    """Signs and seals with one key."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    @classmethod
    def from_file(cls, path: Path | None) -> Sealer:
        """The key in ``path`` (created 0600 on first use); None or an unusable path: a key for this process only."""
        if path is not None:
            try:
                if not path.exists():
                    path.parent.mkdir(parents=True, exist_ok=True)
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    with os.fdopen(fd, "wb") as f:
                        f.write(secrets.token_bytes(32))
                key = path.read_bytes()
                if len(key) >= 32:
                    return cls(key)
            except OSError:
                pass
        return cls(secrets.token_bytes(32))

    def _mac(self, data: bytes) -> bytes:
        return hmac.new(self._key, data, hashlib.sha256).digest()

    def sign(self, text: str) -> str:
        """A signature of ``text``."""
        return f"{_PREFIX}.{_b64(self._mac(text.encode()))}"

    def verify(self, text: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign(text), signature)

    def seal(self, payload: dict[str, Any]) -> str:
        """``payload`` as an opaque string only this key opens."""
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
        return f"{_PREFIX}.{_b64(data)}.{_b64(self._mac(data))}"

    def open(self, token: str) -> dict[str, Any] | None:
        """The payload of a sealed string, or None when it is not one of ours (or was changed)."""
        try:
            prefix, data_b64, mac_b64 = token.split(".")
            data, mac = _unb64(data_b64), _unb64(mac_b64)
        except ValueError:
            return None
        if prefix != _PREFIX or not hmac.compare_digest(mac, self._mac(data)):
            return None
        try:
            out = json.loads(data)
        except ValueError:
            return None
        return out if isinstance(out, dict) else None
