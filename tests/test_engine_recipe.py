"""The contributing guide's engine recipe: an engine is its package (its ``EngineSpec`` in it) plus one entry in the
registry's list.

A toy engine, registered by that one entry with a model format of its own (a directory marked by ``toy.json``)
and an option of its own (``greeting``), is reached by everything that names no engine: ``modeld pull`` finds
its models in a repository, names and stores them, a local one is imported, ``--backend auto`` picks it for its
format, the store's facts read its config, the composition root builds its backend for ``serve``, and
``serve --engine-option`` and ``modeld load --option`` hand its option to its load, where an option it does not
take is refused. No module outside the entry is touched.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pydantic import Field

from backends import registry
from backends.engine_spec import BackendSettings, EngineOptions, EngineSpec, describe_options, engine_options
from backends.formats import MarkedDirectory
from backends.memory import MemoryBackend, MemoryModel
from contract.errors import InvalidArgument
from contract.interfaces import Backend, StateCache
from contract.sizing import OverheadModel
from contract.types import LoadModelRequest, ModelInfo, OpenSessionRequest
from modeld import bootstrap
from modeld.engine_choice import choose_backend
from modeld.settings import ServeSettings
from modeld.store.cli import model_facts
from modeld.store.pull import PullError, pull
from modeld.store.refs import HubRef, RefError, parse_ref
from modeld.store.store import ModelStore
from tests.hubstub import Hub, HubServer, Repo

# --- the toy engine: what its package and its one entry hold ---------------------------------------------------
TOY = MarkedDirectory(kind="toy", title="a toy model directory", marker="toy.json", repo_suffixes=("-toy",))


class ToyOptions(EngineOptions):
    """What only the toy engine takes in a load's ``Config.options``."""

    greeting: str = Field("hello", description="what the toy says first")


class ToyBackend(MemoryBackend):
    """The engine's backend: the reference backend, told apart by a setting it reads from the serve settings and
    an option it reads from each load's config."""

    name = "toy"

    def __init__(self, greeting: str) -> None:
        super().__init__()
        self.greeting = greeting
        self.loaded_greeting = ""

    def _as_reference(self, req: OpenSessionRequest) -> OpenSessionRequest:
        return req.model_copy(update={"type": "memory", "config": req.config.model_copy(update={"options": {}})})

    def load(self, req: OpenSessionRequest, progress: Callable[[float], None]) -> MemoryModel:
        self.loaded_greeting = engine_options(TOY_ENGINE, req.config, ToyOptions).greeting
        return super().load(self._as_reference(req), progress)

    def describe(self, req: OpenSessionRequest, credit_bytes: int = 0) -> ModelInfo:
        engine_options(TOY_ENGINE, req.config, ToyOptions)
        return super().describe(self._as_reference(req), credit_bytes).model_copy(
            update={"engine_options": describe_options(ToyOptions)})


def toy_backend(cache: StateCache | None, settings: BackendSettings) -> Backend:
    return ToyBackend(greeting=settings.engine)


TOY_ENGINE = EngineSpec(name="toy", title="the toy engine", package="json", extra="server", modules=(),
                        missing="the toy engine is not installed", overhead=OverheadModel(name="toy", fixed_bytes=0),
                        backend=toy_backend, embedder=None, auto_rank=5, formats=(TOY,), tape=False, options=ToyOptions)


@pytest.fixture
def toy_registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(registry.ENGINES, TOY_ENGINE.name, TOY_ENGINE)  # the one entry
    yield


CONFIG = json.dumps({"model_type": "toyformer", "max_position_embeddings": 2048, "num_hidden_layers": 3}).encode()


@pytest.fixture
def hub() -> Iterator[Hub]:
    h = Hub(repos={"acme/coder-toy": Repo({"toy.json": b"{}", "weights.bin": b"w" * 5000, "config.json": CONFIG}),
                   "acme/mixed": Repo({"m-Q4_K_M.gguf": b"GGUF" + b"q" * 100, "toy/toy.json": b"{}",
                                       "toy/weights.bin": b"w" * 300})})
    with HubServer(h):
        yield h


def quiet(_: str) -> None:
    pass


