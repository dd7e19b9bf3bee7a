"""``modeld http``: the front alone, as its own process, for a daemon at ``--endpoint``.

Its settings are ``modeld.settings.HttpSettings``, the front's part of ``modeld
serve``'s, read the same way: flag, else ``MODELD_<SETTING>``, else the config
file, else the built-in default.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from contract.endpoint import default_endpoint

from .. import dirs
from ..logs import LOG_FORMATS, setup_logging
from ..settings import HttpSettings, SettingsError, add_setting, layering_epilog, parse_settings
from .server import HttpFront, parse_aliases, parse_listen

__all__ = ["DEFAULT_LISTEN", "build_front", "build_parser", "main"]

#: where ``modeld http`` listens when no --http says (``serve`` serves no front then)
DEFAULT_LISTEN = "127.0.0.1:8377"


def build_front(settings: HttpSettings, endpoint: str, listen: str) -> HttpFront:
    """The front ``settings`` describe, on ``listen`` (HOST:PORT), for the daemon at ``endpoint``; ValueError
    names a bad address or alias."""
    host, port = parse_listen(listen)
    return HttpFront(endpoint, host, port, api_key=settings.api_key, allow_remote=settings.http_allow_remote,
                     queue_timeout_s=settings.http_queue_timeout, aliases=parse_aliases(settings.alias),
                     strict_model_names=settings.strict_model_names, max_body_bytes=settings.http_max_body,
                     data_dir=settings.data_dir or dirs.data_dir(), keep_billing_header=settings.keep_billing_header,
                     max_connections=settings.http_max_connections, header_timeout_s=settings.http_header_timeout,
                     switch_on_request=settings.switch_on_request)


def build_parser(
    current: HttpSettings | None = None, note: str = "", config: Path | None = None
) -> argparse.ArgumentParser:
    """The ``modeld http`` parser; its help shows ``current``'s values (else the built-in ones) and ``note``."""
    shown = current if current is not None else HttpSettings.model_construct(config=config)
    p = argparse.ArgumentParser(prog="modeld http", description="Serve the HTTP APIs for a running daemon.",
                                epilog=layering_epilog(shown.config_file, note))

    def flag(name: str, **kw: Any) -> None:
        add_setting(p, shown, name, **kw)

    flag("config", type=Path, metavar="PATH")
    flag("endpoint", help="the daemon: ipc://PATH or tcp://HOST:PORT")
    flag("http", metavar="HOST:PORT", unset=DEFAULT_LISTEN, help="serve the HTTP APIs there")
    flag("http_allow_remote", action="store_true")
    flag("api_key")
    flag("http_queue_timeout", type=float, metavar="S")
    flag("http_max_body", metavar="SIZE")
    flag("http_max_connections", type=int, metavar="N")
    flag("http_header_timeout", type=float, metavar="S")
    flag("alias", action="append", metavar="NAME=MODEL")
    flag("strict_model_names", action="store_true")
    flag("switch_on_request", choices=("on", "off"))
    flag("data_dir", type=Path, help="stored responses and the signing key, the daemon's data dir")
    flag("keep_billing_header", action="store_true")
    flag("log_format", choices=LOG_FORMATS)
    flag("log_level")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        settings = parse_settings(HttpSettings, argv, build_parser)
    except SettingsError as exc:
        print(f"modeld http: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format, sys.stderr)
    try:
        front = build_front(settings, settings.endpoint or default_endpoint(), settings.http or DEFAULT_LISTEN)
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
