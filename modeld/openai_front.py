"""An OpenAI-compatible HTTP front: the agents people already run (OpenAI SDK, aider, Continue, opencode) use modeld.

``modeld serve --http HOST:PORT`` serves, beside the ZeroMQ socket:

* ``GET /health`` and ``GET /v1/models`` (the loaded model);
* ``POST /v1/chat/completions``, plain and streamed (server-sent events): the
  message list goes through ``runtime.Chat`` — leading system messages and the
  tools are the stable prefix, the rest the conversation — so every request
  reuses what the previous one left resident; ``usage.prompt_tokens_details
  .cached_tokens`` is the reused part;
* ``POST /v1/embeddings``.

The front is a client of the daemon (it imports ``runtime``, never a backend),
so it can also run as its own process against another endpoint. Requests queue
for the slot in arrival order (``OpenSessionRequest.queue_timeout_s``); a client
that disconnects mid-stream cancels its decode. Errors are OpenAI error objects:
400 for a bad request (code ``context_length_exceeded`` for an overflow), 401
for a missing or wrong ``--api-key``, 404 for an unknown model, 503 with
Retry-After when the slot stayed busy or the daemon is unavailable.

Supported request fields: model, messages, tools, tool_choice (``auto``;
``none`` keeps the tools in the prompt and parses no calls; ``required`` and a
named function are enforced by a grammar that admits exactly one call in the
template's own format), response_format (``json_object``, ``json_schema``),
temperature, top_p, seed, stop, max_tokens, max_completion_tokens, stream,
stream_options.include_usage. ``n`` > 1 is refused with 400 rather than ignored.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Generator
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse

from contract.errors import (
    ContextOverflow,
    DaemonTimeout,
    InvalidArgument,
    ModelBusy,
    ModeldError,
    ModelNotActive,
    ShuttingDown,
    Unavailable,
    UnsupportedFeature,
)
from contract.types import EmbedRequest, StructuredOutputConfig
from runtime import Client
from runtime.chat import Chat, ChatEvent, ChatResult

from .metrics import CONTENT_TYPE

__all__ = ["HttpFront", "create_app", "parse_listen"]

log = logging.getLogger("modeld.http")

#: the manifest profile of requests that came over HTTP (they share one warm context)
PROFILE = "openai"
#: how long a request waits for the slot while another holds it
QUEUE_TIMEOUT_S = 300.0
_FINISH = {"stop": "stop", "length": "length", "context_full": "length", "tool_calls": "tool_calls", "cancelled": "stop"}


class ApiError(Exception):
    """An error the front answers in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _api_error(exc: ModeldError) -> ApiError:
    """A daemon error as the HTTP status an OpenAI client expects."""
    if isinstance(exc, ContextOverflow):
        return ApiError(400, exc.message, code="context_length_exceeded")
    if isinstance(exc, (InvalidArgument, UnsupportedFeature)):
        return ApiError(400, exc.message, code=type(exc).__name__)
    if isinstance(exc, ModelNotActive):
        return ApiError(404, exc.message, code="model_not_found")
    if isinstance(exc, (ModelBusy, DaemonTimeout, Unavailable, ShuttingDown)):
        return ApiError(503, exc.message, type_="server_error", code=type(exc).__name__, headers={"Retry-After": "1"})
    return ApiError(500, f"{type(exc).__name__}: {exc.message}", type_="server_error", code=type(exc).__name__)


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as a host and a port."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--http takes HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# --- request mapping ---------------------------------------------------------------------------------------
def _decode_options(body: dict[str, Any]) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        opts["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "seed"):
        if body.get(name) is not None:
            opts[name] = body[name]
    stop = body.get("stop")
    if stop:
        opts["stop"] = [stop] if isinstance(stop, str) else list(stop)
    fmt = body.get("response_format") or {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        opts["structured_output"] = StructuredOutputConfig(json_schema=json.dumps({"type": "object"}))
    elif kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format json_schema needs json_schema.schema (an object)", param="response_format")
        opts["structured_output"] = StructuredOutputConfig(json_schema=json.dumps(schema))
    elif kind not in (None, "text"):
        raise ApiError(400, f"response_format type {kind!r} is not supported", param="response_format")
    choice = body.get("tool_choice")
    if choice == "none":
        opts["parser_protocols"] = []
    elif choice not in (None, "auto"):
        if "structured_output" in opts:
            raise ApiError(400, "a forced tool call and a response_format cannot be combined", param="tool_choice")
        opts["structured_output"] = StructuredOutputConfig(grammar=forced_call_grammar(_forced_names(choice, body.get("tools"))))
    if body.get("n", 1) != 1:
        raise ApiError(400, "n > 1 is not supported: one model slot decodes one reply", param="n")
    return opts


#: a JSON object in the spelling the templates render a call's arguments back with (json.dumps defaults)
_JSON_GBNF = r"""
object ::= "{" ( string ": " value ( ", " string ": " value )* )? "}"
array  ::= "[" ( value ( ", " value )* )? "]"
value  ::= object | array | string | number | "true" | "false" | "null"
string ::= "\"" ( [^"\\] | "\\" ["\\/bfnrtu] )* "\""
number ::= "-"? [0-9]+ ( "." [0-9]+ )?
"""


def forced_call_grammar(names: list[str]) -> str:
    """GBNF for exactly one Hermes tool call to one of ``names`` with a JSON object of arguments.

    It is the form the templates render a call back in, so the next request
    reuses the decoded call; both engines take GBNF.
    """
    alternatives = " | ".join(json.dumps(json.dumps(n)[1:-1]) for n in names)
    head = json.dumps('<tool_call>\n{"name": "')
    middle = json.dumps('", "arguments": ')
    tail = json.dumps("}\n</tool_call>")
    return f"root ::= {head} name {middle} object {tail}\nname ::= {alternatives}{_JSON_GBNF}"


def _forced_names(choice: Any, tools: Any) -> list[str]:
    """The tool names a ``required`` or named ``tool_choice`` allows."""
    names = [t.get("function", {}).get("name", "") for t in tools or [] if isinstance(t, dict)]
    names = [n for n in names if isinstance(n, str) and n]
    if not names:
        raise ApiError(400, "tool_choice forces a call but no tools were given", param="tool_choice")
    if choice == "required":
        return names
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return [str(name)]
    raise ApiError(400, f"tool_choice {choice!r} is not one of auto, none, required or a named function", param="tool_choice")


def _tool_calls(result_calls: list[Any]) -> list[dict[str, Any]]:
    return [
        {"id": c.id or f"call_{uuid.uuid4().hex[:12]}", "type": "function",
         "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in result_calls
    ]


def _usage(result: ChatResult) -> dict[str, Any]:
    u = result.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.reused_tokens},
        # OpenAI's names for predicted-output tokens: here, speculative drafts kept and rejected
        "completion_tokens_details": {
            "accepted_prediction_tokens": u.accepted_tokens,
            "rejected_prediction_tokens": u.drafted_tokens - u.accepted_tokens,
        },
    }


# --- the app ----------------------------------------------------------------------------------------------
def create_app(connect: Callable[[], Client], *, api_key: str = "", queue_timeout_s: float = QUEUE_TIMEOUT_S) -> FastAPI:
    """The FastAPI app; ``connect`` gives a fresh runtime Client (one per request: they are not thread-safe).

    A request waits up to ``queue_timeout_s`` for the slot while another holds it, then gets 503.
    """
    app = FastAPI(title="modeld", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _on_api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.middleware("http")
    async def _auth(request: Request, call_next: Callable[[Request], Any]) -> Response:
        if api_key and request.url.path != "/health":
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return ApiError(401, "missing or wrong API key", code="invalid_api_key").response()
        response: Response = await call_next(request)
        return response

    def active_model() -> str:
        with connect() as c:
            st = c.status()
        if st.active is None:
            if st.state.value in ("Loading", "Switching"):
                raise ApiError(503, "the model is loading", type_="server_error", code="loading", headers={"Retry-After": "1"})
            raise ApiError(404, "no model is loaded (modeld load …)", code="model_not_found")
        return st.active.model_name

    def check_model(requested: str) -> str:
        name = active_model()
        if requested and requested not in (name, "modeld", "default"):
            raise ApiError(404, f"model {requested!r} is not loaded; this daemon serves {name!r}", param="model",
                           code="model_not_found")
        return name

    @app.get("/health")
    async def health() -> dict[str, Any]:
        def status() -> dict[str, Any]:
            with connect() as c:
                st = c.status()
            return {"status": "ok", "state": st.state.value, "model": st.active.model_name if st.active else None}

        try:
            return await anyio.to_thread.run_sync(status)
        except ModeldError as exc:
            raise _api_error(exc) from None

    @app.get("/metrics")
    async def metrics() -> Response:
        """The daemon's Prometheus metrics (the same text as `modeld metrics`)."""

        def scrape() -> str:
            with connect() as c:
                return c.metrics()

        try:
            text = await anyio.to_thread.run_sync(scrape)
        except ModeldError as exc:
            raise _api_error(exc) from None
        return Response(text, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        try:
            name = await anyio.to_thread.run_sync(active_model)
        except ModeldError as exc:
            raise _api_error(exc) from None
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "modeld"}]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response | EventSourceResponse:
        body = await _json_body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        tools = body.get("tools") or None
        opts = _decode_options(body)
        try:
            model = await anyio.to_thread.run_sync(check_model, str(body.get("model") or ""))
        except ModeldError as exc:
            raise _api_error(exc) from None
        created = int(time.time())
        rid = "chatcmpl-" + uuid.uuid4().hex[:24]
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return EventSourceResponse(
                _stream(connect, messages, tools, opts, model, rid, created, include_usage, queue_timeout_s)
            )

        def run() -> ChatResult:
            with connect() as c:
                return Chat(c, profile=PROFILE, queue_timeout_s=queue_timeout_s).send(messages, tools, **opts)

        try:
            result = await anyio.to_thread.run_sync(run)
        except ModeldError as exc:
            raise _api_error(exc) from None
        msg = result.message
        message: dict[str, Any] = {"role": "assistant", "content": msg.content}
        if msg.tool_calls:
            message["tool_calls"] = _tool_calls(msg.tool_calls)
        if msg.reasoning:
            message["reasoning_content"] = msg.reasoning
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": _FINISH.get(result.finish_reason, "stop")}],
            "usage": _usage(result),
        })

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        body = await _json_body(request)
        raw = body.get("input")
        texts = [raw] if isinstance(raw, str) else raw
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise ApiError(400, "input must be a string or a list of strings", param="input")

        def run() -> Any:
            with connect() as c:
                return c.embed(EmbedRequest(texts=texts))

        try:
            res = await anyio.to_thread.run_sync(run)
        except ModeldError as exc:
            raise _api_error(exc) from None
        return JSONResponse({
            "object": "list",
            "model": res.model_name,
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(res.vectors)],
            "usage": {"prompt_tokens": res.tokens, "total_tokens": res.tokens},
        })

    return app


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


