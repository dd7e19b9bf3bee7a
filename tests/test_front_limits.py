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

from harness.daemon import (  # noqa: E402
    DaemonProcess,  # noqa: E402
    free_port,
    wait_http,
)

HALF_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
CHAT = {"model": "ref", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _daemon(tmp: Path, port: int, *extra: str) -> DaemonProcess:
    return DaemonProcess(tmp, "memory", None, "--model", "/models/ref", "--model-name", "ref",
                         "--http", f"127.0.0.1:{port}", *extra)


def _chat(port: int, body: dict[str, object] = CHAT, pause_s: float = 0.0) -> tuple[int, dict[str, object]]:
    """POST a chat request; with ``pause_s`` the body follows its head that much later (a client streaming its
    body, or one slowed down), which is when a front that closes early makes the body's send fail."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        data = json.dumps(body).encode()
        c.putrequest("POST", "/v1/chat/completions", skip_accept_encoding=True)
        c.putheader("content-type", "application/json")
        c.putheader("content-length", str(len(data)))
        c.endheaders()
        time.sleep(pause_s)
        c.send(data)
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


def _limit_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


def room_for_connections(n: int) -> str:
    """Raise this process's soft open-files limit so it can hold ``n`` sockets; why it cannot ("" when it can)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= n + 300:
        return ""
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    except (ValueError, OSError):
        return f"this process may open only {soft} files; {n:,} connections need {n + 300:,}"
    return ""


def half_heads(port: int, n: int) -> list[socket.socket]:
    """``n`` connections that each send half a request head and then nothing."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            socks.append(s)
            s.sendall(HALF_HEAD)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


@pytest.mark.slow
def test_idle_half_sent_connections_cannot_starve_the_daemon(tmp_path: Path) -> None:
    """1,200 connections that send half a request head against a daemon limited to 1,024 descriptors: the
    front holds what its budget allows and turns the rest away with 503; ZeroMQ clients are still served;
    HTTP answers again once they close."""
    cannot = room_for_connections(1200)
    if cannot:
        pytest.skip(cannot)
    port = free_port()
    d = _daemon(tmp_path, port, "--http-header-timeout", "600")
    d.preexec = _limit_open_files
    with d:
        wait_http(port)
        socks = half_heads(port, 1200)
        try:
            # a complete request sent while the last refused half-sent ones are fresh reads its 503 too, even
            # from a client that pauses between its head and its body
            status, body = _chat(port, pause_s=0.2)
            assert status == 503 and body["error"]["code"] == "too_many_connections"  # type: ignore[index]
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
    port = free_port()
    with _daemon(tmp_path, port, "--http-header-timeout", "1", "--memory-token-delay-ms", "60"):
        wait_http(port)
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


def _post_big(port: int, size: int, chunked: bool) -> bytes:
    """POST ``size`` bytes of JSON-ish body to chat completions, as fast as the front takes them; the answer's
    status line (the front may answer and close before the body is all sent)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        framing = b"transfer-encoding: chunked\r\n" if chunked else b"content-length: %d\r\n" % size
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + framing + b"\r\n")
        piece = b'{"model": "ref", "messages": [{"role": "user", "content": "' + b"a" * (1 << 20)
        try:
            for _ in range(size >> 20):
                s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if chunked:
                s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered and closed mid-body: what a cap does
        answer = b""
        try:
            while b"\r\n" not in answer and (data := s.recv(4096)):
                answer += data
        except ConnectionResetError:
            pass
        return answer.split(b"\r\n", 1)[0]
    finally:
        s.close()


@pytest.mark.slow
def test_a_200_mb_body_is_refused_413_and_memory_stays_flat(tmp_path: Path) -> None:
    """With and without a declared length, three at once: 413 before the body is parsed; RSS grows under 50 MB."""
    import threading

    psutil = pytest.importorskip("psutil")
    port = free_port()
    with _daemon(tmp_path, port) as d:
        wait_http(port)
        assert d.proc is not None
        proc = psutil.Process(d.proc.pid)
        assert _chat(port)[0] == 200
        rss0 = proc.memory_info().rss
        answers: list[bytes] = []
        peak = rss0

        def post(chunked: bool) -> None:
            answers.append(_post_big(port, 200 << 20, chunked))

        for _ in range(2):
            threads = [threading.Thread(target=post, args=(chunked,)) for chunked in (False, True, True)]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                peak = max(peak, proc.memory_info().rss)
                time.sleep(0.05)
        rss1 = proc.memory_info().rss
        assert answers and all(a.startswith(b"HTTP/1.1 413") for a in answers), answers
        assert rss1 - rss0 < 50 << 20, f"RSS {rss0 >> 20} -> {rss1 >> 20} MiB (peak {peak >> 20} MiB)"
        assert _chat(port)[0] == 200  # and it serves on
        # a body under the limit sent chunked, in small pieces, is served
        body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 3000}]}).encode()
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        try:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
            for i in range(0, len(body), 500):
                s.sendall(b"%x\r\n%s\r\n" % (len(body[i:i + 500]), body[i:i + 500]))
            s.sendall(b"0\r\n\r\n")
            answer = b""
            while data := s.recv(65536):
                answer += data
        finally:
            s.close()
        assert answer.startswith(b"HTTP/1.1 200") and b'"completion_tokens":4' in answer.replace(b" ", b""), answer[:300]
