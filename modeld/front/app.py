"""The HTTP app: the routes every API shares, the edge checks (key, body size), errors in each API's shape.

Routes: ``GET``/``HEAD /`` (200: clients probe it), ``/health``, ``/metrics``
(the daemon's Prometheus text), ``/openapi.json``, and each protocol's
router (``APIS``: one entry per API, ``front.api.HttpApi``). A request is checked at the edge before a route runs:
the API key (``Authorization: Bearer`` or ``x-api-key``, compared in constant
time), the body size (413 past ``max_body_bytes``, before anything is parsed),
and the body's schema (400 naming the field). Errors are rendered in the
shape of the API the path belongs to (``HttpApi.prefixes``).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contract.errors import ModeldError

from ..defaults import DEFAULT_MAX_BODY_BYTES
from ..metrics import CONTENT_TYPE
from . import anthropic, completions, openai, responses, tokens, ws
from .access import AccessLog, record_of
from .api import HttpApi, error_body
from .core import Serving, Shape, declared, dumped
from .errors import ApiError, api_error
from .openai.protocol import ErrorBody
from .openai.protocol import error_body as openai_error
from .stored import ResponseStore

__all__ = ["APIS", "DEFAULT_MAX_BODY_BYTES", "create_app"]

#: the HTTP APIs the app mounts: a new API is its package and one entry here
APIS: tuple[HttpApi, ...] = (openai.API, anthropic.API, responses.API, tokens.API, completions.API, ws.API)

#: paths answered without the API key (a load balancer's probe)
_OPEN_PATHS = frozenset({"/", "/health"})


def error_response(apis: Sequence[HttpApi], path: str, err: ApiError) -> JSONResponse:
    """``err`` in the shape of the API ``path`` belongs to; OpenAI's where none owns it: the shape most clients
    read."""
    return JSONResponse(dumped(error_body(apis, path, err, openai_error)), status_code=err.status,
                        headers=err.headers)


class EdgeChecks:
    """ASGI middleware: the API key and the body size, before the app reads anything."""

    def __init__(self, app: ASGIApp, *, api_key: str, max_body_bytes: int, apis: Sequence[HttpApi]) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.max_body_bytes = max_body_bytes
        self.apis = apis

    async def _refuse(self, scope: Scope, send: Send, err: ApiError) -> None:
        record = scope.get("state", {}).get("access")
        if record is not None:
            record.error = err.code or ""
        response = error_response(self.apis, scope.get("path", ""), err)
        await response(scope, _no_body, send)

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or [])
        bearer = headers.get(b"authorization", b"")
        given = bearer[7:] if bearer[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        return hmac.compare_digest(given, self.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key and scope.get("path") not in _OPEN_PATHS and not self._authorized(scope):
            await self._refuse(scope, send, ApiError(401, "missing or wrong API key", code="invalid_api_key"))
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        limit = self.max_body_bytes
        if length is not None:
            # the server holds a body to its declared length, so the header is the size
            if not length.isdigit() or int(length) > limit:
                await self._refuse(scope, send, _too_large(limit))
                return
            await self.app(scope, receive, send)
            return
        # A chunked body: read it up to the limit into one buffer, then hand it to the app whole. (One buffer
        # grown in place, not a list of the server's 64 KiB pieces: freed, a large buffer goes back to the
        # system, where thousands of pieces left the heap fragmented and the process 60 MiB larger after two
        # refused 200 MB bodies.)
        buffer = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            buffer += message.get("body", b"")
            if len(buffer) > limit:
                del buffer
                await self._refuse(scope, send, _too_large(limit))
                return
            if not message.get("more_body", False):
                break
        whole: list[Message] = [{"type": "http.request", "body": bytes(buffer), "more_body": False}]
        del buffer

        async def replay() -> Message:
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


async def _no_body() -> Message:
    return {"type": "http.disconnect"}


class Greeting(Shape):
    name: Literal["modeld"]
    status: Literal["ok"]


class Health(Shape):
    status: Literal["ok"]
    #: the slot's state (``SlotState``) and the loaded model (None: no model)
    state: str
    model: str | None


def create_app(serving: Serving, *, store: ResponseStore | None = None, apis: Sequence[HttpApi] = APIS) -> ASGIApp:
    """The front's ASGI app over ``serving`` (whose settings give the API key and the largest body), serving
    ``apis``."""
    app = FastAPI(title="modeld", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    store = store or ResponseStore(None)

    @app.exception_handler(ApiError)
    async def _on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        record_of(request).error = exc.code or str(exc.status)
        return error_response(apis, request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = exc.errors()
        first = problems[0] if problems else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            param = None
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg', ''))}"
        elif first.get("type") == "missing" and not loc:
            message = "the body must be a JSON object"
        else:
            message = f"{param or 'body'}: {first.get('msg', 'invalid')}"
            if len(problems) > 1:
                message += f" (and {len(problems) - 1} more)"
        err = ApiError(400, message, code="invalid_request", param=param)
        record_of(request).error = "invalid_request"
        return error_response(apis, request.url.path, err)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # the framework's own refusals (a body it cannot parse, an unknown route or method) in the API's shape
        code = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "error")
        detail = str(exc.detail) if exc.detail else "refused"
        if exc.status_code == 400 and "parsing the body" in detail:
            detail = "the body is not valid JSON (or nests deeper than the parser allows)"
        elif exc.status_code == 404:
            detail = f"no route {request.method} {request.url.path}"
        record_of(request).error = code
        response = error_response(apis, request.url.path, ApiError(exc.status_code, detail, code=code))
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    @app.get("/", response_model=Greeting, response_model_exclude_unset=True, responses=declared(Greeting, ErrorBody))
    async def root() -> Greeting:
        return Greeting(name="modeld", status="ok")

    @app.head("/", response_model=Greeting, response_model_exclude_unset=True,
              responses=declared(Greeting, ErrorBody))
    async def root_head() -> Greeting:  # Claude Code's first request: is the server there
        return Greeting(name="modeld", status="ok")

    @app.get("/health", response_model=Health, response_model_exclude_unset=True,
             responses=declared(Health, ErrorBody))
    async def health() -> Health:
        def status() -> Health:
            with serving.pool.client() as c:
                st = c.status()
            return Health(status="ok", state=st.state.value, model=st.active.model_name if st.active else None)

        try:
            return await anyio.to_thread.run_sync(status)
        except ModeldError as exc:
            raise api_error(exc) from None

    @app.get("/metrics", response_class=Response,
             responses={**declared(None, ErrorBody), 200: {"content": {CONTENT_TYPE: {}}, "description": "the metrics"}})
    async def metrics() -> Response:
        """The daemon's Prometheus metrics (the same text as `modeld metrics`)."""

        def scrape() -> str:
            with serving.pool.client() as c:
                return c.metrics() + generate_latest(serving.registry).decode()

        try:
            text = await anyio.to_thread.run_sync(scrape)
        except ModeldError as exc:
            raise api_error(exc) from None
        return Response(text, media_type=CONTENT_TYPE)

    for api in apis:
        app.include_router(api.router(serving, store))
    edge = EdgeChecks(app, api_key=serving.settings.api_key, max_body_bytes=serving.settings.http_max_body, apis=apis)
    return AccessLog(edge)
