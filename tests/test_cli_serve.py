"""The daemon side of the ``modeld`` command: ``serve`` and ``prepare``, and the composition root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.memory import MemoryBackend
from contract.messages import StatusRequest
from contract.types import SlotState, owner_fingerprint
from harness.daemon import ROOT, DaemonProcess
from modeld.bootstrap import build_daemon, build_slot, preload_request
from modeld.settings import ServeSettings


def modeld(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "modeld", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout
    )


def test_prepare_help_says_what_it_converts_and_where() -> None:
    out = modeld("prepare", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for words in ("OpenVINO IR", "all-MiniLM-L6-v2", "GGUF", "MODELD_MODEL_CACHE", "converts nothing", "--only"):
        assert words in text, words
    assert str(ROOT / ".cache" / "models") in text or "MODELD_MODEL_CACHE" in os.environ


def test_prepare_twice_converts_nothing_the_second_time() -> None:
    # The first run is what `make setup` did already (it converts only what is missing).
    first = modeld("prepare", timeout=1800)
    assert first.returncode == 0, first.stderr
    outputs = [Path(line) for line in first.stdout.splitlines()]
    # two IRs (the bundled model and the context-extended copy serve uses), the embedder's GGUF and its IR
    assert len(outputs) == 4 and all(p.exists() for p in outputs), first.stdout

    def stamps() -> dict[Path, tuple[int, int]]:
        files = [f for p in outputs for f in ([p] if p.is_file() else sorted(p.rglob("*")))]
        return {f: (f.stat().st_mtime_ns, f.stat().st_size) for f in files}

    before = stamps()
    second = modeld("prepare")
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    assert stamps() == before


def test_prepare_refuses_a_missing_gguf(tmp_path: Path) -> None:
    out = modeld("prepare", "--only", "openvino", "--gguf", str(tmp_path / "missing.gguf"))
    assert out.returncode == 1 and out.stderr.startswith("modeld prepare:") and "missing.gguf" in out.stderr


def test_serve_help_and_bad_arguments() -> None:
    out = modeld("serve", "--help")
    assert out.returncode == 0 and "--mem-max" in out.stdout and "--backend" in out.stdout
    bad = modeld("serve", "--backend", "nope")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_the_cli_imports_no_daemon_for_client_commands() -> None:
    """``modeld status`` and friends never import the daemon, the planner or a backend."""
    code = (
        "import sys; import modeld.cli, runtime.cli; "
        "bad = sorted(m for m in sys.modules if m.startswith(('backends', 'modeld.server', 'modeld.capacity', "
        "'modeld.bootstrap', 'modeld.__main__'))); print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


#: the engine table: the registry, the spec types (``backends.engine_spec``), the model formats, and each engine's
#: light package and spec
TABLE_MODULES = ("backends", "backends.registry", "backends.engine_spec", "backends.formats", "backends.memory_spec",
                 *(f"backends.{name}{part}" for name in ("llama", "openvino", "vllm") for part in ("", ".spec")))
#: the engines' own libraries (openvino covers openvino_genai and openvino_tokenizers)
ENGINE_LIBRARIES = ("llama_cpp", "openvino", "torch", "httpx")


@pytest.mark.parametrize("modules", ["backends.registry",
                                     "modeld.serve, modeld.prepare, modeld.slot, modeld.embedding_slot, modeld.capacity"])
def test_only_the_composition_root_imports_backends(modules: str) -> None:
    """Starting the daemon reads the engine table (``backends.registry``, the engines' specs and the model formats
    they list, ``backends.formats``, which import no engine) and nothing else of the backends until an engine is
    built; the table alone imports no engine's library."""
    code = (
        f"import sys, {modules}; "
        f"bad = sorted(m for m in sys.modules if m.startswith('backends') and m not in {TABLE_MODULES!r}"
        f" or m.startswith({ENGINE_LIBRARIES!r})); print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_bootstrap_takes_a_backend_through_the_same_door(tmp_path: Path) -> None:
    """The daemon itself is built the same way by every ``modeld serve`` the daemon tests start."""
    opts = ServeSettings(backend="memory", owner="o")
    slot = build_slot(opts, f"ipc://{tmp_path / 'm.sock'}", MemoryBackend())
    st = slot.status()
    assert (st.backend, st.state, st.owner_instance_id, st.embedding) == ("memory", SlotState.EMPTY, owner_fingerprint("o"), None)
    assert preload_request(opts) is None  # the memory backend preloads nothing unless asked
    req = preload_request(ServeSettings(backend="memory", model="/m/x", num_ctx=64))
    assert req is not None and (req.model_name, req.type, req.config.num_ctx) == ("x", "memory", 64)
    assert preload_request(ServeSettings(backend="llama", no_preload=True)) is None
    req = preload_request(ServeSettings(backend="llama", flash_attn=True, kv_cache_type="q8_0"))
    assert req is not None and (req.config.flash_attn, req.config.kv_cache_type) == (True, "q8_0")
    assert not req.config.exact_decode
    req = preload_request(ServeSettings(backend="openvino", exact_decode=True))
    assert req is not None and req.config.exact_decode


def test_a_queued_preload_reads_as_loading_before_the_worker_takes_it(tmp_path: Path) -> None:
    """Right after ``serve`` starts, the slot is still Empty while its preload waits for the worker; status
    must not tell a client polling for readiness that there is no model (the bench and supervisors poll)."""
    opts = ServeSettings(backend="memory", model="/m/x", num_ctx=64, data_dir=tmp_path / "data",
                        endpoint=f"ipc://{tmp_path / 'm.sock'}")
    daemon = build_daemon(opts, MemoryBackend())
    try:
        assert daemon.handlers.status(b"", StatusRequest()).state is SlotState.EMPTY
        req = preload_request(opts)
        assert req is not None
        daemon.preload(req)
        st = daemon.handlers.status(b"", StatusRequest())  # the worker has not started: nothing has run
        assert (st.state, st.busy_operation) == (SlotState.LOADING, "load")
    finally:
        daemon.close()  # never served
    with DaemonProcess(tmp_path / "proc", "memory", None, "--model", "/m/x", "--num-ctx", "64") as d, d.client() as c:
        # start() returns at the first Ready or Empty: with a preload it is Ready (Empty would be a lie)
        assert c.status().state is SlotState.READY


@pytest.mark.parametrize("backend", ["llama", "openvino"])
def test_bootstrap_preloads_the_bundled_model(backend: str) -> None:
    req = preload_request(ServeSettings(backend=backend))
    assert req is not None and req.model_name == "smollm2-135m-instruct" and req.path.endswith(".gguf")


def test_version_and_help_list_every_command() -> None:
    from harness.daemon import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "modeld", "--version"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("modeld ")
    out = subprocess.run([sys.executable, "-m", "modeld", "--help"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    for command in ("serve", "prepare", "http", "keys", "status", "load", "unload", "describe", "embed", "run", "cache", "chat"):
        assert f"    {command} " in out.stdout, command
