"""A client of Evergreen sessions over gRPC (the daemon's ``--grpc``): one ``EvergreenSession`` per stream.

``send`` puts actions and node fragments on the stream (``text``, ``parent``, ``end_of_turn`` and ``generate``
build them); ``output`` reads an action's output node to its final fragment and returns its text. The stream
ends with ``close``; a session the server aborted raises ``grpc.RpcError`` (its ``code()`` and ``details()``
say which rule or failure). Needs the ``grpc`` extra; nothing of the daemon is imported.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Mapping
from typing import Any

from .proto import load

__all__ = ["END_OF_TURN", "TEXT", "EvergreenClient", "EvergreenSession"]

TEXT = "text/plain"
END_OF_TURN = "application/x-protobuf; type=EndOfTurn"
_END = object()


class EvergreenSession:
    """One ``Session`` stream: what was sent, what came back."""

    def __init__(self, stub: Any, pb2: Any, metadata: list[tuple[str, str]], timeout_s: float | None) -> None:
        self.pb2 = pb2
        self._out: queue.Queue[Any] = queue.Queue()
        self._replies = stub.Session(self._requests(), metadata=metadata, timeout=timeout_s)
        #: output fragments read so far, by node id
        self.received: dict[str, list[Any]] = {}

    def _requests(self) -> Iterator[Any]:
        while (m := self._out.get()) is not _END:
            yield m

    def send(self, *messages: Any) -> None:
        """Put ``SessionMessage``s on the stream, in order."""
        for m in messages:
            self._out.put(m)

    def close(self) -> None:
        """End the stream from this side (the server ends the session when it has answered)."""
        self._out.put(_END)

    def cancel(self) -> None:
        """Drop the stream at once (the server cancels what runs)."""
        self._replies.cancel()

    def output(self, node_id: str) -> str:
        """Read the stream until ``node_id``'s final fragment; its text (fragments of other nodes are kept)."""
        while True:
            frags = self.received.get(node_id, [])
            if frags and not frags[-1].continued:
                return b"".join(f.chunk_fragment.data for f in sorted(frags, key=lambda f: f.seq)).decode()
            m = next(self._replies)
            self.received.setdefault(m.node_fragment.id, []).append(m.node_fragment)

    # --- message builders ---------------------------------------------------------------------------------------
    def text(self, node_id: str, data: str, *, seq: int = 0, continued: bool = False) -> Any:
        cf = self.pb2.ChunkFragment(data=data.encode())
        if seq == 0:
            cf.metadata.mimetype = TEXT
        return self.pb2.SessionMessage(node_fragment=self.pb2.NodeFragment(id=node_id, seq=seq, continued=continued,
                                                                           chunk_fragment=cf))

    def end_of_turn(self, node_id: str) -> Any:
        cf = self.pb2.ChunkFragment(metadata=self.pb2.ChunkMetadata(mimetype=END_OF_TURN))
        return self.pb2.SessionMessage(node_fragment=self.pb2.NodeFragment(id=node_id, chunk_fragment=cf))

    def parent(self, node_id: str, *children: str, seq: int = 0, continued: bool = False) -> Any:
        return self.pb2.SessionMessage(node_fragment=self.pb2.NodeFragment(id=node_id, seq=seq, continued=continued,
                                                                           child_ids=list(children)))

    def generate(self, prompt: str, response: str, config: Mapping[str, Any] | None = None) -> Any:
        action = self.pb2.Action(name="GENERATE", input=[self.pb2.NamedParameter(name="prompt", id=prompt)],
                                 output=[self.pb2.NamedParameter(name="response", id=response)])
        if config:
            action.config.update(dict(config))
        return self.pb2.SessionMessage(action=action)


class EvergreenClient:
    """A channel to the daemon's Evergreen server at ``target`` (HOST:PORT)."""

    def __init__(self, target: str, *, api_key: str = "", timeout_s: float | None = 600.0) -> None:
        import grpc  # type: ignore[import-untyped]  # (the grpc extra)

        self._pb2, pb2_grpc = load()
        self._channel = grpc.insecure_channel(target)
        self._stub = pb2_grpc.EvergreenStub(self._channel)
        self._metadata = [("authorization", f"Bearer {api_key}")] if api_key else []
        self.timeout_s = timeout_s

    def session(self) -> EvergreenSession:
        return EvergreenSession(self._stub, self._pb2, self._metadata, self.timeout_s)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> EvergreenClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