def test_a_registered_engine_s_format_is_pulled_chosen_and_served(toy_registered: None, hub: Hub,
                                                                    tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "models")
    m = pull(store, "acme/coder-toy", endpoint=hub.url, log=quiet)
    assert (m.format, m.name, m.primary) == ("toy", "coder", "")  # the repository's "-toy" dropped from the name
    assert {f.name for f in m.files} == {"toy.json", "weights.bin", "config.json"}
    _, directory = store.get("coder")
    facts = model_facts(m, directory)
    assert (facts["architecture"], facts["context"], facts["layers"]) == ("toyformer", 2048, 3)
    assert (facts["engine"], facts["engine_reason"]) == ("toy", "the model is a toy model directory")

    # a reference by its marker file picks it beside a GGUF; the listing offers both, each its own way
    assert parse_ref("acme/mixed/toy/toy.json") == HubRef("acme/mixed", file="toy/toy.json")
    mixed = pull(store, "acme/mixed/toy/toy.json", endpoint=hub.url, log=quiet, name="mixed-toy")
    assert (mixed.format, mixed.primary, [f.name for f in mixed.files]) == ("toy", "toy", ["toy/toy.json",
                                                                                           "toy/weights.bin"])
    with pytest.raises(RefError) as listing:
        pull(store, "acme/mixed:Q8_0", endpoint=hub.url, log=quiet)
    assert "acme/mixed/toy/toy.json  toy model directory in toy" in str(listing.value)
    assert "acme/mixed:Q4_K_M" in str(listing.value)

    # serve: the name resolves through the store, auto picks the engine for its format, the root builds its backend
    opts = bootstrap.resolve_model(ServeSettings(backend="auto", model="coder", data_dir=tmp_path), log=quiet)
    assert opts.model == str(directory) and opts.model_name == "coder"
    opts = bootstrap.resolve_backend(opts)
    assert opts.backend == "toy"
    backend = bootstrap.build_backend(opts)
    assert isinstance(backend, ToyBackend) and backend.greeting == "toy"


def test_a_registered_engine_s_option_reaches_its_load_and_others_are_refused(toy_registered: None) -> None:
    from runtime import cli

    opts = bootstrap.resolve_backend(ServeSettings(backend="auto", model="hello", engine_option=("greeting=hi",)))
    assert opts.backend == "toy"
    backend = bootstrap.build_backend(opts)
    assert isinstance(backend, ToyBackend)
    req = OpenSessionRequest(type="toy", model_name="hello", config=opts.load_config)
    backend.load(req, lambda _: None)
    assert backend.loaded_greeting == "hi"
    # the client's ``modeld load --option`` makes the same config
    args = cli.build_parser().parse_args(["load", "hello", "--type", "toy", "--option", "greeting=hey"])
    backend.load(LoadModelRequest(**cli.model_handle(args)), lambda _: None)
    assert backend.loaded_greeting == "hey"
    info = backend.describe(req)
    assert [(o.name, o.type, o.default, o.description) for o in info.engine_options] == [
        ("greeting", "string", "hello", "what the toy says first")]
    assert registry.option_list("toy") == info.engine_options  # what the registry lists of it
    with pytest.raises(InvalidArgument, match=r"refused by the toy engine: colour: not an option it takes "
                                              r"\(its options: greeting\)"):
        backend.load(req.model_copy(update={"config": req.config.model_copy(update={"options": {"colour": "red"}})}),
                     lambda _: None)


def test_a_local_model_of_the_format_is_imported_and_others_are_refused(toy_registered: None, tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "models")
    src = tmp_path / "mine"
    src.mkdir()
    (src / "toy.json").write_text("{}")
    (src / "weights.bin").write_bytes(b"w" * 64)
    m = pull(store, str(src), log=quiet)
    assert (m.format, m.name) == ("toy", "mine")
    assert bootstrap.engine_facts(str(src)).model_kind == "toy"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PullError, match="not a GGUF file, nor an OpenVINO IR directory, nor a toy model directory"):
        pull(store, str(empty), log=quiet)


def test_without_the_entry_nothing_knows_the_format(tmp_path: Path) -> None:
    """The control: the same repository and directory without the toy engine registered."""
    assert "toy" not in registry.ENGINES
    with pytest.raises(RefError, match="names no model"):
        parse_ref("acme/coder-toy/toy.json")
    src = tmp_path / "mine"
    src.mkdir()
    (src / "toy.json").write_text("{}")
    assert bootstrap.engine_facts(str(src)).model_kind == "other"
    assert choose_backend(bootstrap.engine_facts(str(src)))[0] != "toy"
