"""The scratch repository each agent works on: a tiny Python project with one bug, committed once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["TASKS", "Changes", "make_repo"]

#: a run's tasks: the same agent again and again on the same repository, as a user's next requests are (their
#: requests share the agent's system prompt and tools with the first task's, which the daemon keeps warm). Four,
#: not one: an agent's first request is cold on any server, and with a model this small an agent ends a task
#: in one or two requests where a capable one makes several, so a session of one task measures little more
#: than that first prefill
TASKS = (
    "Fix the bug in calc.py so that add returns the sum.",
    "Add a test to test_calc.py that checks add(2, 3) == 5.",
    "Add a function sub(a, b) to calc.py that returns a minus b.",
    "Add a test for sub to test_calc.py.",
)

FILES = {
    "calc.py": '"""Small arithmetic helpers."""\n\n\ndef add(a, b):\n    """Return the sum of a and b."""\n    return a - b\n\n\n'
               'def mul(a, b):\n    """Return the product of a and b."""\n    return a * b\n',
    "test_calc.py": "from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
                    "def test_mul():\n    assert mul(2, 3) == 6\n",
    "README.md": "# calc\n\nArithmetic helpers. Run the tests with `python -m pytest`.\n",
}

#: the agents' own state in a repository (aider's history files, per-project settings) is not a change
IGNORE = "__pycache__/\n.pytest_cache/\n.aider*\n.claude/\n.qwen/\n.opencode/\n.codex/\n"

GIT_ENV = {"GIT_AUTHOR_NAME": "modeld agents", "GIT_AUTHOR_EMAIL": "agents@modeld.invalid",
           "GIT_COMMITTER_NAME": "modeld agents", "GIT_COMMITTER_EMAIL": "agents@modeld.invalid"}


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                         stdin=subprocess.DEVNULL)
    return out.stdout


class Changes:
    """What an agent did to its repository since ``make_repo``."""

    def __init__(self, repo: Path, base: str) -> None:
        self.repo = repo
        self.base = base

    def porcelain(self) -> str:
        return _git(self.repo, "status", "--porcelain", "--untracked-files=all")

    def head(self) -> str:
        return _git(self.repo, "rev-parse", "HEAD").strip()

    def diff(self) -> str:
        """The tracked changes against the first commit (commits the agent made included)."""
        return _git(self.repo, "diff", self.base)

    def changed(self) -> bool:
        return bool(self.porcelain().strip()) or self.head() != self.base

    def fixed(self) -> bool:
        """Whether ``calc.add`` now returns the sum (checked in a child interpreter with a timeout)."""
        check = "import calc, sys; sys.exit(0 if calc.add(2, 3) == 5 and calc.add(-1, 1) == 0 else 1)"
        try:
            rc = subprocess.run([sys.executable, "-c", check], cwd=self.repo, capture_output=True, timeout=20,
                                check=False, stdin=subprocess.DEVNULL).returncode
        except (OSError, subprocess.TimeoutExpired):
            return False
        return rc == 0


def make_repo(repo: Path, env: dict[str, str]) -> Changes:
    """Create the repository at ``repo`` with its first commit; ``env`` is the git environment to use."""
    repo.mkdir(parents=True, exist_ok=True)
    for name, text in FILES.items():
        (repo / name).write_text(text)
    (repo / ".gitignore").write_text(IGNORE)
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True, env=env, stdin=subprocess.DEVNULL)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True, env=env, stdin=subprocess.DEVNULL)
    subprocess.run(["git", "-C", str(repo), "commit", "-q", "-m", "calc: add and mul"], check=True, env=env,
                   stdin=subprocess.DEVNULL)
    base = _git(repo, "rev-parse", "HEAD").strip()
    return Changes(repo, base)
