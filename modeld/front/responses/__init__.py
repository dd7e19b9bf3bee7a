"""The OpenAI Responses API: ``POST /v1/responses`` (stateless and stored), ``GET``/``DELETE /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel`` and ``POST /v1/responses/input_tokens``.

A request becomes the same neutral turn as a chat completion (``core``), so a
conversation renders to the same tokens whichever API carried it and Codex's
turns reuse each other as any client's do:

* ``instructions`` and leading ``system``/``developer`` messages are the stable
  prefix; ``message`` items (text parts) the turns; ``function_call`` items the
  assistant's calls (joined to the assistant message before them, as chat
  completions carry them); ``function_call_output`` the tool results;
  ``reasoning`` items the assistant's reasoning, read back from
  ``encrypted_content`` when the daemon sealed it (else from their summary).
* ``tools``: ``function`` tools as they are; a ``namespace`` tool's functions
  flattened under their own names (a call names its namespace again in the
  reply); ``custom`` (free-form) tools as a function of one string ``input``.
  Tools this daemon cannot run (``web_search``, ``file_search``,
  ``computer_use``, ``image_generation``, ``local_shell``, hosted ``mcp``, …) are
  left out of the prompt and logged, never refused.
* ``tool_choice``, ``max_output_tokens`` (a cap), ``temperature``, ``top_p``,
  ``text.format`` (``json_schema``/``json_object``), ``reasoning`` (accepted;
  the model's own reasoning comes out as a ``reasoning`` item), ``include``
  (``reasoning.encrypted_content``: a sealed blob of the reasoning),
  ``prompt_cache_key``, ``metadata``, ``parallel_tool_calls`` and the rest are
  accepted.
* ``store`` (default true) keeps the response in the data dir;
  ``previous_response_id`` continues it with only the new input: the stored
  conversation is resent to the slot, whose KV still holds it, so the turn is
  as warm as a stateless one that resends everything.

Over ~400 lines on purpose: the request's translation and the streamed event sequence walk the
same output items (message, reasoning, function calls), and the stored responses share them too.

The package: ``protocol`` (the request and reply models), ``translate`` (to and from the serving
core's turn), ``routes`` (the routes and their streams).
"""

from __future__ import annotations

from ..api import HttpApi
from ..openai.protocol import error_body
from .protocol import ResponsesRequest
from .routes import router

#: the app's entry for it (``app.APIS``): it keeps the front's stored responses
API = HttpApi(router, ("/v1/responses",), error_body)

__all__ = ["API", "ResponsesRequest", "router"]
