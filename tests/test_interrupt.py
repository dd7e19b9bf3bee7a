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
