"""``modeld http``: the front alone, as its own process, for a daemon at ``--endpoint``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from contract.endpoint import default_endpoint

from .. import dirs
from ..capacity.sizes import parse_size
from ..logs import LOG_FORMATS, setup_logging
from .app import DEFAULT_MAX_BODY_BYTES
from .guard import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS
from .server import QUEUE_TIMEOUT_S, HttpFront, parse_aliases, parse_listen

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="modeld http", description="Serve the HTTP APIs for a running daemon.")
    p.add_argument("--endpoint", default=None, help="the daemon (default: env MODELD_ENDPOINT or the per-user ipc socket)")
    p.add_argument("--http", default=os.environ.get("MODELD_HTTP") or "127.0.0.1:8377", metavar="HOST:PORT")
    p.add_argument("--http-allow-remote", action="store_true", help="let --http bind a non-loopback address")
    p.add_argument("--api-key", default=os.environ.get("MODELD_API_KEY", ""), help="the key clients must send (env MODELD_API_KEY)")
    p.add_argument("--http-queue-timeout", type=float, default=QUEUE_TIMEOUT_S, metavar="S")
    p.add_argument("--http-max-body", default=str(DEFAULT_MAX_BODY_BYTES), metavar="SIZE",
                   help="largest request body (413 past it)")
    p.add_argument("--http-max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help="open connections served at once (503 past it; kept under the open files limit)")
    p.add_argument("--http-header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="S",
                   help="seconds a connection may take to send a request head (408 past it; 0 = no limit)")
    p.add_argument("--alias", action="append", default=[], metavar="NAME=MODEL", help="answer requests for NAME with MODEL")
    p.add_argument("--strict-model-names", action="store_true",
                   help="refuse (404) a request naming a model that is not loaded, instead of serving it with the loaded one")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="stored responses and the signing key (default: the daemon's data dir)")
    p.add_argument("--keep-billing-header", action="store_true",
                   help="Messages API: keep a system block that only carries a client's per-request billing header")
    p.add_argument("--log-format", choices=LOG_FORMATS, default=os.environ.get("MODELD_LOG_FORMAT") or "plain")
    p.add_argument("--log-level", default=os.environ.get("MODELD_LOG_LEVEL") or "INFO")
    args = p.parse_args(argv)
    setup_logging(args.log_level, args.log_format, sys.stderr)
    try:
        host, port = parse_listen(args.http)
        front = HttpFront(args.endpoint or default_endpoint(), host, port, api_key=args.api_key,
                          allow_remote=args.http_allow_remote, queue_timeout_s=args.http_queue_timeout,
                          aliases=parse_aliases(args.alias), strict_model_names=args.strict_model_names,
                          max_body_bytes=parse_size(args.http_max_body), data_dir=args.data_dir or dirs.data_dir(),
                          keep_billing_header=args.keep_billing_header, max_connections=args.http_max_connections,
                          header_timeout_s=args.http_header_timeout)
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
    print(f"modeld: HTTP APIs at {front.url}", file=sys.stderr, flush=True)
    stop.wait()
    front.stop()
    return 0
