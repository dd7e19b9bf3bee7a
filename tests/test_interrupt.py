"""contract.interrupt: the scope a daemon request runs in."""

from __future__ import annotations

import threading

import pytest

from contract import interrupt
from contract.errors import Cancelled


def test_outside_a_scope_nothing_is_interrupted() -> None:
    assert interrupt.current() is None
    interrupt.check("prefill")


def test_scope_is_per_thread_and_nests() -> None:
    outer, inner = threading.Event(), threading.Event()
    with interrupt.interruptible(outer):
        assert interrupt.current() is outer
        seen: list[object] = []
        t = threading.Thread(target=lambda: seen.append(interrupt.current()))
        t.start()
        t.join()
        assert seen == [None]  # another thread's work is not this request's
        with interrupt.interruptible(inner):
            inner.set()
            with pytest.raises(Cancelled, match="prefill was cancelled"):
                interrupt.check("prefill")
        assert interrupt.current() is outer
        interrupt.check("prefill")  # the outer event is not set
        outer.set()
        with pytest.raises(Cancelled):
            interrupt.check("decode")
    assert interrupt.current() is None


def test_a_slow_prefix_stretches_only_a_stable_prefix_and_a_cancel_ends_its_wait() -> None:
    """``serve --slow-prefix-s``: each chunk of a stable prefix's prefill waits its share of the whole (a 100-token
    prefix held to 0.4 s: a 25-token chunk waits 0.1 s); a conversation's prefill is not held; a cancel ends the
    wait at once."""
    import threading
    import time

    interrupt.set_slow_prefix(0.4)
    try:
        with interrupt.prefilling(0, 100, stable=True):
            t0 = time.monotonic()
            for end in (25, 50, 75, 100):
                interrupt.chunk_done(end)
            assert time.monotonic() - t0 >= 0.38  # (at least: a loaded machine only adds)
        interrupt.set_slow_prefix(120.0)
        with interrupt.prefilling(100, 200):  # a conversation after it: were it held, a whole 2 minutes
            t0 = time.monotonic()
            interrupt.chunk_done(200)
            assert time.monotonic() - t0 < 30
        cancel = threading.Event()
        cancel.set()
        with interrupt.interruptible(cancel), interrupt.prefilling(0, 100, stable=True):
            t0 = time.monotonic()
            interrupt.chunk_done(50)  # its share is a minute
            assert time.monotonic() - t0 < 30
    finally:
        interrupt.set_slow_prefix(0.0)
