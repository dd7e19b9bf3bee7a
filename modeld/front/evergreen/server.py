"""Evergreen over bidirectional streaming gRPC (``--grpc HOST:PORT``): one ``Session`` stream per session.

Each message the client streams is an action or a node fragment (``runtime/evergreen/evergreen.proto``); the
server streams the output nodes' fragments back as the actions run (``session.EvergreenSession``). A broken rule
or a failed action ends the stream with a status: ``INVALID_ARGUMENT`` (the rule, named), ``NOT_FOUND``
(an unknown model), ``FAILED_PRECONDITION`` (a switch refused), ``UNAVAILABLE`` (the slot stayed busy, the daemon
is gone: retry), ``INTERNAL``. The API key (``--api-key``) goes in the ``authorization: Bearer`` metadata. A
client that goes away cancels the running action, and the slot is free as soon as its decode stops. The server
runs on a thread of its own with its own event loop, beside the HTTP front.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped]
from google.protobuf import json_format  # type: ignore[import-untyped]

from runtime.evergreen.proto import load

from ..core import Serving
from .nodes import Abort, Action, Chunk, Fragment
from .session import EvergreenSession

__all__ = ["EvergreenServer", "action_of", "fragment_of", "message_of"]

log = logging.getLogger("modeld.evergreen")

_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
           404: grpc.StatusCode.NOT_FOUND, 409: grpc.StatusCode.FAILED_PRECONDITION,
           413: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}
#: config keys whose values are whole numbers (a Struct carries every number as a double)
_INTEGERS = frozenset({"max_tokens", "top_k", "seed"})


def fragment_of(nf: Any) -> Fragment:
    """A ``NodeFragment`` message as the node store's ``Fragment``."""
    chunk = None
    has_metadata = False
    if nf.HasField("chunk_fragment"):
        cf = nf.chunk_fragment
        has_metadata = cf.HasField("metadata")
        chunk = Chunk(cf.metadata.mimetype if has_metadata else "", cf.data, cf.ref)
    return Fragment(id=nf.id, seq=nf.seq, continued=nf.continued, child_ids=tuple(nf.child_ids), chunk=chunk,
                    has_metadata=has_metadata)


def action_of(a: Any) -> Action:
    config = json_format.MessageToDict(a.config) if a.HasField("config") else {}
    for key in _INTEGERS & set(config):
        value = config[key]
        if isinstance(value, float) and value.is_integer():
            config[key] = int(value)
    return Action(name=a.name, inputs=tuple((p.name, p.id) for p in a.input),
                  outputs=tuple((p.name, p.id) for p in a.output), config=config)


def message_of(pb2: Any, f: Fragment) -> Any:
    """An output ``Fragment`` as a ``SessionMessage``."""
    assert f.chunk is not None
    cf = pb2.ChunkFragment(data=f.chunk.data)
    if f.has_metadata:
        cf.metadata.mimetype = f.chunk.mimetype
    return pb2.SessionMessage(node_fragment=pb2.NodeFragment(id=f.id, seq=f.seq, continued=f.continued,
                                                             chunk_fragment=cf))


class EvergreenServer:
    """The gRPC server for ``serving``'s daemon on ``listen`` (HOST:PORT), on its own thread."""

    def __init__(self, serving: Serving, listen: str, *, api_key: str = "", allow_file_refs: Path | None = None) -> None:
        self.serving = serving
        self.listen = listen
        self.api_key = api_key
        self.allow_file_refs = allow_file_refs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="modeld-grpc", daemon=True)
        #: the port bound (``listen``'s, or the one the system chose for port 0)
        self.port = 0

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        if not self._started.wait(timeout_s) or self._error is not None:
            raise RuntimeError(f"the Evergreen gRPC server did not start on {self.listen}: {self._error}")
        log.info("Evergreen gRPC at %s", self.listen)

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # a bind that failed: start() reports it
            self._error = exc
            self._started.set()

    async def _serve(self) -> None:
        pb2, pb2_grpc = load()
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        server = grpc.aio.server()
        pb2_grpc.add_EvergreenServicer_to_server(_Servicer(self, pb2), server)
        self.port = server.add_insecure_port(self.listen)
        await server.start()
        self._started.set()
        await self._stopping.wait()
        await server.stop(grace=1.0)


class _Servicer:
    def __init__(self, owner: EvergreenServer, pb2: Any) -> None:
        self.owner = owner
        self.pb2 = pb2

    def _authorized(self, context: grpc.aio.ServicerContext) -> bool:
        if not self.owner.api_key:
            return True
        metadata = dict(context.invocation_metadata() or ())
        given = str(metadata.get("authorization", ""))
        key = given[7:] if given[:7].lower() == "bearer " else str(metadata.get("x-api-key", ""))
        return hmac.compare_digest(key.encode(), self.owner.api_key.encode())

    async def Session(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # noqa: N802 (the service's method name)
        if not self._authorized(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key (authorization: Bearer KEY)")
        session = EvergreenSession(self.owner.serving, allow_file_refs=self.owner.allow_file_refs)
        try:
            async for message in requests:
                kind = message.WhichOneof("kind")
                if kind is None:
                    raise Abort("a session message with neither an action nor a node fragment")
                item = action_of(message.action) if kind == "action" else fragment_of(message.node_fragment)
                async for fragment in session.take(item):
                    yield message_of(self.pb2, fragment)
        except Abort as exc:
            log.info("Evergreen session aborted: %s", exc)
            await context.abort(_STATUS.get(exc.status, grpc.StatusCode.INTERNAL), str(exc))
