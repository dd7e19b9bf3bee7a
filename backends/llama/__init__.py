"""The llama.cpp engine (llama-cpp-python).

* ``native``   – the C boundary: log capture, error translation, ``open_llama`` (AMX workaround, load progress);
* ``options``  – the model's shape and the resolved load options;
* ``model``    – ``LlamaLoadedModel``: the resident model, its KV mechanics and state bytes;
* ``sampling`` – one decode pass: the sampler chain and grammar constraints;
* ``backend``  – ``LlamaBackend``: load, describe, model facts.
"""

from .backend import LlamaBackend
from .model import BACKEND_NAME, LlamaLoadedModel
from .native import open_llama, runtime_version

__all__ = ["BACKEND_NAME", "LlamaBackend", "LlamaLoadedModel", "open_llama", "runtime_version"]