async def _stream(connect: Callable[[], Client], messages: list[Any], tools: Any, opts: dict[str, Any], model: str,
                  rid: str, created: int, include_usage: bool, queue_timeout_s: float) -> AsyncGenerator[str, None]:
    """The reply as ``chat.completion.chunk`` events; a disconnect closes the decode (it cancels within one token)."""
    client = connect()
    events: Generator[ChatEvent, None, None] | None = None

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    try:
        try:
            events = await anyio.to_thread.run_sync(
                lambda: Chat(client, profile=PROFILE, queue_timeout_s=queue_timeout_s).stream(messages, tools, **opts))
        except ModeldError as exc:
            err = _api_error(exc)
            yield json.dumps({"error": {"message": err.message, "type": err.type, "code": err.code}})
            return
        yield chunk({"role": "assistant", "content": ""})
        n_calls = 0
        while True:
            event = await anyio.to_thread.run_sync(next, events, None)
            if event is None:
                break
            if event.result is not None:
                yield chunk({}, _FINISH.get(event.result.finish_reason, "stop"))
                if include_usage:
                    yield json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                      "choices": [], "usage": _usage(event.result)})
                break
            delta: dict[str, Any] = {}
            if event.text:
                delta["content"] = event.text
            if event.thinking:
                delta["reasoning_content"] = event.thinking
            if event.tool_calls:
                delta["tool_calls"] = [dict(call, index=n_calls + i) for i, call in enumerate(_tool_calls(event.tool_calls))]
                n_calls += len(event.tool_calls)
            if delta:
                yield chunk(delta)
        yield "[DONE]"
    finally:
        # A disconnect cancels this generator: closing the decode stream sends the daemon a cancel.
        def close() -> None:
            if events is not None:
                events.close()
            client.close()

        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(close)


