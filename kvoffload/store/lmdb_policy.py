"""What the LMDB store asks of an eviction policy, and what every policy does alike: one interface, so
that LRU (lmdb_lru.py) and S3-FIFO (lmdb_s3fifo.py) each stand whole in a file of their own and the
store (lmdb_store.py) never asks which one it has.

An entry's place in the eviction order is its tick: a u64 after the entry header in its `meta` record
(little-endian) and the prefix of its record in the `lru` index (big-endian, so the index sorts by
it). The store writes the payload; a policy decides what a tick means (`insert`, `hit`), which entry
goes next (`evict_next`), the newest position in its index and, for a policy with a small queue, that
queue's bytes (what lmdb_counters.py recounts). The records every policy shares -- placing an entry in
the index, applying hits, removing an entry and crediting its charge -- are here, once.

Hits are deferred (`Touches`): a read transaction stays read-only, and the next write transaction
applies the hits it saw (`apply_hits`); a transaction that does not commit gives them back.

Locks: a policy is called only inside the store's write transactions, under its `_write_lock` (lmdb_store.py
gives the whole order): it has no lock of its own. `Touches._lock` is a leaf, held for a few dictionary
operations; readers take it, never a writer's lock.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence

from . import entry
from .lmdb_counters import Counters, Databases, entry_charge

INDEX = struct.Struct(">Q")  # the tick that prefixes a key in the `lru` index
TICK = struct.Struct("<Q")  # the tick after the entry header in a `meta` record
META_BYTES = entry.HEADER_BYTES + TICK.size


def tick_of(meta) -> int | None:
    """The tick in a `meta` record; None for a record of another size (damaged)."""
    return TICK.unpack(meta[entry.HEADER_BYTES :])[0] if len(meta) == META_BYTES else None


def index_tick(record) -> int | None:
    """The tick of an `lru` index record (its key); None for a record too short to have one."""
    record = bytes(record[: INDEX.size])
    return INDEX.unpack(record)[0] if len(record) == INDEX.size else None


class Policy:
    """The interface (the first group of methods, each policy's own) and the shared record handling."""

    name: str
    small_queue = False  # whether it charges a small queue (the small_bytes counter)

    def __init__(self, dbs: Databases, psize: int, capacity: int):
        self.dbs, self.psize, self.capacity = dbs, psize, capacity

    # -- what each policy decides --------------------------------------------------------------------
    def insert(self, counts: Counters, key: bytes, charge: int) -> int:
        """A new entry's tick (advancing `counts.tick`)."""
        raise NotImplementedError

    def hit(self, counts: Counters, tick: int, times: int) -> int | None:
        """The tick of an entry at `tick` read `times` times since the last write; None: unchanged."""
        raise NotImplementedError

    def evict_next(self, txn, counts: Counters) -> bytes | None:
        """Remove the entry the policy evicts next (`evict`): its key; None when the store is empty."""
        raise NotImplementedError

    def newest(self, txn) -> int:
        """The newest position in the index (the tick counter may not be behind it)."""
        raise NotImplementedError

    def small_bytes(self, txn) -> int:
        """The small queue's charges, counted from the entries (a policy with `small_queue`)."""
        return 0

    def removed(self, counts: Counters, tick: int, freed: int) -> None:
        """An entry at `tick`, charged `freed`, left (its records are gone)."""

    def committed(self, counts: Counters) -> None:
        """The transaction that made `counts`' evictions committed."""

    def clear(self) -> None:
        """The store was emptied."""

    # -- what every policy does alike ----------------------------------------------------------------
    def charge(self, nbytes: int) -> int:
        return entry_charge(nbytes, self.psize)

    def place(self, txn, key: bytes, header: bytes, tick: int) -> None:
        """Write `key`'s `meta` record (its entry header, then `tick`) and its index record."""
        txn.put(key, header + TICK.pack(tick), db=self.dbs.meta)
        txn.put(INDEX.pack(tick) + key, b"", db=self.dbs.lru)

    def apply_hits(self, txn, touched: dict[bytes, int], counts: Counters) -> None:
        """Move the entries read since the last write (key -> times), in the order they were read."""
        for key, times in touched.items():
            meta = txn.get(key, db=self.dbs.meta)
            old = None if meta is None else tick_of(meta)
            if old is None:
                continue
            new = self.hit(counts, old, times)
            if new is None:
                continue
            header = bytes(meta[: entry.HEADER_BYTES])
            txn.delete(INDEX.pack(old) + key, db=self.dbs.lru)
            self.place(txn, key, header, new)

    def remove(self, txn, key: bytes, counts: Counters) -> int | None:
        """Delete `key`'s records in `txn`, taking from `counts` the bytes it was charged (from the
        stored payload itself): those bytes, or None if it was not there."""
        payload = txn.get(key, db=self.dbs.data)
        meta = txn.get(key, db=self.dbs.meta)
        if payload is None and meta is None:
            return None
        freed = self.charge(len(payload)) if payload is not None else 0
        txn.delete(key, db=self.dbs.data)
        if meta is not None:
            tick = tick_of(meta)
            if tick is not None:
                txn.delete(INDEX.pack(tick) + key, db=self.dbs.lru)
                self.removed(counts, tick, freed)
            txn.delete(key, db=self.dbs.meta)
            counts.entries -= 1
        counts.used -= freed
        return freed

    def evict(self, txn, key: bytes, counts: Counters) -> int | None:
        """`remove`, tallied in `counts` as an eviction (counted in stats() once committed)."""
        freed = self.remove(txn, key, counts)
        if freed is not None:
            counts.evicted += 1
            counts.evicted_bytes += freed
        return freed


class Touches:
    """Hits read transactions saw (key -> times, oldest first), waiting for the next write; `take` and
    `done` / `give_back` run under the store's write lock, `add` on any reader's thread."""

    def __init__(self) -> None:
        self._pending: dict[bytes, int] = {}
        self._taken: dict[bytes, int] = {}  # those a write transaction under way took
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._pending[key] = self._pending.pop(key, 0) + 1

    def take(self) -> dict[bytes, int]:
        """The pending hits, for a write transaction (given back if it does not commit)."""
        with self._lock:
            touched, self._pending = self._pending, {}
        self._taken = touched
        return touched

    def done(self) -> None:
        """The transaction that took them committed (or, for advisory recency, failed for good)."""
        self._taken = {}

    def give_back(self) -> None:
        """The transaction that took the hits did not commit: they are pending again (before any since)."""
        touched, self._taken = self._taken, {}
        with self._lock:
            for key, times in self._pending.items():
                touched[key] = touched.pop(key, 0) + times
            self._pending = touched

    def clear(self) -> None:
        with self._lock:
            self._pending.clear()
