"""The LMDB tier's accounting: what an entry is charged against the capacity, and the counters -- `info`
records that each carry their own check -- with their rebuild from the entries themselves. Kept apart
from the store so that the one rule for a charge and the one recount serve the open (lmdb_files.py),
every write transaction (lmdb_store.py) and the policies' own bookkeeping (lmdb_policy.py). No lock
here: the store reads and writes the counters inside its write transactions, under its write lock.

Records: tick (LRU's clock, S3-FIFO's position counter), bytes_used (the entries' charges), entries (the
number of `meta` records) and, under S3-FIFO, small_bytes (the small queue's charges). Each is its u64
value (big-endian, as before there were checks) and an xxh3-64 over its name and value: a flipped bit,
a torn or stray write, another record's bytes under this name all fail it. A record of the format
before checks (the bare 8-byte value) is unchecked.

At open every record is checked, and against what the entries give cheaply: the entry count is LMDB's
own count of `meta`; bytes_used is page-rounded, at least a page per entry and at most the largest
charge per entry; small_bytes is part of bytes_used; the tick is not behind the newest index position.
When a record fails, one pass over the entries recounts them all (BENCHMARKS.md, "LMDB counter
rebuild") and the records that failed or disagree with that count are rewritten (a sound tick is kept
where it is ahead of the newest entry): `counters_rebuilt` in stats(). A write transaction checks the
records it reads (the check only) and recounts in that transaction if one fails.

What a policy tells the counters (`policy` below, lmdb_policy.py): its databases (`dbs`), the page size
(`psize`), whether it keeps a small queue (`small_queue`: the small_bytes record), the newest position
in its index (`newest`) and the small queue's charges (`small_bytes`)."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, NamedTuple

import xxhash

if TYPE_CHECKING:
    from lmdb import _Database as Database  # py-lmdb's stubs give the database handle's type a private name

INDEX_BYTES = 512  # an entry's records in the three B-trees (charged, with the payload's pages)
_U64 = struct.Struct(">Q")
_CHECK_BYTES = 8
RECORD_BYTES = _U64.size + _CHECK_BYTES
TICK, USED, SMALL, ENTRIES = b"tick", b"bytes_used", b"small_bytes", b"entries"


def entry_charge(nbytes: int, psize: int = 4096) -> int:
    """Disk space an entry takes, charged against the capacity: its payload in overflow pages (one
    16-byte page header), plus its index records."""
    return -(-(nbytes + 16) // psize) * psize + INDEX_BYTES


def encode(name: bytes, value: int) -> bytes:
    packed = _U64.pack(value)
    return packed + xxhash.xxh3_64_digest(name + packed)


def decode(name: bytes, raw) -> tuple[int | None, str | None]:
    """(value, None), or (None, why not): missing, unchecked (the format before checks), failing its check."""
    if raw is None:
        return None, "missing"
    raw = bytes(raw)
    if len(raw) == _U64.size:
        return None, "unchecked"
    if len(raw) != RECORD_BYTES or xxhash.xxh3_64_digest(name + raw[: _U64.size]) != raw[_U64.size :]:
        return None, "failed its check"
    return _U64.unpack(raw[: _U64.size])[0], None


def decode_value(name: bytes, raw) -> int | None:
    """The value of a sound record, or of an unchecked one (what a read-only look at a store shows)."""
    value, why = decode(name, raw)
    return _U64.unpack(bytes(raw))[0] if why == "unchecked" else value


class Counters:
    """The counters a write transaction reads first and writes last, and the evictions it made (counted
    in stats() only once it committed; `ghosted`: the (key, bytes) S3-FIFO evicted from its small
    queue, for its ghost once committed)."""

    __slots__ = ("tick", "used", "small", "entries", "evicted", "evicted_bytes", "ghosted")

    def __init__(self, tick: int = 0, used: int = 0, small: int = 0, entries: int = 0):
        self.tick, self.used, self.small, self.entries = tick, used, small, entries
        self.evicted = self.evicted_bytes = 0
        self.ghosted: list[tuple[bytes, int]] = []

    def records(self, small_queue: bool) -> dict[bytes, int]:
        used = max(self.used, 0)
        records = {TICK: self.tick, USED: used, ENTRIES: max(self.entries, 0)}
        if small_queue:
            records[SMALL] = min(max(self.small, 0), used)
        return records


class Databases(NamedTuple):
    data: Database
    meta: Database
    lru: Database
    info: Database


def write(txn, policy, counts: Counters) -> None:
    for name, value in counts.records(policy.small_queue).items():
        txn.put(name, encode(name, value), db=policy.dbs.info)


def describe(rebuilt: dict[bytes, str]) -> str:
    """The rebuilt records, for a log line."""
    return ", ".join(f"{n.decode()} ({why})" for n, why in rebuilt.items())


def load(txn, policy, max_entry_bytes: int | None = None, force: bool = False) -> tuple[Counters, dict[bytes, str]]:
    """The counters, and the records rebuilt from the entries (name -> why). `max_entry_bytes` (at
    open) adds the invariants to the checks; `force` recounts whatever the records say."""
    dbs = policy.dbs
    names = (TICK, USED, ENTRIES, SMALL) if policy.small_queue else (TICK, USED, ENTRIES)
    stored: dict[bytes, int] = {}  # the sound records
    bad: dict[bytes, str] = {}  # the others: name -> why
    for name in names:
        value, why = decode(name, txn.get(name, db=dbs.info))
        if why is not None:
            bad[name] = why
        elif value is not None:
            stored[name] = value
    if (
        bad
        and set(bad.values()) == {"missing"}
        and not txn.stat(dbs.meta)["entries"]
        and not txn.stat(dbs.data)["entries"]
    ):
        counts = Counters(
            **{
                k: stored.get(n) or 0
                for k, n in (("tick", TICK), ("used", USED), ("small", SMALL), ("entries", ENTRIES))
            }
        )
        write(txn, policy, counts)  # a new store: nothing to rebuild
        return counts, {}
    if not bad and max_entry_bytes is not None:
        bad = _implausible(txn, policy, stored, max_entry_bytes)
    if not bad and not force:
        return Counters(stored[TICK], stored[USED], stored.get(SMALL, 0), stored[ENTRIES]), {}
    true = recount(txn, policy)
    found = true.records(policy.small_queue)
    if TICK not in bad and not force:
        found[TICK] = max(found[TICK], stored[TICK])  # a sound tick may be ahead of every entry's
    rebuilt = {
        name: bad.get(name, "disagreed with the entries")
        for name in names
        if name in bad or stored[name] != found[name]
    }
    counts = Counters(found[TICK], found[USED], found.get(SMALL, 0), found[ENTRIES])
    write(txn, policy, counts)
    return counts, rebuilt


def _implausible(txn, policy, stored: dict[bytes, int], max_entry_bytes: int) -> dict[bytes, str]:
    """The records (name -> why) that sound records cannot be, judged cheaply from the entries."""
    bad, psize = {}, policy.psize
    entries, used = stored[ENTRIES], stored[USED]
    if entries != txn.stat(policy.dbs.meta)["entries"]:
        bad[ENTRIES] = "disagreed with LMDB's count"
    pages = used - entries * INDEX_BYTES
    if pages % psize or pages < entries * psize or used > entries * entry_charge(max_entry_bytes, psize):
        bad[USED] = f"impossible for {entries} entries"
    if policy.small_queue and stored[SMALL] > used:
        bad[SMALL] = "more than bytes_used"
    if stored[TICK] < policy.newest(txn):
        bad[TICK] = "behind the newest entry"
    return bad


def recount(txn, policy) -> Counters:
    """Every counter from the entries: their payloads' charges, their `meta` records, their index."""
    dbs = policy.dbs
    counts = Counters(policy.newest(txn))
    counts.used = sum(entry_charge(len(value), policy.psize) for _, value in txn.cursor(db=dbs.data))
    counts.entries = sum(1 for _ in txn.cursor(db=dbs.meta).iternext(values=False))
    if policy.small_queue:
        counts.small = policy.small_bytes(txn)
    return counts
