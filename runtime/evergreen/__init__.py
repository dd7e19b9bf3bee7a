"""Evergreen sessions over gRPC (the daemon's ``--grpc``; the ``grpc`` extra): ``EvergreenClient``, and the
messages generated from ``evergreen.proto`` (``proto.load``)."""

from __future__ import annotations

from .client import END_OF_TURN, TEXT, EvergreenClient, EvergreenSession

__all__ = ["END_OF_TURN", "TEXT", "EvergreenClient", "EvergreenSession"]
