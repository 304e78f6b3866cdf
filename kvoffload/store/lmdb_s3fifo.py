"""S3-FIFO on the LMDB tier (`lmdb://...?evict=s3fifo`), whole: its tick encoding, its eviction walk, its
ghost. It lives in the records LRU already has: no new record, no longer record, so the capacity charge
and the map's headroom are LRU's (the interface and the shared records: lmdb_policy.py).

The LRU tick (the `lru` index key's big-endian u64 prefix, the meta record's little-endian u64) becomes
a position: the top bit is the queue (0 small, 1 main), the two low bits the hit count (0..3), the bits
between a counter that every insert and every move advances by STEP. Ordered by the index, the small
queue comes first, oldest first, then the main queue: each queue's head is its first index record. A hit
raises the count in place (same counter: the FIFO position is kept); a move to a queue's tail takes the
next counter. The algorithm is the memory tier's (eviction.py, S3FIFO): new keys enter small (10% of the
capacity, in charged bytes, counted in the `info` db as small_bytes); small's head leaves unless it was
hit, then it moves to main's tail with its hits; main's head with hits goes back to main's tail with one
less, otherwise it leaves. A move rewrites the entry's `meta` and `lru` records and never a payload
page: one transaction copies at most every B-tree page of `meta` and `lru` once, as a batch of LRU hits
can, so the map's headroom holds for both. The ghost of keys evicted from small is this process's
(`Ghost`): it is not persistent and not shared, so after a restart, or in another process, a returning
key enters small again.

No lock of its own: the policy, its ghost included, is used under the store's write lock only."""

from __future__ import annotations

from collections import OrderedDict

from . import entry
from .eviction import S3FIFO
from .lmdb_counters import Counters, Databases
from .lmdb_lru import evict_first
from .lmdb_policy import INDEX, Policy, index_tick, tick_of

MAIN = 1 << 63  # the queue bit
STEP = 4  # the counter's unit, above the hit count
MAX_FREQ = S3FIFO.MAX_FREQ  # the hit count's mask (two bits)
COUNTER = (MAIN - 1) & ~MAX_FREQ  # the counter's bits
SMALL_SHARE = S3FIFO.SMALL_SHARE
GHOST_KEYS = 1 << 16  # at most this many keys remembered (the ghost lives in the process's memory)
MAIN_KEY = INDEX.pack(MAIN)  # the main queue's index records sort from here on


def in_small(tick: int) -> bool:
    return tick < MAIN


def hits(tick: int) -> int:
    return tick & MAX_FREQ


