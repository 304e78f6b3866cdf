"""LRU on the LMDB tier (`lmdb://...?evict=lru`, the default, and the policy of a store written before
there was a choice): the tick is a counter, every insert and every hit takes the next one, and the
`lru` index's first record is the least recently used entry. The policy interface and the records it
shares with S3-FIFO are lmdb_policy.py's; no lock of its own (it runs under the store's write lock).
"""

from __future__ import annotations

from .lmdb_counters import Counters
from .lmdb_policy import INDEX, Policy, index_tick


class LRUPolicy(Policy):
    name = "lru"

    def insert(self, counts: Counters, key: bytes, charge: int) -> int:
        counts.tick += 1
        return counts.tick

    def hit(self, counts: Counters, tick: int, times: int) -> int:
        """The most recent: touched keys end in the order they were read."""
        counts.tick += 1
        return counts.tick

    def evict_next(self, txn, counts: Counters) -> bytes | None:
        return evict_first(self, txn, counts)

    def newest(self, txn) -> int:
        cursor = txn.cursor(db=self.dbs.lru)
        tick = index_tick(cursor.key()) if cursor.last() else None
        return tick or 0


def evict_first(policy: Policy, txn, counts: Counters) -> bytes | None:
    """Remove the entry first in the index (LRU: the least recently used); an index record whose entry
    is gone is dropped on the way, and an entry without an index record goes too, after the rest (every
    policy's last resort)."""
    for db in (policy.dbs.lru, policy.dbs.data):
        cursor = txn.cursor(db=db)
        while cursor.first():
            key = bytes(cursor.key())
            if db is policy.dbs.lru:
                cursor.delete()
                key = key[INDEX.size :]
            if policy.evict(txn, key, counts) is not None:
                return key
    return None
