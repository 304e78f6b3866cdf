"""The write-behind of a `tiered://` store (`write="behind"`, the default): the engine waits for the memory
tier only, and this module's writer thread writes the back tier behind it (as vLLM's OffloadingConnector
and SGLang's HiCache write-back do): a back-tier write costs the engine nothing, and a back tier that
falls behind loses durability of some pages, never engine time. Kept apart from the tier composition
(tiered.py) because it alone owns a thread, a queue and the lock that guards them.

`queue(keys)` holds the values the front has of a batch of keys in one lease (`front.acquire_batch`,
by host address: an arena slot is neither evicted nor overwritten while held) and queues the batch
for the writer thread, which commits them (at most BATCH_ENTRIES / BATCH_BYTES per `back.put_many`,
a long batch in pieces) straight from the held bytes, then releases the batch. Queueing a save's
batch costs the saving thread no Python per value (it runs while the engine's thread waits for the GIL).
  - each key names its latest value only (`_where`): a later put of a key replaces its waiting one
    (latest wins; a piece being committed is always older than what is queued), a batch left with
    nothing to write is released at once;
  - bounded by bytes (`behind_bytes`, the bytes of the values waiting or being committed; default
    min(memory capacity / 2, 2 GiB): half the memory tier stays evictable) and by age (`behind_age`,
    default 30 s). The values of a batch past the byte bound are not queued, a batch waiting longer
    than the age bound is not written: either stays in memory only, counted (`behind_dropped`,
    `behind_dropped_bytes`), logged once at WARNING, then at DEBUG;
  - a back that refuses or fails a write is counted (`behind_failed`), never raised to a caller.
`withdraw(keys)` makes way for a synchronous write or delete of keys in the back: a queued or in-flight
value can neither overwrite nor resurrect them. `held(keys)` are the values waiting or in flight, for
the store's lookups (tiered.py). A process that exits without closing its stores still writes what is
queued (`_flush_at_exit`).

Locks: `_lock` (with its condition `_changed`) guards the queue; it is held for dictionary operations
and for the front's `acquire_batch` / `delete` (so a delete and a put's queueing never interleave), then the
tiers' own locks are taken inside it. It is held across a call to the back in `clear` only (rare, an
operator's reset: no batch is in flight then and none can start), never on the write or read path: the
writer commits without it, and a withdrawal waits for the batch holding its key on the condition, not on
a lock. Order: `_lock`, then the front's or the back's own locks, then a store's counter lock; no thread
holding a tier's lock waits for `_lock` (the writer takes it only after `back.put_many` returns).
A batch is released (`front.release_batch`) once no key names it: by the writer under `_lock` once it
committed it, by the other paths after `_lock`.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np

from ..threads import start_background
from .base import HeldBatch, Lease, Store
from .buffers import host_bytes

log = logging.getLogger(f"{__package__}.tiered")  # the tiered store's logger

BATCH_ENTRIES = 256  # at most this many values per back.put_many
BATCH_BYTES = 64 << 20  # and at most this many bytes (or one value, if larger)
DEFAULT_BEHIND_AGE = 30.0  # seconds an entry may wait for the back tier
MAX_DEFAULT_BEHIND_BYTES = 2 << 30
CLOSE_FLUSH_SECONDS = 60.0  # close() waits this long for the queue to drain


def default_behind_bytes(front_capacity: int) -> int:
    return max(1, min(front_capacity // 2, MAX_DEFAULT_BEHIND_BYTES))


_open: weakref.WeakSet[WriteBehind] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    """A process that exits normally without closing its stores (shared stores are never closed) still
    writes what is queued: the writer threads are daemons, stopped only after this."""
    for behind in list(_open):
        if not behind.flush(CLOSE_FLUSH_SECONDS):
            log.warning("tiered store %s: exiting with values not yet written to %s", behind.url, behind.back.url)


class _Batch:
    """The values one `queue` call holds in the front (one `HeldBatch`), in key order; the writer takes
    them from `taken` on. A key's value is still to be written while `_where` names this batch for it."""

    __slots__ = ("keys", "held", "sizes", "since", "taken", "live")

    def __init__(self, keys: list[bytes], held: HeldBatch, since: float):
        self.keys, self.held, self.since = keys, held, since
        self.sizes: list[int] = held.sizes.tolist()
        self.taken = 0  # values [0, taken) went to the writer
        self.live = len(keys)  # keys `_where` names this batch for

    def lease(self, at: int) -> Lease:
        """Value `at` as a lease the batch holds (the caller neither writes nor releases it)."""
        address, nbytes = int(self.held.addresses[at]), self.sizes[at]
        return Lease(self.keys[at], host_bytes(address, nbytes), cast(int, self.held.handle), address)


