"""``python -m benchmarks [--sections a,b]``: the ``make bench`` tables."""

import sys

from benchmarks.run import main

sys.exit(main())
