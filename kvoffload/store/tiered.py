"""Memory in front of a back tier: LMDB, Redis, or LMDB in front of Redis. Reads try memory first and
promote a back-tier hit into memory, so hot prefixes stay in host RAM. This module composes the tiers
(what each call asks of which tier, and in which order); the write-behind (tiered_behind.py) and the
admission (tiered_admission.py) are parts with a module each. The stats keep the names `disk_*` for the
back tier (`disk_hits`, `disk_entries`, ...), whatever it is: they are an interface.

Writes (`write="behind"`, the default): `put_many` / `write_many` store in the front and return True per
value the front holds -- visible at once, since this process's lookups are answered by the front -- and
hand the admitted ones to the write-behind, which writes the back behind them. Values larger than the
memory tier, and `delete`, go to the back synchronously, after the writer's batch if that is committing
the key (`WriteBehind.withdraw`). `write="through"`: every put is in the back (durable) when it returns,
then in the front.

Prefetch (`prefetch`, a queued request's prefix): the back's values that memory lacks are promoted into
front slots by the same readers, ahead of the request's load, which then reads memory.

Lookups and reads take one order (`_cascade`, shared by `contains_many`, `read_many`, `acquire` and
`prefetch`): the front; then the writer's values (a copying front may have evicted what it leased; a
read takes only private copies, never a front slot the writer frees once committed); then the back,
each hit copied into a front slot inside the back's consume callback (`front.write_many`, no
intermediate copy) and served as such -- `acquire` leases the front slot, so a DMA reads straight from
the arena. Values too large for the front are private-copy leases. A read of several values from the
back is split over a pool of READERS threads (`_read_back`).

Evictions (`watch_evictions`): a key evicted by one tier is reported when the other tier does not hold
it either (nor the write-behind queue), e.g. a value evicted from memory before its admission.

Locks: this module takes none of its own. In the one order: the write-behind's `_lock` (tiered_behind.py)
-> the memory tier's lock or the back tier's -> a store's counter lock; admission's lock
(tiered_admission.py) is a leaf. The eviction listeners (`_front_evicted`) ask the write-behind (its
`_lock`) only once the tier that evicted has released its own locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import compress
from typing import NamedTuple, cast

import numpy as np

from .base import HeldBatch, ItemColumns, Lease, Reservation, Store, check_keys
from .buffers import Buffer
from .tiered_admission import Admission, write_options
from .tiered_behind import DEFAULT_BEHIND_AGE, WriteBehind, default_behind_bytes

READERS = 4  # threads reading the back for one acquire (a cold prefix): faults on several pages at once


def _behind_option(name: str) -> property:
    """A write-behind setting, read and set as the store's own (`store.behind_age = ...`)."""
    return property(lambda self: getattr(self._behind, name), lambda self, value: setattr(self._behind, name, value))


