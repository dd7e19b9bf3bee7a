"""What every tape engine does around its own load: the request's checks before it, the same wiring after.

An engine's ``Backend.load`` calls ``check_load`` before it reads a file (a bad
template name or tool format costs no load) and ``finish_load`` on the model it
built; what lies between (opening the engine, its options) is the engine's own.
"""

from __future__ import annotations

from typing import Protocol

from contract.interfaces import StateCache
from contract.types import OpenSessionRequest

from ..bundled import model_cache_dir
from ..resident import check_model_type
from .draft_costs import draft_costs
from .model import TapeModel
from .templates import requested_template
from .toolformats import require_format

__all__ = ["check_load", "finish_load"]


class LoadedTape(TapeModel, Protocol):
    """A just-built engine model, as ``finish_load`` drives it (``TapeModelBase`` gives all of it)."""

    draft_costs_measured: bool

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
    speculates measures the draft checks' costs (``draft_costs``, kept per machine in the model
    cache). Any failure closes the model before it is raised: a half-loaded model holds no memory.
    """
    try:
        model.check_declared_template()
        model.warm_up()
        if speculative:
            model.draft_costs = draft_costs(model, model_cache_dir())
            model.draft_costs_measured = True
    except BaseException:
        model.close()
        raise
    model.cache = cache
    model.speculative = speculative
