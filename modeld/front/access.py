"""One access-log line per HTTP request, written when its response has been sent in full.

The line (logger ``modeld.access``, level INFO) says what an operator needs to
see what an agent did, never what it said: method, route, status, the model
that served it, whether it streamed, prompt / cached (reused) / completion
tokens, where and why the prompt's reuse stopped when it lost what the daemon held (``miss``), the finish
reason, time to first token, what the prefill computed and its tokens per second, total time, and the error
code of a refusal. Routes fill the request's ``AccessRecord``
(``record_of(request)``); a streamed reply fills it as it ends, and the line
is written as the last byte is sent (or once the client went away: status 499).
With ``--log-format json`` each field is a key of the JSON line.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["AccessLog", "AccessRecord", "record_of"]

log = logging.getLogger("modeld.access")

#: the status logged for a request whose client went away before the response was sent
CLIENT_GONE = 499


@dataclass
class AccessRecord:
    """What one request did; the routes fill in what they know."""

    method: str
    route: str
    status: int = 0
    model: str = ""
    stream: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""
    ttft_ms: float = 0.0
    #: what the prefill computed (the prompt less what was reused) and how fast: a slow first request reads here
    prefilled_tokens: int = 0
    prefill_ms: float = 0.0
    #: where the prompt's reuse stopped and why (``ReuseMiss.brief``: ``cause@index``), when it lost something
    miss: str = ""
    total_ms: float = 0.0
    error: str = ""
    started: float = field(default_factory=time.perf_counter, repr=False)

    @property
    def prefill_tps(self) -> float:
        """Prefill tokens per second (0 when nothing was prefilled)."""
        return self.prefilled_tokens / (self.prefill_ms / 1000) if self.prefilled_tokens and self.prefill_ms > 0 else 0.0

    def fields(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("started")
        out["prefill_tps"] = round(self.prefill_tps, 1)
        return out

    def line(self) -> str:
        """The plain-text form: ``METHOD ROUTE STATUS key=value …`` (empty values left out)."""
        head = f"{self.method} {self.route} {self.status}"
        parts = []
        for key in ("model", "prompt_tokens", "cached_tokens", "miss", "completion_tokens", "finish_reason", "error"):
            value = getattr(self, key)
            if value:
                parts.append(f"{key}={value}")
        if self.stream:
            parts.append("stream=1")
        if self.ttft_ms:
            parts.append(f"ttft_ms={self.ttft_ms:.0f}")
        if self.prefilled_tokens:
            # (a prefill cut short counts the chunks it finished, and has no rate)
            parts.append(f"prefilled_tokens={self.prefilled_tokens}")
        if self.prefill_tps:
            parts.append(f"prefill_tps={self.prefill_tps:.0f}")
        parts.append(f"total_ms={self.total_ms:.0f}")
        return " ".join([head, *parts])


def record_of(request: Request) -> AccessRecord:
    """The access record of ``request`` (a fresh one outside the middleware, e.g. in a unit test)."""
    record = getattr(request.state, "access", None)
    if not isinstance(record, AccessRecord):
        record = AccessRecord(request.method, request.url.path)
        request.state.access = record
    return record


class AccessLog:
    """ASGI middleware: an ``AccessRecord`` per HTTP request, logged when the response is complete."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = AccessRecord(scope.get("method", ""), scope.get("path", ""))
        scope.setdefault("state", {})["access"] = record
        logged = False

        def write() -> None:
            nonlocal logged
            if logged:
                return
            logged = True
            record.total_ms = (time.perf_counter() - record.started) * 1000
            log.info("%s", record.line(), extra={"access": record.fields()})

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = int(message["status"])
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                write()  # before the last byte goes: a client that reads the log on its reply finds the line there
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            if not logged:
                if not record.status:
                    record.status = CLIENT_GONE
                write()
