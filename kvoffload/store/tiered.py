"""Memory in front of a back tier: LMDB, Redis, or LMDB in front of Redis. Reads try memory first and
promote a back-tier hit into memory, so hot prefixes stay in host RAM. Writes are write-behind by
default: the engine waits for the memory tier only, and a background thread writes the back tier behind
it (as vLLM's OffloadingConnector and SGLang's HiCache write-back do): a back-tier write costs the engine
nothing, and a back tier that falls behind loses durability of some pages, never engine time.
The stats keep the names `disk_*` for the back tier (`disk_hits`, `disk_entries`, ...), whatever it is:
they are an interface.

Writes (`write="behind"`): `put_many` / `write_many` store in the front and return True per value the
front holds -- visible at once, since this process's lookups are answered by the front. Each such
value is leased in the front (`front.acquire(touch=False)`: an arena slot is neither evicted nor
overwritten while leased) and queued for this store's writer thread, which commits batches (at most
BATCH_ENTRIES / BATCH_BYTES per `back.put_many`) straight from the leased views, then releases them.
  - one queue entry per key: a later put of a key replaces its waiting entry (latest wins; a batch
    being committed is always older than what is queued);
  - bounded by bytes (`behind_bytes`, the bytes leased for the writer, waiting or being committed;
    default min(memory capacity / 2, 2 GiB): half the memory tier stays evictable) and by age
    (`behind_age`, default 30 s). A value that would exceed the byte bound is not queued, an entry
    waiting longer than the age bound is not written: either stays in memory only, counted
    (`behind_dropped`, `behind_dropped_bytes`), logged once at WARNING, then at DEBUG;
  - a back that refuses or fails a write is counted (`behind_failed`), never raised to a caller;
  - `on_durable(keys)` (optional) is called by the writer with the keys the back reported written.
Values larger than the memory tier, and `delete`, go to the back synchronously, after the writer's
batch if that is committing the key: a queued or in-flight value can neither overwrite nor resurrect them.
`write="through"`: every put is in the back (durable) when it returns, then in the front.

Admission (`admit=N`, write-behind only; default 1: every value goes behind): a value goes below memory
only on its N-th use, where its put is the first use and every read served from memory (a hit on a
prefix) or put again (a recompute) is another; until then it lives in memory only and is counted
(`behind_not_admitted`). One-off prompts then never cost back-tier bandwidth nor evict reused
prefixes from the back tier. At most ADMIT_TRACKED keys wait for admission (the oldest are forgotten).

Prefetch (`prefetch`, a queued request's prefix): the back's values that memory lacks are promoted into
front slots by the same readers, ahead of the request's load, which then reads memory.

Reads (`read_many`, `acquire`): the front; then the writer's private copies (a copying front may have
evicted what it leased); then the back, each hit copied into a front slot inside the back's consume
callback (`front.write_many`, no intermediate copy) and served as such -- `acquire` leases the front
slot, so a DMA reads straight from the arena. Values too large for the front are private-copy leases.

Evictions (`watch_evictions`): a key evicted by one tier is reported when the other tier does not hold
it either (nor the write-behind queue), e.g. a value evicted from memory before its admission.

Locks: `_lock` (with its condition `_changed`) guards the queue; it is held for dictionary operations
and for the front's `acquire` / `delete` (so a delete and a put's queueing never interleave), then the
tiers' own locks are taken inside it. It is held across a call to the back in `clear` only (rare, an
operator's reset: no batch is in flight then and none can start), never on the write or read path: the
writer commits without it, and a delete waits for the batch holding its key on the condition, not on a
lock. Order: `_lock`, then the front's or the back's own locks; no thread holding a tier's lock waits
for `_lock` (the writer takes it only after `back.put_many` returns; the admission count `_uses` is
guarded by `_lock` alone). The eviction listeners (`_front_evicted`) take `_lock` only once the tier that
evicted has released its own locks.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..threads import start_background
from .base import Lease, Reservation, Store
from .buffers import Buffer

log = logging.getLogger(__name__)

BATCH_ENTRIES = 256  # at most this many values per back.put_many
BATCH_BYTES = 64 << 20  # and at most this many bytes (or one value, if larger)
DEFAULT_BEHIND_AGE = 30.0  # seconds an entry may wait for the back tier
MAX_DEFAULT_BEHIND_BYTES = 2 << 30
CLOSE_FLUSH_SECONDS = 60.0  # close() waits this long for the queue to drain
WRITE_MODES = ("behind", "through")
ADMIT_TRACKED = 1 << 20  # keys remembered while they wait for admission (admit > 1)
READERS = 4  # threads reading the back for one acquire (a cold prefix): faults on several pages at once


def default_behind_bytes(front_capacity: int) -> int:
    return max(1, min(front_capacity // 2, MAX_DEFAULT_BEHIND_BYTES))


_open_stores: weakref.WeakSet[TieredStore] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    """A process that exits normally without closing its stores (shared stores are never closed) still
    writes what is queued: the writer threads are daemons, stopped only after this."""
    for store in list(_open_stores):
        if not store.flush(CLOSE_FLUSH_SECONDS):
            log.warning("tiered store %s: exiting with values not yet written to %s", store.url, store.back.url)


@dataclass
class _Pending:
    lease: Lease
    nbytes: int
    since: float  # time.monotonic() when queued


class TieredStore(Store):
    COUNTERS = Store.COUNTERS + ("memory_hits", "disk_hits", "promotions", "behind_written", "behind_written_bytes",
                                 "behind_dropped", "behind_dropped_bytes", "behind_failed", "behind_not_admitted",
                                 "behind_admitted", "prefetched", "prefetched_bytes")

    def __init__(self, front: Store, back: Store, url: str | None = None, *, write: str = "behind",
                 behind_bytes: int | None = None, behind_age: float = DEFAULT_BEHIND_AGE,
                 on_durable: Callable[[list[bytes]], None] | None = None, admit: int = 1):
        super().__init__()
        if write not in WRITE_MODES:
            raise ValueError(f"write must be one of {', '.join(WRITE_MODES)}, got {write!r}")
        if admit < 1 or (admit > 1 and write != "behind"):
            raise ValueError(f"admit must be a positive number of uses, and above 1 needs write=behind, got {admit}")
        self.admit = admit
        self._uses: OrderedDict[bytes, int] = OrderedDict()  # key -> uses so far, while waiting for admission
        self.front, self.back, self.write = front, back, write
        self.capacity = back.capacity
        self.url = url or f"tiered://({front.url} | {back.url})"
        self.behind_bytes = default_behind_bytes(front.capacity) if behind_bytes is None else behind_bytes
        self.behind_age = behind_age
        self.on_durable = on_durable
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # queue or in-flight batch changed
        self._queue: OrderedDict[bytes, _Pending] = OrderedDict()  # oldest first
        self._inflight: dict[bytes, _Pending] = {}  # the batch being committed
        self._held = 0  # bytes queued or in flight (the byte bound)
        self._thread: threading.Thread | None = None
        self._readers = None  # a thread pool for `_read_back`, made on first use
        self._stopping = self._closed = False
        self._warned: set[str] = set()
        if write == "behind":
            _open_stores.add(self)

    # -- limits: a batch is validated against the back before anything is written ------------------------
    @property
    def max_key_bytes(self) -> int | None:  # type: ignore[override]
        limits = [n for n in (self.front.max_key_bytes, self.back.max_key_bytes) if n is not None]
        return min(limits) if limits else None

    @property
    def max_entry_bytes(self) -> int:
        return self.back.max_entry_bytes

    @property
    def in_place(self) -> bool:  # type: ignore[override]
        return self.front.in_place

    def fits(self, nbytes: int) -> bool:
        return self.back.fits(nbytes)  # a value too large for the front goes straight to the back

    def _fits_front(self, nbytes: int) -> bool:
        return nbytes <= self.front.max_entry_bytes

    # -- writes -------------------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        views = self._views(items)
        stored = [False] * len(views)
        if self.write == "through":
            stored = self.back.put_many(views)
            self.front.put_many([v for v, ok in zip(views, stored) if ok and self._fits_front(v[1].nbytes)])
            for (key, view), ok in zip(views, stored):
                if ok and not self._fits_front(view.nbytes):
                    self.front.delete(key)  # an older, smaller value must not be served
        else:
            small = [i for i, (_, v) in enumerate(views) if self._fits_front(v.nbytes)]
            large = [i for i, (_, v) in enumerate(views) if not self._fits_front(v.nbytes)]
            for i, ok in zip(small, self.front.put_many([views[i] for i in small]) if small else []):
                stored[i] = ok
            self._queue_behind(self._admitted([views[i][0] for i in small if stored[i]], put=True))
            for i, ok in zip(large, self._write_now([views[i] for i in large]) if large else []):
                stored[i] = ok
        self._count_puts(stored, [v.nbytes for _, v in views])
        return stored

    def reserve(self, items: Sequence[tuple[bytes, int]]) -> Reservation:
        """Front slots (write-behind), or private buffers that `publish` puts (write-through, or a
        value too large for the front)."""
        items = list(items)
        if self.write == "through" or any(not self._fits_front(n) or n > self.max_entry_bytes for _, n in items):
            return super().reserve(items)
        self._views([(key, b"") for key, _ in items])  # the keys, against the back's limits
        front = self.front.reserve(items)
        return Reservation(items, front.destinations, front)

    def publish(self, reservation: Reservation, filled: Sequence[bool]) -> list[bool]:
        if reservation.handle is None:  # private buffers: put_many counts and queues them
            return super().publish(reservation, filled)
        stored = self.front.publish(reservation.handle, filled)
        self._queue_behind(self._admitted([key for (key, _), ok in zip(reservation.items, stored) if ok], put=True))
        self._count_puts(stored, [n for _, n in reservation.items])
        return stored

    def _count_puts(self, stored: list[bool], sizes: list[int]) -> None:
        self._count(puts=sum(stored), put_bytes=sum(n for n, ok in zip(sizes, stored) if ok),
                    dropped_puts=len(stored) - sum(stored))

    def _write_now(self, views: list[tuple[bytes, memoryview]]) -> list[bool]:
        """Values too large for the front: to the back now, after any queued or in-flight value of theirs."""
        keys = [key for key, _ in views]
        with self._lock:
            stale = self._settle(keys)
            for key in keys:
                self.front.delete(key)  # an older, smaller value must not be served
        self.front.release(p.lease for p in stale)
        return self.back.put_many(views)

    def _settle(self, keys: Sequence[bytes]) -> list[_Pending]:
        """Under `_lock`: take the keys' waiting entries out of the queue (the caller releases them), then
        wait until the writer is not committing any of them."""
        stale = [p for p in map(self._unqueue, keys) if p is not None]
        self._changed.wait_for(lambda: not any(key in self._inflight for key in keys))
        return stale

    def _admitted(self, keys: Sequence[bytes], *, put: bool) -> list[bytes]:
        """The keys whose use now is their `admit`-th (see the module docstring): those go behind. A put
        starts counting a key; a read counts only keys already waiting."""
        if self.admit == 1 or not keys:
            return list(keys) if put else []
        ready, waiting = [], 0
        with self._lock:
            for key in keys:
                uses = self._uses.pop(key, 0)
                if not put and not uses:
                    continue  # admitted before, or never put here
                if uses + 1 >= self.admit:
                    ready.append(key)
                    continue
                self._uses[key] = uses + 1
                waiting += put
                while len(self._uses) > ADMIT_TRACKED:
                    self._uses.popitem(last=False)
        self._count(behind_not_admitted=waiting, behind_admitted=len(ready))
        return ready

    def _queue_behind(self, keys: Sequence[bytes]) -> None:
        """Lease what the front now holds of `keys` and queue it for the writer."""
        if not keys:
            return
        keys = list(dict.fromkeys(keys))
        dropped: list[_Pending] = []
        expired: list[_Pending] = []
        with self._lock:
            if self._closed:
                return
            now = time.monotonic()
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
        self._dropped(dropped, "the write-behind queue is full (behind_bytes=%d)" % self.behind_bytes)

    def _ensure_writer(self) -> None:
        """Under `_lock`: a writer thread while anything is queued (started lazily; again after a fork)."""
        if self._queue and (self._thread is None or not self._thread.is_alive()):
            self._thread = start_background(self._run, "kvoffload-write-behind")

    def _too_old(self) -> str:
        return "waited longer than behind_age=%gs for the back tier" % self.behind_age

    def _unqueue(self, key: bytes) -> _Pending | None:
        """Under `_lock`: take `key`'s waiting entry out of the queue (the caller releases its lease)."""
        pending = self._queue.pop(key, None)
        if pending is not None:
            self._held -= pending.nbytes
        return pending

    def _expire(self, now: float, expired: list[_Pending]) -> None:
        """Under `_lock`: take out the entries that waited longer than `behind_age` (oldest first)."""
        while self._queue:
            key, pending = next(iter(self._queue.items()))
            if now - pending.since <= self.behind_age:
                break
            expired.append(self._unqueue(key))

    def _dropped(self, dropped: list[_Pending], why: str) -> None:
        if dropped:
            self._count(behind_dropped=len(dropped), behind_dropped_bytes=sum(p.nbytes for p in dropped))
            self._warn_once("dropped", "tiered store %s: %d value(s) kept in memory only, not written to %s: %s",
                            self.url, len(dropped), self.back.url, why)

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
            self._expire(time.monotonic(), expired)
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
            self._warn_once("failed", "tiered store %s: writing %d value(s) behind to %s failed: %s",
                            self.url, len(batch), self.back.url, exc, exc_info=True)
        finally:
            self._dropped(expired, self._too_old())
            done = [p.lease.key for p, ok in zip(batch, written) if ok]
            self._count(behind_written=len(done), behind_failed=len(batch) - len(done),
                        behind_written_bytes=sum(p.nbytes for p, ok in zip(batch, written) if ok))
            if len(done) < len(batch):
                self._warn_once("refused", "tiered store %s: %s did not take %d value(s) written behind",
                                self.url, self.back.url, len(batch) - len(done))
            try:
                if done and self.on_durable is not None:
                    self.on_durable(done)
            except Exception:
                log.exception("tiered store %s: on_durable callback failed", self.url)
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

    # -- reads --------------------------------------------------------------------------------------
    def _promote(self, key: bytes, view: memoryview) -> bool:
        """Copy a back hit into a front slot (inside the back's consume callback: no intermediate copy)."""
        if not self._fits_front(view.nbytes):
            return False

        def fill(dests: list[np.ndarray | None]) -> list[bool]:
            if dests[0] is not None:
                dests[0][:] = np.frombuffer(view, np.uint8)
            return [dests[0] is not None]

        return self.front.write_many([(key, view.nbytes)], fill)[0]

    def _private(self, keys: Sequence[bytes], missing: list[int]) -> dict[int, np.ndarray]:
        """Values of `missing` keys the writer holds as private copies (not arena slots it may free)."""
        found = {}
        with self._lock:
            for i in missing:
                pending = self._queue.get(keys[i]) or self._inflight.get(keys[i])
                if pending is not None and pending.lease.slot is None:
                    found[i] = pending.lease.view
        return found

    def read_many(self, keys: Sequence[bytes], consume: Callable[[int, memoryview], None]) -> list[bool]:
        nbytes = promoted = 0

        def counted(i: int, view: memoryview) -> None:
            nonlocal nbytes
            consume(i, view)
            nbytes += view.nbytes

        served = self.front.read_many(keys, counted)
        if self.admit > 1:
            self._queue_behind(self._admitted([key for key, ok in zip(keys, served) if ok], put=False))
        missing = [i for i, ok in enumerate(served) if not ok]
        if missing and (self._queue or self._inflight):
            for i, view in self._private(keys, missing).items():
                counted(i, memoryview(view))
                served[i] = True
            missing = [i for i in missing if not served[i]]

        def from_back(j: int, view: memoryview) -> None:
            nonlocal promoted
            i = missing[j]
            promoted += self._promote(keys[i], view)
            counted(i, view)
            served[i] = True

        disk_hits = sum(self.back.read_many([keys[i] for i in missing], from_back)) if missing else 0
        hits = sum(served)
        self._count(hits=hits, misses=len(keys) - hits, get_bytes=nbytes, memory_hits=hits - disk_hits,
                    disk_hits=disk_hits, promotions=promoted)
        return served

    def acquire(self, keys: Sequence[bytes], *, touch: bool = True) -> list[Lease | None]:
        leases = self.front.acquire(keys, touch=touch)
        if self.admit > 1 and touch:
            self._queue_behind(self._admitted([key for key, lease in zip(keys, leases) if lease is not None],
                                              put=False))
        missing = [i for i, lease in enumerate(leases) if lease is None]
        if missing and (self._queue or self._inflight):
            for i, view in self._private(keys, missing).items():
                leases[i] = Lease(keys[i], view)
            missing = [i for i in missing if leases[i] is None]
        promoted: list[int] = []

        def from_back(j: int, view: memoryview) -> None:
            i = missing[j]
            if self._promote(keys[i], view):
                promoted.append(i)
            else:  # too large for the front, or no room: a private copy
                leases[i] = Lease(keys[i], np.frombuffer(view, np.uint8).copy())

        disk_hits = self._read_back(keys, missing, from_back)
        for i, lease in zip(promoted, self.front.acquire([keys[i] for i in promoted], touch=False)):
            leases[i] = lease
        lost = [i for i in promoted if leases[i] is None]  # evicted again before it could be held
        for i, lease in zip(lost, self.back.acquire([keys[i] for i in lost], touch=False) if lost else []):
            leases[i] = lease
        if touch:
            hits = [lease.view.nbytes for lease in leases if lease is not None]
            self._count(hits=len(hits), misses=len(keys) - len(hits), get_bytes=sum(hits),
                        memory_hits=len(hits) - disk_hits, disk_hits=disk_hits, promotions=len(promoted))
        return leases

    def _read_back(self, keys: Sequence[bytes], missing: list[int], consume: Callable[[int, memoryview], None]) -> int:
        """`back.read_many` of the `missing` keys (consume gets the index into `missing`), split over
        READERS threads when there are several values: with a cold page cache each thread's page faults
        keep the back tier busy while the others copy, where one reader waits for each fault in turn."""
        if not missing:
            return 0
        parts = [part.tolist() for part in np.array_split(np.arange(len(missing)), min(READERS, len(missing)))]
        if len(parts) == 1:
            return sum(self.back.read_many([keys[i] for i in missing], consume))
        with self._lock:
            if self._readers is None:
                from concurrent.futures import ThreadPoolExecutor

                self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="kvoffload-read")
        futures = [self._readers.submit(self.back.read_many, [keys[missing[j]] for j in part],
                                        lambda k, view, part=part: consume(part[k], view)) for part in parts]
        return sum(sum(future.result()) for future in futures)

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Promote the back's values of `keys` that memory lacks into memory (READERS threads), so the
        read that follows (a queued request's load) is a memory hit; counted in `prefetched`. Values
        too large for the front, or for which it has no room, stay in the back."""
        keys = list(keys)
        missing = [i for i, there in enumerate(self.front.contains_many(keys)) if not there]
        if missing and (self._queue or self._inflight):
            missing = [i for i in missing if i not in self._private(keys, missing)]
        promoted: list[int] = []  # appended from reader threads (list.append is atomic)

        def from_back(j: int, view: memoryview) -> None:
            if self._promote(keys[missing[j]], view):
                promoted.append(view.nbytes)

        self._read_back(keys, missing, from_back)
        self._count(prefetched=len(promoted), prefetched_bytes=sum(promoted))
        return len(promoted)

    def release(self, leases: Iterable[Lease | None]) -> None:
        self.front.release(leases)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        present = self.front.contains_many(keys)
        missing = [i for i, ok in enumerate(present) if not ok]
        if missing and (self._queue or self._inflight):
            with self._lock:
                for i in missing:
                    present[i] = keys[i] in self._queue or keys[i] in self._inflight
            missing = [i for i in missing if not present[i]]
        for i, ok in zip(missing, self.back.contains_many([keys[i] for i in missing]) if missing else []):
            present[i] = ok
        return present

    def delete(self, key: bytes) -> bool:
        with self._lock:
            stale = self._settle([key])  # a batch committing the key is done first: it cannot resurrect it
            in_front = self.front.delete(key)
        self.front.release(p.lease for p in stale)
        return self.back.delete(key) or in_front or bool(stale)

    def watch_evictions(self, listener: Callable[[list[bytes]], None] | None) -> None:
        """A key leaves this store when a tier evicts it and the other tier does not hold it (nor the
        write-behind queue): a value on disk outlives its memory copy, a hot one its disk copy."""
        super().watch_evictions(listener)
        self.front.watch_evictions(None if listener is None else self._front_evicted)
        self.back.watch_evictions(None if listener is None else self._back_evicted)

    def _front_evicted(self, keys: list[bytes]) -> None:
        with self._lock:
            keys = [key for key in keys if key not in self._queue and key not in self._inflight]
        if keys:
            self._report_evicted([key for key, there in zip(keys, self.back.contains_many(keys)) if not there])

    def _back_evicted(self, keys: list[bytes]) -> None:
        self._report_evicted([key for key, there in zip(keys, self.front.contains_many(keys)) if not there])

    def claim(self, owner: str) -> None:
        self.front.claim(owner)
        self.back.claim(owner)

    def clear(self, owner: str) -> bool:
        """Both tiers and the values waiting to be written behind; nothing changes if the back refuses."""
        with self._lock:
            self._changed.wait_for(lambda: not self._inflight)  # a batch committing now cannot come back
            if not self.back.clear(owner):
                return False
            stale = [self._unqueue(key) for key in list(self._queue)]
            self.front.clear(owner)
        self.front.release(p.lease for p in stale)
        return True

    # -- figures and shutdown -------------------------------------------------------------------------
    def _usage(self) -> dict[str, int]:
        usage = {}
        for name, tier in (("memory", self.front), ("disk", self.back)):  # "disk": the back tier (stat names)
            for k, v in tier.stats().items():
                if k != "url":
                    usage[f"{name}_{k}"] = v
        usage["entries"] = usage.get("disk_entries", 0)
        usage["bytes_used"] = usage.get("disk_bytes_used", 0)
        usage["evictions"] = usage.get("disk_evictions", 0)  # entries gone from the store as a whole
        usage["checksum_failures"] = usage.get("disk_checksum_failures", 0)
        with self._lock:
            usage["behind_queued"] = len(self._queue) + len(self._inflight)
            usage["behind_queued_bytes"] = self._held
            usage["admission_waiting"] = len(self._uses)
        return usage

    def counter(self, name: str) -> int:
        """As `stats()` reports it: evictions and checksum failures are the back tier's (`_usage`)."""
        return self.back.counter(name) if name in ("evictions", "checksum_failures") else super().counter(name)

    def close(self) -> None:
        """Flush (at most CLOSE_FLUSH_SECONDS), stop the writer, close both tiers. A writer still stuck
        in the back leaves both tiers open: it holds views into the front."""
        if self._closed:
            return
        if not self.flush(CLOSE_FLUSH_SECONDS):
            log.warning("tiered store %s: gave up waiting for the back tier after %gs; %d value(s) not written",
                        self.url, CLOSE_FLUSH_SECONDS, len(self._queue) + len(self._inflight))
        with self._lock:
            self._closed = self._stopping = True
            _open_stores.discard(self)
            left = list(self._queue.values())
            self._queue.clear()
            self._held -= sum(p.nbytes for p in left)
            self._changed.notify_all()
        self._dropped(left, "the store was closed")
        self.front.release(p.lease for p in left)
        if self._thread is not None:
            self._thread.join(5.0)
            if self._thread.is_alive():
                log.error("tiered store %s: the write-behind thread is stuck in %s; tiers left open",
                          self.url, self.back.url)
                return
        if self._readers is not None:
            self._readers.shutdown(wait=True)
        self.front.close()
        self.back.close()
