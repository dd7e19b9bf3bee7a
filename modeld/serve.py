"""``modeld serve``: resolve the settings (``modeld.settings``), build the daemon (``modeld.bootstrap``), serve until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import TextIO

from backends.registry import ENGINES

from . import dirs
from .bootstrap import backend_choices, build_daemon, preload_request, resolve_backend, resolve_model
from .logs import setup_logging
from .sdnotify import notify
from .server import EXIT_WEDGED
from .settings import ServeSettings, SettingsError
from .settings_cli import add_flags, layering_epilog, parse_settings

__all__ = ["add_serve_arguments", "build_parser", "load", "main", "serve"]

log = logging.getLogger("modeld")


def add_serve_arguments(p: argparse.ArgumentParser, current: ServeSettings | None = None) -> None:
    """The ``modeld serve`` flags, one per setting (``modeld.settings_cli.add_flags``); the help says what applies
    without a flag: ``current`` (the settings from the environment and the config file), else the built-in
    defaults."""
    add_flags(p, ServeSettings, "serve", current, choices={"backend": backend_choices()})


def build_parser(
    current: ServeSettings | None = None, note: str = "", config: Path | None = None
) -> argparse.ArgumentParser:
    """The ``modeld serve`` parser; its help shows ``current``'s values (``add_serve_arguments``) and ``note``."""
    config = current.config_file if current is not None else config or dirs.config_file()
    p = argparse.ArgumentParser(prog="modeld serve", description="Serve one model slot over ZeroMQ.",
                                epilog=layering_epilog(config, note))
    add_serve_arguments(p, current)
    return p


def load(argv: list[str] | None = None) -> ServeSettings:
    """The settings for ``argv`` over the environment and the config file; raises SettingsError.

    argparse parses the command line (and exits for ``--help`` or a malformed
    flag). ``--config`` is read first, so the help shows the defaults of the
    file it names (``modeld.settings_cli.parse_settings``).
    """
    return parse_settings(ServeSettings, argv, build_parser)


#: glibc's mallopt parameter for the size from which allocations are mmapped
_M_MMAP_THRESHOLD = -3
_MMAP_FROM_BYTES = 1 << 20


def _return_large_buffers_to_the_os() -> None:
    """Serve KV states (tens of MB each) from mmap, so freeing one gives its pages back.

    glibc raises its mmap threshold after each large free (up to 32 MiB), after which
    state buffers come from the heap and their pages stay with the process: the
    daemon's RSS then grows with every workspace switch although nothing leaks.
    Fixing the threshold keeps RSS equal to what is held. A no-op off glibc.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, _MMAP_FROM_BYTES)


def _log_stream() -> TextIO:
    """The log's own copy of stderr: llama.cpp points fd 2 at /dev/null while it loads a model, which
    would swallow the load's progress lines (``modeld.slot_model``)."""
    try:
        return os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1)
    except (OSError, ValueError, AttributeError):  # no usable fd 2: log where stderr goes
        return sys.stderr


def serve(opts: ServeSettings) -> int:
    _return_large_buffers_to_the_os()
    setup_logging(opts.log_level, opts.log_format, _log_stream())
    try:
        opts = resolve_model(opts, log=lambda line: print(line, file=sys.stderr, flush=True))
    except (ValueError, RuntimeError) as exc:  # not in the store, a failed pull (PullError, RefError, StoreError)
        print(f"modeld: {exc}", file=sys.stderr)
        return 2
    opts = resolve_backend(opts)
    if opts.backend_reason:
        log.info("backend %s (%s)", opts.backend, opts.backend_reason)
    try:
        daemon = build_daemon(opts)
    except (ValueError, RuntimeError) as exc:  # a bad size or setting, an exposed endpoint, unusable keys
        print(f"modeld: {exc}", file=sys.stderr)
        return 2
    if opts.insecure_tcp and not opts.curve:
        log.warning("serving %s without authentication (--insecure-tcp)", daemon.endpoint)
    front = None
    if opts.grpc and not opts.http:
        print("modeld: --grpc serves Evergreen beside the HTTP front: give --http too", file=sys.stderr)
        return 2
    if opts.http:
        try:
            from .front import build_front  # the `http` extra

            front = build_front(opts, daemon.endpoint, opts.http)
        except (ImportError, ValueError) as exc:
            print(f"modeld: {exc}", file=sys.stderr)
            return 2

    fired = False

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal fired
        if not fired:  # fire once; a second signal during shutdown is ignored
            fired = True
            log.info("received %s", signal.Signals(signum).name)
            notify("STOPPING=1")
            daemon.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    preload = preload_request(opts)
    spec = ENGINES.get(opts.backend)
    if spec is not None and spec.notice:
        log.warning("%s", spec.notice)
    if preload is not None:
        daemon.preload(preload)

    def tell_systemd() -> None:
        # READY once clients can connect; the model may still be loading (status says)
        if daemon.ready.wait(timeout=300):
            loading = f"; loading {preload.model_name}" if preload is not None else ""
            notify("READY=1", f"STATUS=serving {daemon.endpoint}{loading}", f"MAINPID={os.getpid()}")

    threading.Thread(target=tell_systemd, name="modeld-sd-notify", daemon=True).start()
    try:
        if front is not None:
            front.start()
            print(f"modeld: HTTP APIs (OpenAI-compatible) at {front.url}", file=sys.stderr, flush=True)
        daemon.serve()
    except RuntimeError as exc:
        print(f"modeld: {exc}", file=sys.stderr)
        return 1
    finally:
        if front is not None:
            front.stop()
    if daemon.preload_error:
        print(f"modeld: could not load the model to serve ({preload.path if preload else ''}): {daemon.preload_error}",
              file=sys.stderr)
    elif daemon.exit_code == EXIT_WEDGED:
        print(f"modeld: the model worker was wedged (no progress for {opts.wedge_timeout:.0f} s); exiting for a restart",
              file=sys.stderr)
    return daemon.exit_code


def main(argv: list[str] | None = None) -> int:
    try:
        settings = load(argv)
    except SettingsError as exc:
        print(f"modeld serve: {exc}", file=sys.stderr)
        return 2
    return serve(settings)