class HttpFront:
    """The front served by uvicorn on its own thread (``modeld serve --http``)."""

    def __init__(
        self,
        endpoint: str,
        host: str,
        port: int,
        *,
        api_key: str = "",
        allow_remote: bool = False,
        queue_timeout_s: float = QUEUE_TIMEOUT_S,
    ) -> None:
        if not is_loopback(host) and not allow_remote:
            raise ValueError(
                f"--http {host}:{port} is not a loopback address; pass --http-allow-remote to serve other machines "
                "(and set --api-key)"
            )
        app = create_app(
            lambda: Client(endpoint, timeout_s=queue_timeout_s + 60), api_key=api_key, queue_timeout_s=queue_timeout_s
        )
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/v1"
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="modeld-http", daemon=True)

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self._server.started:
            raise RuntimeError(f"the HTTP front did not start on {self.url}")
        log.info("OpenAI-compatible API at %s", self.url)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)


def main(argv: list[str] | None = None) -> int:
    """``modeld http``: the front alone, as its own process, for a daemon at ``--endpoint``."""
    import argparse
    import os
    import signal
    import sys

    from contract.endpoint import default_endpoint

    p = argparse.ArgumentParser(prog="modeld http", description="Serve the OpenAI-compatible API for a running daemon.")
    p.add_argument("--endpoint", default=None, help="the daemon (default: env MODELD_ENDPOINT or the per-user ipc socket)")
    p.add_argument("--http", default=os.environ.get("MODELD_HTTP") or "127.0.0.1:8377", metavar="HOST:PORT")
    p.add_argument("--http-allow-remote", action="store_true", help="let --http bind a non-loopback address")
    p.add_argument("--api-key", default=os.environ.get("MODELD_API_KEY", ""), help="bearer key (env MODELD_API_KEY)")
    p.add_argument("--http-queue-timeout", type=float, default=QUEUE_TIMEOUT_S, metavar="S")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        host, port = parse_listen(args.http)
        front = HttpFront(args.endpoint or default_endpoint(), host, port, api_key=args.api_key,
                          allow_remote=args.http_allow_remote, queue_timeout_s=args.http_queue_timeout)
    except ValueError as exc:
        print(f"modeld http: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        front.start()
    except RuntimeError as exc:
        print(f"modeld http: {exc}", file=sys.stderr)
        return 1
    print(f"modeld: OpenAI-compatible API at {front.url}", file=sys.stderr, flush=True)
    stop.wait()
    front.stop()
    return 0

