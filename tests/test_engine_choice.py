"""``--backend auto`` (``modeld.engine_choice``): the rule on injected machines, and what this machine picks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.daemon import ROOT, DaemonProcess
from modeld.bootstrap import exclusive_settings, resolve_backend
from modeld.engine_choice import EngineFacts, choose_backend
from modeld.settings import ServeSettings

BOTH = frozenset({"llama", "openvino"})
X86 = EngineFacts(machine="x86_64", installed=BOTH, model_kind="gguf")


@pytest.mark.parametrize(
    ("change", "backend", "why"),
    [
        ({}, "openvino", "ran faster on OpenVINO"),
        ({"machine": "AMD64"}, "openvino", "ran faster on OpenVINO"),
        ({"model_kind": "ir"}, "openvino", "IR directory"),
        ({"num_gpu_layers": 20}, "llama", "GPU layers"),
        ({"exclusive": {"llama": "--flash-attn and --kv-cache-type q8_0"}}, "llama",
         "--kv-cache-type q8_0 asked for: llama.cpp settings"),
        ({"machine": "aarch64"}, "llama", "aarch64"),
        ({"installed": frozenset({"llama"})}, "llama", "OpenVINO is not installed"),
        ({"installed": frozenset()}, "llama", "OpenVINO is not installed"),
        ({"installed": frozenset({"openvino"})}, "openvino", "llama-cpp-python is not installed"),
        ({"installed": frozenset({"openvino"}), "num_gpu_layers": 20}, "openvino", "llama-cpp-python is not installed"),
        ({"refusals": {"openvino": "architecture 'gemma3' is not one of ['llama']"}}, "llama", "gemma3"),
        ({"model_kind": "other"}, "llama", "not a readable GGUF"),
        ({"model_kind": "ir", "installed": frozenset({"llama"})}, "llama",
         "an OpenVINO IR directory but OpenVINO is not installed (the load will say so)"),
        ({"model_kind": "ir", "installed": frozenset({"openvino"})}, "openvino", "IR directory"),
    ],
)
def test_the_rule_on_injected_machines(change: dict[str, object], backend: str, why: str) -> None:
    name, reason = choose_backend(EngineFacts(**{**X86.__dict__, **change}))  # type: ignore[arg-type]
    assert name == backend and why in reason


def test_the_reason_quotes_no_figure() -> None:
    """The evidence was measured on the project's machines: ``status`` on this one points at it, quoting none."""
    _, reason = choose_backend(X86)
    assert reason.endswith("(docs/benchmarks.md)") and not any(ch.isdigit() for ch in reason.replace("x86-64", ""))


def test_an_explicit_backend_always_wins() -> None:
    opts = ServeSettings(backend="llama", model="/nowhere.gguf")
    assert resolve_backend(opts) is opts


def test_exclusive_settings_are_named_for_auto() -> None:
    assert exclusive_settings(ServeSettings()) == {}
    assert exclusive_settings(ServeSettings(kv_cache_type="f16")) == {}  # OpenVINO serves an f16 cache too
    assert exclusive_settings(ServeSettings(exact_decode=True)) == {}  # and decodes exactly too
    assert exclusive_settings(ServeSettings(flash_attn=True, kv_cache_type="q8_0")) == {
        "llama": "--flash-attn and --kv-cache-type q8_0"}
    assert exclusive_settings(ServeSettings(kv_cache_type="q4_0")) == {"llama": "--kv-cache-type q4_0"}


@pytest.mark.parametrize(("option", "backend", "why"), [
    ("extra_bufts=false", "llama", "--engine-option extra_bufts asked for: llama.cpp settings OpenVINO does not offer"),
    ("inference_precision=f32", "openvino", "ran faster on OpenVINO"),
])
def test_an_engine_option_only_one_engine_takes_picks_it(option: str, backend: str, why: str) -> None:
    given = exclusive_settings(ServeSettings(engine_option=(option,)))
    assert given == {backend: f"--engine-option {option.partition('=')[0]}"}
    name, reason = choose_backend(EngineFacts(**{**X86.__dict__, "exclusive": given}))  # type: ignore[arg-type]
    assert (name, why in reason) == (backend, True), reason
    # an option no engine takes is no engine's: auto picks as without it, and the load refuses it
    assert exclusive_settings(ServeSettings(engine_option=("nonesuch=1",))) == {}


def test_auto_on_this_machine_names_the_engine_and_the_reason() -> None:
    pytest.importorskip("llama_cpp")
    opts = resolve_backend(ServeSettings(backend="auto"))  # the bundled model
    assert opts.backend in ("llama", "openvino") and opts.backend_reason.startswith("auto: ")
    not_a_model = resolve_backend(ServeSettings(backend="auto", model=__file__))
    assert not_a_model.backend == "llama" and "not a readable GGUF" in not_a_model.backend_reason


@pytest.mark.openvino
def test_a_daemon_started_with_auto_says_which_engine_and_why(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    pytest.importorskip("openvino_genai")
    picked = resolve_backend(ServeSettings(backend="auto"))
    d = DaemonProcess(tmp_path, "auto", None, "--cache-ram", "0", "--cache-disk", "0").start(wait_state=("Ready",))
    try:
        with d.client() as c:
            st = c.status()
        assert st.backend == picked.backend and st.backend_reason == picked.backend_reason
        out = subprocess.run([sys.executable, "-m", "modeld", "status", "--endpoint", d.endpoint],
                             capture_output=True, text=True, cwd=ROOT, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert f"{picked.backend} " in out.stdout and "(auto: " in out.stdout, out.stdout
    finally:
        d.stop()
