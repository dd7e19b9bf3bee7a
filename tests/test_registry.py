"""The engine table (``backends.registry``): an engine is one entry, and bootstrap, ``auto`` and the CLI read it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from backends.engine_spec import BackendSettings, EngineFacts, EngineSpec
from backends.memory import MemoryBackend
from backends.registry import ENGINES
from contract.interfaces import Backend, StateCache
from contract.sizing import OverheadModel
from contract.types import Config
from modeld import bootstrap, cli
from modeld.bootstrap import build_backend, build_slot, preload_request, prepare_models, resolve_backend
from modeld.engine_choice import choose_backend
from modeld.settings import ServeSettings

#: a module no extra of the project brings: the fake engine's "package" when it is not installed
MISSING_MODULE = "modeld_fake_engine_runtime"


class FakeEngineBackend(MemoryBackend):
    """The contract's reference backend under another name: what the fake engine builds."""

    def __init__(self, cache: StateCache | None, settings: BackendSettings) -> None:
        super().__init__()
        self.cache, self.speculative = cache, settings.speculative


class FakeEmbedder:
    """An embedding engine factory that is never asked to load (``contract.interfaces.EngineFactory``)."""

    backend = "fake"


def fake_backend(cache: StateCache | None, settings: BackendSettings) -> Backend:
    return FakeEngineBackend(cache, settings)


def missing_backend(cache: StateCache | None, settings: BackendSettings) -> Backend:
    __import__(MISSING_MODULE)  # an engine's factory imports its package when called
    raise AssertionError("unreachable")


def fake_prepare(gguf: Path | None, log: Any) -> list[Path]:
    log(f"fake conversion of {gguf}")
    return [Path("/fake/out")]


#: the one entry the fake engine needs: installed as the module ``json`` is, asked first by ``auto``, taking any
#: model without fast-paths of its own
FAKE = EngineSpec(
    name="fake",
    title="Fake",
    package="json",
    extra="fake",
    modules=(MISSING_MODULE,),
    missing="Fake is not installed",
    overhead=OverheadModel(name="fake", fixed_bytes=0),
    backend=fake_backend,
    embedder=lambda: FakeEmbedder,  # type: ignore[arg-type,return-value]
    prepare=fake_prepare,
    auto_rank=0,
    prefers=lambda f: (f.machine == "fake-cpu" or f.model_kind == "other", "the fake engine takes this model"),
    exclusive_settings=lambda cfg: "--num-ctx 123" if cfg.num_ctx == 123 else "",
)


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> EngineSpec:
    monkeypatch.setitem(ENGINES, FAKE.name, FAKE)
    return FAKE


def test_bootstrap_builds_a_registered_engine(fake_engine: EngineSpec, tmp_path: Path) -> None:
    opts = ServeSettings(backend="fake", speculative=False, cache_ram=0, cache_disk=0, data_dir=tmp_path)
    backend = build_backend(opts)
    assert isinstance(backend, FakeEngineBackend) and not backend.speculative
    slot = build_slot(opts, f"ipc://{tmp_path / 'f.sock'}")
    assert slot.status().backend == "memory"  # the fake serves as the reference backend it wraps
    req = preload_request(opts)  # an engine preloads the bundled model
    assert req is not None and req.type == "fake" and req.path.endswith(".gguf")
    assert "fake" in bootstrap.prepare_steps()
    logged: list[str] = []
    assert prepare_models(only="fake", gguf=Path("/m.gguf"), log=logged.append) == [Path("/fake/out")]
    assert logged == ["fake conversion of /m.gguf"]


def test_auto_considers_a_registered_engine(fake_engine: EngineSpec) -> None:
    installed = frozenset({"fake", "llama", "openvino"})
    assert choose_backend(EngineFacts(machine="fake-cpu", installed=installed, model_kind="gguf")) == (
        "fake", "the fake engine takes this model")
    # declined, it leaves the model to the others, which decide as they would without it
    name, reason = choose_backend(EngineFacts(machine="x86_64", installed=installed, model_kind="gguf"))
    assert name == "openvino" and "ran faster on OpenVINO" in reason
    # its exclusive settings reach the others through the facts bootstrap gathers
    assert bootstrap.exclusive_settings(ServeSettings(num_ctx=123)) == {"fake": "--num-ctx 123"}
    # bootstrap finds it installed (its package is importable) and picks it for a model the others cannot read
    picked = resolve_backend(ServeSettings(backend="auto", model=__file__))
    assert (picked.backend, picked.backend_reason) == ("fake", "auto: the fake engine takes this model")


def test_the_cli_names_a_registered_engines_extra(
    fake_engine: EngineSpec, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.extra_of_module(MISSING_MODULE) == "fake"
    assert cli.extra_of_module("openvino_genai") == "openvino" and cli.extra_of_module("llama_cpp") == "llama"
    assert cli.extra_of_module("psutil") == "server" and cli.extra_of_module("nothing_we_know") is None
    # `modeld serve --backend fake` without its package: the CLI says which extra installs it
    broken = EngineSpec(**{**FAKE.__dict__, "backend": missing_backend})
    monkeypatch.setitem(ENGINES, FAKE.name, broken)
    monkeypatch.setattr(cli, "_daemon_main", lambda command: lambda rest: build_backend(ServeSettings(backend="fake")))
    assert cli.main(["serve"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert f"module {MISSING_MODULE!r} is not installed" in err and "pip install '.[fake]'" in err
    assert MISSING_MODULE not in sys.modules


def test_the_reference_backend_is_an_entry_auto_never_picks(tmp_path: Path) -> None:
    """``memory`` is registered like the engines: named, it builds the reference backend with its own setting, no
    workspace cache, no embedding slot, no bundled model; ``auto`` never picks it, even where nothing else is
    installed."""
    opts = ServeSettings(backend="memory", memory_token_delay_ms=7, data_dir=tmp_path, model="any-name")
    backend = build_backend(opts)
    assert isinstance(backend, MemoryBackend) and backend.token_delay_s == 0.007
    assert bootstrap.build_cache(opts) is None and bootstrap.build_embedder(opts, lambda: 0) is None
    assert preload_request(opts.model_copy(update={"model": None})) is None
    assert bootstrap.resolve_model(opts) == opts  # a name, not a file to find in the store
    assert "memory" in bootstrap.backend_choices()
    only = EngineFacts(machine="x86_64", installed=frozenset({"memory"}), model_kind="gguf")
    assert choose_backend(only)[0] != "memory"


def test_every_engine_entry_is_whole() -> None:
    """What the table promises of each real engine: a unique extra, and settings read from a load config."""
    assert len({spec.extra for spec in ENGINES.values()}) == len(ENGINES)
    for spec in ENGINES.values():
        assert spec.name in bootstrap.backend_choices() and spec.overhead.name
        if spec.exclusive_settings is not None:
            assert spec.exclusive_settings(Config()) == ""
