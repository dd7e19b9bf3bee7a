"""The llama.cpp engine (llama-cpp-python).

* ``spec``     – its ``EngineSpec`` (listed by ``backends.registry``) and ``LlamaOptions``; light, no llama.cpp;
* ``native``   – the C boundary: log capture, error translation, ``open_llama`` (AMX workaround, load progress);
* ``options``  – the model's shape and the resolved load options;
* ``model``    – ``LlamaLoadedModel``: the resident model, its KV mechanics and state bytes;
* ``sampling`` – one decode pass: the sampler chain and grammar constraints;
* ``backend``  – ``LlamaBackend``: load, describe, model facts.

Importing the package imports no llama.cpp: the names below load their module when first read.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# llama.cpp's CPU threads meet at an OpenMP barrier after every operation, and libgomp spins 300,000 rounds there
# before it sleeps. When the machine has other work, the spinning thread holds the core its partner is waiting for:
# beside two CPU-bound processes on 2 cores, decode fell to 0.3 tokens/s in one run of two or three. At 3,000
# rounds it held 28-36 tokens/s in six runs, and a quiet machine keeps its speed (docs/engines.md, "Threads on a
# busy machine"). libgomp reads this once, when llama.cpp's library loads (imported by a module of this package, so
# after this line); a user's value wins.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

if TYPE_CHECKING:
    from .backend import LlamaBackend
    from .model import BACKEND_NAME, LlamaLoadedModel
    from .native import open_llama, runtime_version

__all__ = ["BACKEND_NAME", "LlamaBackend", "LlamaLoadedModel", "open_llama", "runtime_version"]


def __getattr__(name: str) -> Any:
    """Each public name, imported from its module when it is first read (PEP 562)."""
    if name == "LlamaBackend":
        from . import backend

        return getattr(backend, name)
    if name in ("BACKEND_NAME", "LlamaLoadedModel"):
        from . import model

        return getattr(model, name)
    if name in ("open_llama", "runtime_version"):
        from . import native

        return getattr(native, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
