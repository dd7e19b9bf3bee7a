"""``--backend auto``: which engine serves the requested model fastest on this machine, and why.

The engines of ``backends.registry`` are asked in their ``auto_rank`` order; the
first that takes the model serves it, and the last takes whatever all the others
declined, with the first decline as its reason. An engine:

* takes a model in a format only it reads (``EngineSpec.formats``: an OpenVINO IR
  directory) when installed, and declines it otherwise (the load will say so);
* declines when its package is not installed;
* takes the model when no engine after it is installed;
* declines when the load asks for a setting or an engine option only another engine
  offers (``backends.registry.exclusive_given``);
* else answers by its own preferences (``EngineSpec.prefers``: OpenVINO's are a
  GGUF it converts on an x86-64 CPU, with the ``make bench`` figures behind them in
  its docstring).

An explicit ``--backend`` always wins. The rule is a pure function of
``EngineFacts`` and the table, so it is tested on injected machines and engines;
``modeld.bootstrap.engine_facts`` gathers the facts of this one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from backends.engine_spec import EngineFacts, EngineSpec
from backends.registry import ENGINES

__all__ = ["EngineFacts", "choose_backend"]


def choose_backend(f: EngineFacts, engines: Iterable[EngineSpec] | None = None) -> tuple[str, str]:
    """The engine's name (of ``engines``, default: every registered one) and a one-line reason."""
    specs = list(ENGINES.values() if engines is None else engines)
    # the engines' titles, for the reasons (the facts' own win)
    titles = {s.name: s.title for s in (*ENGINES.values(), *specs)}
    f = replace(f, titles={**titles, **f.titles})
    # an engine with no rank (the reference backend) is never picked: it must be named
    ranked = sorted((s for s in specs if s.auto_rank is not None), key=lambda s: s.auto_rank or 0)
    declined = ""
    for i, spec in enumerate(ranked):
        later = ranked[i + 1:]
        if not later:
            return spec.name, declined or f"{spec.title} is the only engine"
        installed = spec.name in f.installed
        own = next((fmt for fmt in spec.formats if fmt.kind == f.model_kind), None)
        if own is not None and not any(fmt.kind == own.kind for s in ranked if s is not spec for fmt in s.formats):
            if installed:
                return spec.name, f"the model is {own.title}"
            declined = declined or f"the model is {own.title} but {spec.missing} (the load will say so)"
            continue
        if not installed:
            declined = declined or spec.missing
            continue
        if not any(s.name in f.installed for s in later):
            return spec.name, " and ".join(s.missing for s in later)
        theirs = next(((name, given) for name, given in f.exclusive.items() if given and name != spec.name), None)
        if theirs is not None:  # a setting or engine option only another engine offers
            owner = f.titles.get(theirs[0], theirs[0])
            declined = declined or f"{theirs[1]} asked for: {owner} settings {spec.title} does not offer"
            continue
        takes, reason = spec.prefers(f) if spec.prefers is not None else (True, f"{spec.title} is preferred")
        if takes:
            return spec.name, reason
        declined = declined or reason
    raise ValueError("no engine is registered")
