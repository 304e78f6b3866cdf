"""Host-memory tier: values kept in an arena of large host-memory chunks, evicted by LRU or S3-FIFO.

Chunks are page-locked (pinned, through torch) when CUDA is present, so device copies from and into
this tier run at link speed. Memory is reserved a chunk at a time, never per value: page-locking is a
driver call far slower than the copy, and paying it for every new value size wastes the link. A chunk
is carved into slots of one size class (the value size rounded up to 4 KiB; a KV layout has few page
sizes); free slots are reused in O(1), and a chunk whose slots are all free goes back to a pool that
any class takes from, so memory follows the workload. The capacity caps the chunk bytes. A pinned arena
is reserved whole at open (`reserve`, default: when pinned), so no save ever waits for page-locking.
Which entry makes room is the eviction policy's choice (`evict`, eviction.py: lru, the default, or
s3fifo); the arena tells it of every insert, hit and removal, and asks it for a victim nobody holds.

A slot can be held: by a reader while it consumes, by a lease (`acquire`) until `release`, by a
`write_many` while its caller fills it. Held bytes are never evicted, reused or overwritten; a key
evicted, replaced or deleted while its slot is held leaves the index at once, and the slot is freed
when its last holder lets go.

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
from typing import cast

import numpy as np

from .base import Lease, Reservation, Store, check_key
from .buffers import Buffer
from .errors import EntryTooLargeError, StoreConfigError
from .eviction import make_policy, policy_name

log = logging.getLogger(__name__)

PAGE = 4096  # slot sizes are multiples of this
MAX_CHUNK = 256 << 20  # default largest chunk, and so the largest value
_SHIFT = 32  # a slot handle is chunk id << _SHIFT | slot index
_SLOT_MASK = (1 << _SHIFT) - 1
_lease_ids = itertools.count(1)  # unique across stores: a lease released twice or elsewhere is caught


def _cuda_present() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


class _Chunk:
    __slots__ = ("id", "array", "address", "size", "slot_bytes", "carved", "free", "used")

    def __init__(self, id: int, array: np.ndarray):
        self.id, self.array, self.size = id, array, array.nbytes
        self.address = array.ctypes.data  # its slots' host addresses, without a numpy lookup per slot
        self.slot_bytes = 0  # 0 while in the pool (no slot in use)
        self.carved = 0  # slots handed out so far; the rest of the chunk is uncarved
        self.free: deque[int] = deque()  # indices of freed slots, reused oldest first (see _take)
        self.used = 0


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
        # New chunks take this much (or one slot, if larger): a small arena still holds several classes.
        self._grain = min(self.chunk_bytes, max(PAGE, 1 << max(0, (capacity // 16).bit_length() - 1)))
        self._lock = threading.Lock()
        self._index: dict[bytes, tuple[int, int]] = {}  # key -> (slot, nbytes)
        self._policy = make_policy(evict, capacity)  # the order of the index's keys, for eviction
        self._chunks: dict[int, _Chunk] = {}
        self._open: dict[int, dict[int, _Chunk]] = {}  # slot bytes -> chunks with a free or uncarved slot
        self._pool: dict[int, _Chunk] = {}  # chunks with no slot in use
        self._holds: dict[int, int] = {}  # slot -> holders (readers, leases)
        self._starved: set[int] = set()  # classes `_take` found no slot for since the last free
        self._orphans: set[int] = set()  # held slots whose key left the index: freed at the last release
        self._leases: dict[int, int] = {}  # lease id -> slot
        self._chunk_ids = itertools.count()
        self._reserved = self._used = self._pending = 0  # arena bytes, value bytes, slots being filled
        self._limit = capacity  # lowered if the host refuses memory
        self._closed = False
        self._owners: set[str] = set()  # namespaces that claimed this store (see Store.clear)
        if self.pinned if reserve is None else reserve:
            self._reserve_all()

    def _reserve_all(self) -> None:
        """Allocate the whole capacity now, as pooled chunks (a cold arena page-locks at ~1 GB/s)."""
        with self._lock:
            while self._limit - self._reserved >= PAGE:
                size = min(self._grain, self._limit - self._reserved) // PAGE * PAGE
                try:
                    array = self._allocate(size)
                except (RuntimeError, MemoryError) as exc:
                    log.warning(
                        "memory store: reserved %d of %d bytes at open (%s); the arena stays there",
                        self._reserved,
                        self.capacity,
                        exc,
                    )
                    self._limit = self._reserved
                    return
                chunk = _Chunk(next(self._chunk_ids), array)
                self._chunks[chunk.id] = chunk
                self._pool[chunk.id] = chunk
                self._reserved += size

    @property
    def max_entry_bytes(self) -> int:
        return self.chunk_bytes

    def _allocate(self, nbytes: int) -> np.ndarray:
        if self.pinned:
            import torch

            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        return np.empty(nbytes, dtype=np.uint8)

    # -- slots (all under the lock) ----------------------------------------------------------------
    def _class(self, nbytes: int) -> int:
        return min(max(PAGE, -(-nbytes // PAGE) * PAGE), self.chunk_bytes)

    def _view(self, slot: int, nbytes: int) -> tuple[np.ndarray, int]:
        """A slot's first `nbytes` and its host address."""
        chunk = self._chunks[slot >> _SHIFT]
        start = (slot & _SLOT_MASK) * chunk.slot_bytes
        return chunk.array[start : start + nbytes], chunk.address + start

    def _take(self, cls: int) -> int | None:
        """A slot of class `cls` without evicting: a free one, a new chunk's, or None."""
        chunk = next(iter(self._open.get(cls, {}).values()), None)
        if chunk is None:
            chunk = self._free_chunk(cls)
            if chunk is None:
                return None
            chunk.slot_bytes = cls
            self._open.setdefault(cls, {})[chunk.id] = chunk
        if chunk.free:
            # Oldest freed first: LRU eviction frees slots in the order they were filled, so a batch
            # reuses them in address order and a device copies runs of adjacent slots in one DMA.
            index = chunk.free.popleft()
        else:
            index, chunk.carved = chunk.carved, chunk.carved + 1
        chunk.used += 1
        if not chunk.free and chunk.carved == chunk.size // cls:
            del self._open[cls][chunk.id]
        return chunk.id << _SHIFT | index

    def _free_chunk(self, cls: int) -> _Chunk | None:
        """A chunk for slots of `cls`: from the pool, else newly allocated within the capacity."""
        fits = [c for c in self._pool.values() if c.size >= cls]
        if fits:
            return self._pool.pop(min(fits, key=lambda c: c.size).id)
        room = self._limit - self._reserved
        if room < cls and room + sum(c.size for c in self._pool.values()) >= cls:
            for chunk in sorted(self._pool.values(), key=lambda c: c.size):  # too small: give them back
                del self._pool[chunk.id], self._chunks[chunk.id]
                self._reserved -= chunk.size
                room += chunk.size
                if room >= cls:
                    break
        if room < cls:
            return None
        size = cls * max(1, min(self._grain, room) // cls)
        try:
            array = self._allocate(size)
        except (RuntimeError, MemoryError) as exc:  # out of (pinned) host memory: stop growing
            log.warning(
                "memory store: cannot allocate a %d-byte chunk (%s); the arena stays at %d bytes",
                size,
                exc,
                self._reserved,
            )
            self._limit = self._reserved
            return None
        chunk = _Chunk(next(self._chunk_ids), array)
        self._chunks[chunk.id] = chunk
        self._reserved += size
        return chunk

    def _free(self, slot: int) -> None:
        self._starved.clear()  # a slot, perhaps a chunk, is free again: every class may find one
        chunk = self._chunks[slot >> _SHIFT]
        chunk.used -= 1
        if chunk.used == 0:  # all slots free: back to the pool, for any class
            self._open[chunk.slot_bytes].pop(chunk.id, None)
            chunk.slot_bytes, chunk.carved, chunk.free = 0, 0, deque()
            self._pool[chunk.id] = chunk
        else:
            chunk.free.append(slot & ((1 << _SHIFT) - 1))
            self._open[chunk.slot_bytes][chunk.id] = chunk

    def _unindex(self, key: bytes, reuse: int = 0) -> tuple[int, int | None]:
        """Drop `key` from the index; its slot is freed now, or by its last holder. Returns its bytes,
        and its slot itself where `reuse` names the slot's class and nobody holds it: handed straight
        to a new value (a full arena's save reuses each victim's slot without freeing and retaking it)."""
        slot, nbytes = self._index.pop(key)
        self._policy.remove(key)
        self._used -= nbytes
        if slot in self._holds:
            self._orphans.add(slot)
        elif reuse and self._chunks[slot >> _SHIFT].slot_bytes == reuse:
            return nbytes, slot
        else:
            self._free(slot)
        return nbytes, None

    def _reserve(self, key: bytes, cls: int, batch: dict[int, int], evicted: list[tuple[bytes, int]]) -> int | None:
        """A slot for a new value of `key`, making room: the key's old value first, then the least
        policy's victim among unheld entries, then this batch's own earliest reservation. None: all held.
        A class found full once in a batch (`_starved`) is not searched again until a slot is freed."""
        slot = None if cls in self._starved else self._take(cls)
        if slot is None:
            self._starved.add(cls)
        while slot is None:
            old = self._index.get(key)
            if old is not None and old[0] not in self._holds:
                slot = self._unindex(key, cls)[1]  # replaced anyway: not an eviction
            elif (victim := self._policy.victim(self._unheld)) is not None:  # unheld, out of the policy
                taken, nbytes = self._index.pop(victim)
                self._used -= nbytes
                evicted.append((victim, nbytes))  # counted once per batch
                if self._chunks[taken >> _SHIFT].slot_bytes == cls:
                    slot = taken  # straight to the new value: not freed and taken again
                else:
                    self._free(taken)
            elif batch:
                self._free(batch.pop(next(iter(batch))))
            else:
                return None
            if slot is None and (slot := self._take(cls)) is not None:
                self._starved.discard(cls)
        return slot

    def _unheld(self, key: bytes) -> bool:
        """May `key` be evicted: nobody holds its slot."""
        return self._index[key][0] not in self._holds

    def _release_holds(self, slots: Iterable[int]) -> None:
        for slot in slots:
            if slot not in self._holds:  # the store was closed meanwhile
                continue
            self._holds[slot] -= 1
            if not self._holds[slot]:
                del self._holds[slot]
                if slot in self._orphans:
                    self._orphans.remove(slot)
                    self._free(slot)

    def _hold(self, keys: Sequence[bytes], touch: bool, lease: bool) -> list[Lease | None]:
        """Hold each present value's slot (None for a miss): a lease each (`lease`, until `release`),
        or the slot itself in `Lease.slot` (a reader's hold, let go by `_release_holds`). One pass
        under the lock: a batch of small pages pays a few dict operations per page."""
        held: list[Lease | None] = []
        append, index, holds, chunks, leases = held.append, self._index, self._holds, self._chunks, self._leases
        mark = self._policy.touch if touch else None
        with self._lock:
            for key in keys:
                entry = index.get(key)
                if entry is None:
                    append(None)
                    continue
                slot, nbytes = entry
                if mark is not None:
                    mark(key)
                holds[slot] = holds.get(slot, 0) + 1
                handle = slot
                if lease:
                    handle = next(_lease_ids)
                    leases[handle] = slot
                chunk = chunks[slot >> _SHIFT]  # `_view`, inlined: this loop runs once per page
                start = (slot & _SLOT_MASK) * chunk.slot_bytes
                append(Lease(key, chunk.array[start : start + nbytes], handle, chunk.address + start))
        if touch:
            hits = [h.view.nbytes for h in held if h is not None]
            self._count(hits=len(hits), misses=len(keys) - len(hits), get_bytes=sum(hits))
        return held

    # -- writes ----------------------------------------------------------------------------------
    def _reserve_slots(self, items: list[tuple[bytes, int]]) -> Reservation:
        batch: dict[int, int] = {}  # item -> reserved slot, in batch order
        latest: dict[bytes, int] = {}  # key -> the item of this batch that will hold it
        dests: list[np.ndarray | None] = [None] * len(items)
        addresses = [0] * len(items)
        evicted: list[tuple[bytes, int]] = []  # (key, bytes)
        classes = {n: self._class(n) for n in {n for _, n in items}}  # a layout has few page sizes
        with self._lock:
            for i, (key, nbytes) in enumerate(items):
                if key in latest and latest[key] in batch:  # a later value of the key replaces it
                    self._free(batch.pop(latest[key]))
                slot = self._reserve(key, classes[nbytes], batch, evicted)
                if slot is not None:
                    batch[i], latest[key] = slot, i
            for i, slot in batch.items():
                dests[i], addresses[i] = self._view(slot, items[i][1])
            self._pending += len(batch)
        if evicted:
            self._count(evictions=len(evicted), evicted_bytes=sum(n for _, n in evicted))
            if self._on_evict is not None:  # a key this batch writes again is not gone
                self._report_evicted(list({k for k, _ in evicted}.difference(key for key, _ in items)))
        return Reservation(items, dests, batch, addresses)

    def publish(self, reservation: Reservation, filled: Sequence[bool]) -> list[bool]:
        """Index the slots `filled` marks (replacing older values of their keys), free the others."""
        items, batch = reservation.items, cast(dict[int, int], reservation.handle)  # ours: item -> slot
        written = [False] * len(items)
        index, insert, used = self._index, self._policy.insert, 0
        with self._lock:
            self._pending -= len(batch)
            for i, slot in batch.items():
                key, nbytes = items[i]
                if not filled[i]:
                    self._free(slot)
                    continue
                if key in index:
                    self._unindex(key)
                index[key] = (slot, nbytes)
                insert(key, nbytes)
                used += nbytes
                written[i] = True
            self._used += used
        ok, declined = sum(written), sum(1 for i in batch if not written[i])
        self._count(
            puts=ok, put_bytes=sum(n for (_, n), w in zip(items, written) if w), dropped_puts=len(items) - ok - declined
        )
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
        keys = [check_key(key, self.max_key_bytes, self.url) for key, _ in items]
        sizes = [int(n) for _, n in items]
        for n in sizes:
            if n < 0:
                raise ValueError(f"a value size must not be negative, got {n}")
            if n > self.max_entry_bytes:
                raise EntryTooLargeError(
                    f"a {n}-byte value cannot fit in {self.url}: it takes entries up to {self.max_entry_bytes} "
                    f"bytes (capacity {self.capacity} bytes); raise the capacity"
                )
        return self._reserve_slots(list(zip(keys, sizes)))

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
            return [k in self._index for k in keys]

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
            free = sum(c.size // c.slot_bytes - c.used for c in self._chunks.values() if c.slot_bytes)
            return {
                "entries": len(self._index),
                "bytes_used": self._used,
                "pinned": int(self.pinned),
                "arena_bytes": self._reserved,
                "chunks": len(self._chunks),
                "slots_free": free,
                "held": len(self._holds) + self._pending,
            }

    def close(self) -> None:
        """Drop every value and chunk (views still held elsewhere keep their own memory alive)."""
        with self._lock:
            for table in (self._index, self._chunks, self._open, self._pool, self._holds, self._leases):
                table.clear()
            self._orphans.clear()
            self._starved.clear()
            self._policy.clear()
            self._reserved = self._used = 0
            self._closed = True
