"""A bounded wait for an exclusive `flock`: processes take turns, and a stuck one is reported, not waited
for forever."""

from __future__ import annotations

import fcntl
import time
from collections.abc import Callable


def flock_within(fd: int, seconds: float, *, poll: float = 0.01, on_wait: Callable[[], None] | None = None) -> bool:
    """Take an exclusive lock on `fd` within `seconds`; False if another process still holds it then.
    `on_wait` runs once, the first time the lock is found taken."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            if on_wait is not None:
                on_wait()
                on_wait = None
            time.sleep(poll)
