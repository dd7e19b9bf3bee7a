"""A re-entrant lock handed over in the order threads asked for it.

The client's threads share one ZeroMQ socket: each reader holds the socket's lock
while it polls (a quarter second at a time), then asks for it again. With
``threading.RLock`` the thread that just released the lock usually takes it
straight back, so a second thread's call could wait many polls for its turn;
on a busy machine a 0.5-s status waited 14 s behind another thread's long call.
Here a thread that releases and asks again queues behind the threads that asked
meanwhile.
"""

from __future__ import annotations

import threading
from collections import deque

__all__ = ["FairLock"]


class FairLock:
    """Re-entrant; ``acquire`` waits its turn in arrival order."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        #: the threads waiting, in the order they asked
        self._queue: deque[int] = deque()

    def acquire(self) -> bool:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            self._queue.append(me)
            try:
                while self._owner is not None or self._queue[0] != me:
                    self._cond.wait()
            except BaseException:  # interrupted while waiting (Ctrl-C): leave the queue, let the next one in
                self._queue.remove(me)
                self._cond.notify_all()
                raise
            self._queue.popleft()
            self._owner, self._depth = me, 1
            return True

    def release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("release of a FairLock this thread does not hold")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
