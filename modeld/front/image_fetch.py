"""Image URLs fetched for a request, when ``--allow-image-urls`` says so (``images.read_images``).

A daemon that fetches what its clients name is a door from them to wherever it can reach, and a local daemon
can reach what nobody else can: services on loopback (its own ZeroMQ endpoint among them) and a cloud's
link-local metadata address. So each hop is checked before it is taken: the host is resolved once, every
address it has must be a unicast one that is not loopback, link-local, unspecified, multicast or reserved
(a private network's address is allowed: the clients on this machine reach it themselves), and the request
goes to the address that was checked (the host named in ``Host`` and, for https, in the TLS handshake and the
certificate check), so a name that resolves otherwise a moment later changes nothing. Redirects are followed
by hand, each hop checked the same way, at most ``MAX_REDIRECTS``. The body is read in chunks up to
``max_bytes`` (413 past it, as for an inline image) within ``FETCH_TIMEOUT_S`` in all, the name lookups
included; what comes back is then read like any inline image (the format sniffed from the bytes: the
``Content-Type`` is not trusted).

Every refusal is a 400 naming the request field and the URL, code ``image_url_refused`` for a URL this daemon
will not fetch and ``image_url_failed`` for one that did not give an image.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import socket
import time

import httpx

from ..defaults import IMAGE_FETCH_REDIRECTS, IMAGE_FETCH_TIMEOUT_S
from .errors import ApiError

__all__ = ["FETCH_TIMEOUT_S", "MAX_REDIRECTS", "fetch"]

#: the whole fetch, every hop together; the redirects followed
FETCH_TIMEOUT_S = IMAGE_FETCH_TIMEOUT_S
MAX_REDIRECTS = IMAGE_FETCH_REDIRECTS
_CHUNK = 64 * 1024
#: where names are resolved, so a resolver that hangs costs a request its deadline, not more (a lookup left
#: running holds one of these threads until the resolver gives up)
_RESOLVER = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="image-url-dns")


def fetch(url: str, where: str, max_bytes: int) -> bytes:
    """The bytes at ``url`` (http or https), checked as the module says; ``ApiError`` otherwise."""
    deadline = time.monotonic() + FETCH_TIMEOUT_S
    current = _parsed(url, where, url)
    with httpx.Client(follow_redirects=False, trust_env=False, verify=True) as client:
        for _ in range(MAX_REDIRECTS + 1):
            if current.scheme not in ("http", "https") or not current.host:
                said = "is not" if str(current) == url else f"redirects to {current}, which is not"
                raise _refused(where, url, f"{said} an http(s) URL with a host")
            address = _checked_address(current, where, url, deadline)
            left = deadline - time.monotonic()
            request = client.build_request(
                "GET", current.copy_with(host=address), headers={"Host": current.netloc.decode("ascii"),
                                                                 "Accept": "image/*"},
                timeout=httpx.Timeout(max(left, 0.001)), extensions={"sni_hostname": current.host})
            try:
                response = client.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise _failed(where, url, f"{type(exc).__name__}: {exc}") from None
            try:
                if response.is_redirect:
                    current = _parsed(response.headers.get("location", ""), where, url, base=current)
                    continue
                if response.status_code != 200:
                    raise _failed(where, url, f"HTTP {response.status_code}")
                return _body(response, where, url, max_bytes, deadline)
            finally:
                response.close()
    raise _failed(where, url, f"more than {MAX_REDIRECTS} redirects")


def _parsed(text: str, where: str, url: str, base: httpx.URL | None = None) -> httpx.URL:
    try:
        return base.join(text) if base is not None else httpx.URL(text)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        said = f"redirects to {text!r}, which" if base is not None else "is a URL that"
        raise _refused(where, url, f"{said} does not parse ({exc})") from None


def _body(response: httpx.Response, where: str, url: str, max_bytes: int, deadline: float) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(where, url, max_bytes)
    data = bytearray()
    try:
        for chunk in response.iter_bytes(_CHUNK):
            data += chunk
            if len(data) > max_bytes:
                raise _too_large(where, url, max_bytes)
            if time.monotonic() > deadline:
                raise _failed(where, url, f"it took longer than {FETCH_TIMEOUT_S:.0f} s")
    except httpx.HTTPError as exc:
        raise _failed(where, url, f"{type(exc).__name__}: {exc}") from None
    return bytes(data)


def _checked_address(current: httpx.URL, where: str, url: str, deadline: float) -> str:
    """The address to connect to for ``current``'s host: resolved once, every address it has allowed."""
    port = current.port or (443 if current.scheme == "https" else 80)
    if not 0 < port < 65536:  # (getaddrinfo would take it modulo 65,536)
        raise _refused(where, url, f"names port {port}, which no host has")
    lookup = _RESOLVER.submit(socket.getaddrinfo, current.host, port, type=socket.SOCK_STREAM)
    try:
        infos = lookup.result(timeout=max(deadline - time.monotonic(), 0.001))
    except concurrent.futures.TimeoutError:
        raise _failed(where, url, f"{current.host} did not resolve within {FETCH_TIMEOUT_S:.0f} s") from None
    except (OSError, OverflowError, UnicodeError) as exc:
        raise _failed(where, url, f"{current.host} does not resolve ({exc})") from None
    addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
    for a in addresses:
        if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
            a = a.ipv4_mapped  # (::ffff:127.0.0.1 is loopback too)
        if a.is_loopback or a.is_link_local or a.is_unspecified or a.is_multicast or a.is_reserved:
            raise _refused(where, url, f"leads to {current.host} ({a}), a loopback, link-local or reserved address "
                           "this daemon does not fetch from")
    return str(addresses[0])


def _refused(where: str, url: str, why: str) -> ApiError:
    return ApiError(400, f"{where}: {url} {why}", code="image_url_refused", param=where)


def _failed(where: str, url: str, why: str) -> ApiError:
    return ApiError(400, f"{where}: fetching the image at {url} failed: {why}", code="image_url_failed", param=where)


def _too_large(where: str, url: str, max_bytes: int) -> ApiError:
    return ApiError(413, f"{where}: the image at {url} is over {max_bytes:,} bytes (--max-image-bytes)",
                    code="image_too_large", param=where)
