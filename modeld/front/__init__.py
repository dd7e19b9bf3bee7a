"""The HTTP front: the APIs coding agents speak, over the daemon's ZeroMQ session contract.

``modeld serve --http HOST:PORT`` serves it on a thread beside the daemon;
``modeld http`` runs it as its own process for a daemon at ``--endpoint``. It is
a client of the daemon (it imports ``runtime``, never a backend). Modules:

* ``core``: the serving core every API shares (a request in the neutral form
  becomes one ``runtime.Chat`` turn; refusals before any reply byte; keep-alives);
* one package per API, each ``protocol`` (request and reply models),
  ``translate`` (to and from the core's turn) and ``routes``: ``openai`` (chat
  completions, models, embeddings), ``responses`` (the Responses API, with
  ``stored``: the responses kept for ``previous_response_id``) and
  ``anthropic`` (Messages), and ``tokens`` (``/tokenize``, ``/detokenize``: protocol and routes only, a
  session call rather than a turn); ``app`` mounts each with one line;
* ``app``: the shared routes, edge checks and error shapes; ``errors``: the
  daemon's errors as each API's; ``access``: the access log; ``guard``: the
  connection cap and header deadline; ``pool``: long-lived daemon clients;
  ``sealing``: signatures on what clients echo back; ``server``: uvicorn;
  ``main``: ``modeld http``, and ``build_front``, the front its settings describe.
"""

from .app import create_app
from .main import build_front, main
from .server import HttpFront, is_loopback, parse_listen

__all__ = ["HttpFront", "build_front", "create_app", "is_loopback", "main", "parse_listen"]
