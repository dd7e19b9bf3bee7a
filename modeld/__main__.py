"""``python -m modeld``: the ``modeld`` command (``modeld.cli``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
