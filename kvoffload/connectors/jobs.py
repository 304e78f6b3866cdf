"""Saves and loads off the engine step: an `Offloader`'s work submitted as jobs, run in submission order
on one background thread, and reported as results the engine polls.

One thread, in order, on purpose: a load submitted after a save of the same pages finds them (the
scheduler may count pages of a save still in flight as present), and a store sees one writer per
engine. The engine keeps the blocks a job reads or writes alive until the job is reported (vLLM: the
scheduler pins them). On a GPU the submitting thread passes a fence, so a job touches the blocks only
after the compute queued before it; the job returns once its copies are done.
Lock order: the queue's condition is never held while a job runs or a store is called."""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from ..threads import start_background
from .offloader import Offloader
from .plan import STORE_CALL_PAGES, BlockTable, Page

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadDone:
    """A load job's result."""

    req_id: str  # the request whose blocks it restored
    ok: bool  # every page restored
    missing: tuple[bytes, ...] = ()  # keys of the pages that did not arrive
    kind: ClassVar[str] = "load"


@dataclass(frozen=True, slots=True)
class SaveDone:
    """A save job's result."""

    job_id: int  # the caller's id of the job (vLLM: the scheduler's, which unpins its blocks then)
    req_id: str  # the request whose pages it saved
    ok: bool  # it ran (some pages may have been dropped)
    written: tuple[Page, ...] = ()  # the pages now in the store
    kind: ClassVar[str] = "save"


JobResult = LoadDone | SaveDone


class Jobs:
    def __init__(self, offloader: Offloader, name: str = "kvoffload-jobs"):
        self.offloader = offloader
        self._queue: deque = deque()
        self._results: list[JobResult] = []
        self._running = 0  # jobs taken off the queue and not yet reported
        self._cond = threading.Condition()
        self._closed = False
        self._thread = start_background(self._run, name)  # niced: the engine's forward runs first
        _live.add(self)

    # -- submission (the engine's thread) ------------------------------------------------------------
    def submit_load(
        self, req_id: str, block_keys: Sequence[bytes], start: int, end: int, block_ids: BlockTable
    ) -> None:
        """Restore request `req_id`'s blocks [start, end) (reported as a `LoadDone`)."""
        fence = self.offloader.transfer.fence()
        self._submit((LoadDone(req_id, False), (list(block_keys), start, end, block_ids, fence)))

    def submit_save(self, job_id: int, req_id: str, pages: Sequence[Page]) -> None:
        """Save request `req_id`'s pages placed at their physical blocks (`Page.block`), reported as a
        `SaveDone` carrying `job_id`."""
        fence = self.offloader.transfer.fence()
        self._submit((SaveDone(job_id, req_id, False), (list(pages), fence)))

    def _submit(self, job: tuple[JobResult, tuple]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("kvoffload jobs: submitted after close")
            self._queue.append(job)
            self._cond.notify_all()

    def poll(self) -> list[JobResult]:
        """The results of the jobs finished since the last poll, in completion order."""
        if not self._results:  # the engine polls every step: no lock when nothing finished (one is seen next poll)
            return []
        with self._cond:
            results, self._results = self._results, []
        return results

    def wait_results(self, timeout: float) -> bool:
        """Wait up to `timeout` for a result while jobs are pending (an engine step with nothing to
        compute sleeps here instead of spinning against the job thread); True if one is ready."""
        with self._cond:
            return bool(
                self._cond.wait_for(lambda: self._results or not (self._queue or self._running), timeout)
                and self._results
            )

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + self._running

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has run; False if `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 120.0) -> None:
        """Finish the queued jobs (bounded by `timeout`, logged if cut short), then stop the thread."""
        if not self.drain(timeout):
            log.warning("kvoffload jobs: %d job(s) still queued after %.0f s at close; dropped", self.pending, timeout)
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=5)
        _live.discard(self)

    # -- the background thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed and not self._queue:
                    return
                failed, args = self._queue.popleft()  # the job's result, should it fail
                self._running += 1
            try:
                result = self._load(failed, *args) if isinstance(failed, LoadDone) else self._save(failed, *args)
            except Exception as exc:  # noqa: BLE001 - a failed job is a miss or a dropped save, never a crash
                log.error("kvoffload %s job %s failed: %s", failed.kind, failed, exc, exc_info=True)
                result = failed
            with self._cond:
                self._results.append(result)
                self._running -= 1
                self._cond.notify_all()

    def _load(self, job: LoadDone, block_keys, start, end, block_ids, fence) -> LoadDone:
        """Host copies in slices of STORE_CALL_PAGES pages, as saves (see `_save`)."""
        step = None if self.offloader.transfer.gpu else STORE_CALL_PAGES
        loaded = self.offloader.load(block_keys, start, end, block_ids, after=fence, step=step)
        return LoadDone(job.req_id, loaded.ok, loaded.missing_keys)

    def _save(self, job: SaveDone, pages, fence) -> SaveDone:
        """Host copies go in slices of STORE_CALL_PAGES pages with the GIL handed back between them: the
        engine's thread, waiting for it, runs its step instead of waiting out the switch interval
        behind a long save. A device transfer waits on its copies without the GIL: one call, pipelined."""
        step = (len(pages) or 1) if self.offloader.transfer.gpu else STORE_CALL_PAGES
        written: list[Page] = []
        for at in range(0, len(pages), step):
            written += self.offloader.save_pages(pages[at : at + step], after=fence)
            time.sleep(0)
        return SaveDone(job.job_id, job.req_id, True, tuple(written))


_live: weakref.WeakSet[Jobs] = weakref.WeakSet()


@atexit.register
def _finish_at_exit() -> None:
    """Saves acknowledged to nobody yet are still worth finishing when the process exits normally."""
    for jobs in list(_live):
        jobs.close(timeout=60.0)
