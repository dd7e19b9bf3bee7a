"""The agents, installed at pinned versions into a scratch prefix (``.cache/agents``), never into the project's venv.

npm packages go into one ``npm install --prefix``; each PyPI agent gets its own venv (their dependencies
conflict with the project's and with each other's). ``installed.json`` records what was installed; an
install whose pins match it is skipped.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NPM_PACKAGES", "OPENCODE_PLUGIN", "PYPI_AGENTS", "InstallError", "Installed", "ensure_installed"]

#: npm packages, one install
NPM_PACKAGES = (
    "opencode-ai@1.18.33",
    "@openai/codex@0.171.0",
    "@anthropic-ai/claude-code@2.1.332",
    "@qwen-code/qwen-code@0.24.4",
)
#: OpenCode installs this package into each config directory it reads unless it is there already; installed
#: once here, each scratch config directory links to it, so OpenCode never reaches for the registry at run time
OPENCODE_PLUGIN = "@opencode-ai/plugin@1.18.33"
#: venv name -> requirement
PYPI_AGENTS = {
    "aider": "aider-chat==0.86.2",
    "mini": "mini-swe-agent==2.4.6",
    "llm": "llm==0.36",
}
STAMP = "installed.json"


class InstallError(RuntimeError):
    """An install step failed (its log names the step)."""


@dataclass(frozen=True)
class Installed:
    """Where the installed agents live."""

    root: Path

    @property
    def npm_bin(self) -> Path:
        return self.root / "npm" / "node_modules" / ".bin"

    @property
    def opencode_config(self) -> Path:
        """A directory holding ``OPENCODE_PLUGIN`` installed (package.json, package-lock.json, node_modules)."""
        return self.root / "opencode-config"

    def venv_bin(self, name: str) -> Path:
        return self.root / "venvs" / name / "bin"

    def exe(self, name: str) -> str:
        """The path of an agent's command (``opencode``, ``aider`` …)."""
        for d in (self.npm_bin, *(self.venv_bin(v) for v in PYPI_AGENTS)):
            if (d / name).exists():
                return str(d / name)
        raise InstallError(f"{name} is not installed under {self.root}")


def _pins() -> dict[str, object]:
    return {"npm": list(NPM_PACKAGES), "opencode_plugin": OPENCODE_PLUGIN, "pypi": dict(PYPI_AGENTS)}


def _run(cmd: list[str], log: Path) -> None:
    print(f"agents: {' '.join(cmd)}", file=sys.stderr, flush=True)
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False).returncode
    if rc:
        raise InstallError(f"`{' '.join(cmd)}` exited {rc} (log: {log})")


def ensure_installed(root: Path, *, python: str = "python3", force: bool = False) -> Installed:
    """Install the pinned agents under ``root`` unless ``root/installed.json`` already records these pins."""
    root.mkdir(parents=True, exist_ok=True)
    stamp = root / STAMP
    pins = _pins()
    if not force and stamp.exists():
        try:
            if json.loads(stamp.read_text()) == pins:
                return Installed(root)
        except ValueError:
            pass
    if shutil.which("npm") is None:
        raise InstallError("npm is not on PATH (Node.js is needed for opencode, codex, claude and qwen)")
    stamp.unlink(missing_ok=True)
    log = root / "install.log"
    log.write_text("")
    npm = root / "npm"
    npm.mkdir(exist_ok=True)
    _run(["npm", "install", "--prefix", str(npm), "--no-audit", "--no-fund", "--save-exact", *NPM_PACKAGES], log)
    plugin = root / "opencode-config"
    plugin.mkdir(exist_ok=True)
    _run(["npm", "install", "--prefix", str(plugin), "--no-audit", "--no-fund", "--save-exact", OPENCODE_PLUGIN], log)
    for name, req in PYPI_AGENTS.items():
        venv = root / "venvs" / name
        if not (venv / "bin" / "python").exists():
            _run([python, "-m", "venv", str(venv)], log)
        _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", req], log)
    stamp.write_text(json.dumps(pins, indent=2) + "\n")
    return Installed(root)
