"""How the bench starts its peers: ``llama-server`` lays the weights out as the daemon does on this CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import llama_server


@pytest.mark.llama
@pytest.mark.parametrize("extra_bufts", ["1", "0"])
def test_llama_server_repacks_the_weights_only_where_the_daemon_does(monkeypatch: pytest.MonkeyPatch,
                                                                      extra_bufts: str) -> None:
    """Where llama.cpp's extra weight buffers (AMX, repacking) are off for the daemon (a CPU whose AMX kernels
    crash on the bundled model, or ``MODELD_LLAMA_EXTRA_BUFTS=0``), ``llama-server`` runs with ``--no-repack``."""
    pytest.importorskip("llama_cpp")
    from backends.llama.native import extra_bufts_default

    monkeypatch.setenv("MODELD_LLAMA_EXTRA_BUFTS", extra_bufts)
    monkeypatch.setattr(llama_server, "ensure_built", lambda: Path("/opt/llama-server"))
    argv = llama_server.command(Path("model.gguf"), 4096, 8080)
    assert argv[0] == "/opt/llama-server" and argv[argv.index("-c") + 1] == "4096"
    assert ("--no-repack" in argv) is (not extra_bufts_default()) is (extra_bufts == "0")
