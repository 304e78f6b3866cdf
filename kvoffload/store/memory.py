"""Host-memory tier: values kept in the slots of an arena of large host-memory chunks (arena.py),
evicted by LRU or S3-FIFO.

Chunks are page-locked (pinned, through torch) when CUDA is present, so device copies from and into
this tier run at link speed; a pinned arena is reserved whole at open (`reserve`, default: when
pinned), so no save ever waits for page-locking. The capacity caps the chunk bytes. Which entry makes
room is the eviction policy's choice (`evict`, eviction.py: lru, the default, or s3fifo); the store
tells it of every insert, hit and removal, and asks it for a victim nobody holds.

Batches of small pages (thousands of 72 KiB pages a save) are the hot path: a batch of one size class
whose keys are all new takes its slots a chunk at a time and, when full, its LRU victims at once
(`_reserve_run`); its publication and a lease batch of present, unheld keys are bulk dict operations.
Anything else takes the per-value path; both hand out the same slots and evict the same keys. A device
copies by address: a reservation's addresses come vectorised (`Arena.locate`, no view per slot unless
`destinations` is read), and `acquire_batch` holds a load's batch with one lease, by address.

A slot can be held: by a reader while it consumes, by a lease (`acquire`, or one for a whole batch:
`acquire_batch`) until `release` (`release_batch`), by a `write_many` while its caller fills it. Held
bytes are never evicted, reused or overwritten; a key evicted, replaced or deleted while its slot is
held leaves the index at once, and the slot is freed when its last holder lets go.

A watched arena (`watch_evictions`) reports the keys it evicted, after its lock is released.

Lock order: one store lock (`_lock`), taken for bookkeeping only (no copy, no fill, no caller callback
runs under it); the base class's counter lock is taken after it is released, never inside it. A tiered
store's write-behind may hold its lock while calling in (`tiered_behind.WriteBehind._lock` -> this lock):
this lock is always the innermost."""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from operator import itemgetter
from typing import NamedTuple, cast

import numpy as np

from .arena import SHIFT, SLOT_MASK, Arena, SlotViews
from .base import HeldBatch, ItemColumns, Lease, Reservation, Store, check_keys
from .buffers import Buffer
from .errors import EntryTooLargeError, StoreConfigError
from .eviction import make_policy, policy_name

log = logging.getLogger(__name__)

MAX_CHUNK = 256 << 20  # default largest chunk, and so the largest value
_lease_ids = itertools.count(1)  # unique across stores: a lease released twice or elsewhere is caught


class _Batch(NamedTuple):
    """A reservation's handle: each item's reserved slot (-1: none), its keys and sizes."""

    slots: list[int]
    keys: list[bytes]
    sizes: list[int]


class _Evicted(NamedTuple):
    """The entries a reservation evicted: their keys and bytes (two columns: a batch evicts hundreds)."""

    keys: list[bytes]
    sizes: list[int]


def _cuda_present() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


