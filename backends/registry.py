"""The engines modeld serves, each listed once: ``ENGINES`` maps a name to its ``EngineSpec``.

An engine is its package, whose ``spec.py`` declares its ``EngineSpec`` (``backends.engine_spec``): how to build
its backend and its embedding engine, its ``modeld prepare`` step, the pip extra that installs it (and the modules
that extra brings, for the CLI's message), its memory overhead (``contract.sizing.OverheadModel``, calibrated by
``make bench``), the options only it takes in a load's ``Config.options`` (``EngineOptions``), what
``--backend auto`` weighs (``modeld.engine_choice``), and what the daemon builds around it (a workspace cache for a
tape engine, an embedding slot, the bundled model for an engine that serves files). This module lists those specs,
and its functions read the list: the composition root (``modeld.bootstrap``), ``auto`` and the CLI read it, and
none of them names an engine. Adding an engine is its package and one line in the list below; the contract's
reference backend (``memory``, no inference, ``backends.memory_spec``) is listed too, one ``auto`` never picks.

This module stays light: it imports each engine's spec, never the engine. Every factory imports its engine when it
is called, so an engine whose package is not installed breaks none of the others (``EngineSpec.package`` says which
module tells it is there).
"""

from __future__ import annotations

from pathlib import Path

from contract.types import Config, EngineOption

from .engine_spec import EngineSpec, describe_options
from .formats import ModelFormat
from .llama.spec import SPEC as LLAMA
from .memory_spec import SPEC as MEMORY
from .openvino.spec import SPEC as OPENVINO
from .vllm.spec import SPEC as VLLM

__all__ = ["ENGINES", "engine", "exclusive_given", "format_on_disk", "model_format", "model_formats",
           "not_a_known_format", "option_list"]

#: every engine by name; ``model_formats`` lists their formats in this order (GGUF first)
ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (LLAMA, OPENVINO, VLLM, MEMORY)}


def engine(name: str) -> EngineSpec:
    """The spec registered as ``name``; KeyError for an unknown one."""
    return ENGINES[name]


def model_formats() -> list[ModelFormat]:
    """Every registered engine's formats, each once, in the table's order (GGUF first)."""
    out: dict[str, ModelFormat] = {}
    for spec in ENGINES.values():
        for fmt in spec.formats:
            out.setdefault(fmt.kind, fmt)
    return list(out.values())


def format_on_disk(path: Path) -> ModelFormat | None:
    """The registered format ``path`` on disk is a model of; None for none."""
    return next((f for f in model_formats() if f.is_model(path)), None)


def not_a_known_format() -> str:
    """What a path or a file that no registered format takes is not: "not a GGUF file, nor an OpenVINO IR …"."""
    return "not " + ", nor ".join(f.title for f in model_formats())


def model_format(kind: str) -> ModelFormat | None:
    """The registered format ``kind`` names (an earlier manifest's alias too); None for none."""
    return next((f for f in model_formats() if kind == f.kind or kind in f.aliases), None)


def option_list(name: str) -> list[EngineOption]:
    """The options engine ``name`` takes, as ``describe`` lists them (none for an unknown engine)."""
    spec = ENGINES.get(name)
    return describe_options(spec.options if spec is not None else None)


def exclusive_given(cfg: Config) -> dict[str, str]:
    """Per engine, what among ``cfg`` only it offers, as flags ("--flash-attn", "--engine-option NAME"): ``auto``
    leaves the model to an engine that takes everything asked for."""
    out: dict[str, str] = {}
    for spec in ENGINES.values():
        given = [spec.exclusive_settings(cfg)] if spec.exclusive_settings is not None else []
        takes = set(spec.options.model_fields) if spec.options is not None else set()
        others = {f for s in ENGINES.values() if s is not spec and s.options is not None for f in s.options.model_fields}
        given += [f"--engine-option {o}" for o in sorted(cfg.options) if o in takes and o not in others]
        if text := " and ".join(g for g in given if g):
            out[spec.name] = text
    return out
