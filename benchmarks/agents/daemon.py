"""The daemon under test, started as ``make run`` starts it, on its own endpoint, data dir and a free port.

``MODELD_LOG_FORMAT=json`` makes it write one JSON object per log line on stderr; every line is kept in
``daemon.log`` and the access-log lines (logger ``modeld.access``) are collected in order, so the runner
can take the slice written while one agent ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from harness.daemon import free_port

__all__ = ["Daemon", "DaemonError", "LlamaServer", "get_json"]

ACCESS_LOGGER = "modeld.access"


class DaemonError(RuntimeError):
    """The daemon did not come up (its log says why)."""


def get_json(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    """``GET url``: the status and the parsed body (None when it is not JSON); status 0 when unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            status, raw = int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except OSError:
        return 0, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, None


class Daemon:
    """``modeld serve --backend B --http 127.0.0.1:PORT`` on a private endpoint and data dir."""

    def __init__(self, modeld: str, log_path: Path, *, backend: str = "auto", extra: list[str] | None = None) -> None:
        self.modeld = modeld
        self.log_path = log_path
        self.backend = backend
        self.extra = list(extra or [])
        self.port = free_port()
        self.tmp = Path(tempfile.mkdtemp(prefix="modeld-agents-"))
        self.endpoint = f"ipc://{self.tmp}/modeld.sock"
        self.access: list[dict[str, Any]] = []
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [self.modeld, "serve", "--backend", self.backend, "--http", f"127.0.0.1:{self.port}",
                "--endpoint", self.endpoint, "--data-dir", str(self.tmp / "data"), *self.extra]

    #: how errors name it
    what = "the daemon"

    def env(self) -> dict[str, str]:
        return dict(os.environ, MODELD_LOG_FORMAT="json")

    def ready(self, status: int, body: Any) -> dict[str, Any] | None:
        """The health a ``/health`` answer says once the server is ready; None before."""
        return body if status == 200 and isinstance(body, dict) and body.get("state") == "Ready" else None

    async def start(self, timeout: float = 300.0) -> dict[str, Any]:
        """Start it and wait for ``/health`` to say it is ready (``ready``); returns that health."""
        argv = await asyncio.to_thread(self.argv)  # (a peer's is built the first time it is asked for: minutes)
        print(f"agents: {' '.join(argv)}", file=sys.stderr, flush=True)
        self.proc = await asyncio.create_subprocess_exec(
            *argv, env=self.env(), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        self._reader = asyncio.create_task(self._read())
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if self.proc.returncode is not None:
                raise DaemonError(f"{self.what} exited {self.proc.returncode} while starting (log: {self.log_path})")
            status, body = await asyncio.to_thread(get_json, self.url + "/health", 5.0)
            last = body
            health = self.ready(status, body)
            if health is not None:
                return health
            await asyncio.sleep(1.0)
        raise DaemonError(f"{self.what} was not ready after {timeout:.0f} s (last /health: {last}; log: {self.log_path})")

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with self.log_path.open("wb") as log:
            while line := await self.proc.stdout.readline():
                log.write(line)
                log.flush()
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and rec.get("logger") == ACCESS_LOGGER:
                    rec["_arrived"] = time.time()
                    self.access.append(rec)

    def status(self) -> dict[str, Any] | None:
        """``modeld status --json`` for this daemon (None when it fails)."""
        try:
            out = subprocess.run([self.modeld, "status", "--json", "--endpoint", self.endpoint],
                                 capture_output=True, text=True, timeout=30, check=False)
            data = json.loads(out.stdout)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return None
        return data if isinstance(data, dict) else None

    async def stop(self, grace: float = 20.0) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader, 5.0)
        shutil.rmtree(self.tmp, ignore_errors=True)


class LlamaServer(Daemon):
    """llama.cpp's ``llama-server`` in the daemon's place (``make agents --peer llama-server``): the file modeld
    serves, the window, the model name and the reply limit (``-n``) the agents were told, one slot and the
    machine's threads, its defaults otherwise (its RAM prompt cache on, its jinja chat template).

    It writes no access log: the runner reads each request's figures from what the proxy recorded
    (``AccessLine.from_proxied``), and ``status`` says nothing (it has no operation to wait for)."""

    what = "llama-server"

    def __init__(self, log_path: Path, model: Path, name: str, context: int, *extra: str) -> None:
        super().__init__("", log_path, extra=list(extra))
        self.model, self.name, self.context = model, name, context

    def argv(self) -> list[str]:
        from benchmarks import llama_server

        return llama_server.command(self.model, self.context, self.port, "--alias", self.name, *self.extra)

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def ready(self, status: int, body: Any) -> dict[str, Any] | None:
        """``/health`` answers 200 (``{"status": "ok"}``) once the model is in."""
        return {"status": "ok", "state": "Ready", "model": self.name} if status == 200 else None

    def status(self) -> dict[str, Any] | None:
        return {}
