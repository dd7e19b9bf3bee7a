"""The run: install the agents, start the daemon and the recording proxy, run each agent, report."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from backends.devices import usable_cpus
from benchmarks.agents.daemon import Daemon, DaemonError, LlamaServer, get_json
from benchmarks.agents.install import Installed, InstallError, ensure_installed
from benchmarks.agents.proxy import Proxy
from benchmarks.agents.report import AccessLine, AgentResult, assign, side_by_side, table
from benchmarks.agents.scratch import GIT_ENV, TASKS, make_repo
from benchmarks.agents.specs import AGENTS, Context, Launch
from harness.daemon import free_port
from harness.load import cpu_burners

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "agents"
DEFAULT_CONTEXT = 8192
#: the built-in tools Claude Code is given by default: the ones the tasks need (read, edit, write, run tests)
CLAUDE_TOOLS = "Bash,Edit,Read,Write"
#: what agents.json keeps of the daemon's status after each agent
STATUS_KEYS = ("state", "busy_operation", "session_open", "last_error", "generation")


def _log(msg: str) -> None:
    print(f"agents: {msg}", file=sys.stderr, flush=True)


def _base_python() -> str:
    """The interpreter the project's venv was made from (the agents' venvs get the same Python version)."""
    base = Path(sys.base_prefix) / "bin" / "python3"
    return str(base) if base.exists() else "python3"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.agents", description=__doc__)
    p.add_argument("--only", default="", help=f"comma-separated agents to run (default: all of {','.join(AGENTS)})")
    p.add_argument("--timeout", type=float, default=0.0,
                   help=f"wall-clock seconds per agent and task (default {TIMEOUT_S:g}, and with --load N that "
                        "much more for each process N adds per CPU: the agents get the slower machine's time)")
    p.add_argument("--settle", type=float, default=60.0,
                   help="seconds to wait after an agent for the daemon to log the requests it left and go idle (default 60)")
    p.add_argument("--model", default="", help="the model name the agents are told (default: the first of /v1/models)")
    p.add_argument("--context", type=int, default=0,
                   help="the context window the agents are told (default: the daemon's effective context)")
    p.add_argument("--claude-tools", default=CLAUDE_TOOLS,
                   help=f"Claude Code's --tools: 'default' (its own dozen) or a list (default {CLAUDE_TOOLS}: "
                        "what the tasks use, so its first prompt fits the bundled model's trained 8,192 tokens)")
    p.add_argument("--output-tokens", type=int, default=2048,
                   help="the reply limit the agents are told, and the server's for a request that sets none "
                   "(default 2048)")
    p.add_argument("--outdir", type=Path, default=None, help="where logs and dumps go (default .cache/agents/runs/TIME)")
    p.add_argument("--backend", default=os.environ.get("MODELD_BACKEND", "auto"), help="modeld serve --backend")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for modeld serve (repeatable), e.g. --serve-arg=--num-ctx=16384")
    p.add_argument("--modeld", default="", help="the modeld command (default: the one beside this Python)")
    p.add_argument("--task", action="append", default=[], metavar="TASK",
                   help="what each agent is asked to do, one run of the agent per task, in order on the same "
                   f"repository (repeatable; default: the {len(TASKS)} of benchmarks.agents.scratch.TASKS)")
    p.add_argument("--tasks", type=int, default=0, metavar="N",
                   help="run only the first N tasks per agent (default: all; --task names them instead)")
    p.add_argument("--load", type=int, default=0, metavar="N",
                   help="run N CPU-bound processes beside the daemon for the whole run: a slower machine on demand")
    p.add_argument("--peer", choices=["llama-server"], default="",
                   help="then run the same agents and tasks against llama.cpp's llama-server (the file, window and "
                        "model name modeld served; built on first use) and print both tables side by side")
    p.add_argument("--kill-within", type=float, default=0.0, metavar="S",
                   help="kill each agent at a random moment of its first S seconds, as its own timeout would, and "
                        "time how soon the daemon's slot is free after (--seed picks the moments; 0: never)")
    p.add_argument("--seed", type=int, default=0, help="the seed of --kill-within's moments")
    p.add_argument("--install-only", action="store_true", help="install the agents and exit")
    p.add_argument("--reinstall", action="store_true", help="install the agents again even when the stamp matches")
    p.add_argument("--python", default=_base_python(),
                   help="the Python that makes the PyPI agents' venvs (default: the one this venv was made from)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(AGENTS)
    unknown = [n for n in names if n not in AGENTS]
    if unknown:
        p.error(f"unknown agent(s) {', '.join(unknown)}; known: {', '.join(AGENTS)}")
    args.agents = names
    args.task = args.task or list(TASKS)
    if args.tasks < 0 or args.load < 0:
        p.error("--tasks and --load take a count of 0 or more")
    if args.tasks:
        args.task = args.task[: args.tasks]
    if not args.timeout:
        args.timeout = load_timeout(args.load)
    return args


#: seconds an agent has for one task on a machine that runs nothing else
TIMEOUT_S = 420.0


def load_timeout(load: int, cpus: int | None = None) -> float:
    """The default time per agent and task beside ``load`` CPU-bound processes: ``TIMEOUT_S`` scaled by how many
    runnable processes share each CPU (two on two CPUs: twice), so a run under --load measures whether the
    agents complete, not whether they complete on a quiet machine's schedule."""
    cpus = cpus or usable_cpus()
    return TIMEOUT_S * (1 + load / cpus)


