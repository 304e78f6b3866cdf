"""The memory tier's slots: large host-memory chunks, each carved into slots of one size class.

A class is a value size rounded up to 4 KiB (a KV layout has few page sizes). Free slots are reused in
O(1), oldest freed first; a chunk whose slots are all free goes back to a pool that any class takes
from, so memory follows the workload. Chunks are page-locked when the tier is pinned (a driver call far
slower than the copy: reserved a chunk at a time, never per value), and `reserve_all` takes the whole
capacity at open. Which value a slot holds, and which one to evict, is the store's business
(memory.py); every call here runs under the store's lock.

A slot handle is `chunk id << 32 | slot index`; a chunk knows its host address, so a slot's address is
arithmetic, not a numpy lookup (a device copies runs of adjacent slots by address)."""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Sequence

import numpy as np

log = logging.getLogger(__name__)

PAGE = 4096  # slot sizes are multiples of this
SHIFT = 32  # a slot handle is chunk id << SHIFT | slot index
SLOT_MASK = (1 << SHIFT) - 1
FEW = 16  # `locate` of at most this many slots: plain Python beats numpy's per-call cost


class Chunk:
    __slots__ = ("id", "array", "address", "size", "slot_bytes", "carved", "free", "used")

    def __init__(self, id: int, array: np.ndarray):
        self.id, self.array, self.size = id, array, array.nbytes
        self.address = array.ctypes.data  # its slots' host addresses, without a numpy lookup per slot
        self.slot_bytes = 0  # 0 while in the pool (no slot in use)
        self.carved = 0  # slots handed out so far; the rest of the chunk is uncarved
        self.free: deque[int] = deque()  # indices of freed slots, reused oldest first (see take)
        self.used = 0


class SlotViews(Sequence):
    """The slots of a reservation as numpy views, each made when read (-1: no slot, None): a device
    transfer copies by address and never reads them."""

    def __init__(self, arena: Arena, slots: Sequence[int], sizes: Sequence[int]):
        self.arena, self.slots, self.sizes = arena, slots, sizes

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, i):  # an index (a reservation's `destinations` are read one by one)
        slot = self.slots[i]
        return None if slot < 0 else self.arena.view(slot, self.sizes[i])[0]


