"""CPU-bound processes beside a daemon: the machine of a user with other work going on (a build, a browser, a busy
runner). The tests of a loaded machine, ``make soak`` and the bench's loaded decode start them the same way."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["cpu_burners"]


#: a process left behind by a parent killed outright stops by itself after this long
BURN_AT_MOST_S = 86400.0


def _burn() -> None:
    end = time.monotonic() + BURN_AT_MOST_S
    while time.monotonic() < end:
        pass


@contextmanager
def cpu_burners(n: int = 2) -> Iterator[list[int]]:
    """``n`` processes that keep a core busy each, for the block's run (killed at its end, however it ends); the
    block gets their pids."""
    ctx = multiprocessing.get_context("spawn")
    burners = [ctx.Process(target=_burn, daemon=True) for _ in range(n)]
    for b in burners:
        b.start()
    try:
        yield [b.pid for b in burners if b.pid is not None]
    finally:
        for b in burners:
            b.kill()
            b.join()
