"""The vLLM engine: the daemon's sessions, templates and tape over a vLLM server (or a router in front of several).

* ``spec``    – its ``EngineSpec`` (listed by ``backends.registry``) and ``VLLMOptions``; light, no HTTP client;
* ``link``    – the server's HTTP API in token ids: its model, its tokenizer, prefills and streamed decodes;
* ``model``   – ``VLLMLoadedModel``: the tape whose KV the server holds, and ``VLLMSteps``, one decode pass;
* ``backend`` – ``VLLMBackend``: load (the server and its tokenizer checked), describe.

Importing the package imports neither the HTTP client nor llama.cpp: the names below load their module when first
read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import VLLMBackend, runtime_version
    from .model import BACKEND_NAME, VLLMLoadedModel

__all__ = ["BACKEND_NAME", "VLLMBackend", "VLLMLoadedModel", "runtime_version"]


def __getattr__(name: str) -> Any:
    """Each public name, imported from its module when it is first read (PEP 562)."""
    if name in ("VLLMBackend", "runtime_version"):
        from . import backend

        return getattr(backend, name)
    if name in ("BACKEND_NAME", "VLLMLoadedModel"):
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
