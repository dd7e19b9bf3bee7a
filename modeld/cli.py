"""The ``modeld`` console script: ``serve``, ``prepare``, ``http`` and ``keys`` run here, everything else is a client command.

Each command's module is imported only when it runs, so a client command never
loads the daemon (ZeroMQ server, capacity planner) and ``serve`` never loads a
backend it does not serve.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command, rest = (args[0], args[1:]) if args else ("", [])
    if command == "serve":
        from .serve import main as serve_main

        return serve_main(rest)
    if command == "prepare":
        from .prepare import main as prepare_main

        return prepare_main(rest)
    if command == "keys":
        from .netsec import keys_main

        return keys_main(rest)
    if command == "http":
        from .openai_front import main as http_main

        return http_main(rest)
    from runtime.cli import main as client_main

    return client_main(args)


if __name__ == "__main__":
    sys.exit(main())
