"""Background threads that yield the CPU to the engine: I/O work (saves, loads, write-behind) runs on
threads niced below the engine's, so on a machine with few cores the kernel runs the forward first
and the I/O in the gaps, instead of both slowing down alike."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

NICE = 10  # added to the thread's niceness (Linux: per thread; elsewhere a no-op)


def start_background(target: Callable[[], None], name: str) -> threading.Thread:
    """A started daemon thread running `target` at a lower CPU priority than its creator."""

    def run() -> None:
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + NICE)
        except (AttributeError, OSError) as exc:  # not Linux, or not permitted: full priority
            log.debug("kvoffload: %s keeps its priority (%s)", name, exc)
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
