"""Running under systemd (``modeld.sdnotify``, ``contrib/``): the units verify, readiness is notified,
and a socket systemd bound is served (socket activation) — each against a real daemon process."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from harness.daemon import ROOT
from runtime import Client

CONTRIB = ROOT / "contrib"


def test_the_units_verify(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed here")
    service = (CONTRIB / "modeld.service").read_text()
    # verify checks that ExecStart's program exists: point it at this checkout's
    exe = Path(sys.executable).parent / "modeld"
    (tmp_path / "modeld.service").write_text(service.replace("%h/.local/bin/modeld", str(exe)))
    shutil.copy(CONTRIB / "modeld.socket", tmp_path / "modeld.socket")
    for mode in ([], ["--user"]):
        out = subprocess.run([tool, "verify", *mode, "modeld.service", "modeld.socket"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)})
        # a directive systemd does not understand is only a warning: none may be printed
        assert out.returncode == 0 and "modeld." not in out.stderr, out.stderr


#: what systemd does before it execs a socket-activated service: the socket becomes fd 3,
#: LISTEN_FDS=1 and LISTEN_PID=<the service's pid> (exec keeps the pid)
_ACTIVATE = (
    "import os, sys; fd = int(sys.argv[1]); os.dup2(fd, 3); os.close(fd); "
    "os.environ.update(LISTEN_FDS='1', LISTEN_PID=str(os.getpid())); os.execv(sys.executable, sys.argv[2:])"
)


def _serve(tmp_path: Path, *extra: str, env: dict[str, str] | None = None, activate_fd: int | None = None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "modeld", "serve", "--backend", "memory", "--no-preload",
           "--data-dir", str(tmp_path / "data"), *extra]
    pass_fds: tuple[int, ...] = ()
    if activate_fd is not None:
        cmd = [sys.executable, "-c", _ACTIVATE, str(activate_fd), *cmd]
        pass_fds = (activate_fd,)
    with open(tmp_path / "daemon.log", "ab") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                                stdout=log, stderr=subprocess.STDOUT, pass_fds=pass_fds)


def test_readiness_and_stopping_are_notified(tmp_path: Path) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify"))
    listener.settimeout(60)
    proc = _serve(tmp_path, "--endpoint", f"ipc://{tmp_path / 's.sock'}", env={"NOTIFY_SOCKET": str(tmp_path / "notify")})
    try:
        ready = listener.recv(4096).decode().splitlines()
        assert "READY=1" in ready and f"MAINPID={proc.pid}" in ready
        assert any(line.startswith("STATUS=serving ipc://") for line in ready)
        with Client(f"ipc://{tmp_path / 's.sock'}", timeout_s=10.0) as c:
            assert c.status().backend == "memory"  # READY meant it: clients connect
        proc.send_signal(signal.SIGTERM)
        assert listener.recv(4096).decode() == "STOPPING=1"
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()
        listener.close()


def test_a_socket_systemd_bound_is_served(tmp_path: Path) -> None:
    path = tmp_path / "run" / "modeld.sock"
    path.parent.mkdir(mode=0o700)
    bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound.bind(str(path))
    bound.listen(16)
    os.chmod(path, 0o600)
    fd = bound.fileno()
    proc = _serve(tmp_path, "--endpoint", f"ipc://{path}", activate_fd=fd)
    bound.close()  # the daemon holds it now
    try:
        with Client(f"ipc://{path}", timeout_s=30.0) as c:
            assert c.status().backend == "memory"
        assert path.exists()  # the daemon did not replace the socket systemd owns
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert path.exists()  # nor remove it: systemd keeps listening for the next start
    finally:
        proc.kill()
        proc.wait()
