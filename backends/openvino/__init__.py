"""The OpenVINO engine (openvino, openvino-genai): a paged-attention IR whose KV block pools we own.

* ``spec``     – its ``EngineSpec`` (listed by ``backends.registry``), ``OpenVINOOptions`` and its preferences in
  ``--backend auto``; light, no OpenVINO;
* ``prepare``  – GGUF → IR conversion, once, into the model cache (``modeld prepare``);
* ``native``   – the runtime version and the one translation of OpenVINO exceptions;
* ``options``  – the model source (IR or GGUF), its shape and the resolved load options;
* ``graph``    – the IR rewritten to paged attention, and the prefill shape buckets;
* ``model``    – ``OpenVINOLoadedModel``: the resident model, its KV pools and state bytes;
* ``sampling`` – one decode pass: numpy sampling, llguidance masks (``guidance``);
* ``backend``  – ``OpenVINOBackend``: load, describe, model facts.

Importing the package imports no OpenVINO: the names below load their module when first read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import OpenVINOBackend
    from .model import BACKEND_NAME, OpenVINOLoadedModel
    from .native import runtime_version

__all__ = ["BACKEND_NAME", "OpenVINOBackend", "OpenVINOLoadedModel", "runtime_version"]


def __getattr__(name: str) -> Any:
    """Each public name, imported from its module when it is first read (PEP 562)."""
    if name == "OpenVINOBackend":
        from . import backend

        return getattr(backend, name)
    if name in ("BACKEND_NAME", "OpenVINOLoadedModel"):
        from . import model

        return getattr(model, name)
    if name == "runtime_version":
        from . import native

        return getattr(native, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
