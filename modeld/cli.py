"""The ``modeld`` console script: ``serve`` runs the daemon, everything else is a client command."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "serve":
        from .__main__ import main as serve_main

        return serve_main(args[1:])
    from runtime.cli import main as client_main

    return client_main(args)


if __name__ == "__main__":
    sys.exit(main())
