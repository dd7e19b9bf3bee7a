"""The front served by uvicorn: on a thread of ``modeld serve --http``, or as ``modeld http`` on its own."""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from pathlib import Path

import uvicorn

from runtime import Client

from .app import DEFAULT_MAX_BODY_BYTES, create_app
from .core import Serving
from .guard import (
    ACCEPT_BACKLOG,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    connection_cap,
    guarded_protocol,
)
from .pool import ClientPool
from .sealing import Sealer
from .stored import ResponseStore

__all__ = ["QUEUE_TIMEOUT_S", "HttpFront", "is_loopback", "parse_aliases", "parse_listen"]

log = logging.getLogger("modeld.http")

#: how long a request waits for the slot while another holds it, then 503
QUEUE_TIMEOUT_S = 300.0


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as a host and a port."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--http takes HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def parse_aliases(values: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``NAME=MODEL`` pairs (``--alias``) as a mapping; ValueError naming a malformed one."""
    out = {}
    for value in values:
        name, sep, target = value.partition("=")
        if not sep or not name.strip() or not target.strip():
            raise ValueError(f"--alias takes NAME=MODEL, got {value!r}")
        out[name.strip()] = target.strip()
    return out


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HttpFront:
    """The HTTP APIs for the daemon at ``endpoint``, served by uvicorn on its own thread."""

    def __init__(
        self,
        endpoint: str,
        host: str,
        port: int,
        *,
        api_key: str = "",
        allow_remote: bool = False,
        queue_timeout_s: float = QUEUE_TIMEOUT_S,
        aliases: dict[str, str] | None = None,
        strict_model_names: bool = False,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        data_dir: Path | None = None,
        keep_billing_header: bool = False,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        switch_on_request: bool = True,
    ) -> None:
        if not is_loopback(host) and not allow_remote:
            raise ValueError(
                f"--http {host}:{port} is not a loopback address; pass --http-allow-remote to serve other machines "
                "(and set --api-key)"
            )
        if not is_loopback(host) and not api_key:
            log.warning("--http %s:%d serves other machines with no --api-key: anyone who reaches the port can use "
                        "the model", host, port)
        # a client waits for its reply as long as a request may queue, and then some
        self.pool = ClientPool(lambda: Client(endpoint, timeout_s=queue_timeout_s + 60))
        # the key that signs what clients echo back, and the stored responses, live in the data dir
        sealer = Sealer.from_file(data_dir / "http.key" if data_dir is not None else None)
        store = ResponseStore(data_dir / "responses" if data_dir is not None else None)
        serving = Serving(self.pool, queue_timeout_s=queue_timeout_s, aliases=aliases,
                          strict_model_names=strict_model_names, sealer=sealer, keep_billing_header=keep_billing_header,
                          switch_on_request=switch_on_request)
        app = create_app(serving, api_key=api_key, max_body_bytes=max_body_bytes, store=store)
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/v1"
        # the access log is the front's own (modeld.access); uvicorn logs only its warnings
        # the pure-Python h11 protocol, guarded: a connection cap under the descriptor budget, a request-head deadline
        protocol = guarded_protocol(connection_cap(max_connections), header_timeout_s)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                                log_config=None, http=protocol, backlog=ACCEPT_BACKLOG)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="modeld-http", daemon=True)

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self._server.started:
            raise RuntimeError(f"the HTTP front did not start on {self.url}")
        log.info("HTTP APIs at %s", self.url)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self.pool.close()
