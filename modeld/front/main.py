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

from contract.endpoint import default_endpoint

from ..defaults import DEFAULT_LISTEN
from ..logs import setup_logging
from ..settings import HttpSettings, SettingsError
from ..settings_cli import add_flags, layering_epilog, parse_settings
from .server import HttpFront

__all__ = ["DEFAULT_LISTEN", "build_front", "build_parser", "main"]



def build_front(settings: HttpSettings, endpoint: str, listen: str) -> HttpFront:
    """The front ``settings`` describe, on ``listen`` (HOST:PORT), for the daemon at ``endpoint``; ValueError
    names a bad address."""
    return HttpFront(settings, endpoint, listen)


def build_parser(
    current: HttpSettings | None = None, note: str = "", config: Path | None = None
) -> argparse.ArgumentParser:
    """The ``modeld http`` parser; its help shows ``current``'s values (else the built-in ones) and ``note``."""
    shown = current if current is not None else HttpSettings.model_construct(config=config)
    p = argparse.ArgumentParser(prog="modeld http", description="Serve the HTTP APIs for a running daemon.",
                                epilog=layering_epilog(shown.config_file, note))

    add_flags(p, HttpSettings, "http", shown)
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
