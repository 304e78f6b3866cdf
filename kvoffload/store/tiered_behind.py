"""The write-behind of a `tiered://` store (`write="behind"`, the default): the engine waits for the memory
tier only, and this module's writer thread writes the back tier behind it (as vLLM's OffloadingConnector
and SGLang's HiCache write-back do): a back-tier write costs the engine nothing, and a back tier that
falls behind loses durability of some pages, never engine time. Kept apart from the tier composition
(tiered.py) because it alone owns a thread, a queue and the lock that guards them.

`queue(keys)` leases each value the front holds (`front.acquire(touch=False)`: an arena slot is neither
evicted nor overwritten while leased) and queues it for the writer thread, which commits batches (at
most BATCH_ENTRIES / BATCH_BYTES per `back.put_many`) straight from the leased views, then releases them.
  - one queue entry per key: a later put of a key replaces its waiting entry (latest wins; a batch
    being committed is always older than what is queued);
  - bounded by bytes (`behind_bytes`, the bytes leased for the writer, waiting or being committed;
    default min(memory capacity / 2, 2 GiB): half the memory tier stays evictable) and by age
    (`behind_age`, default 30 s). A value that would exceed the byte bound is not queued, an entry
    waiting longer than the age bound is not written: either stays in memory only, counted
    (`behind_dropped`, `behind_dropped_bytes`), logged once at WARNING, then at DEBUG;
  - a back that refuses or fails a write is counted (`behind_failed`), never raised to a caller.
`withdraw(keys)` makes way for a synchronous write or delete of keys in the back: a queued or in-flight
value can neither overwrite nor resurrect them. `held(keys)` are the values waiting or in flight, for
the store's lookups (tiered.py). A process that exits without closing its stores still writes what is
queued (`_flush_at_exit`).

Locks: `_lock` (with its condition `_changed`) guards the queue; it is held for dictionary operations
and for the front's `acquire` / `delete` (so a delete and a put's queueing never interleave), then the
tiers' own locks are taken inside it. It is held across a call to the back in `clear` only (rare, an
operator's reset: no batch is in flight then and none can start), never on the write or read path: the
writer commits without it, and a withdrawal waits for the batch holding its key on the condition, not on
a lock. Order: `_lock`, then the front's or the back's own locks, then a store's counter lock; no thread
holding a tier's lock waits for `_lock` (the writer takes it only after `back.put_many` returns).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..threads import start_background
from .base import Lease, Store

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


@dataclass
class _Pending:
    lease: Lease
    nbytes: int
    since: float  # the write-behind's clock() when queued


class WriteBehind:
    """The queue of values leased in `front` for `back`, and the thread that writes them; `count` is the
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
        self._changed = threading.Condition(self._lock)  # queue or in-flight batch changed
        self._queue: OrderedDict[bytes, _Pending] = OrderedDict()  # oldest first
        self._inflight: dict[bytes, _Pending] = {}  # the batch being committed
        self._held = 0  # bytes queued or in flight (the byte bound)
        self._thread: threading.Thread | None = None
        self._stopping = self.closed = False
        self._warned: set[str] = set()
        _open.add(self)

    @property
    def busy(self) -> bool:
        """Anything waiting or in flight (read without the lock: a hint that `held` may find something)."""
        return bool(self._queue or self._inflight)

    def held(self, keys: Sequence[bytes]) -> list[Lease | None]:
        """The lease of each key's value waiting or being committed (None: the writer holds none)."""
        with self._lock:
            found = [self._queue.get(key) or self._inflight.get(key) for key in keys]
        return [None if pending is None else pending.lease for pending in found]

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {"behind_queued": len(self._queue) + len(self._inflight), "behind_queued_bytes": self._held}

    def queue(self, keys: Sequence[bytes]) -> None:
        """Lease what the front now holds of `keys` and queue it for the writer."""
        if not keys:
            return
        keys = list(dict.fromkeys(keys))
        dropped: list[_Pending] = []
        expired: list[_Pending] = []
        with self._lock:
            if self.closed:
                return
            now = self._clock()
            self._expire(now, expired)  # room for new values before refusing any
            to_release = [p.lease for p in expired]
            for key, lease in zip(keys, self.front.acquire(keys, touch=False)):
                old = self._unqueue(key)  # latest wins, queued or not
                if old is not None:
                    to_release.append(old.lease)
                if lease is None:  # evicted or deleted since it was stored: the writer never gets it
                    self._count(behind_dropped=1)
                    continue
                n = lease.view.nbytes
                if self._held + n > self.behind_bytes:
                    dropped.append(_Pending(lease, n, now))
                    to_release.append(lease)
                    continue
                self._queue[key] = _Pending(lease, n, now)
                self._held += n
            self._ensure_writer()
            self._changed.notify_all()
        self.front.release(to_release)
        self._dropped(expired, self._too_old())
        self._dropped(dropped, f"the write-behind queue is full (behind_bytes={self.behind_bytes})")

    def withdraw(self, keys: Sequence[bytes]) -> tuple[int, list[bool]]:
        """Make way for a write or delete of `keys` in the back itself: their waiting values leave the
        queue (released), a batch committing any of them is waited for, and the front's copies are
        deleted -- under `_lock`, so no put's queueing interleaves. (How many were waiting, and per key
        whether the front held it.)"""
        with self._lock:
            stale = [p for p in map(self._unqueue, keys) if p is not None]
            self._changed.wait_for(lambda: not any(key in self._inflight for key in keys))
            in_front = [self.front.delete(key) for key in keys]
        self.front.release(p.lease for p in stale)
        return len(stale), in_front

    def clear(self, owner: str) -> bool:
        """Both tiers and the values waiting to be written behind; nothing changes if the back refuses."""
        with self._lock:
            self._changed.wait_for(lambda: not self._inflight)  # a batch committing now cannot come back
            if not self.back.clear(owner):
                return False
            stale = [self._take(key) for key in list(self._queue)]
            self.front.clear(owner)
        self.front.release(p.lease for p in stale)
        return True

    def _ensure_writer(self) -> None:
        """Under `_lock`: a writer thread while anything is queued (started lazily; again after a fork)."""
        if self._queue and (self._thread is None or not self._thread.is_alive()):
            self._thread = start_background(self._run, "kvoffload-write-behind")

    def _too_old(self) -> str:
        return f"waited longer than behind_age={self.behind_age:g}s for the back tier"

    def _unqueue(self, key: bytes) -> _Pending | None:
        """Under `_lock`: take `key`'s waiting entry out of the queue (the caller releases its lease)."""
        return self._take(key) if key in self._queue else None

    def _take(self, key: bytes) -> _Pending:
        """Under `_lock`: `_unqueue` of a key that is queued."""
        pending = self._queue.pop(key)
        self._held -= pending.nbytes
        return pending

    def _expire(self, now: float, expired: list[_Pending]) -> None:
        """Under `_lock`: take out the entries that waited longer than `behind_age` (oldest first)."""
        while self._queue:
            key, pending = next(iter(self._queue.items()))
            if now - pending.since <= self.behind_age:
                break
            expired.append(self._take(key))

    def _dropped(self, dropped: list[_Pending], why: str) -> None:
        if dropped:
            self._count(behind_dropped=len(dropped), behind_dropped_bytes=sum(p.nbytes for p in dropped))
            self._warn_once(
                "dropped",
                "tiered store %s: %d value(s) kept in memory only, not written to %s: %s",
                self.url,
                len(dropped),
                self.back.url,
                why,
            )

    def _warn_once(self, what: str, message: str, *args, exc_info=None) -> None:
        level = logging.DEBUG if what in self._warned else logging.WARNING
        self._warned.add(what)
        log.log(level, message, *args, exc_info=exc_info)

    # -- the writer thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                self._changed.wait_for(lambda: self._queue or self._stopping)
                if not self._queue:  # stopping, and nothing left
                    return
            try:
                self._commit_batch()
            except Exception:  # never let the writer die: what it held is released by _commit_batch
                log.exception("tiered store %s: write-behind error", self.url)

    def _commit_batch(self) -> None:
        expired: list[_Pending] = []
        with self._lock:
            self._expire(self._clock(), expired)
            size = 0
            while self._queue and len(self._inflight) < BATCH_ENTRIES:
                key, pending = next(iter(self._queue.items()))
                if self._inflight and size + pending.nbytes > BATCH_BYTES:
                    break
                del self._queue[key]
                self._inflight[key] = pending
                size += pending.nbytes
            batch = list(self._inflight.values())
        written = [False] * len(batch)
        try:
            if batch:
                written = list(self.back.put_many([(p.lease.key, p.lease.view) for p in batch]))
        except Exception as exc:  # a back that raises is a failed write, never the caller's problem
            self._warn_once(
                "failed",
                "tiered store %s: writing %d value(s) behind to %s failed: %s",
                self.url,
                len(batch),
                self.back.url,
                exc,
                exc_info=True,
            )
        finally:
            self._dropped(expired, self._too_old())
            done = [p.lease.key for p, ok in zip(batch, written) if ok]
            self._count(
                behind_written=len(done),
                behind_failed=len(batch) - len(done),
                behind_written_bytes=sum(p.nbytes for p, ok in zip(batch, written) if ok),
            )
            if len(done) < len(batch):
                self._warn_once(
                    "refused",
                    "tiered store %s: %s did not take %d value(s) written behind",
                    self.url,
                    self.back.url,
                    len(batch) - len(done),
                )
            self.front.release([p.lease for p in expired + batch])
            with self._lock:
                self._inflight.clear()
                self._held -= sum(p.nbytes for p in batch)  # the expired left `_held` when taken out
                self._changed.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is committed (or dropped); False if `timeout` seconds passed first."""
        with self._lock:
            self._ensure_writer()
            return self._changed.wait_for(lambda: not self._queue and not self._inflight, timeout)

    def close(self) -> bool:
        """Flush (at most CLOSE_FLUSH_SECONDS), drop what is left, stop the writer; False if the writer
        is still stuck in the back (it holds views into the front: the tiers must stay open)."""
        if not self.flush(CLOSE_FLUSH_SECONDS):
            log.warning(
                "tiered store %s: gave up waiting for the back tier after %gs; %d value(s) not written",
                self.url,
                CLOSE_FLUSH_SECONDS,
                len(self._queue) + len(self._inflight),
            )
        with self._lock:
            self.closed = self._stopping = True
            _open.discard(self)
            left = list(self._queue.values())
            self._queue.clear()
            self._held -= sum(p.nbytes for p in left)
            self._changed.notify_all()
        self._dropped(left, "the store was closed")
        self.front.release(p.lease for p in left)
        if self._thread is not None:
            self._thread.join(5.0)
            if self._thread.is_alive():
                log.error(
                    "tiered store %s: the write-behind thread is stuck in %s; tiers left open", self.url, self.back.url
                )
                return False
        return True
