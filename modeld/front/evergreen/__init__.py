"""Evergreen (``../shared/seeds/002``): a session of nodes and actions, the prompt a tree of chunks the client
streams in any order, the reply an output node streamed back.

``nodes``: the session's nodes and the protocol's rules, apart from any transport; ``session``: actions run on
the front's serving core (a prompt that names the earlier prompt and response is the conversation the daemon
already holds, so only what is new is prefilled); ``server``: the bidirectional gRPC transport (``--grpc``, the
``grpc`` extra; the messages are ``runtime/evergreen/evergreen.proto``'s). docs/evergreen.md.
"""

from __future__ import annotations

from .nodes import END_OF_TURN, TEXT, Abort, Action, Chunk, Fragment, NodeStore
from .session import EvergreenSession

# (``server`` needs grpcio: imported by the front only with --grpc)

__all__ = ["END_OF_TURN", "TEXT", "Abort", "Action", "Chunk", "EvergreenSession", "Fragment", "NodeStore"]
