"""In CI every suite's imports must work: an engine that does not import fails the run instead of skipping its
tests quietly (``tests/conftest.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness.daemon import ROOT


def _pytest(tmp_path: Path, ci: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "llama_cpp.py").write_text('raise ImportError("not installed on this machine")\n')
    env = {**os.environ, "CI": ci, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_errors.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_ci_run_without_an_engine_fails(tmp_path: Path) -> None:
    run = _pytest(tmp_path, "true")
    assert run.returncode == 1, run.stdout[-2000:]
    assert "llama_cpp (ImportError: not installed on this machine)" in run.stdout + run.stderr


def test_a_developer_run_without_an_engine_goes_on(tmp_path: Path) -> None:
    run = _pytest(tmp_path, "")
    assert run.returncode == 0, run.stdout[-2000:]


def test_every_knob_the_suite_reads_survives_the_scrub_of_the_developer_s_settings() -> None:
    """``tests/conftest.py`` drops every MODELD_* variable before a test runs; a knob the suite itself reads (the
    examples ``make fuzz`` asks for) must be kept, or the run silently uses the suite's default."""
    import re

    from tests.conftest import SUITE_KNOBS

    read = set()
    for path in (ROOT / "tests").glob("*.py"):
        read |= set(re.findall(r"""os\.environ(?:\.get\(|\[)["'](MODELD_[A-Z0-9_]+)""", path.read_text()))
    assert read, "no knob found: the pattern no longer matches how the suite reads them"
    assert read <= set(SUITE_KNOBS), sorted(read - set(SUITE_KNOBS))