@contextlib.contextmanager
def cpu_load(n: int) -> Iterator[None]:
    """``n`` CPU-bound processes for the block (none for 0): what another program's work does to the daemon."""
    with cpu_burners(n) as pids:
        if pids:
            _log(f"load: {n} CPU-bound process(es) beside the daemon (pids {', '.join(map(str, pids))})")
        yield


def _modeld(arg: str) -> str:
    if arg:
        return arg
    beside = Path(sys.executable).parent / "modeld"
    if beside.exists():
        return str(beside)
    found = shutil.which("modeld")
    if found is None:
        raise DaemonError("no modeld command beside this Python nor on PATH (make serving installs it)")
    return found


def _kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def _launch(launch: Launch, log: Path, timeout: float) -> tuple[int | None, bool]:
    """Run it to the end or to ``timeout``; returns (exit code or None, timed out)."""
    with log.open("wb") as out:
        out.write(f"$ {' '.join(launch.argv)}\n".encode())
        out.flush()
        proc = await asyncio.create_subprocess_exec(
            *launch.argv, cwd=launch.cwd, env=launch.env, stdin=asyncio.subprocess.DEVNULL,
            stdout=out, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        try:
            try:
                code = await asyncio.wait_for(proc.wait(), timeout)
                return code, False
            except TimeoutError:
                _kill_group(proc.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), 5.0)
                except TimeoutError:
                    _kill_group(proc.pid, signal.SIGKILL)
                    await proc.wait()
                return None, True
        finally:
            if proc.returncode is None:
                _kill_group(proc.pid, signal.SIGKILL)
                await proc.wait()
            _kill_group(proc.pid, signal.SIGKILL)  # what it left behind in its session


