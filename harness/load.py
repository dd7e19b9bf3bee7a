"""CPU-bound processes beside a daemon: the machine of a user with other work going on (a build, a browser, a busy
runner). The tests of a loaded machine, ``make soak`` and the bench's loaded decode start them the same way."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["cpu_burners"]


def _burn() -> None:
    while True:
        pass


@contextmanager
def cpu_burners(n: int = 2) -> Iterator[None]:
    """``n`` processes that keep a core busy each, for the block's run (killed at its end, however it ends)."""
    ctx = multiprocessing.get_context("spawn")
    burners = [ctx.Process(target=_burn, daemon=True) for _ in range(n)]
    for b in burners:
        b.start()
    try:
        yield
    finally:
        for b in burners:
            b.kill()
            b.join()
