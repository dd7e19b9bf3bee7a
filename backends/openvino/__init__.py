"""The OpenVINO engine (openvino, openvino-genai): a paged-attention IR whose KV block pools we own.

* ``prepare``  – GGUF → IR conversion, once, into the model cache (``modeld prepare``);
* ``native``   – the runtime version and the one translation of OpenVINO exceptions;
* ``options``  – the model source (IR or GGUF), its shape and the resolved load options;
* ``graph``    – the IR rewritten to paged attention, and the prefill shape buckets;
* ``model``    – ``OpenVINOLoadedModel``: the resident model, its KV pools and state bytes;
* ``sampling`` – one decode pass: numpy sampling, llguidance masks (``guidance``);
* ``backend``  – ``OpenVINOBackend``: load, describe, model facts.
"""

from .backend import OpenVINOBackend
from .model import BACKEND_NAME, OpenVINOLoadedModel
from .native import runtime_version

__all__ = ["BACKEND_NAME", "OpenVINOBackend", "OpenVINOLoadedModel", "runtime_version"]
