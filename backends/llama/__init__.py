"""The llama.cpp engine (llama-cpp-python).

* ``native``   – the C boundary: log capture, error translation, ``open_llama`` (AMX workaround, load progress);
* ``options``  – the model's shape and the resolved load options;
* ``model``    – ``LlamaLoadedModel``: the resident model, its KV mechanics and state bytes;
* ``sampling`` – one decode pass: the sampler chain and grammar constraints;
* ``backend``  – ``LlamaBackend``: load, describe, model facts.
"""

import os

# llama.cpp's CPU threads meet at an OpenMP barrier after every operation, and libgomp spins 300,000 rounds there
# before it sleeps. When the machine has other work, the spinning thread holds the core its partner is waiting for:
# beside two CPU-bound processes on 2 cores, decode fell to 0.3 tokens/s in one run of two or three. At 3,000
# rounds it held 28-36 tokens/s in six runs, and a quiet machine keeps its speed (docs/engines.md, "Threads on a
# busy machine"). libgomp reads this once, when llama.cpp's library loads (the imports below); a user's value wins.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

from .backend import LlamaBackend  # noqa: E402  (after the setting above)
from .model import BACKEND_NAME, LlamaLoadedModel  # noqa: E402
from .native import open_llama, runtime_version  # noqa: E402

__all__ = ["BACKEND_NAME", "LlamaBackend", "LlamaLoadedModel", "open_llama", "runtime_version"]
