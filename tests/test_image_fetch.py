"""Image URLs fetched under ``--allow-image-urls`` (``modeld/front/image_fetch.py``): what is fetched, what never is.

A real HTTP server (the standard library's) serves the images on this machine's own non-loopback address, as a
server on the network would (loopback is what the fetcher refuses); the tests that need one skip where the
machine has no such address. Then a real daemon process: the flag reaches the front, and without it a URL is
refused naming the flag.
"""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from modeld.front import image_fetch  # noqa: E402
from modeld.front.errors import ApiError  # noqa: E402
from modeld.front.images import ImageLimits, ImageRef, read_images  # noqa: E402
from tests.test_images import data_url, image_bytes  # noqa: E402
from tests.test_openai_front import Front  # noqa: E402

LIMITS = ImageLimits(max_images=4, max_bytes=64 * 1024, max_pixels=1024 * 1024, fetch_urls=True)
RED = image_bytes(color=(255, 0, 0))
#: how long the stalling route waits before its body: far past the fetch's limit in the test that uses it
STALL_S = 5.0


def _own_address() -> str | None:
    """An IPv4 address of this machine that is not loopback nor link-local (what a network server would have)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith(("127.", "169.254.")):
                return str(a.address)
    return None


class _Images(http.server.BaseHTTPRequestHandler):
    loopback_port = 0

    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        if self.path == "/red.png":
            self._send(200, RED, "image/png")
        elif self.path == "/no-type":
            self._send(200, RED, "application/octet-stream")
        elif self.path == "/to-red":
            self._redirect("/red.png")
        elif self.path == "/to-loopback":
            self._redirect(f"http://127.0.0.1:{self.loopback_port}/red.png")
        elif self.path == "/loop":
            self._redirect("/loop")
        elif self.path == "/big":
            self._send(200, b"\0" * (LIMITS.max_bytes + 1), "image/png")
        elif self.path == "/big-chunked":  # no length said: the reader must stop at the limit itself
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(LIMITS.max_bytes // 4096 + 2):
                self.wfile.write(b"1000\r\n" + b"\0" * 4096 + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        elif self.path == "/stall":
            self.send_response(200)
            self.send_header("Content-Length", str(len(RED)))
            self.end_headers()
            time.sleep(STALL_S)
            self.wfile.write(RED)
        else:
            self._send(404, b"not here", "text/plain")

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, to: str) -> None:
        self.send_response(302)
        self.send_header("Location", to)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The image server's base URL on this machine's own address (and its twin on loopback, for the redirect)."""
    address = _own_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to serve from")
    loopback = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    _Images.loopback_port = loopback.server_address[1]
    outer = http.server.ThreadingHTTPServer((address, 0), _Images)
    outer.daemon_threads = loopback.daemon_threads = True
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (outer, loopback)]
    for t in threads:
        t.start()
    yield f"http://{address}:{outer.server_address[1]}"
    for s in (outer, loopback):
        s.shutdown()
        s.server_close()


def _refused(url: str, limits: ImageLimits = LIMITS) -> ApiError:
    with pytest.raises(ApiError) as err:
        read_images([ImageRef("messages[0].content[1]", url=url)], limits)
    return err.value


def test_a_fetched_image_is_the_inline_one(server: str) -> None:
    inline = read_images([ImageRef("a", url=data_url(RED))], LIMITS)[0]
    for path in ("/red.png", "/no-type", "/to-red"):  # the type said or not; through a redirect
        fetched = read_images([ImageRef("b", url=server + path)], LIMITS)[0]
        assert (fetched.digest, fetched.format, fetched.width) == (inline.digest, inline.format, inline.width)


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/red.png", "http://localhost:9/red.png", "http://[::1]:9/x.png",
                                 "http://169.254.169.254/latest/meta-data/", "http://0.0.0.0:9/x.png",
                                 "http://[::ffff:127.0.0.1]:9/x.png"])
def test_loopback_link_local_and_unspecified_addresses_are_never_fetched(url: str) -> None:
    err = _refused(url)
    assert (err.status, err.code, err.param) == (400, "image_url_refused", "messages[0].content[1]")
    assert url in err.message


def test_a_redirect_to_loopback_is_refused(server: str) -> None:
    err = _refused(server + "/to-loopback")
    assert err.code == "image_url_refused" and "127.0.0.1" in err.message


@pytest.mark.parametrize("path, status, code, words", [
    ("/missing", 400, "image_url_failed", "HTTP 404"),
    ("/loop", 400, "image_url_failed", "redirects"),
    ("/big", 413, "image_too_large", "over 65,536 bytes"),
    ("/big-chunked", 413, "image_too_large", "over 65,536 bytes"),
])
def test_what_does_not_give_an_image_within_the_limits_is_refused(server: str, path: str, status: int, code: str,
                                                                   words: str) -> None:
    err = _refused(server + path)
    assert (err.status, err.code) == (status, code) and words in err.message, err.message


def test_a_server_that_stalls_past_the_time_limit_is_given_up_on(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(image_fetch, "FETCH_TIMEOUT_S", STALL_S / 10)
    err = _refused(server + "/stall")
    assert err.code == "image_url_failed", err.message


def test_a_resolver_that_hangs_costs_the_request_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def hanging(*args: Any, **kw: Any) -> Any:
        release.wait(STALL_S)
        raise OSError("gave up")

    monkeypatch.setattr(image_fetch, "FETCH_TIMEOUT_S", STALL_S / 10)
    monkeypatch.setattr(image_fetch.socket, "getaddrinfo", hanging)
    try:
        err = _refused("http://images.example/x.png")
    finally:
        release.set()
    assert err.code == "image_url_failed" and "did not resolve within" in err.message, err.message


def test_other_schemes_are_refused() -> None:
    assert _refused("ftp://example.com/x.png").code == "invalid_image"  # only data: and, allowed, http(s)
    assert _refused("file:///etc/passwd").code == "invalid_image"
    assert _refused("http://:80/x.png").code == "image_url_refused"  # no host
    assert _refused("http://10.0.0.1:99999/x.png").code == "image_url_refused"  # no such port


def test_the_flag_reaches_the_daemon_and_without_it_urls_are_refused_naming_it(tmp_path: Any) -> None:
    import openai

    content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]
    for flags, words in [((), "--allow-image-urls"), (("--allow-image-urls",), "loopback")]:
        with Front(tmp_path / str(len(flags)), *flags) as f:
            with pytest.raises(openai.BadRequestError) as err:
                f.sdk().chat.completions.create(model="ref", max_tokens=2,
                                                messages=[{"role": "user", "content": content}])
            assert err.value.body["code"] == "image_url_refused" and words in err.value.body["message"], err.value.body
