"""The front served by uvicorn: on a thread of ``modeld serve --http``, or as ``modeld http`` on its own."""

from __future__ import annotations

import ipaddress
import logging
import threading
import time

import uvicorn

from runtime import Client

from ..defaults import QUEUE_TIMEOUT_S
from ..settings import HttpSettings
from .app import create_app
from .core import Serving
from .guard import ACCEPT_BACKLOG, connection_cap, guarded_protocol
from .pool import ClientPool
from .sealing import Sealer
from .stored import ResponseStore

__all__ = ["QUEUE_TIMEOUT_S", "HttpFront", "is_loopback", "parse_listen"]

log = logging.getLogger("modeld.http")



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


class HttpFront:
    """The HTTP APIs for the daemon at ``endpoint``, served by uvicorn on its own thread."""

    def __init__(self, settings: HttpSettings, endpoint: str, listen: str) -> None:
        """The front ``settings`` describe (the ``HttpSettings`` group, passed whole), on ``listen`` (HOST:PORT),
        for the daemon at ``endpoint``; ValueError names a bad address."""
        host, port = parse_listen(listen)
        if not is_loopback(host) and not settings.http_allow_remote:
            raise ValueError(
                f"--http {host}:{port} is not a loopback address; pass --http-allow-remote to serve other machines "
                "(and set --api-key)"
            )
        if not is_loopback(host) and not settings.api_key:
            log.warning("--http %s:%d serves other machines with no --api-key: anyone who reaches the port can use "
                        "the model", host, port)
        # a client waits for its reply as long as a request may queue, and then some
        self.pool = ClientPool(lambda: Client(endpoint, timeout_s=settings.http_queue_timeout + 60))
        # the key that signs what clients echo back, and the stored responses, live in the data dir
        data_dir = settings.data_home
        serving = Serving(self.pool, settings, sealer=Sealer.from_file(data_dir / "http.key"))
        app = create_app(serving, store=ResponseStore(data_dir / "responses"))
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/v1"
        # the access log is the front's own (modeld.access); uvicorn logs only its warnings
        # the pure-Python h11 protocol, guarded: a connection cap under the descriptor budget, a request-head deadline
        protocol = guarded_protocol(connection_cap(settings.http_max_connections), settings.http_header_timeout)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                                log_config=None, http=protocol, ws="websockets-sansio", backlog=ACCEPT_BACKLOG)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="modeld-http", daemon=True)
        #: Evergreen over gRPC beside it (``--grpc``), on the same serving core
        self.grpc = None
        if settings.grpc:
            grpc_host, grpc_port = parse_listen(settings.grpc)
            if not is_loopback(grpc_host) and not settings.http_allow_remote:
                raise ValueError(f"--grpc {settings.grpc} is not a loopback address; pass --http-allow-remote to "
                                 "serve other machines (and set --api-key)")
            try:
                from .evergreen.server import EvergreenServer  # the `grpc` extra
            except ImportError as exc:
                raise ValueError(f"--grpc needs the project's 'grpc' extra (pip install '.[grpc]'): {exc}") from None

            self.grpc = EvergreenServer(serving, f"{grpc_host}:{grpc_port}", api_key=settings.api_key,
                                        allow_file_refs=settings.allow_file_refs)

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self._server.started:
            raise RuntimeError(f"the HTTP front did not start on {self.url}")
        log.info("HTTP APIs at %s", self.url)
        if self.grpc is not None:
            self.grpc.start()

    def stop(self) -> None:
        if self.grpc is not None:
            self.grpc.stop()
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self.pool.close()
