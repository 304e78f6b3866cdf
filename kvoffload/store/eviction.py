"""Which entry a full memory tier evicts: LRU, or S3-FIFO, which a one-off scan cannot flush.

LRU lets every new key push out the least recently used one, so a long prompt read once (a document)
evicts a working set that is hit again and again (a shared system prompt, an agent's context). S3-FIFO
(Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023) admits new keys to a small
FIFO (10% of the capacity, in bytes here); a key hit while there moves on to the main FIFO when it
reaches the small queue's end, the others leave, remembered in a ghost FIFO of keys only. A key found in
the ghost goes straight to main. Main is a CLOCK: a 2-bit hit counter per entry, an entry at the end
with hits left goes back to the front with one less.

A policy orders keys only; the arena (memory.py) owns the values and calls it under its own lock:
`insert` when a value is indexed, `touch` on a hit, `victim` for the next entry to evict (with a test of
whether it may go: a held slot may not), `remove` when a key leaves (evicted, deleted, replaced); the
`_many` forms and `victims` serve batches of small pages in bulk (S3-FIFO's `victims` declines). LRU
keeps its order in the caller's own dict of the keys (its insertion order), so most of these are free.
Every call is O(1), `victim` amortised: a counter is spent once per hit."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence

from .errors import StoreConfigError

POLICIES = ("lru", "s3fifo")


def policy_name(name: str, option: str) -> str:
    """`name` if it names a policy, else a StoreConfigError naming `option` and the choices. The one check
    of every eviction option (`evict=`, `lmdb_evict=`): the store constructors call it, being public API,
    and so does the URL parser (url_config.py), which must refuse a bad URL when it is parsed -- vLLM's
    scheduler and the connector config only parse -- and before any tier of it opens."""
    if name not in POLICIES:
        raise StoreConfigError(f"{option} takes {' or '.join(POLICIES)}, got {str(name)[:40]!r}")
    return name


class LRU:
    """Least recently used first, kept in the insertion order of the caller's own dict (`keys`: the
    arena's index): the caller adds a key at the end (a replaced value: deleted first) and deletes keys
    itself, victims too; a hit moves its key to the end. No structure of its own: a batch of small pages
    pays no second insert and delete per page."""

    def __init__(self, capacity: int, keys: dict):
        self._order = keys  # oldest first

    def insert(self, key: bytes, nbytes: int) -> None:
        pass  # the caller's dict has it at the end

    def touch(self, key: bytes) -> None:
        self._order[key] = self._order.pop(key)

    def insert_many(self, keys: Sequence[bytes], sizes: Sequence[int]) -> None:
        pass

    def touch_many(self, keys: Sequence[bytes]) -> None:
        order = self._order
        order.update(zip(keys, map(order.pop, keys)))

    def victims(self, count: int, may_go: Callable[[list[bytes]], bool]) -> list[bytes] | None:
        """The next `count` victims at once, if `may_go` says all of them may go (then they are the keys
        `count` calls of `victim` would give; they leave the order as the caller deletes them); else None."""
        keys = list(itertools.islice(self._order, count))
        return keys if len(keys) == count and may_go(keys) else None

    def remove(self, key: bytes) -> None:
        pass  # the caller deleted it

    def victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        """The least recently used evictable key (the caller deletes it); None if none may go. A key that
        may not go counts as in use: it moves to the recent end, so a long run of held entries (values
        waiting for the write-behind) is stepped over once, not on every eviction."""
        order, held, found = self._order, [], None
        for key in order:
            if evictable(key):
                found = key
                break
            held.append(key)
        for key in held:
            order[key] = order.pop(key)
        return found

    def clear(self) -> None:
        pass  # the caller clears its dict


class S3FIFO:
    """Small FIFO (new keys), main FIFO with CLOCK reinsertion, ghost FIFO of keys evicted from small."""

    SMALL_SHARE = 10  # the small queue's target: capacity / SMALL_SHARE
    MAX_FREQ = 3  # a 2-bit counter

    def __init__(self, capacity: int):
        self._small_target = max(1, capacity // self.SMALL_SHARE)
        self._ghost_limit = max(1, capacity - self._small_target)  # as many bytes as main may hold
        self._small: OrderedDict[bytes, int] = OrderedDict()  # key -> bytes, oldest first
        self._main: OrderedDict[bytes, int] = OrderedDict()
        self._ghost: OrderedDict[bytes, int] = OrderedDict()
        self._freq: dict[bytes, int] = {}  # every key in small or main
        self._small_bytes = self._ghost_bytes = 0

    def insert(self, key: bytes, nbytes: int) -> None:
        self.remove(key)
        self._freq[key] = 0
        if key in self._ghost:  # evicted from small not long ago, wanted again: it is reused
            self._ghost_bytes -= self._ghost.pop(key)
            self._main[key] = nbytes
        else:
            self._small[key] = nbytes
            self._small_bytes += nbytes

    def touch(self, key: bytes) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)

    def insert_many(self, keys: Sequence[bytes], sizes: Sequence[int]) -> None:
        for key, nbytes in zip(keys, sizes):
            self.insert(key, nbytes)

    def touch_many(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.touch(key)

    def victims(self, count: int, may_go: Callable[[list[bytes]], bool]) -> None:
        """No batch of victims: which key goes depends on the hits met on the way (`victim`)."""
        return None

    def remove(self, key: bytes) -> None:
        if self._freq.pop(key, None) is None:
            return
        if key in self._small:
            self._small_bytes -= self._small.pop(key)
        else:
            del self._main[key]

    def victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        """From small while it holds its share (or main is empty), else from main; the other queue if
        that one has nothing that may go. None: nothing may go."""
        first_small = self._small_bytes >= self._small_target or not self._main
        for take in (self._from_small, self._from_main) if first_small else (self._from_main, self._from_small):
            key = take(evictable)
            if key is not None:
                return key
        return None

    def _from_small(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        for _ in range(len(self._small)):
            key, nbytes = self._small.popitem(last=False)
            self._small_bytes -= nbytes
            if self._freq[key]:  # hit while in small: promoted, its hits kept for main's clock
                self._main[key] = nbytes
            elif not evictable(key):  # held: in use, another round in small
                self._small[key] = nbytes
                self._small_bytes += nbytes
            else:
                del self._freq[key]
                self._ghost[key] = nbytes
                self._ghost_bytes += nbytes
                while self._ghost_bytes > self._ghost_limit:
                    self._ghost_bytes -= self._ghost.popitem(last=False)[1]
                return key
        return None

    def _from_main(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        # Each round spends a hit or steps over a held key: after MAX_FREQ + 1 rounds every evictable
        # key has reached zero.
        for _ in range((self.MAX_FREQ + 1) * len(self._main) + 1):
            if not self._main:
                return None
            key = next(iter(self._main))
            if not evictable(key):
                self._main.move_to_end(key)
            elif self._freq[key]:
                self._freq[key] -= 1
                self._main.move_to_end(key)
            else:
                del self._main[key], self._freq[key]
                return key
        return None

    def clear(self) -> None:
        for table in (self._small, self._main, self._ghost, self._freq):
            table.clear()
        self._small_bytes = self._ghost_bytes = 0


def make_policy(name: str, capacity: int, keys: dict) -> LRU | S3FIFO:
    """The policy `name` (one of POLICIES) for a cache of `capacity` bytes whose keys are those of `keys`
    (the caller's dict: LRU keeps its recency order in it)."""
    return LRU(capacity, keys) if name == "lru" else S3FIFO(capacity)
