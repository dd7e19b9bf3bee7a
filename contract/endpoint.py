"""Where the daemon listens by default (shared by the daemon and the client)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

ENDPOINT_ENV = "MODELD_ENDPOINT"
SOCKET_NAME = "modeld.sock"


def runtime_dir() -> Path:
    """A per-user directory for the socket: $XDG_RUNTIME_DIR/modeld, else /tmp/modeld-<uid>."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_dir():
        return Path(xdg) / "modeld"
    return Path(tempfile.gettempdir()) / f"modeld-{os.getuid()}"


def default_endpoint() -> str:
    env = os.environ.get(ENDPOINT_ENV)
    if env:
        return env
    return f"ipc://{runtime_dir() / SOCKET_NAME}"


def ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint[len("ipc://") :]) if endpoint.startswith("ipc://") else None
