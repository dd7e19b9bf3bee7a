"""The ``modeld`` console script: ``serve``, ``prepare``, ``http``, ``keys``, ``feedback`` and the store's commands
(``pull``, ``ls``, ``show``, ``rm``, ``alias``) run here, everything else is a client command.

Each command's module is imported only when it runs, so a client command never
loads the daemon (ZeroMQ server, capacity planner) and ``serve`` never loads a
backend it does not serve. A plain ``pip install modeld`` is the client; a
daemon command run there names the extra that installs what it is missing
instead of ending in a traceback; an engine's extra is its entry's in
``backends.registry``, read only then.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.flags import OptionFlag

EXIT_ERROR = 1
#: the model store's commands (``modeld.store.cli``): daemon-side, they need huggingface_hub and the data dir
STORE_COMMANDS = ("pull", "ls", "show", "rm", "alias")

#: top-level modules the daemon commands import that the client install lacks → the extra that brings them
_EXTRA_OF_MODULE = {
    "psutil": "server",
    "prometheus_client": "server",
    "pydantic_settings": "server",
    "platformdirs": "server",
    "fastapi": "http",
    "starlette": "http",
    "uvicorn": "http",
    "sse_starlette": "http",
    "anyio": "http",
    "huggingface_hub": "server",
    "grpc": "grpc",
    "grpc_tools": "grpc",
    "google": "grpc",
    "torch": "convert",
    "transformers": "convert",
}


def extra_of_module(name: str) -> str | None:
    """The extra that installs the top-level module ``name`` (an engine's: from its registry entry); None: none."""
    if name in _EXTRA_OF_MODULE:
        return _EXTRA_OF_MODULE[name]
    from backends.registry import ENGINES  # light, and only read once a command has failed

    return next((spec.extra for spec in ENGINES.values() if name in spec.modules), None)


def _daemon_main(command: str) -> Callable[[list[str]], int]:
    if command == "serve":
        from .serve import main as serve_main

        return serve_main
    if command == "prepare":
        from .prepare import main as prepare_main

        return prepare_main
    if command in STORE_COMMANDS:
        from .store.cli import main as store_main

        return lambda rest: store_main([command, *rest])
    if command == "keys":
        from .netsec import keys_main

        return keys_main
    if command == "feedback":
        from .front.ws.feedback import main as feedback_main

        return feedback_main
    from .front import main as http_main

    return http_main


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command, rest = (args[0], args[1:]) if args else ("", [])
    if command in ("serve", "prepare", "keys", "http", "feedback", *STORE_COMMANDS):
        try:
            # an engine is imported once the command runs (``modeld serve --backend NAME``), not with it
            return _daemon_main(command)(rest)
        except ModuleNotFoundError as exc:
            extra = extra_of_module((exc.name or "").partition(".")[0])
            if extra is None:  # not a missing extra: a broken install, shown as it is
                raise
            print(
                f"modeld {command}: module {exc.name!r} is not installed: this command needs the project's "
                f"{extra!r} extra (in the checkout: pip install '.[{extra}]'; `make run` installs the daemon "
                "with both engines)",
                file=sys.stderr,
            )
            return EXIT_ERROR
    from runtime.cli import Extensions
    from runtime.cli import main as client_main

    return client_main(args, Extensions(parsers=daemon_parsers, pull=_pull, options=_engine_options))


def _engine_options() -> list[OptionFlag]:
    """The registered engines' load options, as the client commands' flags (a client-only install: none)."""
    try:
        from .settings import option_flags_of
    except ImportError:
        return []
    return option_flags_of()


def daemon_parsers() -> dict[str, argparse.ArgumentParser]:
    """The daemon-side commands' parsers, for ``modeld completion``: those whose modules this install can import
    (``http`` needs the http extra; a client-only install completes the client commands alone)."""
    own: dict[str, argparse.ArgumentParser] = {}
    try:
        from .netsec import keys_parser
        from .prepare import build_parser as prepare_parser
        from .serve import build_parser as serve_parser
        from .store.cli import command_parsers as store_parsers
    except ImportError:
        return own
    own.update({"serve": serve_parser(), "prepare": prepare_parser(), "keys": keys_parser(), **store_parsers()})
    try:
        from .front.main import build_parser as http_parser
    except ImportError:
        return own
    from .front.ws.feedback import build_parser as feedback_parser

    own["http"] = http_parser()
    own["feedback"] = feedback_parser()
    return own


def _pull(name: str, data_dir: Path | None) -> str:
    """``load NAME --pull``: NAME into the store (huggingface_hub and the store are the daemon's install)."""
    from .store.cli import pull_into_store

    return pull_into_store(name, data_dir)


if __name__ == "__main__":
    sys.exit(main())
