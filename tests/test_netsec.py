"""Who may reach the daemon (``modeld.netsec``): tcp exposure, CURVE keys, the runtime directory's permissions."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from contract.errors import ModeldError, Unavailable
from harness.daemon import ROOT, DaemonProcess, free_tcp_endpoint
from modeld.netsec import check_runtime_dir, check_tcp_exposure, is_loopback_tcp, server_keys
from runtime import Client


@pytest.mark.parametrize(
    ("endpoint", "loopback"),
    [("tcp://127.0.0.1:5555", True), ("tcp://127.8.0.1:1", True), ("tcp://[::1]:5555", True),
     ("tcp://localhost:5555", True), ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False),
     ("tcp://192.168.1.4:5555", False), ("tcp://eth0:5555", False), ("ipc:///tmp/x.sock", False)],
)
def test_loopback_endpoints(endpoint: str, loopback: bool) -> None:
    assert is_loopback_tcp(endpoint) is loopback


def test_a_tcp_endpoint_beyond_loopback_needs_curve_or_an_explicit_insecure_flag() -> None:
    for ok in ("ipc:///tmp/x.sock", "tcp://127.0.0.1:5555"):
        check_tcp_exposure(ok, curve=False, insecure=False)
    with pytest.raises(ValueError, match="--curve.*--insecure-tcp"):
        check_tcp_exposure("tcp://0.0.0.0:5555", curve=False, insecure=False)
    check_tcp_exposure("tcp://0.0.0.0:5555", curve=True, insecure=False)
    check_tcp_exposure("tcp://0.0.0.0:5555", curve=False, insecure=True)


def test_server_keys_are_created_once_and_kept_private(tmp_path: Path) -> None:
    public, secret = server_keys(tmp_path)
    assert len(public) == len(secret) == 40 and public != secret
    assert server_keys(tmp_path) == (public, secret)
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    sec = tmp_path / "keys" / "server.key_secret"
    assert stat.S_IMODE(sec.stat().st_mode) == 0o600
    os.chmod(sec, 0o644)
    with pytest.raises(RuntimeError, match="chmod 600"):
        server_keys(tmp_path)


def test_the_runtime_directory_is_private_or_refused(tmp_path: Path) -> None:
    fresh = tmp_path / "run" / "modeld"
    check_runtime_dir(fresh)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    check_runtime_dir(fresh)  # ours and private: used as it is
    os.chmod(fresh, 0o755)
    with pytest.raises(RuntimeError, match="mode is 755"):
        check_runtime_dir(fresh)
    link = tmp_path / "link"
    link.symlink_to(fresh)
    with pytest.raises(RuntimeError, match="not a directory"):
        check_runtime_dir(link)


def _serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "modeld", "serve", "--backend", "memory", "--no-preload",
         "--data-dir", str(tmp_path / "data"), *args],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def test_serve_refuses_an_open_socket_beyond_loopback(tmp_path: Path) -> None:
    port = free_tcp_endpoint().rsplit(":", 1)[1]
    out = _serve(tmp_path, "--endpoint", f"tcp://0.0.0.0:{port}")
    assert out.returncode == 2 and "--curve" in out.stderr and "--insecure-tcp" in out.stderr


def test_serve_refuses_a_runtime_directory_others_may_enter(tmp_path: Path) -> None:
    run = tmp_path / "xdg"
    (run / "modeld").mkdir(parents=True)
    os.chmod(run / "modeld", 0o777)
    out = _serve(tmp_path, env={"XDG_RUNTIME_DIR": str(run)})
    assert out.returncode == 1 and "refusing the runtime directory" in out.stderr, out.stderr


def test_with_curve_a_keyed_client_works_and_an_unkeyed_one_gets_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    public, _ = server_keys(tmp_path / "data")  # what `modeld keys` makes and prints
    keys = subprocess.run([sys.executable, "-m", "modeld", "keys", "--data-dir", str(tmp_path / "data")],
                          capture_output=True, text=True, cwd=ROOT, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert keys.returncode == 0 and keys.stdout.strip() == public.decode()
    port = free_tcp_endpoint().rsplit(":", 1)[1]
    monkeypatch.setenv("MODELD_SERVER_KEY", public.decode())  # for DaemonProcess's own readiness probe
    with DaemonProcess(tmp_path, "memory", f"tcp://0.0.0.0:{port}", "--no-preload", "--curve"):
        local = f"tcp://127.0.0.1:{port}"
        with Client(local, timeout_s=10.0, server_key=public.decode()) as keyed:
            assert keyed.status().backend == "memory"
        monkeypatch.delenv("MODELD_SERVER_KEY")
        with Client(local, timeout_s=1.5) as stranger, pytest.raises(ModeldError):  # no key: no handshake
            stranger.status()
        other, _ = zmq.curve_keypair()  # a well-formed key, not this daemon's
        with Client(local, timeout_s=30.0, server_key=other.decode()) as wrong, pytest.raises(Unavailable) as refused:
            t0 = time.monotonic()
            wrong.status()
        # said at once and as what it is, not after the timeout as "is modeld serve running?"
        assert time.monotonic() - t0 < 5.0 and "refused the CURVE handshake" in str(refused.value)
