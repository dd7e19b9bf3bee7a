"""modeld.priority: a thread made nicer than the rest of its process, and only it."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from modeld.priority import MAX_NICE, lower_this_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")


def _in_thread(by: int) -> tuple[int | None, int, int]:
    """``lower_this_thread(by)`` in a new thread: what it returned, that thread's nice, a thread it started."""
    out: list[tuple[int | None, int, int]] = []

    def child_nice(box: list[int]) -> None:
        box.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    def run() -> None:
        got = lower_this_thread(by)
        box: list[int] = []
        t = threading.Thread(target=child_nice, args=(box,))
        t.start()
        t.join()
        out.append((got, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), box[0]))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


def test_only_the_calling_thread_and_the_threads_it_starts_are_lowered() -> None:
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    got, nice, child = _in_thread(3)
    assert got == nice == min(MAX_NICE, base + 3)
    assert child == nice, "threads the worker starts (the engine's) inherit its priority"
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base, "the caller's thread is untouched"


def test_zero_changes_nothing_and_the_cap_holds() -> None:
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert _in_thread(0)[:2] == (None, base)
    assert _in_thread(100)[:2] == (MAX_NICE, MAX_NICE)
