"""Tokens: ``POST /tokenize`` and ``POST /detokenize``, in llama-server's shape (its clients and scripts call them),
and in vLLM's (``prompt``, ``add_special_tokens``; ``GET /tokenizer_info``), which evaluation harnesses use to
tokenize on the server.

``/tokenize`` takes ``content`` (special tokens such as ``<|im_start|>`` parsed, as a prompt is) and
``add_special`` (the model's BOS first, where the model adds one) and answers ``tokens``; ``/detokenize`` takes
``tokens`` and answers ``content``. Both run on the loaded model (or the model ``model`` names, as a turn's
does), in arrival order with the turns; an id outside the vocabulary is a 400 naming it. llama-server's
``with_pieces`` and ``parse_special: false`` are refused with a 400 rather than answered otherwise.

``GET /v1/readouts`` answers the readout manifest the daemon serves (``serve --readouts``: its concepts, layers,
hidden size and digest), or a 404 when it serves none.

The package: ``protocol`` (the request and reply models) and ``routes``.
"""

from __future__ import annotations

from ..api import HttpApi
from ..openai.protocol import error_body
from .routes import router

#: the app's entry for it (``app.APIS``)
API = HttpApi(lambda serving, _store: router(serving), ("/tokenize", "/detokenize", "/tokenizer_info", "/v1/readouts"), error_body)

__all__ = ["API", "router"]
