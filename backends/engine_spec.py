"""What an engine is to the rest of modeld: ``EngineSpec``, its options' base ``EngineOptions``, and the facts
``--backend auto`` weighs (``EngineFacts``).

Every engine package declares its spec in its own ``spec.py`` (``backends.llama.spec``, …) from these types, and
the registry (``backends.registry``) lists the specs. The helpers here read a load's engine options given an
engine's spec or options model, so an engine's own modules need no registry.

This module stays light: it imports the contract and the model formats (``backends.formats``), no engine package.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from contract.errors import InvalidArgument
from contract.interfaces import Backend, EngineFactory, StateCache
from contract.sizing import OverheadModel
from contract.types import Config, EngineOption

from .formats import ModelFormat

if TYPE_CHECKING:  # (the readouts module reads safetensors: the specs stay light)
    from .readouts import Readouts

__all__ = ["X86_64", "EngineFacts", "EngineOptions", "EngineSpec", "Verdict", "check_options", "describe_options",
           "engine_options"]

X86_64 = frozenset({"x86_64", "amd64", "x64"})


@dataclass(frozen=True)
class EngineFacts:
    """What ``--backend auto`` weighs about this machine, the model and the settings asked for."""

    #: ``platform.machine()``
    machine: str
    #: the engines whose package is installed (``EngineSpec.package``)
    installed: frozenset[str]
    #: the model's format (``ModelFormat.kind``: "gguf", "ir", …) or "other" (missing, unreadable, no engine's)
    model_kind: str
    #: for a GGUF, per engine: why it cannot serve this file (absent or "": it can)
    refusals: Mapping[str, str] = field(default_factory=dict)
    #: ``Config.num_gpu_layers`` asked for: 0 none, -1 all, -2 as many as fit (auto), else a count
    num_gpu_layers: int = 0
    #: per engine: the settings asked for that only it offers (``EngineSpec.exclusive_settings``)
    exclusive: Mapping[str, str] = field(default_factory=dict)
    #: the GPUs found (``backends.devices.read_gpus``), as status names them ("NVIDIA L4, 24GiB")
    gpus: tuple[str, ...] = ()
    #: the installed engines whose build offloads to them (``EngineSpec.gpu_offload``)
    gpu_engines: frozenset[str] = frozenset()
    #: per engine, how reasons call it (``EngineSpec.title``); ``modeld.engine_choice.choose_backend`` fills it from
    #: the engines it weighs, and an engine absent from it is called by its name
    titles: Mapping[str, str] = field(default_factory=dict)


#: an engine's preference in ``auto``: (takes the model, why); see ``EngineSpec.prefers``
Verdict = tuple[bool, str]


class EngineOptions(BaseModel):
    """The base of an engine's options model (``EngineSpec.options``): each field is an option of
    ``Config.options``, its description what ``describe`` and the docs say of it; None is "unset"."""

    model_config = ConfigDict(extra="forbid", frozen=True)


_Options = TypeVar("_Options", bound=EngineOptions)


@dataclass(frozen=True)
class BackendSettings:
    """What an engine's backend factory is given of ``modeld serve``'s settings (``EngineSpec.backend``): each
    engine reads those it takes."""

    #: the engine's name (``--backend``, resolved from ``auto``)
    engine: str = ""
    #: speculative decoding of greedy requests by default (``--speculative``)
    speculative: bool = True
    #: the concept readouts every model serves (``--readouts``, read once by the composition root)
    readouts: Readouts | None = None
    #: sessions served at once (``--sessions``; None: the engine's own default)
    sessions: int | None = None
    #: the reference backend's simulated time per generated token, in ms (``--memory-token-delay-ms``)
    memory_token_delay_ms: float = 0.0


@dataclass(frozen=True)
class EngineSpec:
    """One engine, as the composition root, ``auto`` and the CLI see it."""

    #: ``--backend`` value, ``LoadModelRequest.type`` and status's backend
    name: str
    #: how reasons and messages call it
    title: str
    #: the top-level module whose presence means the engine is installed
    package: str
    #: the pip extra that installs it (``pip install '.[EXTRA]'``)
    extra: str
    #: top-level modules only this engine's extra brings: the CLI names the extra when one is missing
    modules: tuple[str, ...]
    #: what ``auto`` says when ``package`` is missing
    missing: str
    #: its runtime's memory beyond weights and KV (``contract.sizing``), calibrated by ``make bench``
    overhead: OverheadModel
    #: the Backend for ``modeld serve``: (workspace cache, the serve settings it may read) → backend
    backend: Callable[[StateCache | None, BackendSettings], Backend]
    #: the embedding side slot's engine factory (``contract.interfaces.EngineFactory``); None: it embeds nothing
    embedder: Callable[[], EngineFactory[Any]] | None
    #: ``modeld prepare``'s step for it: (a GGUF, or None for the bundled ones; log) → outputs; None: no step
    prepare: Callable[[Path | None, Callable[[str], None]], list[Path]] | None = None
    #: where ``auto`` ranks it: lower is asked first; the last one takes what every other declines; None: ``auto``
    #: never picks it (it must be named)
    auto_rank: int | None = 0
    #: its preferences in ``auto`` once it is installed and another engine is too (None: it takes the model)
    prefers: Callable[[EngineFacts], Verdict] | None = None
    #: the model formats it reads (``backends.formats``): the store, ``pull`` and ``auto`` know no others
    formats: tuple[ModelFormat, ...] = ()
    #: why it cannot serve a GGUF ("": it can); asked only while it is installed
    refusal: Callable[[Path], str] | None = None
    #: the settings in a load config that only it offers, as flags ("" for none)
    exclusive_settings: Callable[[Config], str] | None = None
    #: whether its installed build offloads layers to a GPU (None: it never does); imports the engine
    gpu_offload: Callable[[], bool] | None = None
    #: what its installed build was built with, for status (None: nothing to say); imports the engine
    build_info: Callable[[], str] | None = None
    #: its models are files (the bundled model is preloaded, ``--model`` is looked up in the store); False: any
    #: text names a model (the reference backend's models are names)
    serves_files: bool = True
    #: it keeps a token tape whose KV the workspace cache saves and restores (False: the daemon builds no cache)
    tape: bool = True
    #: what ``modeld serve`` logs when it starts on it ("": nothing)
    notice: str = ""
    #: the options it takes in a load's ``Config.options`` (``engine_options`` checks them; ``describe``,
    #: ``serve --engine-option`` and ``modeld load --option`` pass them); None: it takes none
    options: type[EngineOptions] | None = None


def engine_options(spec: EngineSpec, cfg: Config, model: type[_Options]) -> _Options:
    """``cfg.options`` as the options model of engine ``spec`` (``model``, its ``EngineSpec.options``); an option
    it does not take, or a value it does not, is InvalidArgument naming the engine's options."""
    try:
        return model.model_validate(cfg.options)
    except ValidationError as exc:
        takes = ", ".join(model.model_fields) or "none"
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: "
                             f"{'not an option it takes' if e['type'] == 'extra_forbidden' else e['msg']}"
                             for e in exc.errors())
        raise InvalidArgument(f"engine option refused by {spec.title}: {problems} (its options: {takes})",
                              options=sorted(cfg.options)) from exc


def check_options(spec: EngineSpec, cfg: Config) -> None:
    """Refuse (InvalidArgument) a load whose ``Config.options`` engine ``spec`` does not take."""
    if spec.options is not None:
        engine_options(spec, cfg, spec.options)
    elif cfg.options:
        raise InvalidArgument(f"engine option refused by {spec.title}: it takes none (given: "
                              f"{', '.join(sorted(cfg.options))})", options=sorted(cfg.options))


def describe_options(model: type[EngineOptions] | None) -> list[EngineOption]:
    """The options of an options model (an engine's ``EngineSpec.options``), as ``describe`` lists them (none for
    None)."""
    if model is None:
        return []
    out = []
    properties = model.model_json_schema()["properties"]
    for field_name, f in model.model_fields.items():
        schema = properties[field_name]
        kinds = [s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"]
        kind = kinds[0] if kinds else {}
        out.append(EngineOption(name=field_name, type=str(kind.get("type", "")),
                                choices=[str(c) for c in kind.get("enum", [])],
                                default="unset" if f.default is None else str(f.default),
                                description=f.description or ""))
    return out