class Arena:
    """Chunks of at most `chunk_bytes`, `capacity` bytes in all (less if the host refuses memory)."""

    def __init__(self, capacity: int, chunk_bytes: int, pinned: bool):
        self.capacity, self.chunk_bytes, self.pinned = capacity, chunk_bytes, pinned
        # New chunks take this much (or one slot, if larger): a small arena still holds several classes.
        self.grain = min(chunk_bytes, max(PAGE, 1 << max(0, (capacity // 16).bit_length() - 1)))
        self.chunks: dict[int, Chunk] = {}
        self.open: dict[int, dict[int, Chunk]] = {}  # slot bytes -> chunks with a free or uncarved slot
        self.pool: dict[int, Chunk] = {}  # chunks with no slot in use
        self.starved: set[int] = set()  # classes `take` found no slot for since the last free
        self.reserved = 0  # bytes in chunks
        self.limit = capacity  # lowered if the host refuses memory
        self._ids = itertools.count()
        # Per chunk id, for `locate`: its address, slot size and index of its last slot (room for 64
        # chunks, grown by doubling).
        self._bases, self._steps, self._lasts = (np.zeros(64, dtype=np.int64) for _ in range(3))

    def allocate(self, nbytes: int) -> np.ndarray:
        if self.pinned:
            import torch

            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        return np.empty(nbytes, dtype=np.uint8)

    def reserve_all(self) -> None:
        """Allocate the whole capacity now, as pooled chunks (a cold arena page-locks at ~1 GB/s)."""
        while self.limit - self.reserved >= PAGE:
            size = min(self.grain, self.limit - self.reserved) // PAGE * PAGE
            chunk = self._new_chunk(size)
            if chunk is None:
                return
            self.pool[chunk.id] = chunk

    def _new_chunk(self, size: int) -> Chunk | None:
        try:
            array = self.allocate(size)
        except (RuntimeError, MemoryError) as exc:  # out of (pinned) host memory: stop growing
            log.warning(
                "memory store: cannot allocate a %d-byte chunk (%s); the arena stays at %d of %d bytes",
                size,
                exc,
                self.reserved,
                self.capacity,
            )
            self.limit = self.reserved
            return None
        chunk = Chunk(next(self._ids), array)
        self.chunks[chunk.id] = chunk
        self.reserved += size
        return chunk

    def class_of(self, nbytes: int) -> int:
        return min(max(PAGE, -(-nbytes // PAGE) * PAGE), self.chunk_bytes)

    def slot_class(self, slot: int) -> int:
        return self.chunks[slot >> SHIFT].slot_bytes

    def view(self, slot: int, nbytes: int) -> tuple[np.ndarray, int]:
        """A slot's first `nbytes` and its host address."""
        chunk = self.chunks[slot >> SHIFT]
        start = (slot & SLOT_MASK) * chunk.slot_bytes
        return chunk.array[start : start + nbytes], chunk.address + start

    def locate(self, slots: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The host address and the room of each slot (-1: none, 0 and 0), vectorised over a table of
        the chunks' addresses and slot sizes (no sort, no per-slot Python but for a few slots). The room
        is what a device copy may cover from the address on to reach the next slot (`Reservation.room`):
        the slot's size, 0 for a chunk's last slot. Chunks are separate allocations, and a copy must not
        run from one into the next even where they lie next to each other (a CUDA copy then fails)."""
        if len(slots) <= FEW:
            parts = [(0, 0) if s < 0 else self._where(s) for s in slots]
            return np.array([a for a, _ in parts], np.int64), np.array([n for _, n in parts], np.int64)
        at = np.asarray(slots, dtype=np.int64)
        ids = at >> SHIFT  # a missing slot (-1) reads the table's last row: zeroed below
        index = at & SLOT_MASK
        step = self._steps[ids]
        address = self._bases[ids] + index * step
        room = np.where(index == self._lasts[ids], 0, step)
        missing = at < 0
        if missing.any():
            address[missing] = room[missing] = 0
        return address, room

    def _where(self, slot: int) -> tuple[int, int]:
        chunk, index = self.chunks[slot >> SHIFT], slot & SLOT_MASK
        last = chunk.size // chunk.slot_bytes - 1
        return chunk.address + index * chunk.slot_bytes, 0 if index == last else chunk.slot_bytes

    def _describe(self, chunk: Chunk) -> None:
        """Enter a chunk's address, slot size and last slot in `locate`'s table (grown by doubling)."""
        if chunk.id >= len(self._bases):
            grow = np.zeros(2 * chunk.id - len(self._bases), np.int64)
            tables = (self._bases, self._steps, self._lasts)
            self._bases, self._steps, self._lasts = (np.concatenate([t, grow]) for t in tables)
        self._bases[chunk.id], self._steps[chunk.id] = chunk.address, chunk.slot_bytes
        self._lasts[chunk.id] = chunk.size // chunk.slot_bytes - 1

    def take(self, cls: int) -> int | None:
        """A slot of class `cls`: a free one, a new chunk's, or None (then `cls` is starved)."""
        slots = self.take_many(cls, 1)
        return slots[0] if slots else None

    def take_many(self, cls: int, count: int) -> list[int]:
        """Up to `count` slots of class `cls`, as `count` calls of `take` would hand them out (a chunk's
        freed slots oldest first, then its uncarved ones), a chunk at a time. A class found full is
        starved: not searched again until a slot is freed."""
        slots: list[int] = []
        while len(slots) < count and cls not in self.starved:
            chunk = next(iter(self.open.get(cls, {}).values()), None)
            if chunk is None:
                chunk = self._chunk_for(cls)
                if chunk is None:
                    self.starved.add(cls)
                    break
                chunk.slot_bytes = cls
                self._describe(chunk)
                self.open.setdefault(cls, {})[chunk.id] = chunk
            # Oldest freed first: LRU eviction frees slots in the order they were filled, so a batch
            # reuses them in address order and a device copies runs of adjacent slots in one DMA.
            base, free, want = chunk.id << SHIFT, chunk.free, count - len(slots)
            reused = min(want, len(free))
            slots += [base | free.popleft() for _ in range(reused)]
            carved = min(want - reused, chunk.size // cls - chunk.carved)
            slots += range(base | chunk.carved, base | (chunk.carved + carved))
            chunk.carved += carved
            chunk.used += reused + carved
            if not chunk.free and chunk.carved == chunk.size // cls:
                del self.open[cls][chunk.id]
        return slots

    def _chunk_for(self, cls: int) -> Chunk | None:
        """A chunk for slots of `cls`: from the pool, else newly allocated within the capacity."""
        fits = [c for c in self.pool.values() if c.size >= cls]
        if fits:
            return self.pool.pop(min(fits, key=lambda c: c.size).id)
        room = self.limit - self.reserved
        if room < cls and room + sum(c.size for c in self.pool.values()) >= cls:
            for chunk in sorted(self.pool.values(), key=lambda c: c.size):  # too small: give them back
                del self.pool[chunk.id], self.chunks[chunk.id]
                self.reserved -= chunk.size
                room += chunk.size
                if room >= cls:
                    break
        if room < cls:
            return None
        return self._new_chunk(cls * max(1, min(self.grain, room) // cls))

    def free(self, slot: int) -> None:
        self.starved.clear()  # a slot, perhaps a chunk, is free again: every class may find one
        chunk = self.chunks[slot >> SHIFT]
        chunk.used -= 1
        if chunk.used == 0:  # all slots free: back to the pool, for any class
            self.open[chunk.slot_bytes].pop(chunk.id, None)
            chunk.slot_bytes, chunk.carved, chunk.free = 0, 0, deque()
            self.pool[chunk.id] = chunk
        else:
            chunk.free.append(slot & SLOT_MASK)
            self.open[chunk.slot_bytes][chunk.id] = chunk

    def slots_free(self) -> int:
        return sum(c.size // c.slot_bytes - c.used for c in self.chunks.values() if c.slot_bytes)

    def clear(self) -> None:
        for table in (self.chunks, self.open, self.pool):
            table.clear()
        self.starved.clear()
        self.reserved = 0
