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


def test_prompt_wake_ups_are_the_calling_thread_s_alone() -> None:
    """``runtime.wakeups.prompt_wakeups``: the calling thread gets the shortest slice and keeps its nice value;
    the threads and processes it makes start with the default slice (an engine's threads, a program it runs)."""
    import subprocess

    from harness.daemon import thread_slices
    from runtime.wakeups import SLICE_US, prompt_wakeups

    if not thread_slices(os.getpid()):
        pytest.skip("this kernel reports no slices")
    out: dict[str, object] = {}

    def run() -> None:
        me = threading.get_native_id()
        nice = os.getpriority(os.PRIO_PROCESS, me)
        default = thread_slices(os.getpid())[me][1]
        out["set"] = prompt_wakeups()
        out["slices"] = (default, thread_slices(os.getpid())[me][1], nice == os.getpriority(os.PRIO_PROCESS, me))
        box: list[int] = []
        t = threading.Thread(target=lambda: box.append(thread_slices(os.getpid())[threading.get_native_id()][1]))
        t.start()
        t.join()
        child = subprocess.run([sys.executable, "-c", "print(open('/proc/self/sched').read())"], capture_output=True,
                               text=True, check=True).stdout
        out["made"] = (box[0], next(int(float(line.split(":")[1])) for line in child.splitlines()
                                    if line.startswith("se.slice")))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if not out["set"] or out["slices"][1] != SLICE_US * 1000:  # type: ignore[index]
        pytest.skip("this kernel has no custom slices (Linux 6.12 on)")
    default, short, same_nice = out["slices"]  # type: ignore[misc]
    assert short == SLICE_US * 1000 < default and same_nice
    assert out["made"] == (default, default)
