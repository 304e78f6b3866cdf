"""S3-FIFO on the LMDB tier (`lmdb://...?evict=s3fifo`), in the records LRU already has: no new record,
no longer record, so the capacity charge and the map's headroom are LRU's.

The LRU tick (the `lru` index key's big-endian u64 prefix, the meta record's little-endian u64) becomes
a position: the top bit is the queue (0 small, 1 main), the two low bits the hit count (0..3), the bits
between a counter that every insert and every move advances by STEP. Ordered by the index, the small
queue comes first, oldest first, then the main queue: each queue's head is its first index record. A hit
raises the count in place (same counter: the FIFO position is kept); a move to a queue's tail takes the
next counter. The algorithm is the memory tier's (eviction.py, S3FIFO): new keys enter small (10% of the
capacity, in charged bytes, counted in the `info` db as small_bytes); small's head leaves unless it was
hit, then it moves to main's tail with its hits; main's head with hits goes back to main's tail with one
less, otherwise it leaves. The ghost of keys evicted from small is this process's (`Ghost`): it is not
persistent and not shared, so after a restart, or in another process, a returning key enters small again."""

from __future__ import annotations

from collections import OrderedDict

from .eviction import S3FIFO

MAIN = 1 << 63  # the queue bit
STEP = 4  # the counter's unit, above the hit count
MAX_FREQ = S3FIFO.MAX_FREQ  # the hit count's mask (two bits)
COUNTER = (MAIN - 1) & ~MAX_FREQ  # the counter's bits
SMALL_SHARE = S3FIFO.SMALL_SHARE
GHOST_KEYS = 1 << 16  # at most this many keys remembered (the ghost lives in the process's memory)


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

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def clear(self) -> None:
        self._keys.clear()
        self._bytes = 0
