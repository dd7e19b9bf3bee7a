"""The HTTP front's connection limits (modeld/front/guard.py) against real daemon processes: idle and
half-sent connections cannot starve the daemon of descriptors, and a slow request head is closed."""

from __future__ import annotations

import http.client
import json
import resource
import socket
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from tests.daemon_proc import DaemonProcess  # noqa: E402
from tests.test_openai_front import _port, _wait_http  # noqa: E402

HALF_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
CHAT = {"model": "ref", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _daemon(tmp: Path, port: int, *extra: str) -> DaemonProcess:
    return DaemonProcess(tmp, "memory", None, "--model", "/models/ref", "--model-name", "ref",
                         "--http", f"127.0.0.1:{port}", *extra)


def _chat(port: int, body: dict[str, object] = CHAT) -> tuple[int, dict[str, object]]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


def _limit_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


@pytest.mark.slow
def test_idle_half_sent_connections_cannot_starve_the_daemon(tmp_path: Path) -> None:
    """1,200 connections that send half a request head against a daemon limited to 1,024 descriptors: the
    front holds what its budget allows and turns the rest away with 503; ZeroMQ clients are still served;
    HTTP answers again once they close."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1500:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
        except (ValueError, OSError):
            pytest.skip(f"this process may open only {soft} files; the test needs 1,500")
    port = _port()
    d = _daemon(tmp_path, port, "--http-header-timeout", "600")
    d.preexec = _limit_open_files
    socks: list[socket.socket] = []
    with d:
        _wait_http(port)
        try:
            for _ in range(1200):
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                s.sendall(HALF_HEAD)
                socks.append(s)
            # the ones past the cap (1,024 less the 256 kept for the rest) were answered and closed
            answered = socks[-100].recv(4096)
            assert answered.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in answered.lower(), answered
            assert b"too_many_connections" in answered
            # the daemon's own clients still connect and are served
            for _ in range(20):
                with d.client(timeout_s=10.0) as c:
                    assert c.status().state.value == "Ready"
            status, body = _chat(port)
            assert status == 503 and body["error"]["code"] == "too_many_connections"  # type: ignore[index]
        finally:
            for s in socks:
                s.close()
        deadline = time.monotonic() + 10
        while (status := _chat(port)[0]) != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert status == 200
        assert d.proc is not None and d.proc.poll() is None
        assert "Too many open files" not in d.log()


def test_a_slow_request_head_is_closed_but_a_long_stream_is_not(tmp_path: Path) -> None:
    port = _port()
    with _daemon(tmp_path, port, "--http-header-timeout", "1", "--memory-token-delay-ms", "60"):
        _wait_http(port)
        slow = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            slow.sendall(HALF_HEAD)
            t0 = time.monotonic()
            answered = slow.recv(4096)
            took = time.monotonic() - t0
            assert answered.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in answered, answered
            assert 0.5 < took < 5.0, took
            assert slow.recv(4096) == b""  # and closed
        finally:
            slow.close()
        # a reply that takes longer than the head deadline (40 tokens at 60 ms) runs to its end
        t0 = time.monotonic()
        status, body = _chat(port, {**CHAT, "max_tokens": 40})
        assert status == 200 and body["usage"]["completion_tokens"] == 40, body  # type: ignore[index]
        assert time.monotonic() - t0 > 2.0
