"""A daemon never loses its working model to a bad load, and ``serve --model BAD`` fails loudly (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from contract.errors import ModelLoadFailed
from contract.types import LoadModelRequest
from harness.daemon import ROOT, DaemonProcess

pytestmark = pytest.mark.llama


def test_serve_exits_non_zero_when_its_model_does_not_load(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))  # the magic, then garbage
    out = subprocess.run(
        [sys.executable, "-m", "modeld", "serve", "--backend", "llama", "--model", str(bad),
         "--endpoint", f"ipc://{tmp_path / 's.sock'}", "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, cwd=ROOT, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 1, out.stderr
    assert "could not load the model to serve" in out.stderr and "ModelLoadFailed" in out.stderr
    assert not (tmp_path / "s.sock").exists()  # it cleaned up after itself


def test_a_rejected_switch_leaves_the_working_model_serving(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from backends.bundled import bundled_gguf_path

    good = bundled_gguf_path()
    broken = tmp_path / "broken.gguf"
    data = good.read_bytes()
    # one tensor renamed in the header: the file parses (and plans) but llama.cpp refuses the model
    assert data.count(b"output_norm.weight") == 1
    broken.write_bytes(data.replace(b"output_norm.weight", b"output_norm.weighX"))
    d = DaemonProcess(tmp_path, "llama", None, "--cache-ram", "0", "--cache-disk", "0").start(wait_state=("Ready",))
    with d, d.client(timeout_s=120.0) as c:
        before = c.status()
        assert before.active is not None
        with pytest.raises(ModelLoadFailed):
            c.load_model(LoadModelRequest(model_name="broken", type="llama", path=str(broken)))
        st = c.status()
        assert st.state.value == "Ready" and st.active is not None
        assert st.active.digest == before.active.digest and st.last_error.startswith("ModelLoadFailed")
        reply = c.chat([{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0.0)
        assert reply.usage.completion_tokens > 0
