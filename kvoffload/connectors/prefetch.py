"""Prefetch: the prefix of a request still waiting in the engine's queue is promoted from a slow tier
(LMDB, Redis) into the memory tier before the engine schedules it (`Store.prefetch`), so its load then
reads memory. Its own background thread: loads and saves (`jobs`) never wait behind a prefetch.

Bounded by `budget`: the bytes of the jobs of requests not yet scheduled; a job that would go over it
is skipped (counted), so queued requests cannot fill the memory tier with prefixes that evict what
running requests need. `done(req_ids)` ends a request's prefetch when it is scheduled (its load takes
over, and finds in memory what was promoted by then) or leaves: a queued job is dropped, a running one
stops after its current slice, and its bytes return to the budget.
Lock order: the condition is never held while the store is called."""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from ..store import Store
from ..threads import start_background
from .plan import STORE_CALL_PAGES, Page

log = logging.getLogger(__name__)


class Prefetcher:
    def __init__(self, store: Store, budget: int, name: str = "kvoffload-prefetch"):
        self.store, self.budget = store, budget
        self.counters: Counter[str] = Counter()
        self._queue: OrderedDict[str, list[Page]] = OrderedDict()  # request -> pages, oldest first
        self._charged: dict[str, int] = {}  # request -> bytes held against the budget (queued or running)
        self._running: str | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread = start_background(self._run, name)

    def submit(self, req_id: str, pages: Sequence[Page]) -> bool:
        """Queue a request's pages (the ones its load would read); False when over budget (skipped)."""
        nbytes = sum(p.group.used_bytes_per_block for p in pages)
        with self._cond:
            if self._closed or req_id in self._charged or not pages:
                return False
            if sum(self._charged.values()) + nbytes > self.budget:
                self.counters["prefetch_skipped"] += 1
                return False
            self._charged[req_id] = nbytes
            self._queue[req_id] = list(pages)
            self._cond.notify_all()
        return True

    def done(self, req_ids: Iterable[str]) -> None:
        """These requests were scheduled or left: their prefetch ends and gives its budget back."""
        with self._cond:
            for req_id in req_ids:
                if self._charged.pop(req_id, None) is not None and self._queue.pop(req_id, None) is not None:
                    self.counters["prefetch_cancelled"] += 1

    def cancel_all(self, timeout: float = 30.0) -> bool:
        """End every prefetch and wait for the running one to stop (a store reset must not be refilled
        by a promotion already under way); False if it did not stop within `timeout`."""
        with self._cond:
            self.counters["prefetch_cancelled"] += len(self._queue)
            self._queue.clear()
            self._charged.clear()
        return self.idle(timeout)

    @property
    def charged(self) -> int:
        with self._cond:
            return sum(self._charged.values())

    def idle(self, timeout: float) -> bool:
        """Wait until no job is queued or running (tests); False if `timeout` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._running is None, timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._charged.clear()
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                req_id, pages = self._queue.popitem(last=False)
                self._running = req_id
            try:
                self._prefetch(req_id, pages)
            except Exception as exc:  # noqa: BLE001 - a failed prefetch only leaves the load to read the slow tier
                log.warning("kvoffload prefetch for %s failed: %s", req_id, exc, exc_info=True)
                self.counters["prefetch_errors"] += 1
            with self._cond:
                self._running = None
                self._cond.notify_all()

    def _prefetch(self, req_id: str, pages: list[Page]) -> None:
        self.counters["prefetch_jobs"] += 1
        for at in range(0, len(pages), STORE_CALL_PAGES):  # a cancelled job stops within one slice
            with self._cond:
                if self._closed or req_id not in self._charged:  # scheduled or gone meanwhile
                    self.counters["prefetch_cancelled"] += 1
                    return
            moved = self.store.prefetch([p.key for p in pages[at : at + STORE_CALL_PAGES]])
            self.counters["prefetched_pages"] += moved