class TieredStore(Store):
    COUNTERS = Store.COUNTERS + (
        "memory_hits",
        "disk_hits",
        "promotions",
        "behind_written",
        "behind_written_bytes",
        "behind_dropped",
        "behind_dropped_bytes",
        "behind_failed",
        "behind_not_admitted",
        "behind_admitted",
        "prefetched",
        "prefetched_bytes",
    )
    behind_bytes, behind_age = map(_behind_option, ("behind_bytes", "behind_age"))

    def __init__(
        self,
        front: Store,
        back: Store,
        url: str | None = None,
        *,
        write: str = "behind",
        behind_bytes: int | None = None,
        behind_age: float = DEFAULT_BEHIND_AGE,
        admit: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__()
        write, self.admit = write_options(write, admit, "tiered store:")  # the one check, URLs' too
        self._admission = Admission(self.admit, self._count)
        self.front, self.back, self.write = front, back, write
        self.capacity = back.capacity
        self.url = url or f"tiered://({front.url} | {back.url})"
        self._behind = WriteBehind(
            front,
            back,
            self.url,
            self._count,
            behind_age=behind_age,
            behind_bytes=default_behind_bytes(front.capacity) if behind_bytes is None else behind_bytes,
            clock=clock,  # the age bound's (a test's own clock)
        )
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="kvoffload-read")  # threads start on use

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

    @property
    def memory_front(self) -> Store | None:
        return self.front if self.front.process_local else None

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
            self._admit([views[i][0] for i in small if stored[i]], put=True)
            for i, ok in zip(large, self._write_now([views[i] for i in large]) if large else []):
                stored[i] = ok
        self._count_puts(stored, [v.nbytes for _, v in views])
        return stored

    def reserve(self, items: Sequence[tuple[bytes, int]]) -> Reservation:
        """Front slots (write-behind), or private buffers that `publish` puts (write-through, or a
        value too large for the front)."""
        items = ItemColumns.of(items)
        largest = max(items.sizes, default=0)
        if self.write == "through" or largest > min(self.front.max_entry_bytes, self.max_entry_bytes):
            return super().reserve(list(zip(items.keys, items.sizes)))
        check_keys(items.keys, self.max_key_bytes, self.url)  # against the back's limits
        front = self.front.reserve(items)  # what it evicted is the front's: a copy behind may remain
        return Reservation(items, front.destinations, front, front.addresses, front.room, front.evicted)

    def publish(self, reservation: Reservation, filled: Sequence[bool]) -> list[bool]:
        handle = reservation.handle
        if handle is None:  # private buffers: put_many counts and queues them
            return super().publish(reservation, filled)
        if not isinstance(handle, Reservation):
            raise TypeError(f"tiered store {self.url}: not one of its reservations")
        stored = self.front.publish(handle, filled)
        items = cast(ItemColumns, reservation.items)  # `reserve` made them columns
        keys, sizes = items.keys, items.sizes
        self._admit(list(compress(keys, stored)), put=True)
        self._count_puts(stored, sizes)
        return stored

    def _count_puts(self, stored: list[bool], sizes: Sequence[int]) -> None:
        self._count(
            puts=sum(stored),
            put_bytes=sum(compress(sizes, stored)),
            dropped_puts=len(stored) - sum(stored),
        )

    def _write_now(self, views: list[tuple[bytes, memoryview]]) -> list[bool]:
        """Values too large for the front: to the back now, after any queued or in-flight value of theirs."""
        self._behind.withdraw([key for key, _ in views])  # an older, smaller value must not be served
        return self.back.put_many(views)

    def _admit(self, keys: Sequence[bytes], *, put: bool) -> None:
        """A use of `keys` (their put, or a hit served from memory): those it admits are written behind."""
        self._behind.queue(self._admission.admitted(keys, put=put))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is committed (or dropped); False if `timeout` seconds passed first."""
        return self._behind.flush(timeout)

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

    def _cascade(
        self,
        keys: Sequence[bytes],
        found: list,
        take: Callable[[int, np.ndarray], None],
        back: Callable[[list[int]], int],
        *,
        any_held: bool = False,
    ) -> int:
        """The one lookup order: the front's answer first (`found`, one per key, falsy where it has
        nothing), then the values the write-behind holds (`take(i, view)`: private copies only, or with
        `any_held` -- a lookup -- any value waiting), then `back(indices)` for the rest: what it returns
        (0 when nothing was left for the back)."""
        missing = [i for i, ok in enumerate(found) if not ok]
        if missing and self._behind.busy:
            held = {
                i: lease.view
                for i, lease in zip(missing, self._behind.held([keys[i] for i in missing]))
                if lease is not None and (any_held or lease.slot is None)
            }
            for i, view in held.items():
                take(i, view)
            missing = [i for i in missing if i not in held]
        return back(missing) if missing else 0

    def read_many(self, keys: Sequence[bytes], consume: Callable[[int, memoryview], None]) -> list[bool]:
        # Per key, not running totals: the back tier may consume on several reader threads at once.
        sizes, promoted = [0] * len(keys), [False] * len(keys)

        def counted(i: int, view: memoryview) -> None:
            consume(i, view)
            sizes[i] = view.nbytes

        def from_writer(i: int, view: np.ndarray) -> None:
            counted(i, view.data)  # .data: the array's memoryview
            served[i] = True

        def from_back(i: int, view: memoryview) -> None:
            promoted[i] = self._promote(keys[i], view)
            counted(i, view)
            served[i] = True

        served = self.front.read_many(keys, counted)
        if self.admit > 1:
            self._admit([key for key, ok in zip(keys, served) if ok], put=False)
        disk_hits = self._cascade(
            keys, served, from_writer, lambda missing: self._read_back(keys, missing, from_back, readers=1)
        )
        hits = sum(served)
        self._count(
            hits=hits,
            misses=len(keys) - hits,
            get_bytes=sum(sizes),
            memory_hits=hits - disk_hits,
            disk_hits=disk_hits,
            promotions=sum(promoted),
        )
        return served

    def acquire(self, keys: Sequence[bytes], *, touch: bool = True) -> list[Lease | None]:
        promoted: list[int] = []

        def from_writer(i: int, view: np.ndarray) -> None:
            leases[i] = Lease(keys[i], view)

        def from_back(i: int, view: memoryview) -> None:
            if self._promote(keys[i], view):
                promoted.append(i)
            else:  # too large for the front, or no room: a private copy
                leases[i] = Lease(keys[i], np.frombuffer(view, np.uint8).copy())

        leases = self.front.acquire(keys, touch=touch)
        if self.admit > 1 and touch:
            self._admit([key for key, lease in zip(keys, leases) if lease is not None], put=False)
        disk_hits = self._cascade(keys, leases, from_writer, lambda missing: self._read_back(keys, missing, from_back))
        for i, lease in zip(promoted, self.front.acquire([keys[i] for i in promoted], touch=False)):
            leases[i] = lease
        lost = [i for i in promoted if leases[i] is None]  # evicted again before it could be held
        for i, lease in zip(lost, self.back.acquire([keys[i] for i in lost], touch=False) if lost else []):
            leases[i] = lease
        if touch:
            hits = [lease.view.nbytes for lease in leases if lease is not None]
            self._count(
                hits=len(hits),
                misses=len(keys) - len(hits),
                get_bytes=sum(hits),
                memory_hits=len(hits) - disk_hits,
                disk_hits=disk_hits,
                promotions=len(promoted),
            )
        return leases

    def acquire_batch(self, keys: Sequence[bytes], *, touch: bool = True) -> HeldBatch:
        """A batch the memory front holds whole (a warm restore): the front's own batch, by address, one
        handle and no lease per value. Otherwise (a page to promote from the back tier first): `acquire`'s
        leases, as any tier's."""
        keys = list(keys)
        if not all(self.front.contains_many(keys)):
            return super().acquire_batch(keys, touch=touch)
        held = self.front.acquire_batch(keys, touch=touch)
        if not held.addresses.all():  # evicted between the two looks: the general path
            self.front.release_batch(held)
            return super().acquire_batch(keys, touch=touch)
        if touch:
            if self.admit > 1:
                self._admit(keys, put=False)
            self._count(hits=len(keys), get_bytes=int(held.sizes.sum()), memory_hits=len(keys))
        return held._replace(handle=_FrontBatch(held))

    def release_batch(self, held: HeldBatch) -> None:
        if isinstance(held.handle, _FrontBatch):
            self.front.release_batch(held.handle.held)
        else:
            super().release_batch(held)

    def _read_back(
        self,
        keys: Sequence[bytes],
        missing: list[int],
        consume: Callable[[int, memoryview], None],
        readers: int = READERS,
    ) -> int:
        """`back.read_many` of the `missing` keys (consume gets the key's index), split over `readers`
        threads when there are several values: with a cold page cache each thread's page faults keep the
        back tier busy while the others copy, where one reader waits for each fault in turn."""

        def read(part: list[int]) -> int:
            return sum(self.back.read_many([keys[i] for i in part], lambda k, view: consume(part[k], view)))

        parts = [
            [missing[j] for j in part] for part in np.array_split(np.arange(len(missing)), min(readers, len(missing)))
        ]
        if len(parts) == 1:
            return read(parts[0])
        return sum(future.result() for future in [self._readers.submit(read, part) for part in parts])

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Promote the back's values of `keys` that memory lacks into memory (READERS threads), so the
        read that follows (a queued request's load) is a memory hit; counted in `prefetched`. Values
        too large for the front, or for which it has no room, stay in the back."""
        keys = list(keys)
        promoted: list[int] = []  # appended from reader threads (list.append is atomic)

        def from_back(i: int, view: memoryview) -> None:
            if self._promote(keys[i], view):
                promoted.append(view.nbytes)

        self._cascade(
            keys,
            self.front.contains_many(keys),
            lambda i, view: None,
            lambda missing: self._read_back(keys, missing, from_back),
        )
        self._count(prefetched=len(promoted), prefetched_bytes=sum(promoted))
        return len(promoted)

    def advise(self, keys: Sequence[bytes]) -> None:
        """The back reads ahead those of `keys` that memory lacks."""
        keys = list(keys)
        missing = [key for key, there in zip(keys, self.front.contains_many(keys)) if not there]
        if missing:
            self.back.advise(missing)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        def from_writer(i: int, view: np.ndarray) -> None:
            present[i] = True

        def from_back(missing: list[int]) -> int:
            found = self.back.contains_many([keys[i] for i in missing])
            for i, ok in zip(missing, found):
                present[i] = ok
            return sum(found)

        present = self.front.contains_many(keys)
        self._cascade(keys, present, from_writer, from_back, any_held=True)
        return present

    def release(self, leases: Iterable[Lease | None]) -> None:
        self.front.release(leases)

    def delete(self, key: bytes) -> bool:
        stale, (in_front,) = self._behind.withdraw([key])  # a batch committing the key is done first
        return self.back.delete(key) or in_front or bool(stale)

    def watch_evictions(self, listener: Callable[[list[bytes]], None] | None) -> None:
        """A key leaves this store when a tier evicts it and the other tier does not hold it (nor the
        write-behind queue): a value on disk outlives its memory copy, a hot one its disk copy."""
        super().watch_evictions(listener)
        self.front.watch_evictions(None if listener is None else self._front_evicted)
        self.back.watch_evictions(None if listener is None else self._back_evicted)

    def _front_evicted(self, keys: list[bytes]) -> None:
        keys = [key for key, lease in zip(keys, self._behind.held(keys)) if lease is None]
        if keys:
            self._report_evicted([key for key, there in zip(keys, self.back.contains_many(keys)) if not there])

    def _back_evicted(self, keys: list[bytes]) -> None:
        self._report_evicted([key for key, there in zip(keys, self.front.contains_many(keys)) if not there])

    def claim(self, owner: str) -> None:
        self.front.claim(owner)
        self.back.claim(owner)

    def clear(self, owner: str) -> bool:
        """Both tiers and the values waiting to be written behind; nothing changes if the back refuses."""
        return self._behind.clear(owner)

    # -- figures and shutdown -------------------------------------------------------------------------
    def _usage(self) -> dict[str, int]:
        usage: dict[str, int] = {}
        for name, tier in (("memory", self.front), ("disk", self.back)):  # "disk": the back tier (stat names)
            for k, v in tier.stats().items():
                if k != "url" and isinstance(v, int):  # every figure but the URL is a count
                    usage[f"{name}_{k}"] = v
        usage["entries"] = usage.get("disk_entries", 0)
        usage["bytes_used"] = usage.get("disk_bytes_used", 0)
        usage["evictions"] = usage.get("disk_evictions", 0)  # entries gone from the store as a whole
        usage["checksum_failures"] = usage.get("disk_checksum_failures", 0)
        usage.update(self._behind.usage(), admission_waiting=len(self._admission))
        return usage

    def counter(self, name: str) -> int:
        """As `stats()` reports it: evictions and checksum failures are the back tier's (`_usage`)."""
        return self.back.counter(name) if name in ("evictions", "checksum_failures") else super().counter(name)

    def close(self) -> None:
        """Flush (at most CLOSE_FLUSH_SECONDS), stop the writer, close both tiers. A writer still stuck
        in the back leaves both tiers open: it holds views into the front."""
        if self._behind.closed or not self._behind.close():
            return
        self._readers.shutdown(wait=True)
        self.front.close()
        self.back.close()


class _FrontBatch(NamedTuple):
    """`TieredStore.acquire_batch`'s handle for a batch its memory front holds."""

    held: HeldBatch
