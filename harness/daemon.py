"""Start and stop a real ``modeld serve`` OS process for tests."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from contract.errors import ModeldError
from contract.types import OpenSessionRequest
from runtime import Client

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 120.0, poll_s: float = 0.05,
               seen: Callable[[], object] | None = None) -> None:
    """Return once ``condition()`` is true; fail naming ``what`` (and what ``seen()`` reads then) after
    ``timeout_s``. The wait is a ceiling for a daemon that never gets there, not a measure of speed: on a loaded
    machine the state comes late, and the test waits for it (where a fixed sleep would guess how late)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            last = f"; last seen: {seen()}" if seen is not None else ""
            raise AssertionError(f"not {what} after {timeout_s:.0f} s{last}")
        time.sleep(poll_s)


def free_tcp_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def wait_http(port: int, path: str = "/health", timeout_s: float = 30.0,
              proc: subprocess.Popen[bytes] | None = None) -> None:
    """Until ``GET path`` on 127.0.0.1:``port`` answers 200; raises when ``proc`` exits first or the time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited {proc.returncode} while starting")
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        try:
            c.request("GET", path)
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            c.close()
        time.sleep(0.1)
    raise RuntimeError(f"nothing answered {path} on port {port} within {timeout_s:.0f} s")


class DaemonProcess:
    """``modeld serve`` as a child process with its own endpoint and data dir."""

    #: ``start`` waits after Ready until the model's draft check costs are timed (``SpeculationStatus.pending``),
    #: as on a daemon that sat idle once: the bench sets it, so its turns draft by a measured table and no
    #: timing is cut short by them; tests serve at once, as a daemon an agent starts does
    wait_for_costs: ClassVar[bool] = False
    #: how long that wait may take (the timing prefills 2,048 tokens; minutes on a busy machine)
    COSTS_TIMEOUT_S: ClassVar[float] = 900.0

    def __init__(self, tmp: Path, backend: str = "memory", endpoint: str | None = None, *extra: str) -> None:
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.backend = backend
        self.endpoint = endpoint or f"ipc://{tmp / 'modeld.sock'}"
        self.extra = list(extra)
        self.log_path = tmp / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        #: run in the child before ``modeld serve`` (e.g. to set a resource limit)
        self.preexec: Callable[[], None] | None = None
        #: variables set in the child's environment besides this process's
        self.env: dict[str, str] = {}

    def start(self, ready_timeout_s: float = 120.0, wait_state: tuple[str, ...] = ("Ready", "Empty")) -> DaemonProcess:
        cmd = [
            sys.executable, "-m", "modeld", "serve",
            "--backend", self.backend,
            "--endpoint", self.endpoint,
            "--data-dir", str(self.tmp / "data"),
            *self.extra,
        ]
        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.env}
        env.pop("MODELD_ENDPOINT", None)
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     preexec_fn=self.preexec)
        deadline = time.monotonic() + ready_timeout_s
        with Client(self.endpoint, timeout_s=2.0) as c:
            while True:
                if self.proc.poll() is not None:
                    self._log.close()
                    raise RuntimeError(f"modeld exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    st = c.status(timeout_s=1.0)
                    if st.state.value in wait_state:
                        if self.wait_for_costs:
                            try:
                                wait_until(lambda: not self._costs_pending(c), "the draft costs to be timed",
                                           timeout_s=self.COSTS_TIMEOUT_S, poll_s=0.5)
                            except AssertionError:
                                self.stop()  # as a daemon never Ready is: no process outlives a failed start
                                raise
                        return self
                except ModeldError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"modeld not ready after {ready_timeout_s}s:\n{self.log()}")
                time.sleep(0.1)

    def client(self, **kw: object) -> Client:
        return Client(self.endpoint, **kw)  # type: ignore[arg-type]

    @staticmethod
    def _costs_pending(c: Client) -> bool:
        st = c.status(timeout_s=5.0)
        return st.speculation is not None and st.speculation.pending

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_lines(self, match: Callable[[str], bool], count: int = 1, timeout_s: float = 120.0) -> list[str]:
        """The log's lines that ``match``, once there are at least ``count`` of them.

        The wait is a ceiling for a daemon that never writes them (the test then fails with the log's tail), not a
        measure of speed: on a loaded machine a line comes late, and the test waits for it."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [ln for ln in self.log().splitlines() if match(ln)]
            if len(found) >= count:
                return found
            if time.monotonic() > deadline or (self.proc is not None and self.proc.poll() is not None):
                tail = "\n".join(self.log().splitlines()[-40:])
                raise AssertionError(f"{len(found)} of {count} expected log lines after {timeout_s:.0f} s:\n{tail}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> DaemonProcess:
        """Start the daemon, unless ``start`` already did (``with DaemonProcess(…).start(…) as d``)."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def streaming_client(endpoint: str, model: OpenSessionRequest, *, owner: str = "", then: str = "") -> subprocess.Popen[str]:
    """A client process that opens a session on ``model`` and streams a long decode.

    After three chunks it prints "streaming" (returned once it did), then runs the
    Python statement ``then`` (e.g. ``os._exit(0)``: die holding the session) and
    keeps reading. The caller kills it and closes ``stdout``.
    """
    script = textwrap.dedent(
        f"""
        import os
        from runtime import Client
        from contract.types import *
        c = Client({endpoint!r}, owner={owner!r}, timeout_s=60)
        s = c.open_session(OpenSessionRequest.model_validate({model.model_dump()!r}))
        s.ensure_prefix(PrefixInput(text="sys"))
        s.prefill_suffix(SuffixInput(text="go"))
        for i, ch in enumerate(s.decode(DecodeConfig(max_tokens=100000))):
            if i == 3:
                print("streaming", flush=True)
                {then or "pass"}
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "streaming":
        proc.kill()
        proc.wait()
        proc.stdout.close()
        raise RuntimeError("the streaming client never started streaming")
    return proc


def thread_slices(pid: int) -> dict[int, tuple[str, int]]:
    """Linux 6.6 on: each thread of process ``pid`` (by thread id), its name and its scheduler slice in
    nanoseconds (``se.slice`` in /proc); empty where the kernel does not report slices."""
    out: dict[int, tuple[str, int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            sched = Path(f"/proc/{pid}/task/{tid}/sched").read_text()
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
        for line in sched.splitlines():
            if line.startswith("se.slice"):
                out[int(tid)] = (name, int(float(line.split(":")[1])))
    return out


def kernel_takes_custom_slices() -> bool:
    """The kernel reports slices and gives a thread the short one ``runtime.wakeups`` asks for (Linux 6.12 on);
    asked from a thread of its own, which then ends."""
    from runtime.wakeups import SLICE_US, prompt_wakeups

    got: list[bool] = []

    def ask() -> None:
        me = threading.get_native_id()
        got.append(prompt_wakeups() and thread_slices(os.getpid()).get(me, ("", 0))[1] == SLICE_US * 1000)

    t = threading.Thread(target=ask)
    t.start()
    t.join()
    return got[0]


def thread_nices(pid: int) -> dict[int, int]:
    """Linux: each thread of process ``pid`` (by thread id) and its nice value, from /proc."""
    out: dict[int, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:
            continue  # the thread ended meanwhile
        # after "(comm)": state is field 3, nice field 19 (proc(5))
        out[int(tid)] = int(stat[stat.rindex(")") + 2 :].split()[16])
    return out


