"""The CI guard in ``tests/conftest.py``: in CI a suite whose engine does not import fails instead of skipping.

A skip is for a developer's partial install; a green CI run that ran no engine test would prove nothing.
Shown as CI sees it: pytest run in a subprocess with ``CI=true``, once with llama-cpp-python made to fail
its import (a module of that name earlier on the path) and once as installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ci_pytest(extra_path: Path | None) -> subprocess.CompletedProcess[str]:
    path = [str(extra_path)] if extra_path is not None else []
    env = {**os.environ, "CI": "true", "PYTHONPATH": os.pathsep.join([*path, str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_errors.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_ci_run_without_an_engine_fails(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    (tmp_path / "llama_cpp.py").write_text('raise ImportError("llama-cpp-python is not installed")\n')
    out = _ci_pytest(tmp_path)
    assert out.returncode != 0, out.stdout
    assert "would only skip" in out.stdout + out.stderr and "llama_cpp (ImportError" in out.stdout + out.stderr
    # the same run with the engine as installed passes: it is the missing import that fails it
    assert _ci_pytest(None).returncode == 0
