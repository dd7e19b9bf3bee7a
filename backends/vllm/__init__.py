"""The vLLM engine: the daemon's sessions, templates and tape over a vLLM server (or a router in front of several).

* ``link``    – the server's HTTP API in token ids: its model, its tokenizer, prefills and streamed decodes;
* ``model``   – ``VLLMLoadedModel``: the tape whose KV the server holds, and ``VLLMSteps``, one decode pass;
* ``backend`` – ``VLLMBackend``: load (the server and its tokenizer checked), describe.
"""

from .backend import VLLMBackend, runtime_version
from .model import BACKEND_NAME, VLLMLoadedModel

__all__ = ["BACKEND_NAME", "VLLMBackend", "VLLMLoadedModel", "runtime_version"]
