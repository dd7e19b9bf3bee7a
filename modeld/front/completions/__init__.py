"""The legacy completions API: ``POST /v1/completions`` (plain and streamed), a raw prompt continued.

The prompt (text, token ids, or a list of one of either) is the whole context, with no chat template: what an
editor's completion as the user types sends, and scripts written for the legacy API. Successive prompts that
share a head reuse it from the KV by token LCP, as a conversation does (``usage.prompt_tokens_details.
cached_tokens`` counts it). ``echo`` puts the prompt before the reply; ``logprobs`` (k, 0-20) gives each reply
token's log probability and the k likeliest tokens at its step in the legacy shape (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``). Refused with a 400 rather than answered otherwise:
several prompts, ``n`` or ``best_of`` above 1, ``suffix`` (fill in the middle), and ``echo`` with ``logprobs``
(the prompt's own tokens scored).

The package: ``protocol`` (the request and reply models), ``translate`` (to the serving core's turn, and the
legacy logprobs shape), ``routes`` (the route and its stream).
"""

from __future__ import annotations

from ..api import HttpApi
from ..openai.protocol import error_body
from .routes import router

#: the app's entry for it (``app.APIS``)
API = HttpApi(lambda serving, _store: router(serving), ("/v1/completions",), error_body)

__all__ = ["API", "router"]
