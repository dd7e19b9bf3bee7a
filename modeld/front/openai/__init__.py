"""The OpenAI API: ``/v1/chat/completions`` (plain and streamed), ``/v1/models``, ``/v1/embeddings``.

Requests are validated at the edge by the models of ``protocol``: a malformed field is a
400 naming it (``param``), and fields this daemon does not act on are accepted
and ignored where OpenAI documents them as hints (``user``, ``store``,
``metadata``, ``prompt_cache_key``, ``parallel_tool_calls``, penalties), never
where ignoring would change the answer (``n`` > 1, image parts: 400). ``logprobs`` and
``top_logprobs`` (0-20) give each reply token's log probability. ``top_k`` and ``min_p`` are accepted as llama-server and vLLM accept
them. No ``max_tokens`` means no limit: the reply runs to the end of
generation or of the context window (finish reason ``length``).

Tool choice: ``auto``; ``none`` keeps the tools in the prompt and parses no
calls; ``required`` and a named function are enforced by a grammar that admits
exactly one call in the template's own (Hermes) format.

The package: ``protocol`` (the request and reply models), ``translate`` (to and from the serving
core's turn), ``routes`` (the routes and their streams).
"""

from __future__ import annotations

from ..api import HttpApi
from .protocol import ChatCompletionRequest, error_body
from .routes import router
from .translate import call_schemas, tool_choice_options

#: the app's entry for it (``app.APIS``)
API = HttpApi(lambda serving, _store: router(serving), ("/v1/chat/completions", "/v1/models", "/v1/embeddings"),
              error_body)

__all__ = ["API", "ChatCompletionRequest", "call_schemas", "router", "tool_choice_options"]