class Run:
    """One harness run: a daemon, a proxy, the agents one after the other."""

    def __init__(self, args: argparse.Namespace, installed: Installed, outdir: Path, peer: Run | None = None) -> None:
        """``peer``: this run serves the agents with llama-server, on what that modeld run served them."""
        self.args = args
        self.peer_of = peer
        self.installed = installed
        self.outdir = outdir
        self.daemons = 0
        self.daemon: Daemon | None = None
        self.proxy: Proxy | None = None
        self.model = ""
        #: the model file the daemon serves ("" when its status did not say): a peer run serves the same
        self.model_path = ""
        self.context = 0
        self.health: dict[str, Any] = {}
        self.starts: list[float] = []  # when each agent started (wall clock)
        self.old_access: list[dict[str, Any]] = []  # the lines of daemons restarted since
        self._rng = random.Random(args.seed)  # the moments --kill-within kills the agents at

    async def start_daemon(self) -> Daemon:
        self.daemons += 1
        suffix = "" if self.daemons == 1 else f"-{self.daemons}"
        daemon: Daemon
        if self.peer_of is not None:
            from backends.bundled import served_bundled_gguf

            path = self.peer_of.model_path or str(served_bundled_gguf())
            daemon = LlamaServer(self.outdir / f"llama-server{suffix}.log", Path(path), self.peer_of.model,
                                 self.peer_of.context, "-n", str(self.args.output_tokens))
        else:
            # the reply limit the agents are told is also the server's for a request that sets none (Codex sends
            # none: a small model's reply that never ends would run to the context's end)
            daemon = Daemon(_modeld(self.args.modeld), self.outdir / f"daemon{suffix}.log", backend=self.args.backend,
                            extra=["--max-tokens", str(self.args.output_tokens), *self.args.serve_arg])
        try:
            self.health = await daemon.start()
        except BaseException:
            await daemon.stop()
            raise
        self.daemon = daemon
        if self.proxy is not None:
            self.proxy.upstream = ("127.0.0.1", daemon.port)
        return daemon

    async def setup(self) -> None:
        daemon = await self.start_daemon()
        _log(f"daemon ready at {daemon.url} ({self.health})")
        if self.peer_of is not None:
            self.model, self.context = self.peer_of.model, self.peer_of.context
            self.proxy = Proxy(("127.0.0.1", daemon.port), free_port())
            await self.proxy.start()
            _log(f"recording proxy at {self.proxy.url}; model {self.model!r}, context {self.context}")
            return
        self.model = self.args.model
        if not self.model:
            _, body = await asyncio.to_thread(get_json, daemon.url + "/v1/models")
            data = body.get("data") if isinstance(body, dict) else None
            if isinstance(data, list) and data and isinstance(data[0], dict):
                self.model = str(data[0].get("id", ""))
            self.model = self.model or str(self.health.get("model") or "")
        if not self.model:
            raise DaemonError("the daemon lists no model (/v1/models); name one with --model")
        self.context = self.args.context
        status = await asyncio.to_thread(daemon.status)
        active = (status or {}).get("active") or {}
        self.model_path = str(active.get("path") or "")
        if not self.context:
            self.context = int(active.get("effective_context") or 0) or DEFAULT_CONTEXT
        self.proxy = Proxy(("127.0.0.1", daemon.port), free_port())
        await self.proxy.start()
        _log(f"recording proxy at {self.proxy.url}; model {self.model!r}, context {self.context}")

    async def close(self) -> None:
        if self.proxy is not None:
            await self.proxy.stop()
        if self.daemon is not None:
            await self.daemon.stop()

    async def agent(self, name: str) -> AgentResult:
        assert self.daemon is not None and self.proxy is not None
        scratch = self.outdir / "scratch" / name
        home = scratch / "home"
        home.mkdir(parents=True, exist_ok=True)
        git_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1",
                   **GIT_ENV}
        changes = make_repo(scratch / "repo", git_env)
        self.proxy.begin(name, self.outdir / name)
        started = time.time()
        self.starts.append(started)
        t0 = time.monotonic()
        codes: list[int | None] = []
        timed_out = False
        kill_at = self._rng.uniform(5.0, self.args.kill_within) if self.args.kill_within else None
        killed: float | None = None
        for k, task in enumerate(self.args.task):
            ctx = Context(name=name, installed=self.installed, server=self.proxy.url, model=self.model,
                          context=self.context, output=min(self.args.output_tokens, self.context // 2),
                          task=task, repo=changes.repo, home=home, outdir=scratch,
                          claude_tools=self.args.claude_tools)
            launch = AGENTS[name](ctx)
            _log(f"{name} (task {k + 1}): {' '.join(launch.argv)}")
            log = self.outdir / (f"{name}.log" if k == 0 else f"{name}-{k + 1}.log")
            left = None if kill_at is None else kill_at - (time.monotonic() - t0)
            if left is not None and left <= self.args.timeout:
                code, cut = await _launch(launch, log, max(left, 0.0))
                if cut:  # the harness killed it: the daemon must let go of whatever it was doing for it
                    killed = time.monotonic() - t0
                    codes.append(None)
                    break
            else:
                code, timed_out = await _launch(launch, log, self.args.timeout)
            codes.append(code)
            if timed_out:
                break
        failed = [c for c in codes if c != 0]
        code = failed[0] if failed else (codes[-1] if codes else None)
        seconds = time.monotonic() - t0
        note = []
        aborted = self.proxy.abort()
        freed: float | None = None
        if killed is not None:
            freed = await asyncio.to_thread(self.free_after, 60.0)
            note.append(f"killed at {killed:.0f} s ({aborted} request(s) in flight); the slot was free "
                        + (f"{freed:.2f} s after" if freed is not None else "only past 60 s"))
        if aborted and killed is None:
            note.append(f"{aborted} request(s) still open when the agent ended were closed")
        if not await self.proxy.drain(10.0):
            note.append(f"{self.proxy.inflight} request(s) still in flight 10 s after the agent ended")
        requests = self.proxy.end()
        # A request the agent gave up on is logged when the daemon is done with it: wait for its line, so the
        # next agent starts on a free daemon (lines are matched to agents by when they started, in the end).
        settled = time.monotonic() + self.args.settle
        served = await self.settle(len(requests), self.args.settle)
        if served < len(requests):
            note.append(f"{len(requests) - served} request(s) had no access-log line "
                        f"{self.args.settle:.0f} s after the agent ended")
        status = await self.idle(settled - time.monotonic())
        if status and status.get("busy_operation"):
            note.append(f"the daemon was still busy ({status['busy_operation']}) "
                        f"{self.args.settle:.0f} s after the agent ended")
        daemon = self.daemon
        if daemon.proc is not None and daemon.proc.returncode is not None:
            note.append(f"the daemon exited ({daemon.proc.returncode}) during this run; restarted for the next")
            await daemon.stop()
            self.old_access += daemon.access
            await self.start_daemon()
        result = AgentResult(agent=name, argv=launch.argv, started=started, exit_code=code, timed_out=timed_out,
                             seconds=seconds, changed=changes.changed(), fixed=changes.fixed(), requests=requests,
                             diff=changes.diff(), note="; ".join(note),
                             daemon_after={k: status.get(k) for k in STATUS_KEYS} if status else None,
                             task_exits=codes, killed_at=killed, freed_s=freed)
        _log(f"{name}: {'timed out' if timed_out else f'exit {code}'} (tasks: {codes}) after {seconds:.0f} s, "
             f"{served} of {len(requests)} request(s) logged by the daemon, changed: {result.changed}")
        return result

    def free_after(self, timeout: float) -> float | None:
        """Seconds until no session holds the daemon's slot and nothing runs on it (None: not within ``timeout``),
        read with the runtime client: a ``modeld status`` process would take longer to start than the answer."""
        assert self.daemon is not None
        from runtime import Client

        t0 = time.monotonic()
        with Client(self.daemon.endpoint, timeout_s=10.0) as c:
            while time.monotonic() - t0 < timeout:
                st = c.status()
                if not st.session_open and not st.busy_operation:
                    return time.monotonic() - t0
                time.sleep(0.02)
        return None

    async def idle(self, timeout: float) -> dict[str, Any] | None:
        """The daemon's status once it has no operation running, or after ``timeout``; None if unreadable."""
        assert self.daemon is not None
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            status = await asyncio.to_thread(self.daemon.status)
            if status is None or not status.get("busy_operation") or time.monotonic() >= deadline:
                return status
            await asyncio.sleep(2.0)

    def records(self) -> list[dict[str, Any]]:
        return self.old_access + (self.daemon.access if self.daemon else [])

    async def settle(self, sent: int, timeout: float) -> int:
        """Wait up to ``timeout`` for the last agent's ``sent`` requests to be logged; returns how many are."""
        if self.peer_of is not None:
            return sent  # a peer writes no access log: the proxy's records are its figures
        deadline = time.monotonic() + timeout
        while True:
            served = len(assign(self.records(), self.starts)[-1])
            if served >= sent or time.monotonic() >= deadline:
                return served
            await asyncio.sleep(0.25)

    def attribute(self, results: list[AgentResult]) -> None:
        """Give each result the access-log lines of the requests it sent (a run cut short has fewer results); a
        peer's results get the figures the proxy recorded."""
        if self.peer_of is not None:
            for result in results:
                result.access = [AccessLine.from_proxied(r) for r in result.requests if r.get("method") == "POST"]
            return
        for result, recs in zip(results, assign(self.records(), self.starts), strict=False):
            result.access = [AccessLine.parse(r) for r in recs]


async def _run(args: argparse.Namespace, installed: Installed, outdir: Path,
               peer: Run | None = None) -> tuple[int, Run, list[AgentResult]]:
    run = Run(args, installed, outdir, peer)
    results: list[AgentResult] = []
    rc = 0
    try:
        try:
            await run.setup()
        except DaemonError as exc:
            _log(str(exc))
            return 2, run, results
        for name in args.agents:
            try:
                results.append(await run.agent(name))
            except DaemonError as exc:  # a daemon that died under an agent did not come back
                _log(f"stopping: {exc}")
                rc = 2
                break
    finally:
        run.attribute(results)
        await run.close()
        summary = {
            "server": "modeld" if peer is None else args.peer,
            "model": run.model, "context": run.context, "health": run.health, "task": args.task, "load": args.load,
            "timeout_s": args.timeout, "outdir": str(outdir),
            "agents": [r.as_json() for r in results],
        }
        (outdir / "agents.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False, default=str) + "\n")
    print(table(results))
    print(f"\nlogs, request dumps and agents.json in {outdir}")
    return rc, run, results


async def _runs(args: argparse.Namespace, installed: Installed, outdir: Path) -> int:
    """The agents against modeld; with ``--peer``, then against the peer on what modeld served, side by side."""
    rc, run, results = await _run(args, installed, outdir)
    if not args.peer or rc != 0:
        return rc
    _log(f"the same agents and tasks against {args.peer}")
    (outdir / args.peer).mkdir(exist_ok=True)
    rc, _, peer_results = await _run(args, installed, outdir / args.peer, run)
    print()
    print(side_by_side(results, peer_results, args.peer))
    return rc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        installed = ensure_installed(CACHE, python=args.python, force=args.reinstall)
    except InstallError as exc:
        _log(f"install failed: {exc}")
        return 2
    if args.install_only:
        _log(f"installed under {CACHE}")
        return 0
    outdir = args.outdir or CACHE / "runs" / time.strftime("%Y%m%d-%H%M%S")
    outdir = outdir.resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    with cpu_load(args.load):
        return asyncio.run(_runs(args, installed, outdir))
