"""A clock a test advances by hand, for code that takes an injectable `clock` (time.monotonic by default):
a bound in seconds is tested by moving time past it, never by sleeping through it."""

import threading


class FakeClock:
    """Callable like time.monotonic; stands still until `advance`d (thread-safe: background threads of the
    code under test read it too)."""

    def __init__(self, start: float = 1000.0):
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        with self._lock:
            self._now += seconds
            return self._now
