"""The WebSocket protocol (``GET /v1/ws``): streamed generations a client steers while they run.

One connection carries generation after generation. The client's ``config``
(a raw ``prompt`` or chat ``messages``, ``tools``, sampling ``parameters``,
``options``) is answered with ``init`` (the generation's id, the model, its
context window, what it can do), ``status`` while it waits for the slot or
prefills, ``token`` messages as the reply is written, and ``completion``.
While it runs, ``control`` messages ``stop``, ``pause``, ``resume``,
``regenerate`` and ``modify`` (new sampling parameters from the next token)
steer it; ``feedback`` rates it (``feedback``: the log and ``modeld
feedback``). Errors carry whether the same message may succeed later and what
to do, from the same mapping as the HTTP APIs' (``protocol.error_message``). The
API key goes in the ``Authorization`` header or the first message (``auth``),
never in the URL.

The package: ``protocol`` (the messages, published as JSON Schema at
``/v1/ws/schema``), ``routes`` (the connection and its generations) and
``feedback``.
"""

from __future__ import annotations

from ..api import HttpApi
from ..openai.protocol import error_body
from .routes import PATH, router

#: the app's entry for it (``app.APIS``)
API = HttpApi(lambda serving, _store: router(serving), (PATH,), error_body)

__all__ = ["API", "PATH", "router"]
