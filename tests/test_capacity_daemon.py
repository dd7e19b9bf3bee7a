"""Memory-budgeted sizing through the real daemon: describe, clamping and refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.bundled import bundled_gguf_path
from contract.errors import InsufficientMemory
from contract.types import Config, LoadModelRequest, OpenSessionRequest, SlotState
from harness.daemon import ROOT, DaemonProcess


def test_load_that_cannot_fit_is_refused_and_daemon_keeps_serving(tmp_path: Path) -> None:
    model = str(bundled_gguf_path())
    with DaemonProcess(tmp_path, "llama", None, "--no-preload", "--mem-max", "60MB") as d, d.client(timeout_s=120) as c:
        with pytest.raises(InsufficientMemory) as exc:
            c.load_model(LoadModelRequest(model_name="smol", path=model, type="llama"))
        msg = exc.value.message
        assert "60000000 bytes" in msg and "--mem-max" in msg and "minimum context" in msg, msg
        details = exc.value.details
        assert details["usable_bytes"] == 60_000_000 and details["limit"] == "user_limit"
        assert details["required_bytes"] > details["usable_bytes"]
        st = c.status()
        assert st.state is SlotState.EMPTY and st.active is None
        # The CLI says the same and exits non-zero.
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        out = subprocess.run(
            [sys.executable, "-m", "modeld", "load", "smol", "--path", model, "--endpoint", d.endpoint],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
        )
        assert out.returncode == 1 and "InsufficientMemory" in out.stderr
        assert c.status().state is SlotState.EMPTY


def test_describe_clamps_with_a_reason_and_status_shows_the_window(tmp_path: Path) -> None:
    model = str(bundled_gguf_path())
    # Room for the weights and overhead plus only a small window of KV.
    with DaemonProcess(tmp_path, "llama", None, "--no-preload", "--mem-max", "400MiB") as d, d.client(timeout_s=120) as c:
        big = c.describe(OpenSessionRequest(path=model, config=Config(num_ctx=8192)))
        assert big.model_max_context == 8192
        assert big.effective_context <= 8192
        assert big.required_bytes <= big.usable_bytes
        if big.effective_context < 8192:
            assert big.clamped and big.reason in ("memory", "user_limit", "reserve")
        over = c.describe(OpenSessionRequest(path=model, config=Config(num_ctx=100_000)))
        assert over.effective_context <= 8192 and over.clamped
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        out = subprocess.run(
            [sys.executable, "-m", "modeld", "describe", "--path", model, "--json", "--endpoint", d.endpoint],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
        )
        assert out.returncode == 0, out.stderr
        body = json.loads(out.stdout)
        for key in ("model_max_context", "effective_context", "kv_bytes_per_token", "required_bytes", "usable_bytes", "reason"):
            assert key in body
        active = c.load_model(LoadModelRequest(model_name="smol", path=model, type="llama"))
        st = c.status()
        assert st.active is not None
        assert st.active.effective_context == active.effective_context > 0
        assert st.active.resident_bytes > 0
