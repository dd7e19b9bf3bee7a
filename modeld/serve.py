"""``modeld serve``: parse the arguments, build the daemon (``modeld.bootstrap``), serve until SIGTERM/SIGINT."""

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

from .bootstrap import BACKEND_CHOICES, ServeOptions, build_daemon, preload_request, resolve_backend
from .sdnotify import notify
from .server import DEFAULT_WEDGE_S, EXIT_WEDGED
from .slot import DEFAULT_LEASE_S, DEFAULT_SESSION_TTL_S

__all__ = ["add_serve_arguments", "build_parser", "main", "serve"]

log = logging.getLogger("modeld")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The ``modeld serve`` options; their dest names are ``ServeOptions``' fields."""
    p.add_argument("--endpoint", default=None, help="ipc://PATH or tcp://HOST:PORT (env MODELD_ENDPOINT)")
    p.add_argument("--backend", choices=BACKEND_CHOICES, default=os.environ.get("MODELD_BACKEND", "auto"),
                   help="the engine (env MODELD_BACKEND); auto: OpenVINO on x86-64 for a model it converts "
                        "(the faster engine here), else llama.cpp; status says which and why")
    p.add_argument("--model", default=None, help="model to preload (default: the bundled model for llama/openvino)")
    p.add_argument("--model-name", default=None, help="logical name of the preloaded model")
    p.add_argument("--num-ctx", type=int, default=0, help="context window of the preloaded model (0 = memory-fitted)")
    p.add_argument("--owner", default=os.environ.get("MODELD_OWNER", ""), help="owner instance id for fencing")
    p.add_argument("--data-dir", type=Path, default=None, help="snapshot blobs and state (default ~/.local/share/modeld)")
    p.add_argument("--mem-max", default=None, help="memory limit for model + KV, e.g. 8GiB (env MODELD_MEM_MAX)")
    p.add_argument("--mem-reserve", default=None, help="memory kept free, e.g. 1GiB (env MODELD_MEM_RESERVE)")
    p.add_argument("--lease", type=float, default=DEFAULT_LEASE_S, help="seconds a silent client keeps its session")
    p.add_argument("--no-preload", action="store_true", help="start with an empty slot")
    p.add_argument("--idle-unload", type=float, default=0.0, metavar="S",
                   help="unload the chat model after S seconds with no session and no operation (0 = never)")
    p.add_argument("--session-ttl", type=float, default=DEFAULT_SESSION_TTL_S, metavar="S",
                   help="release a session that sent no operation for S seconds, even while its client "
                        "renews the lease (0 = never; any operation, explain included, refreshes it)")
    p.add_argument("--embed-idle", type=float, default=300.0, help="seconds before an idle embedding model is unloaded")
    p.add_argument(
        "--memory-token-delay-ms",
        type=float,
        default=0.0,
        help="memory backend only: simulated time per generated token",
    )
    p.add_argument("--log-level", default=os.environ.get("MODELD_LOG_LEVEL", "INFO"))
    p.add_argument(
        "--http",
        default=os.environ.get("MODELD_HTTP") or None,
        metavar="HOST:PORT",
        help="also serve an OpenAI-compatible HTTP API there, e.g. 127.0.0.1:8377 (env MODELD_HTTP)",
    )
    p.add_argument("--http-allow-remote", action="store_true", help="let --http bind a non-loopback address")
    p.add_argument("--http-queue-timeout", type=float, default=300.0, metavar="S",
                   help="seconds an HTTP request waits for a busy slot before 503")
    p.add_argument("--cache-ram", default=os.environ.get("MODELD_CACHE_RAM", "auto"), metavar="SIZE",
                   help="RAM for the workspace cache of prefix states, e.g. 2GiB; 0 = off; "
                        "auto = half of what the model leaves spare, at most 4GiB (env MODELD_CACHE_RAM)")
    p.add_argument("--cache-disk", default=os.environ.get("MODELD_CACHE_DISK", "auto"), metavar="SIZE",
                   help="disk for the workspace cache (survives restarts), e.g. 8GiB; 0 = off; "
                        "auto = a quarter of the free space, at most 16GiB (env MODELD_CACHE_DISK)")
    p.add_argument("--cache-dir", type=Path, default=None, help="workspace cache directory (default DATA_DIR/cache)")
    p.add_argument("--wedge-timeout", type=float, default=DEFAULT_WEDGE_S, metavar="S",
                   help="report the model worker wedged after S seconds without progress: status says so and "
                        "waiting requests get EngineUnresponsive")
    p.add_argument("--exit-when-wedged", action="store_true",
                   help=f"then exit with status {EXIT_WEDGED}, for a supervisor (systemd Restart=) to restart the daemon")
    p.add_argument("--curve", action="store_true",
                   help="tcp endpoints speak ZeroMQ CURVE with the key pair in DATA_DIR/keys (`modeld keys` prints "
                        "the public key clients need)")
    p.add_argument("--insecure-tcp", action="store_true",
                   help="allow a tcp endpoint beyond loopback without CURVE (anyone reaching it controls the daemon)")
    p.add_argument("--blob-disk", default="4GiB", metavar="SIZE",
                   help="disk for snapshot blobs; the least recently used are pruned beyond it")
    p.add_argument("--blob-max-age-days", type=float, default=7.0, metavar="DAYS",
                   help="snapshot blobs unused this long are pruned")
    p.add_argument("--api-key", default=os.environ.get("MODELD_API_KEY", ""), help="bearer key the HTTP API requires (env MODELD_API_KEY)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="modeld serve", description="Serve one model slot over ZeroMQ.")
    add_serve_arguments(p)
    return p


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


def serve(opts: ServeOptions) -> int:
    _return_large_buffers_to_the_os()
    logging.basicConfig(
        level=getattr(logging, str(opts.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
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
    if opts.http:
        try:
            from .openai_front import HttpFront, parse_listen  # the `http` extra

            host, port = parse_listen(opts.http)
            front = HttpFront(daemon.endpoint, host, port, api_key=opts.api_key, allow_remote=opts.http_allow_remote,
                              queue_timeout_s=opts.http_queue_timeout)
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
    if opts.backend == "memory":
        log.warning("serving the memory reference backend: no inference, byte-length token proxies")
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
            print(f"modeld: OpenAI-compatible API at {front.url}", file=sys.stderr, flush=True)
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
    return serve(ServeOptions(**vars(build_parser().parse_args(argv))))
