"""A recording reverse proxy between the agents and the daemon, for seeing what each agent sends.

Every request is forwarded unchanged (streams pass through as they arrive) and dumped to
``<outdir>/<agent>/NNN-<route>.json``: the request (headers with keys masked, the body), the
response status and headers, and the response body (for an event stream, its last ``TAIL`` bytes).
The upstream side is the standard library's ``http.client`` in worker threads, so the proxy needs
nothing beyond the daemon's own HTTP front (starlette, uvicorn, anyio).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import time
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio.to_thread
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from benchmarks.agents.report import usage_of

__all__ = ["Proxy", "describe_request"]

#: how much of an event stream's end a dump keeps
TAIL = 4096
#: the most of a plain response body a dump keeps
BODY_MAX = 1 << 20
HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding",
       "proxy-connection", "te", "trailer", "upgrade"}
SECRET = {"authorization", "x-api-key", "api-key", "proxy-authorization", "cookie"}
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def _slug(path: str) -> str:
    slug = "".join(c if c.isalnum() else "_" for c in path.strip("/"))
    return slug[:80] or "root"


def _body(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


def _masked(headers: list[tuple[str, str]]) -> dict[str, str]:
    return {k: ("***" if k.lower() in SECRET else v) for k, v in headers}


def describe_request(body: Any) -> dict[str, Any]:
    """The shape of a chat / responses / messages request body: what matters for a server, not its text."""
    if not isinstance(body, dict):
        return {}
    out: dict[str, Any] = {}
    for key in ("model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "max_output_tokens",
                "temperature", "tool_choice", "parallel_tool_calls", "store", "reasoning", "thinking",
                "reasoning_effort", "include", "prompt_cache_key", "response_format", "text"):
        if key in body:
            out[key] = body[key]
    tools = body.get("tools")
    if isinstance(tools, list):
        out["tools"] = len(tools)
        kinds = sorted({str(t.get("type", "?")) for t in tools if isinstance(t, dict)})
        out["tool_types"] = kinds
    for key in ("messages", "input"):
        items = body.get(key)
        if isinstance(items, list):
            roles: dict[str, int] = {}
            for m in items:
                if isinstance(m, dict):
                    r = str(m.get("role") or m.get("type") or "?")
                    roles[r] = roles.get(r, 0) + 1
            out[key] = roles
    system = body.get("system")
    if system is not None:
        out["system_chars"] = len(json.dumps(system, ensure_ascii=False))
    out["body_chars"] = len(json.dumps(body, ensure_ascii=False))
    return out


@dataclass
class _Agent:
    name: str
    dir: Path
    seq: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: Ctrl-C stops the harness, not just the proxy."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class Proxy:
    """Forwards to ``upstream`` (host, port); dumps into the current agent's directory."""

    def __init__(self, upstream: tuple[str, int], port: int) -> None:
        self.upstream = upstream
        self.port = port
        self.agent: _Agent | None = None
        self.inflight = 0
        self._open: set[http.client.HTTPConnection] = set()
        app = Starlette(routes=[Route("/{path:path}", self._handle, methods=METHODS)])
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                lifespan="off", timeout_keep_alive=30)
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the recording proxy did not start")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 10.0)

    def begin(self, name: str, directory: Path) -> None:
        """Dump the requests from now on into ``directory`` (agents run one at a time)."""
        directory.mkdir(parents=True, exist_ok=True)
        self.agent = _Agent(name, directory)

    def end(self) -> list[dict[str, Any]]:
        """Stop attributing requests; returns one summary per request the agent sent."""
        agent, self.agent = self.agent, None
        return agent.requests if agent else []

    def abort(self) -> int:
        """Close every upstream connection still open (the agent is gone): the daemon sees its client leave."""
        conns = list(self._open)
        for conn in conns:
            with contextlib.suppress(OSError):
                if conn.sock is not None:
                    conn.sock.shutdown(2)  # wakes a thread blocked reading it
                conn.close()
        return len(conns)

    async def drain(self, timeout: float) -> bool:
        """Wait until no request is in flight; False when some still are after ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return self.inflight == 0

    def _dump(self, agent: _Agent | None, seq: int, path: str, record: dict[str, Any]) -> None:
        if agent is None:
            return
        summary = {k: record[k] for k in ("seq", "method", "path", "status", "stream", "duration_ms",
                                          "first_byte_ms", "error") if k in record}
        summary.update(describe_request(record.get("request_body")))
        prompt, cached, completion = usage_of(record)  # what the response said (a peer writes no access log)
        summary["usage"] = {"prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion}
        agent.requests.append(summary)
        out = agent.dir / f"{seq:03d}-{_slug(path)}.json"
        out.write_text(json.dumps(record, indent=2, ensure_ascii=False, default=str) + "\n")

    async def _handle(self, request: Request) -> Response:
        agent = self.agent
        seq = 0
        if agent is not None:
            agent.seq += 1
            seq = agent.seq
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raw = await request.body()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP]
        record: dict[str, Any] = {
            "seq": seq, "agent": agent.name if agent else None, "time": time.time(),
            "method": request.method, "path": path, "request_headers": _masked(headers),
            "request_body": _body(raw),
        }
        t0 = time.perf_counter()
        self.inflight += 1
        streaming = False
        try:
            conn = http.client.HTTPConnection(*self.upstream, timeout=3600)
            self._open.add(conn)
            try:
                resp = await anyio.to_thread.run_sync(
                    self._send, conn, request.method, path, raw, [*headers, ("accept-encoding", "identity")],
                    abandon_on_cancel=True)
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                self._open.discard(conn)
                record.update(status=502, error=f"upstream: {exc!r}", duration_ms=(time.perf_counter() - t0) * 1000)
                self._dump(agent, seq, request.url.path, record)
                return JSONResponse({"error": {"message": f"proxy: upstream failed: {exc}"}}, status_code=502)
            out_headers = {k: v for k, v in resp.getheaders() if k.lower() not in HOP}
            record.update(status=resp.status, response_headers=out_headers)
            is_stream = resp.getheader("content-type", "").startswith("text/event-stream")
            record["stream"] = is_stream
            if not is_stream:
                try:
                    data = await anyio.to_thread.run_sync(resp.read, abandon_on_cancel=True)
                except (OSError, http.client.HTTPException) as exc:
                    data = b""
                    record["error"] = f"upstream: {exc!r}"
                finally:
                    conn.close()
                    self._open.discard(conn)
                record.update(response_body=_body(data[:BODY_MAX]), response_bytes=len(data),
                              duration_ms=(time.perf_counter() - t0) * 1000)
                self._dump(agent, seq, request.url.path, record)
                return Response(data, status_code=resp.status, headers=out_headers)
            streaming = True
            return StreamingResponse(self._relay(agent, seq, request.url.path, record, conn, resp, t0),
                                     status_code=resp.status, headers=out_headers)
        finally:
            if not streaming:
                self.inflight -= 1

    async def _relay(self, agent: _Agent | None, seq: int, path: str, record: dict[str, Any],
                     conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, t0: float) -> AsyncIterator[bytes]:
        tail = bytearray()
        total = 0
        first: float | None = None
        error = None
        try:
            while True:
                try:
                    chunk = await anyio.to_thread.run_sync(resp.read1, 65536, abandon_on_cancel=True)
                except (OSError, http.client.HTTPException, AttributeError, ValueError) as exc:
                    # the upstream failed, or abort() closed the connection under the read (http.client then
                    # fails inside, on a socket it has dropped)
                    error = f"upstream: {exc!r}"
                    break
                if not chunk:
                    break
                if first is None:
                    first = time.perf_counter()
                total += len(chunk)
                tail += chunk
                del tail[:-TAIL]
                yield chunk
        except BaseException as exc:  # the client closed the stream (the relay is cancelled)
            error = f"client closed the stream after {total} bytes ({type(exc).__name__})"
            raise
        finally:
            conn.close()
            self._open.discard(conn)
            record.update(response_tail=tail.decode("utf-8", "replace"), response_bytes=total,
                          first_byte_ms=None if first is None else (first - t0) * 1000,
                          duration_ms=(time.perf_counter() - t0) * 1000)
            if error:
                record["error"] = error
            self._dump(agent, seq, path, record)
            self.inflight -= 1

    @staticmethod
    def _send(conn: http.client.HTTPConnection, method: str, path: str, body: bytes,
              headers: list[tuple[str, str]]) -> http.client.HTTPResponse:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in headers:
            conn.putheader(k, v)
        if body or method not in ("GET", "HEAD"):
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body or None)
        return conn.getresponse()