class WriteBehind:
    """The queue of values held in `front` for `back`, and the thread that writes them; `count` is the
    store's counter (the behind_* counters are the store's), `url` the store's, for messages; `clock` the
    seconds the age bound is measured in (time.monotonic; a test passes a clock it advances)."""

    def __init__(
        self,
        front: Store,
        back: Store,
        url: str,
        count: Callable[..., None],
        *,
        behind_bytes: int,
        behind_age: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.front, self.back, self.url, self._count = front, back, url, count
        self.behind_bytes, self.behind_age, self._clock = behind_bytes, behind_age, clock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # queue or in-flight piece changed
        self._queue: deque[_Batch] = deque()  # oldest first; a batch leaves once the writer took all of it
        self._where: dict[bytes, tuple[_Batch, int]] = {}  # key -> its latest value's batch and place
        self._inflight: set[bytes] = set()  # the keys of the piece being committed
        self._held = 0  # bytes of the values to write, queued or in flight (the byte bound)
        self._thread: threading.Thread | None = None
        self._stopping = self.closed = False
        self._warned: set[str] = set()
        _open.add(self)

    @property
    def busy(self) -> bool:
        """Anything waiting or in flight (read without the lock: a hint that `held` may find something)."""
        return bool(self._where)

    def held(self, keys: Sequence[bytes]) -> list[Lease | None]:
        """The value of each key waiting or being committed, as a lease the writer holds (None: none)."""
        with self._lock:
            found = list(map(self._where.get, keys))
            return [None if place is None else place[0].lease(place[1]) for place in found]

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {"behind_queued": len(self._where), "behind_queued_bytes": self._held}

    def queue(self, keys: Sequence[bytes]) -> None:
        """Hold what the front now has of `keys` (one batch) and queue it for the writer. No Python step
        per key where the keys are new and fit (a save's batch): the rest is the rare path."""
        if not keys:
            return
        keys = list(dict.fromkeys(keys))
        free: list[_Batch] = []  # batches left with nothing to write: released after the lock
        with self._lock:
            if self.closed:
                return
            now = self._clock()
            self._expire(now, free)  # room for new values before refusing any
            earlier = list(map(self._where.get, keys))
            if any(earlier):  # latest wins: those values are not written
                self._forget(keys, earlier, free)
            held = self.front.acquire_batch(keys, touch=False)
            sizes = held.sizes
            fits = np.cumsum(sizes) <= self.behind_bytes - self._held
            if not (fits.all() and sizes.all()):  # a value evicted since it was stored, or past the bound
                held, keys, sizes = self._admit_some(held, keys, sizes, fits)
            if keys:
                batch = _Batch(keys, held, now)
                places = zip(itertools.repeat(batch), range(len(keys)))
                if sizes.all():
                    self._where.update(zip(keys, places))
                else:  # gone between two holds (another thread's eviction): not written
                    self._count(behind_dropped=int((sizes == 0).sum()))
                    self._where.update(itertools.compress(zip(keys, places), (sizes > 0).tolist()))
                    batch.live = int((sizes > 0).sum())
                if batch.live:
                    self._held += int(sizes.sum())
                    self._queue.append(batch)
                    self._ensure_writer()
                    self._changed.notify_all()
                else:
                    free.append(batch)
        self._release(free)

    def _admit_some(
        self, held: HeldBatch, keys: list[bytes], sizes: np.ndarray, fits: np.ndarray
    ) -> tuple[HeldBatch, list[bytes], np.ndarray]:
        """Under `_lock`: the batch's values the front still has that fit the byte bound, held anew (the
        whole batch is given back), the others counted dropped. (held, keys, sizes) of what stays."""
        present = sizes > 0
        if not present.all():  # evicted or deleted since it was stored: the writer never gets it
            self._count(behind_dropped=int((~present).sum()))
        over = present & ~fits
        if over.any():
            full = f"the write-behind queue is full (behind_bytes={self.behind_bytes})"
            self._dropped(int(over.sum()), int(sizes[over].sum()), full)
        keep = present & fits
        self.front.release_batch(held)
        keys = list(itertools.compress(keys, keep.tolist()))
        if not keys:
            return held, [], sizes[:0]
        held = self.front.acquire_batch(keys, touch=False)
        return held, keys, held.sizes

    def _forget(self, keys: Sequence[bytes], places: Sequence[tuple[_Batch, int] | None], free: list[_Batch]) -> int:
        """Under `_lock`: the values of `keys` still to be written (`places`, from `_where`) will not be;
        batches left with nothing to write (not in flight) go to `free`. Returns how many there were."""
        forgotten = 0
        for key, place in zip(keys, places):
            if place is None:
                continue
            batch, at = place
            del self._where[key]
            self._held -= batch.sizes[at]
            batch.live -= 1
            forgotten += 1
            if not batch.live and batch.taken < len(batch.keys) and not self._inflight.intersection(batch.keys):
                self._queue.remove(batch)
                free.append(batch)
        return forgotten

    def withdraw(self, keys: Sequence[bytes]) -> tuple[int, list[bool]]:
        """Make way for a write or delete of `keys` in the back itself: their waiting values leave the
        queue, a piece committing any of them is waited for, and the front's copies are deleted -- under
        `_lock`, so no put's queueing interleaves. (How many were waiting, and per key whether the front
        held it.)"""
        free: list[_Batch] = []
        with self._lock:
            self._changed.wait_for(lambda: self._inflight.isdisjoint(keys))
            stale = self._forget(keys, list(map(self._where.get, keys)), free)
            in_front = [self.front.delete(key) for key in keys]
        self._release(free)
        return stale, in_front

    def clear(self, owner: str) -> bool:
        """Both tiers and the values waiting to be written behind; nothing changes if the back refuses."""
        with self._lock:
            self._changed.wait_for(lambda: not self._inflight)  # a piece committing now cannot come back
            if not self.back.clear(owner):
                return False
            stale = list(self._queue)
            self._queue.clear()
            self._where.clear()
            self._held = 0
            self.front.clear(owner)
        self._release(stale)
        return True

    def _ensure_writer(self) -> None:
        """Under `_lock`: a writer thread while anything is queued (started lazily; again after a fork)."""
        if self._queue and (self._thread is None or not self._thread.is_alive()):
            self._thread = start_background(self._run, "kvoffload-write-behind")

    def _too_old(self) -> str:
        return f"waited longer than behind_age={self.behind_age:g}s for the back tier"

    def _expire(self, now: float, free: list[_Batch]) -> None:
        """Under `_lock`: the batches that waited longer than `behind_age` (oldest first; one the writer
        is taking pieces of stays) are not written: their values leave the queue, counted dropped."""
        while self._queue and now - self._queue[0].since > self.behind_age and not self._queue[0].taken:
            count, nbytes = self._drop_batch(self._queue[0], free)
            self._dropped(count, nbytes, self._too_old())

    def _drop_batch(self, batch: _Batch, free: list[_Batch]) -> tuple[int, int]:
        """Under `_lock`: a queued batch none of whose values the writer took leaves the queue unwritten
        (into `free`); how many values, and bytes, it still had to write."""
        places = [(batch, at) for at, key in enumerate(batch.keys) if self._where.get(key) == (batch, at)]
        nbytes = sum(batch.sizes[at] for _, at in places)
        self._forget([batch.keys[at] for _, at in places], places, free)  # its last one frees it
        return len(places), nbytes

    def _dropped(self, count: int, nbytes: int, why: str) -> None:
        if count:
            self._count(behind_dropped=count, behind_dropped_bytes=nbytes)
            self._warn_once(
                "dropped",
                "tiered store %s: %d value(s) kept in memory only, not written to %s: %s",
                self.url,
                count,
                self.back.url,
                why,
            )

    def _warn_once(self, what: str, message: str, *args, exc_info=None) -> None:
        level = logging.DEBUG if what in self._warned else logging.WARNING
        self._warned.add(what)
        log.log(level, message, *args, exc_info=exc_info)

    def _release(self, batches: Sequence[_Batch]) -> None:
        """Give the front back what `batches` held (outside `_lock`)."""
        for batch in batches:
            self.front.release_batch(batch.held)

    # -- the writer thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                self._changed.wait_for(lambda: self._queue or self._stopping)
                if not self._queue:  # stopping, and nothing left
                    return
            try:
                self._commit_piece()
            except Exception:  # never let the writer die: what it held is released by _commit_piece
                log.exception("tiered store %s: write-behind error", self.url)

    def _take(self) -> tuple[list[tuple[_Batch, int]], list[_Batch]]:
        """Under `_lock`: the next piece (at most BATCH_ENTRIES values, BATCH_BYTES bytes, or one value):
        the values still to be written, from the oldest batches on, and the batches it finishes taking."""
        piece: list[tuple[_Batch, int]] = []
        done: list[_Batch] = []
        size = 0
        while self._queue and len(piece) < BATCH_ENTRIES:
            batch = self._queue[0]
            while batch.taken < len(batch.keys) and len(piece) < BATCH_ENTRIES:
                at = batch.taken
                if self._where.get(batch.keys[at]) == (batch, at):  # still its latest value
                    if piece and size + batch.sizes[at] > BATCH_BYTES:
                        return piece, done
                    piece.append((batch, at))
                    size += batch.sizes[at]
                batch.taken += 1
            if batch.taken < len(batch.keys):
                break
            done.append(self._queue.popleft())
        return piece, done

    def _commit_piece(self) -> None:
        free: list[_Batch] = []
        with self._lock:
            self._expire(self._clock(), free)
            piece, done = self._take()
            keys = [batch.keys[at] for batch, at in piece]
            self._inflight.update(keys)
        written = [False] * len(piece)
        try:
            if piece:
                written = list(self.back.put_many([(batch.keys[at], batch.lease(at).view) for batch, at in piece]))
        except Exception as exc:  # a back that raises is a failed write, never the caller's problem
            self._warn_once(
                "failed",
                "tiered store %s: writing %d value(s) behind to %s failed: %s",
                self.url,
                len(piece),
                self.back.url,
                exc,
                exc_info=True,
            )
        finally:
            ok = sum(written)
            self._count(
                behind_written=ok,
                behind_failed=len(piece) - ok,
                behind_written_bytes=sum(batch.sizes[at] for (batch, at), w in zip(piece, written) if w),
            )
            if ok < len(piece):
                self._warn_once(
                    "refused",
                    "tiered store %s: %s did not take %d value(s) written behind",
                    self.url,
                    self.back.url,
                    len(piece) - ok,
                )
            with self._lock:
                self._inflight.clear()
                # written or failed, these values leave the queue, unless queued again meanwhile
                places = [(b, at) if self._where.get(k) == (b, at) else None for k, (b, at) in zip(keys, piece)]
                self._forget(keys, places, free)
                # given back once no key names them, before the writer says it is done (a flush finds them
                # released); the front's lock inside ours, the one order
                self._release(free + done)
                self._changed.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is committed (or dropped); False if `timeout` seconds passed first."""
        with self._lock:
            self._ensure_writer()
            return self._changed.wait_for(lambda: not self._queue and not self._inflight, timeout)

    def close(self) -> bool:
        """Flush (at most CLOSE_FLUSH_SECONDS), drop what is left, stop the writer; False if the writer
        is still stuck in the back (it holds the front's bytes: the tiers must stay open)."""
        if not self.flush(CLOSE_FLUSH_SECONDS):
            log.warning(
                "tiered store %s: gave up waiting for the back tier after %gs; %d value(s) not written",
                self.url,
                CLOSE_FLUSH_SECONDS,
                len(self._where),
            )
        with self._lock:
            self.closed = self._stopping = True
            _open.discard(self)
            left: list[_Batch] = []
            count = nbytes = 0
            for batch in [batch for batch in self._queue if not batch.taken]:  # one being taken is the writer's
                dropped = self._drop_batch(batch, left)
                count, nbytes = count + dropped[0], nbytes + dropped[1]
            self._changed.notify_all()
        self._dropped(count, nbytes, "the store was closed")
        self._release(left)
        if self._thread is not None:
            self._thread.join(5.0)
            if self._thread.is_alive():
                log.error(
                    "tiered store %s: the write-behind thread is stuck in %s; tiers left open", self.url, self.back.url
                )
                return False
        return True
