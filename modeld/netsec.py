"""Who may reach the daemon: the runtime directory's permissions, tcp exposure, CURVE keys.

The threat model (docs/operations.md, "Security"): the ipc socket lives in a per-user
directory the daemon creates 0700 and refuses to use when another user owns it
or anyone else may enter it, so only the user's own processes connect. A tcp
endpoint on a loopback address is reachable by every local user; any other
address by the network. There the daemon refuses to listen unless it is told
how: ``--curve`` (ZeroMQ CURVE: traffic encrypted, and only clients given the
server's public key can complete the handshake) or ``--insecure-tcp`` (the
operator accepts an open socket; logged as a warning).

``modeld keys`` prints the public key (creating the pair in ``DATA_DIR/keys``
on first use, the secret file 0600 in a 0700 directory); clients take it as
``--server-key`` / ``MODELD_SERVER_KEY`` / ``Client(server_key=...)``.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import stat
import sys
from pathlib import Path

import zmq

from contract.endpoint import runtime_dir

__all__ = ["check_runtime_dir", "check_tcp_exposure", "is_loopback_tcp", "server_keys"]

PUBLIC_FILE = "server.key"
SECRET_FILE = "server.key_secret"


def check_runtime_dir(path: Path) -> None:
    """Create the per-user runtime directory 0700, or refuse one that another user owns or others may enter."""
    try:
        path.mkdir(parents=True, mode=0o700)
        os.chmod(path, 0o700)
        return
    except FileExistsError:
        pass
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"{path} is not a directory; refusing to put the daemon's socket there")
    problems = []
    if st.st_uid != os.getuid():
        problems.append(f"it belongs to uid {st.st_uid}, not {os.getuid()}")
    if st.st_mode & 0o077:
        problems.append(f"its mode is {stat.S_IMODE(st.st_mode):o}, so other users may enter it")
    if problems:
        raise RuntimeError(
            f"refusing the runtime directory {path}: " + " and ".join(problems)
            + f"; remove it (or `chmod 700 {path}` if it is yours) and start again"
        )


def is_default_runtime_dir(path: Path) -> bool:
    return path.resolve() == runtime_dir().resolve()


def tcp_host(endpoint: str) -> str | None:
    """The host of a ``tcp://HOST:PORT`` endpoint (brackets stripped), None for any other transport."""
    if not endpoint.startswith("tcp://"):
        return None
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
    return host.strip("[]")


def is_loopback_tcp(endpoint: str) -> bool:
    host = tcp_host(endpoint)
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or an interface ("*", "eth0"): treat as reachable from outside


def check_tcp_exposure(endpoint: str, *, curve: bool, insecure: bool) -> None:
    """Refuse a tcp endpoint beyond loopback that has neither CURVE nor an explicit ``--insecure-tcp``."""
    if tcp_host(endpoint) is None or is_loopback_tcp(endpoint) or curve or insecure:
        return
    raise ValueError(
        f"{endpoint} is reachable beyond this machine and would let anyone who reaches it load, unload and "
        "read sessions; serve it with --curve (clients then need `modeld keys` output as --server-key), "
        "or say --insecure-tcp to accept an open socket"
    )


def server_keys(data_dir: Path, *, create: bool = True) -> tuple[bytes, bytes]:
    """The daemon's CURVE key pair (public, secret) as Z85, from ``data_dir/keys``; created on first use."""
    keys = data_dir / "keys"
    pub, sec = keys / PUBLIC_FILE, keys / SECRET_FILE
    if pub.is_file() and sec.is_file():
        if stat.S_IMODE(sec.stat().st_mode) & 0o077:
            raise RuntimeError(f"{sec} may be read by other users (mode {stat.S_IMODE(sec.stat().st_mode):o}); chmod 600 it")
        return pub.read_bytes().strip(), sec.read_bytes().strip()
    if not create:
        raise FileNotFoundError(f"no server key in {keys}; `modeld keys` creates one")
    if not zmq.has("curve"):
        raise RuntimeError("this pyzmq/libzmq build has no CURVE support")
    public, secret = zmq.curve_keypair()
    keys.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(keys, 0o700)
    fd = os.open(sec, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret + b"\n")
    pub.write_bytes(public + b"\n")
    return public, secret


def keys_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="modeld keys", description="The daemon's CURVE key pair for --curve tcp endpoints.")
    p.add_argument("--data-dir", type=Path, default=None, help="where the keys live (default: the daemon's data dir: $MODELD_DATA_DIR, else the config file's "
                   "data_dir, else ~/.local/share/modeld)")
    return p


def keys_main(argv: list[str] | None = None) -> int:
    """``modeld keys``: print the daemon's CURVE public key (the one clients pass as --server-key)."""
    from .settings import SettingsError, data_dir_of

    args = keys_parser().parse_args(argv)
    try:
        data_dir = data_dir_of(args.data_dir)
    except SettingsError as exc:
        print(f"modeld keys: {exc}", file=sys.stderr)
        return 2
    try:
        public, _ = server_keys(data_dir)
    except (OSError, RuntimeError) as exc:
        print(f"modeld: {exc}", file=sys.stderr)
        return 1
    print(public.decode())
    print(f"(the secret half is {data_dir / 'keys' / SECRET_FILE}; give clients the line above as "
          "--server-key or MODELD_SERVER_KEY)", file=sys.stderr)
    return 0