class Ghost:
    """Keys recently evicted from the small queue, oldest first, as many bytes (charged) as the main
    queue may hold and at most GHOST_KEYS keys: a key put again while remembered goes straight to main."""

    def __init__(self, capacity: int):
        self._limit = max(1, capacity - capacity // SMALL_SHARE)
        self._keys: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0

    def add(self, key: bytes, nbytes: int) -> None:
        self._bytes -= self._keys.pop(key, 0)
        self._keys[key] = nbytes
        self._bytes += nbytes
        while self._bytes > self._limit or len(self._keys) > GHOST_KEYS:
            self._bytes -= self._keys.popitem(last=False)[1]

    def take(self, key: bytes) -> bool:
        """Whether `key` was remembered (it is forgotten: it goes to main now)."""
        nbytes = self._keys.pop(key, None)
        if nbytes is None:
            return False
        self._bytes -= nbytes
        return True

    def clear(self) -> None:
        self._keys.clear()
        self._bytes = 0


class S3FIFOPolicy(Policy):
    name = "s3fifo"
    small_queue = True

    def __init__(self, dbs: Databases, psize: int, capacity: int):
        super().__init__(dbs, psize, capacity)
        self._ghost = Ghost(capacity)

    def insert(self, counts: Counters, key: bytes, charge: int) -> int:
        """The next counter in small, or in main for a key the ghost remembers."""
        self._advance(counts)
        if self._ghost.take(key):
            return MAIN | counts.tick
        counts.small += charge
        return counts.tick

    def hit(self, counts: Counters, tick: int, times: int) -> int | None:
        """The hit count rises (at most to 3), in place."""
        new = tick - hits(tick) + min(hits(tick) + times, MAX_FREQ)
        return None if new == tick else new

    def removed(self, counts: Counters, tick: int, freed: int) -> None:
        if in_small(tick):
            counts.small -= freed

    def committed(self, counts: Counters) -> None:
        """Committed evictions from the small queue enter the ghost."""
        for key, nbytes in counts.ghosted:
            self._ghost.add(key, nbytes)

    def clear(self) -> None:
        self._ghost.clear()

    def newest(self, txn) -> int:
        """The last position counter of either queue."""
        cursor = txn.cursor(db=self.dbs.lru)
        ticks = [index_tick(cursor.key())] if cursor.last() else []
        if cursor.set_range(MAIN_KEY) and cursor.prev():
            ticks.append(index_tick(cursor.key()))
        return max((t & COUNTER for t in ticks if t is not None), default=0)

    def small_bytes(self, txn) -> int:
        small = 0
        for record in txn.cursor(db=self.dbs.lru).iternext(values=False):
            tick = index_tick(record)
            if tick is not None and in_small(tick):
                payload = txn.get(bytes(record[INDEX.size :]), db=self.dbs.data)
                small += self.charge(len(payload)) if payload is not None else 0
        return small

    @staticmethod
    def _advance(counts: Counters) -> None:
        """The next counter (the tick of a store that was LRU while empty is aligned first)."""
        counts.tick = (counts.tick & COUNTER) + STEP

    def evict_next(self, txn, counts: Counters) -> bytes | None:
        """From small's head while small holds its share (or main is empty), else from main's head; a
        head with hits moves on instead (index and meta records only: no payload page is copied). Each
        move takes an entry out of small or spends one of its hits, so a victim is found within small +
        3 x entries moves; the bound below only guards that. An evicted key from small is ghosted."""
        cursor = txn.cursor(db=self.dbs.lru)
        from_small = None  # the queue chosen, kept until it has a victim (or, small, until it is empty)
        for _ in range(4 * txn.stat(self.dbs.lru)["entries"] + 1):
            in_main = cursor.set_range(MAIN_KEY)
            in_small = cursor.first() and bytes(cursor.key()[: INDEX.size]) < MAIN_KEY
            if not in_small and not in_main:
                break
            if not in_small:
                counts.small = 0  # a drifted count must not keep choosing an empty queue
            if from_small is None or (from_small and not in_small):
                from_small = in_small and (counts.small >= self.capacity // SMALL_SHARE or not in_main)
            if not from_small:
                cursor.set_range(MAIN_KEY)
            record = bytes(cursor.key())
            tick, key = INDEX.unpack(record[: INDEX.size])[0], record[INDEX.size :]
            cursor.delete()
            meta = txn.get(key, db=self.dbs.meta)
            if not (hits(tick) and meta is not None and tick_of(meta) == tick):
                freed = self.evict(txn, key, counts)
                if freed is None:  # an index record whose entry is gone
                    continue
                if from_small:
                    counts.ghosted.append((key, freed))
                return key
            self._advance(counts)
            if from_small:  # hit while in small: to main's tail, its hits kept for main's clock
                payload = txn.get(key, db=self.dbs.data)
                counts.small -= self.charge(len(payload)) if payload is not None else 0
                moved = MAIN | counts.tick | hits(tick)
            else:  # main's head with hits: back to main's tail with one less
                moved = MAIN | counts.tick | (hits(tick) - 1)
            self.place(txn, key, bytes(meta[: entry.HEADER_BYTES]), moved)
        return evict_first(self, txn, counts)  # an empty index (entries without one), or the guard
