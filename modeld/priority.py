"""The model workers' CPU priority (``--engine-nice``): nicer than the daemon's IO thread, when asked.

An engine step keeps every core busy (llama.cpp's OpenMP threads and
OpenVINO's TBB threads spin between steps). When the IO thread wakes — a
status, a cancel, a heartbeat, a decode frame to forward — it must take a core
from them, and at equal priority the scheduler may let it wait for the running
thread's slice: on 2 cores during a llama.cpp decode, status took p50 1.3 ms,
p90 4.0-4.7 ms, p99 6.3-9.0 ms. With the model worker 10 nicer (its engine
threads are created by it and inherit that): p90 1.5 ms, p99 3.9-5.5 ms; the
decode rate did not move beyond the noise (daemon / in process side by side in
one run: llama.cpp 0.978 at equal priority vs 0.957 niced, OpenVINO 1.001 vs 1.078).

The cost, which made 0 the default: when other programs on the machine compete
for the cores (a build beside the agent, a busy runner), the engine gets the
smaller share. Nice 10 weighs 110 against a normal thread's 1,024 in Linux's
scheduler: beside two CPU-bound processes on two cores the daemon ran at about
15% of a core (the processes at 65% each), and a long first prefill took
several times as long as llama-server's at its normal priority.

Linux only: there a thread's priority is its own (``setpriority`` on its
thread id). Elsewhere ``setpriority`` would renice the whole process, so the
setting is not applied.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from .defaults import MAX_NICE

__all__ = ["MAX_NICE", "lower_this_thread"]

log = logging.getLogger("modeld")



def lower_this_thread(by: int) -> int | None:
    """Make the calling thread ``by`` nicer than it is (capped at ``MAX_NICE``); its new nice value, or None
    when nothing was changed (``by`` is 0, not Linux, or the system refused)."""
    if by <= 0 or not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()
    try:
        nice = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + by)
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as exc:
        log.warning("could not lower the priority of %s: %s", threading.current_thread().name, exc)
        return None
    return nice
