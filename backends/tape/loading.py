"""What every tape engine does around its own load: the request's checks before it, the same wiring after.

An engine's ``Backend.load`` calls ``check_load`` before it reads a file (a bad
template name or tool format costs no load) and ``finish_load`` on the model it
built; what lies between (opening the engine, its options) is the engine's own.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

import jinja2

from contract.interfaces import StateCache
from contract.types import OpenSessionRequest

from ..resident import check_model_type
from . import draft_costs as cost_tables
from .draft_costs import fixed_costs, kept_costs
from .model import TapeModel, model_capabilities, model_format
from .speculate import CheckCosts
from .templates import JinjaTemplate, choose_template, requested_template
from .toolformats import require_format

__all__ = ["check_load", "finish_load", "template_report"]


class LoadedTape(TapeModel, Protocol):
    """A just-built engine model, as ``finish_load`` drives it (``TapeModelBase`` gives all of it)."""

    draft_costs_measured: bool
    costs_pending: bool

    def check_declared_template(self) -> None: ...

    def warm_up(self) -> None: ...

    def close(self) -> None: ...


def check_load(req: OpenSessionRequest, backend_name: str) -> tuple[str, str] | None:
    """The request's engine, chat template and tool format, checked before the load; the requested template
    (``templates.requested_template``: None when the request names none)."""
    check_model_type(req.type, backend_name)
    template = requested_template(req.config.chat_template)
    if req.config.tool_format:
        require_format(req.config.tool_format)
    return template


def finish_load(model: LoadedTape, cache: StateCache | None, speculative: bool) -> None:
    """The built model checked, warmed up, costed and given the backend's workspace cache and speculation default.

    The profile's declared template is checked first, then the engine warms up; a backend that
    speculates reads the draft checks' costs kept for this model and machine (``draft_costs``, in the
    model cache). Where none are kept it drafts by the prior and leaves the timing to the slot's first
    idle moment (``TapeModelBase.idle_work``): the load, and the first request behind it, never wait for it.
    Any failure closes the model before it is raised: a half-loaded model holds no memory.
    """
    try:
        model.check_declared_template()
        model.warm_up()
        if speculative:
            fixed = fixed_costs()
            kept = fixed if fixed is not None else kept_costs(model, cost_tables.table_dir())
            model.draft_costs = kept if kept is not None else CheckCosts.prior()
            model.draft_costs_measured = fixed is None and kept is not None
            model.costs_pending = kept is None
    except BaseException:
        model.close()
        raise
    model.cache = cache
    model.speculative = speculative


def template_report(req: OpenSessionRequest, own: str, whole_tokens: Collection[str], *,
                    vision: bool = False) -> tuple[str, str, list[str]]:
    """What ``describe`` says of the template before any load, as ``status`` says it after one: where the
    template a load would serve with comes from, the tool-call format it would use and why, and the model's
    capabilities (``model_capabilities``).

    ``own`` is the template the model's file carries ("" for none) and ``whole_tokens`` the texts its
    tokenizer keeps as single tokens (the vocabulary choice of a file with none). A template that does not
    compile is said as such; the load refuses it."""
    source, origin = choose_template(requested_template(req.config.chat_template), own, whole_tokens.__contains__)
    try:
        template = JinjaTemplate(source)
    except jinja2.TemplateError as exc:
        return f"{origin}; it does not compile: {exc}", "", ["text", "vision"] if vision else ["text"]
    fmt, tool_format = model_format(template, req.config.tool_format)
    return origin, tool_format, model_capabilities(template, fmt, vision=vision)


def source_capabilities(source: str) -> list[str]:
    """The capabilities (``model_capabilities``) a chat template's source gives its model; a file without one
    (``""``) or with one that does not compile: text only."""
    if not source:
        return ["text"]
    try:
        template = JinjaTemplate(source)
    except jinja2.TemplateError:
        return ["text"]
    return model_capabilities(template, model_format(template, "")[0])