class MemoryStore(Store):
    in_place = True
    process_local = True

    def __init__(
        self,
        capacity: int,
        pinned: bool | None = None,
        url: str | None = None,
        *,
        chunk_bytes: int | None = None,
        reserve: bool | None = None,
        evict: str = "lru",
    ):
        super().__init__()
        self.capacity = capacity
        self.evict = policy_name(evict, "memory store: evict=")  # the one check, URLs' too (eviction.py)
        if pinned and not _cuda_present():
            raise StoreConfigError(
                "memory store: pinned=true needs a CUDA or ROCm device (page-locking is a "
                "driver call); use pinned=auto or pinned=false on this machine"
            )
        if chunk_bytes is not None and chunk_bytes <= 0:
            raise StoreConfigError(f"memory store: chunk_bytes must be positive, got {chunk_bytes}")
        self.pinned = _cuda_present() if pinned is None else pinned
        self.url = url or f"memory://?capacity={capacity}"
        self.chunk_bytes = min(capacity, chunk_bytes or MAX_CHUNK)  # the largest chunk and value
        self._lock = threading.Lock()
        self._arena = Arena(capacity, self.chunk_bytes, self.pinned)  # the slots (under the lock)
        self._index: dict[bytes, tuple[int, int]] = {}  # key -> (slot, nbytes); LRU: oldest first
        self._policy = make_policy(evict, capacity, self._index)  # which indexed key to evict
        self._holds: dict[int, int] = {}  # slot -> holders (readers, leases)
        self._orphans: set[int] = set()  # held slots whose key left the index: freed at the last release
        self._leases: dict[int, int] = {}  # lease id -> slot
        self._batches: dict[int, tuple[Sequence[int], bool]] = {}  # batch lease id -> its slots, all distinct?
        self._used = self._pending = 0  # value bytes, slots being filled
        self._bulk = True  # the bulk paths (a test turns them off to hold them to the per-value path)
        self._closed = False
        self._owners: set[str] = set()  # namespaces that claimed this store (see Store.clear)
        if self.pinned if reserve is None else reserve:
            with self._lock:
                self._arena.reserve_all()

    @property
    def max_entry_bytes(self) -> int:
        return self.chunk_bytes

    # -- slots and the index (all under the lock) -------------------------------------------------
    def _unindex(self, key: bytes, reuse: int = 0) -> tuple[int, int | None]:
        """Drop `key` from the index; its slot is freed now, or by its last holder. Returns its bytes,
        and its slot itself where `reuse` names the slot's class and nobody holds it: handed straight
        to a new value (a full arena's save reuses each victim's slot without freeing and retaking it)."""
        slot, nbytes = self._index.pop(key)
        self._policy.remove(key)
        self._used -= nbytes
        if slot in self._holds:
            self._orphans.add(slot)
        elif reuse and self._arena.slot_class(slot) == reuse:
            return nbytes, slot
        else:
            self._arena.free(slot)
        return nbytes, None

    def _reserve(self, key: bytes, cls: int, batch: dict[int, int], evicted: _Evicted) -> int | None:
        """A slot for a new value of `key`, making room: the key's old value first, then the least
        policy's victim among unheld entries, then this batch's own earliest reservation. None: all held.
        A class found full (starved) is not searched again until a slot is freed."""
        arena = self._arena
        slot = arena.take(cls)
        while slot is None:
            old = self._index.get(key)
            if old is not None and old[0] not in self._holds:
                slot = self._unindex(key, cls)[1]  # replaced anyway: not an eviction
            elif (victim := self._policy.victim(self._unheld)) is not None:
                nbytes, slot = self._unindex(victim, cls)
                evicted.keys.append(victim)  # counted once per batch
                evicted.sizes.append(nbytes)
            elif batch:
                arena.free(batch.pop(next(iter(batch))))
            else:
                return None
            if slot is None:
                slot = arena.take(cls)
        return slot

    def _reserve_run(self, keys: list[bytes], distinct: set[int], evicted: _Evicted) -> list[int]:
        """The hot path of `_reserve_slots`: a batch of one size class (`distinct`: its sizes) whose keys
        are all new takes its slots a chunk at a time and, in a full arena, evicts its LRU victims at
        once, where those are unheld and of the class (the slots `_reserve` would hand out, one by one).
        Returns the slots of the leading items that have one; the rest take the per-value path."""
        if not self._bulk or len(distinct) != 1 or len(set(keys)) != len(keys):
            return []
        if not self._index.keys().isdisjoint(keys):
            return []
        cls = self._arena.class_of(next(iter(distinct)))
        slots = self._arena.take_many(cls, len(keys))
        short = len(keys) - len(slots)
        chunks = self._arena.chunks

        gone: list[tuple[int, int]] = []  # the victims' index entries
        taken: list[int] = []  # their slots

        def may_go(victims: list[bytes]) -> bool:  # unheld, and slots of this class: handed on as they are
            gone[:] = map(self._index.__getitem__, victims)
            taken[:] = map(itemgetter(0), gone)
            lo, hi = min(taken) >> SHIFT, max(taken) >> SHIFT  # mostly a few adjacent chunks: no set of ids
            of_class = hi - lo <= 8 and all(c in chunks and chunks[c].slot_bytes == cls for c in range(lo, hi + 1))
            if not of_class:  # many chunks, or another class's between them: the victims' own chunks
                of_class = all(chunks[c].slot_bytes == cls for c in {slot >> SHIFT for slot in taken})
            return of_class and (not self._holds or self._holds.keys().isdisjoint(taken))

        victims = (self._policy.victims(short, may_go) if short else None) or []
        if victims:
            deque(map(self._index.pop, victims), maxlen=0)  # out of the LRU order too (eviction.py)
            freed = list(map(itemgetter(1), gone))
            slots += taken
            self._used -= sum(freed)
            evicted.keys.extend(victims)
            evicted.sizes.extend(freed)
        return slots

    def _unheld(self, key: bytes) -> bool:
        """May `key` be evicted: nobody holds its slot."""
        return self._index[key][0] not in self._holds

    def _release_holds(self, slots: Iterable[int], distinct: bool = False) -> None:
        """One hold less on each slot (a slot named twice loses two); a slot nobody holds any more is
        freed if its key left the index. A batch of slots held once each is let go in bulk (`distinct`:
        the caller knows no slot is named twice)."""
        slots, holds = list(slots), self._holds
        if distinct or len(set(slots)) == len(slots):
            counts = np.fromiter(map(holds.pop, slots, itertools.repeat(0, len(slots))), np.int64, len(slots))
            still = counts > 1  # held by others too: one hold less (in C: a batch lets go of hundreds)
            if still.any():
                holds.update(zip(itertools.compress(slots, still), (counts[still] - 1).tolist()))
            if self._orphans:  # let go by their last holder: freed (a slot the store closed under is not)
                for slot in self._orphans.intersection(itertools.compress(slots, counts == 1)):
                    self._orphans.remove(slot)
                    self._arena.free(slot)
            return
        for slot in slots:
            if slot not in holds:  # the store was closed meanwhile
                continue
            holds[slot] -= 1
            if not holds[slot]:
                del holds[slot]
                if slot in self._orphans:
                    self._orphans.remove(slot)
                    self._arena.free(slot)

    def _hold(self, keys: Sequence[bytes], touch: bool, lease: bool) -> list[Lease | None]:
        """Hold each present value's slot (None for a miss): a lease each (`lease`, until `release`),
        or the slot itself in `Lease.slot` (a reader's hold, let go by `_release_holds`). One pass
        under the lock: a batch of small pages pays a few dict operations per page."""
        held: list[Lease | None] = []
        append, index, holds, chunks, leases = held.append, self._index, self._holds, self._arena.chunks, self._leases
        with self._lock:
            entries = list(map(index.get, keys))
            found = cast(list[tuple[int, int]], entries) if None not in entries else []
            slots = [slot for slot, _ in found]
            if self._bulk and len(set(slots)) == len(keys) and holds.keys().isdisjoint(slots):  # present, unheld
                if touch:
                    self._policy.touch_many(keys)
                holds.update(dict.fromkeys(slots, 1))
                handles = list(itertools.islice(_lease_ids, len(keys))) if lease else slots
                if lease:
                    leases.update(zip(handles, slots))
                for key, (slot, nbytes), handle in zip(keys, found, handles):
                    chunk = chunks[slot >> SHIFT]  # `Arena.view`, inlined: this loop runs once per page
                    start = (slot & SLOT_MASK) * chunk.slot_bytes
                    append(Lease(key, chunk.array[start : start + nbytes], handle, chunk.address + start))
            else:
                for key, entry in zip(keys, entries):
                    if entry is None:
                        append(None)
                        continue
                    slot, nbytes = entry
                    if touch:
                        self._policy.touch(key)
                    holds[slot] = holds.get(slot, 0) + 1
                    handle = slot
                    if lease:
                        handle = next(_lease_ids)
                        leases[handle] = slot
                    view, address = self._arena.view(slot, nbytes)
                    append(Lease(key, view, handle, address))
        if touch:
            hits = [h.view.nbytes for h in held if h is not None]
            self._count(hits=len(hits), misses=len(keys) - len(hits), get_bytes=sum(hits))
        return held

    # -- writes ----------------------------------------------------------------------------------
    def _reserve_slots(self, keys: list[bytes], sizes: list[int], distinct: set[int]) -> Reservation:
        evicted = _Evicted([], [])
        with self._lock:
            slots = self._reserve_run(keys, distinct, evicted)  # the leading items', in item order
            if len(slots) < len(keys):
                start = len(slots)
                batch = dict(enumerate(slots))  # item -> reserved slot
                classes = {n: self._arena.class_of(n) for n in distinct}  # a layout has few page sizes
                latest = dict(zip(keys[:start], range(start)))  # key -> the item of this batch that will hold it
                for i in range(start, len(keys)):
                    key = keys[i]
                    if key in latest and latest[key] in batch:  # a later value of the key replaces it
                        self._arena.free(batch.pop(latest[key]))
                    slot = self._reserve(key, classes[sizes[i]], batch, evicted)
                    if slot is not None:
                        batch[i], latest[key] = slot, i
                slots = [batch.get(i, -1) for i in range(len(keys))]
            addresses, room = self._arena.locate(slots)
            self._pending += len(slots) - slots.count(-1)
        if evicted.keys:
            self._count(evictions=len(evicted.keys), evicted_bytes=sum(evicted.sizes))
            if self._on_evict is not None:  # a key this batch writes again is not gone
                self._report_evicted(list(set(evicted.keys).difference(keys)))
        handle = _Batch(slots, keys, sizes)
        views = SlotViews(self._arena, slots, sizes)
        return Reservation(ItemColumns(keys, sizes), views, handle, addresses, room, evicted.keys)

    def publish(self, reservation: Reservation, filled: Sequence[bool]) -> list[bool]:
        """Index the slots `filled` marks (replacing older values of their keys), free the others."""
        handle = reservation.handle
        if not isinstance(handle, _Batch):
            raise TypeError(f"memory store {self.url}: not one of its reservations")
        slots, keys, sizes = handle
        index, insert, used, total = self._index, self._policy.insert, 0, 0
        reserved = len(slots) - slots.count(-1)
        with self._lock:
            self._pending -= reserved
            if self._bulk and reserved == len(keys) and all(filled) and index.keys().isdisjoint(keys):  # new
                index.update(zip(keys, zip(slots, sizes)))
                self._policy.insert_many(keys, sizes)
                total = sum(sizes)
                self._used += total
                written = [True] * len(keys)
                slots = []
            else:
                written = [False] * len(keys)
            for i, slot in enumerate(slots):
                key, nbytes = keys[i], sizes[i]
                if slot < 0:
                    continue
                if not filled[i]:
                    self._arena.free(slot)
                    continue
                if key in index:
                    self._unindex(key)
                index[key] = (slot, nbytes)
                insert(key, nbytes)
                used += nbytes
                written[i] = True
            self._used += used
        total += used
        ok, declined = sum(written), sum(1 for i, slot in enumerate(slots) if slot >= 0 and not written[i])
        self._count(puts=ok, put_bytes=total, dropped_puts=len(keys) - ok - declined)
        return written

    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        views = self._views(items)

        def copy(dests: list[np.ndarray | None]) -> list[bool]:
            for dest, (_, view) in zip(dests, views):
                if dest is not None:
                    dest[:] = np.frombuffer(view, np.uint8)
            return [dest is not None for dest in dests]

        return self.write_many([(key, view.nbytes) for key, view in views], copy)

    def reserve(self, items: Sequence[tuple[bytes, int]]) -> Reservation:
        """Held slots for the values (None: no room, or a later item of the batch replaces or evicts
        that one), invisible until `publish`; `write_many` is reserve, fill, publish."""
        columns = ItemColumns.of(items)  # a batch's columns as they are (`check_keys` copies none)
        keys, sizes = columns.keys, columns.sizes
        keys = check_keys(keys, self.max_key_bytes, self.url)
        distinct = set(sizes)  # a layout has few page sizes: checked once each
        if not {type(n) for n in distinct} <= {int}:
            sizes = [int(n) for n in sizes]
            distinct = set(sizes)
        for n in {n for n in distinct if n < 0 or n > self.max_entry_bytes}:
            if n < 0:
                raise ValueError(f"a value size must not be negative, got {n}")
            raise EntryTooLargeError(
                f"a {n}-byte value cannot fit in {self.url}: it takes entries up to {self.max_entry_bytes} "
                f"bytes (capacity {self.capacity} bytes); raise the capacity"
            )
        return self._reserve_slots(keys, sizes, distinct)

    # -- reads -----------------------------------------------------------------------------------
    def read_many(self, keys: Sequence[bytes], consume: Callable[[int, memoryview], None]) -> list[bool]:
        held = self._hold(keys, touch=True, lease=False)
        try:
            for i, entry in enumerate(held):
                if entry is not None:
                    consume(i, entry.view.data)  # outside the lock; the hold keeps the bytes
        finally:
            with self._lock:
                self._release_holds(cast(int, h.slot) for h in held if h is not None)
        return [h is not None for h in held]

    def acquire(self, keys: Sequence[bytes], *, touch: bool = True) -> list[Lease | None]:
        """Hold each present value in its slot (None for a miss) until `release`; do not write the views."""
        return self._hold(keys, touch, lease=True)

    def acquire_batch(self, keys: Sequence[bytes], *, touch: bool = True) -> HeldBatch:
        """`acquire` by host address: one lease holds the batch's slots (no view or lease per value)."""
        keys = list(keys)
        index, holds = self._index, self._holds
        with self._lock:
            entries = list(map(index.get, keys))
            missed = None in entries
            if missed:
                found = [(-1, 0) if entry is None else entry for entry in entries]
            else:
                found = cast(list[tuple[int, int]], entries)
            slots, sizes = zip(*found) if found else ((), ())
            held = [slot for slot in slots if slot >= 0] if missed else slots
            once = dict.fromkeys(held, 1)
            distinct = len(once) == len(held)
            # unheld, once each (`once.keys()`, a view: isdisjoint walks the smaller side, mostly the holds)
            if self._bulk and distinct and holds.keys().isdisjoint(once.keys()):
                holds.update(once)
            elif self._bulk and distinct:  # some held already (a write-behind's leases): one hold more each, in C
                counts = np.fromiter(map(holds.get, held, itertools.repeat(0, len(held))), np.int64, len(held))
                holds.update(zip(held, (counts + 1).tolist()))
            else:
                for slot in held:
                    holds[slot] = holds.get(slot, 0) + 1
            if touch:
                hits = [key for key, entry in zip(keys, entries) if entry is not None] if missed else keys
                self._policy.touch_many(hits)
            handle = next(_lease_ids)
            self._batches[handle] = (held, distinct)
            addresses, room = self._arena.locate(slots)
        if touch:
            self._count(hits=len(held), misses=len(keys) - len(held), get_bytes=sum(sizes))
        return HeldBatch(addresses, np.asarray(sizes, dtype=np.int64), handle, room)

    def release_batch(self, held: HeldBatch) -> None:
        with self._lock:
            batch = self._batches.pop(cast(int, held.handle), None)
            if batch is not None:
                self._release_holds(*batch)
        if batch is None and not self._closed:
            raise ValueError(f"a batch released twice or not acquired from {self.url}")

    def release(self, leases: Iterable[Lease | None]) -> None:
        """Give back leases (None entries and private copies are ignored). A lease released twice, or
        not from this store, raises ValueError once the others are released."""
        with self._lock:
            slots, unknown = [], 0
            for lease in leases:
                if lease is not None and lease.slot is not None:
                    slot = self._leases.pop(lease.slot, None)
                    unknown += slot is None
                    if slot is not None:
                        slots.append(slot)
            self._release_holds(slots)
        if unknown and not self._closed:
            raise ValueError(f"{unknown} lease(s) released twice or not acquired from {self.url}")

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return list(map(self._index.__contains__, keys))

    def delete(self, key: bytes) -> bool:
        with self._lock:
            present = key in self._index
            if present:
                self._unindex(key)
        return present

    def claim(self, owner: str) -> None:
        with self._lock:
            self._owners.add(owner)

    def clear(self, owner: str) -> bool:
        """Every value (held slots are freed at their last release); False if another namespace claimed it."""
        with self._lock:
            others = self._owners - {owner}
            if not others:
                for key in list(self._index):
                    self._unindex(key)
        if others:
            log.warning("memory store %s: not cleared: namespace(s) %s use it too", self.url, sorted(others))
        return not others

    def _usage(self) -> dict[str, int]:
        with self._lock:
            free = self._arena.slots_free()
            return {
                "entries": len(self._index),
                "bytes_used": self._used,
                "pinned": int(self.pinned),
                "arena_bytes": self._arena.reserved,
                "chunks": len(self._arena.chunks),
                "slots_free": free,
                "held": len(self._holds) + self._pending,
            }

    def close(self) -> None:
        """Drop every value and chunk (views still held elsewhere keep their own memory alive)."""
        with self._lock:
            for table in (self._index, self._holds, self._leases, self._batches):
                table.clear()
            self._orphans.clear()
            self._arena.clear()
            self._policy.clear()
            self._used = 0
            self._closed = True
