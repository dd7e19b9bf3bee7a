"""The Anthropic Messages API: ``POST /v1/messages`` (plain and streamed) and ``/v1/messages/count_tokens``.

A request becomes the same neutral turn as a chat completion (``core``), so a
conversation renders to the same tokens whichever API carried it:

* ``system`` (a string or text blocks) is the stable prefix, blocks joined by
  a blank line. A block that only carries a client's per-request billing
  header (``x-anthropic-billing-header: …``, which Claude Code rewrites every
  request) is left out, so it cannot cost the prefix its reuse;
  ``--keep-billing-header`` keeps it. ``cache_control`` markers are hints the
  daemon does not need (it reuses every resident token): they never change
  the tokens.
* ``messages``: text blocks are a turn's text; ``tool_use`` blocks the
  assistant's calls; ``tool_result`` blocks tool messages answering them
  (``is_error`` marks the text); ``thinking`` blocks the assistant's reasoning
  when their signature is the daemon's own (others are left out);
  ``redacted_thinking`` is left out; ``image`` and ``document`` are refused
  with 400 (this model reads text). A ``system`` role inside ``messages`` is
  a system turn.
* ``tools`` (``input_schema``) become function tools; server tools (a
  ``type`` other than ``custom``) are left out and logged. ``tool_choice``:
  ``auto``, ``any`` (a call is forced), ``tool`` (that one is forced), ``none``.
* ``max_tokens`` is a cap (the reply stops at the context's end); ``thinking``
  ``enabled``/``adaptive``/``disabled`` is the template's reasoning switch;
  ``metadata``, ``context_management``, ``output_config``, ``service_tier``
  and any ``anthropic-beta`` header are accepted.

Usage: ``input_tokens`` is what was prefilled, ``cache_read_input_tokens``
what was reused, ``cache_creation_input_tokens`` 0 (the daemon keeps every
prefilled token without being asked), ``output_tokens`` the reply.

The package: ``protocol`` (the request and reply models), ``translate`` (to and from the serving
core's turn), ``routes`` (the routes and their streams).
"""

from __future__ import annotations

from ..api import HttpApi
from .protocol import STOP_REASONS, MessagesRequest, error_body
from .routes import router

#: the app's entry for it (``app.APIS``): Anthropic's error object on its paths
API = HttpApi(lambda serving, _store: router(serving), ("/v1/messages",), error_body)

__all__ = ["API", "STOP_REASONS", "MessagesRequest", "router"]
