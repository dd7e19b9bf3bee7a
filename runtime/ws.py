"""A client of the daemon's WebSocket protocol (``GET /v1/ws`` on the HTTP front; docs/websocket.md).

``WsClient(url, api_key=…)`` opens one connection; ``generate`` sends a ``config``
and reads the generation's messages up to its ``completion`` (an ``error``
raises ``WsError``), handing each to ``on_message`` on the way; ``control``
(``stop``, ``pause``, ``resume``, ``regenerate``, ``modify``) and ``feedback``
may be sent from another thread while it reads. Needs the ``ws`` extra
(``websockets``); nothing of the daemon is imported.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

__all__ = ["WsClient", "WsError"]


class WsError(Exception):
    """The server's ``error`` message: ``kind`` (the protocol's), ``code`` (modeld's), whether the same message
    may succeed later (``recoverable``) and what to do (``recovery_action``, ``retry_after_ms``)."""

    def __init__(self, message: Mapping[str, Any]) -> None:
        super().__init__(str(message.get("message", "error")))
        self.body = dict(message)
        self.kind = str(message.get("error", ""))
        self.code = str(message.get("code", ""))
        self.recoverable = bool(message.get("recoverable", False))
        self.recovery_action = str(message.get("recovery_action", ""))
        self.retry_after_ms = message.get("retry_after_ms")
        self.request_id = str(message.get("request_id", ""))


class WsClient:
    """One WebSocket connection to the front at ``url`` (``ws://HOST:PORT/v1/ws``). Reads are for one thread;
    ``control`` and ``feedback`` may come from another."""

    def __init__(self, url: str, *, api_key: str = "", key_in_header: bool = True, open_timeout_s: float = 10.0,
                 timeout_s: float | None = 600.0) -> None:
        from websockets.sync.client import connect  # the `ws` extra

        headers = {"Authorization": f"Bearer {api_key}"} if api_key and key_in_header else None
        # (entered as a context manager, as websockets asks of a connection that is closed explicitly: ``close``)
        self._ws = connect(url, additional_headers=headers, open_timeout=open_timeout_s, max_size=2**24).__enter__()
        self._send_lock = threading.Lock()
        #: how long a read waits for the next message (None: for ever)
        self.timeout_s = timeout_s
        if api_key and not key_in_header:
            self.send({"type": "auth", "api_key": api_key})

    def __enter__(self) -> WsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._ws.close()

    def send(self, message: Mapping[str, Any]) -> None:
        """Send one message as it is."""
        with self._send_lock:
            self._ws.send(json.dumps(message))

    def recv(self, timeout_s: float | None = -1.0) -> dict[str, Any]:
        """The next message (TimeoutError after ``timeout_s``; the default: the client's ``timeout_s``)."""
        raw = self._ws.recv(timeout=self.timeout_s if timeout_s == -1.0 else timeout_s)
        out = json.loads(raw)
        if not isinstance(out, dict):
            raise ValueError(f"the server sent {type(out).__name__}, not a JSON object")
        return out

    def config(self, *, prompt: str | None = None, messages: Sequence[Mapping[str, Any]] | None = None,
               tools: Sequence[Mapping[str, Any]] = (), model: str = "", options: Mapping[str, Any] | None = None,
               **parameters: Any) -> None:
        """Start a generation (``parameters``: ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``,
        ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty``, ``seed``, ``stop``)."""
        body: dict[str, Any] = {"type": "config", "model": model, "parameters": parameters,
                                "options": dict(options or {})}
        if prompt is not None:
            body["prompt"] = prompt
        if messages is not None:
            body["messages"] = [dict(m) for m in messages]
        if tools:
            body["tools"] = [dict(t) for t in tools]
        self.send(body)

    def control(self, action: str, **parameters: Any) -> None:
        """``stop``, ``pause``, ``resume``, ``regenerate``, or ``modify`` with the parameters to change."""
        body: dict[str, Any] = {"type": "control", "action": action}
        if parameters:
            body["parameters"] = parameters
        self.send(body)

    def feedback(self, rating: float, text: str = "", position: int | None = None, request_id: str = "") -> None:
        body: dict[str, Any] = {"type": "feedback", "rating": rating, "text": text}
        if position is not None:
            body["position"] = position
        if request_id:
            body["request_id"] = request_id
        self.send(body)

    def messages(self) -> Iterator[dict[str, Any]]:
        """The generation's messages up to and with its ``completion``; an ``error`` for it raises ``WsError``."""
        while True:
            message = self.recv()
            if message.get("type") == "error":
                raise WsError(message)
            yield message
            if message.get("type") == "completion":
                return

    def generate(self, *, on_message: Callable[[dict[str, Any]], None] | None = None, **config: Any) -> dict[str, Any]:
        """``config(**config)``, then its messages up to the ``completion``, which is returned."""
        self.config(**config)
        for message in self.messages():
            if on_message is not None:
                on_message(message)
            if message.get("type") == "completion":
                return message
        raise WsError({"message": "the connection ended before the completion"})
