"""The client install: ``pip install .`` with no extra, in a fresh virtual environment.

It must pull pydantic, msgpack and pyzmq (and what they depend on) and nothing
else — no engine, no torch, no psutil or prometheus-client — and still import
``runtime`` and answer ``modeld status`` against a real daemon. A daemon
command there names the extra it needs instead of ending in a traceback.

The project is copied out of the working tree first, so the build writes
nothing next to the sources. pip uses its configured index (and its cache);
when the index cannot be reached the module is skipped, saying so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.daemon import ROOT, DaemonProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: what the client install must not bring (distribution names, normalised)
DAEMON_ONLY = ("torch", "openvino", "openvino-genai", "llama-cpp-python", "psutil", "prometheus-client", "numpy")
#: the client's own dependencies (pyproject's `dependencies`)
CLIENT_DEPS = ("pydantic", "msgpack", "pyzmq")
#: what a fresh venv holds before anything is installed
VENV_SEED = ("pip", "setuptools")
PROJECT_FILES = ("pyproject.toml", "README.md", "contract", "runtime", "modeld", "backends")
PIP_TIMEOUT_S = 240


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MODELD_ENDPOINT", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv with the project installed without extras; yields its directory."""
    tmp = tmp_path_factory.mktemp("client-install")
    venv.create(tmp / "venv", with_pip=True)
    py = tmp / "venv" / "bin" / "python"
    # Probe the index first: the build needs setuptools, the install the three client packages.
    probe = _run([str(py), "-m", "pip", "download", "-q", "--no-deps", "--dest", str(tmp / "probe"),
                  "setuptools>=68", "msgpack>=1.0.5,<2"], tmp, timeout=PIP_TIMEOUT_S)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        pytest.skip(f"the package index is not reachable, so nothing can be installed: {last}")
    src = tmp / "src"
    src.mkdir()
    for name in PROJECT_FILES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    res = _run([str(py), "-m", "pip", "install", "-q", str(src)], tmp, timeout=PIP_TIMEOUT_S)
    assert res.returncode == 0, f"pip install . failed:\n{res.stdout}\n{res.stderr}"
    yield tmp / "venv"


def _installed(env_dir: Path) -> dict[str, list[str]]:
    """Each installed distribution of the venv → its unconditional requirements' names."""
    script = (
        "import importlib.metadata as m, json, re\n"
        "out = {}\n"
        "for d in m.distributions():\n"
        "    reqs = [r for r in (d.requires or []) if 'extra ==' not in r]\n"
        "    out[d.metadata['Name']] = [re.split(r'[ ;<>=!~\\[(]', r, maxsplit=1)[0] for r in reqs]\n"
        "print(json.dumps(out))\n"
    )
    res = _run([str(env_dir / "bin" / "python"), "-c", script], env_dir.parent)
    assert res.returncode == 0, res.stderr
    return {_norm(k): [_norm(r) for r in v] for k, v in json.loads(res.stdout).items()}


def test_client_install_is_the_client_dependencies_and_nothing_else(client_venv: Path) -> None:
    installed = _installed(client_venv)
    assert "modeld" in installed
    assert set(installed["modeld"]) == set(CLIENT_DEPS)
    # the closure of modeld's requirements, plus what the venv started with
    closure: set[str] = set()
    todo = ["modeld"]
    while todo:
        name = todo.pop()
        if name not in closure:
            closure.add(name)
            todo += installed.get(name, [])
    assert set(installed) - closure - set(VENV_SEED) == set()
    assert not set(installed) & set(DAEMON_ONLY), sorted(set(installed) & set(DAEMON_ONLY))


def test_client_install_imports_runtime_without_the_daemon(client_venv: Path) -> None:
    script = (
        "import sys, runtime, runtime.cli, contract\n"
        "from runtime import Chat, Client\n"
        "loaded = sorted(m for m in ('psutil', 'prometheus_client', 'numpy', 'modeld.server', 'modeld.serve') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
        "try:\n"
        "    import psutil\n"
        "except ModuleNotFoundError:\n"
        "    print('no psutil')\n"
        "print(runtime.__file__)\n"
    )
    res = _run([str(client_venv / "bin" / "python"), "-c", script], client_venv.parent)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "no psutil"
    assert Path(lines[1]).is_relative_to(client_venv), lines[1]  # the installed copy, not the checkout


def test_client_install_answers_status_against_a_real_daemon(client_venv: Path, tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "daemon", "memory") as d:
        assert d.proc is not None
        res = _run([str(client_venv / "bin" / "modeld"), "status", "--endpoint", d.endpoint, "--json"], client_venv.parent)
        assert res.returncode == 0, res.stderr
        status = json.loads(res.stdout)
        assert status["pid"] == d.proc.pid
        assert status["backend"] == "memory"
        assert status["state"] == "Empty"


def test_a_daemon_command_in_the_client_install_names_the_missing_extra(client_venv: Path, tmp_path: Path) -> None:
    res = _run([str(client_venv / "bin" / "modeld"), "serve", "--backend", "memory",
                "--endpoint", f"ipc://{tmp_path / 'never.sock'}", "--data-dir", str(tmp_path / "data")], client_venv.parent)
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    assert "needs the project's 'server' extra" in res.stderr, res.stderr
    assert "pip install '.[server]'" in res.stderr
    assert not (tmp_path / "data").exists()  # refused before it built anything

