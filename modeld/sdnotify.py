"""systemd's readiness protocol (``sd_notify``) and socket activation (``contrib/modeld.service``, ``modeld.socket``).

When systemd starts the daemon it sets ``$NOTIFY_SOCKET``; the daemon sends
``READY=1`` once its socket is bound (clients can connect; the preloaded model
may still be loading — ``STATUS=`` says so) and ``STOPPING=1`` when a stop
begins. The protocol is one datagram per message on a unix socket (an
abstract one when the path starts with ``@``), so a few lines of the standard
library do it. Without ``$NOTIFY_SOCKET`` every call is a no-op.

Socket activation (``sd_listen_fds``): when systemd started the daemon for a
``.socket`` unit it passes the bound, listening socket as fd 3 with
``$LISTEN_FDS=1`` and ``$LISTEN_PID`` naming this process; the daemon hands it
to ZeroMQ (``ZMQ_USE_FD``) instead of binding its own.
"""

from __future__ import annotations

import contextlib
import os
import socket

__all__ = ["activated_fd", "notify"]

#: the first descriptor systemd passes (SD_LISTEN_FDS_START)
LISTEN_FDS_START = 3


def notify(*fields: str) -> bool:
    """Send ``FIELD=value`` lines to systemd; False when not started by systemd (or the send failed)."""
    path = os.environ.get("NOTIFY_SOCKET", "")
    if not path:
        return False
    addr = "\0" + path[1:] if path.startswith("@") else path
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        s.sendall("\n".join(fields).encode())
        return True
    return False


def activated_fd() -> int | None:
    """The listening socket systemd passed to this process, if exactly one; the variables are then cleared."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()) or os.environ.get("LISTEN_FDS") != "1":
        return None
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)  # not inherited by anything this process starts
    return LISTEN_FDS_START
