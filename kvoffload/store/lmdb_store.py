"""Disk tier on LMDB: persistent across restarts, crash-safe commits, checksummed entries, a hard
byte capacity enforced by eviction (LRU, or S3-FIFO), many reader processes beside one writer at a time.
This module is the store itself -- its write path (batches, room in the map), its reads, its hits --
composed of the parts that have a module each:
  lmdb_files.py     the directory's hygiene and the open protocol (map size, damage and reset, format);
  lmdb_counters.py  accounting: an entry's charge, the checked counters and their rebuild;
  lmdb_policy.py    the eviction policy interface, the records both policies share, the deferred hits;
  lmdb_lru.py, lmdb_s3fifo.py  the two policies, each whole.

Layout of the environment (four named databases, all updated in one transaction per batch):
  data: key -> payload            meta: key -> header (entry.py) + tick (u64)
  lru:  tick (big-endian u64) + key -> b"" (the eviction order)
  info: format_version, tick, bytes_used, capacity, evict (the policy), small_bytes (S3-FIFO)
The payload and its header live in separate records, so a page is copied into the map once.

Capacity is charged per entry as the disk space it takes (payload and header rounded up to LMDB pages,
plus its index records), computed from the stored record itself, never from an unverified header. An
entry may take at most a quarter of the capacity, and a batch is committed in transactions of at most
that many bytes: LMDB cannot reuse pages freed in the same transaction, and the map's headroom above the
capacity is what such a transaction writes while its evictions are still pinned. The counters (bytes
used, entries, S3-FIFO's small queue, the tick) carry their own checks and are rebuilt from the entries
when they fail (lmdb_counters.py).

When freed pages are reused (measured: py-lmdb 3.0.0, LMDB 0.9.36, 8 MiB map, 3 MiB values): pages that
write transaction N frees are reusable from N+2 on -- a put right after the delete that made its room
fails with MapFullError, the same put after one more committed write succeeds. A write transaction that
changes nothing commits nothing (the id stays); rewriting a record, even with the same bytes, counts. A
reader whose snapshot predates the free pins the pages until it ends. Every write takes its single pages
(B-tree copies) from the lowest free pages, so a second write in between can cut the run a large value
needed (two writes between delete and put failed where one succeeded); a value in overflow pages needs
one run of free pages, or the map's unused tail. So a put that finds no room (`_make_room`) evicts in
policy order the cap's byte minimum, commits, commits one write more, and retries at once; while no
run is long enough, each round evicts one victim more. Only committed evictions are counted; hits read
before a transaction that aborted are applied by the next.

A watched store (`watch_evictions`) reports the keys a write evicted once its transaction committed,
less those the same batch wrote again.

Locks, always taken in this order (none is held while waiting for an earlier one):
  1. `open.lock` (flock, exclusive): only while opening -- the damage checks, a reset, the map size;
  2. `users.lock` (flock, shared while the store is open): a process alone may resize or reset;
     (both lmdb_files.py's)
  3. `_write_lock` (this process's writers) -> LMDB's writer lock (other processes' writers); the
     policy (lmdb_policy.py) runs under it and has no lock of its own;
  4. the hits' lock (`Touches`, lmdb_policy.py), `_counter_lock` (base.py): leaves, held for a few
     dictionary operations.
Readers take none of 1-3: read transactions never wait for a writer.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence

import lmdb

from . import entry
from . import lmdb_counters as counters
from .base import Store
from .buffers import Buffer
from .eviction import policy_name
from .lmdb_counters import Counters, entry_charge
from .lmdb_files import (
    ENTRY_FRACTION,
    MIN_CAPACITY,
    capacity_for_map,
    map_size_for,
    open_files,
    prepare_directory,
    read_stats,
)
from .lmdb_policy import Touches
from .lmdb_reads import Readers, read_part

__all__ = [
    "LMDBStore",
    "MAX_KEY_BYTES",
    "MIN_CAPACITY",
    "capacity_for_map",
    "entry_charge",
    "map_size_for",
    "prepare_directory",
    "read_stats",
]

log = logging.getLogger(__name__)

MAX_KEY_BYTES = 500  # LMDB's key limit (511) less the LRU tick that prefixes a key in `lru`
_ROOM_ROUNDS = 64  # a chunk's tries for room in the map (`_make_room`) before it is dropped
_OWNER = b"owner:"  # info records: the key namespaces that use this directory (see Store.clear)


class LMDBStore(Store):
    max_key_bytes = MAX_KEY_BYTES

    def __init__(
        self,
        path: str,
        capacity: int,
        fingerprint: bytes | None = None,
        url: str | None = None,
        max_readers: int = 256,
        evict: str = "lru",
        readers: int | None = None,
    ):
        """`readers`: threads a large `read_many` is split over (default `READERS`; 1: the caller's only)."""
        super().__init__()
        self._readers = Readers(readers)
        # the one check, URLs' too (eviction.py); the file's own policy once open (lmdb_files.py)
        self.evict = policy_name(evict, "LMDB store: evict=")
        self._count(checksum_failures=0, read_errors=0, counters_rebuilt=0)
        self._env: lmdb.Environment | None = None
        self._users: int | None = None  # `users.lock`'s descriptor (lmdb_files.py)
        self.path = path
        self.configured_capacity = self.capacity = capacity
        self.url = url or f"lmdb://{path}?capacity={capacity}" + ("&evict=s3fifo" if evict == "s3fifo" else "")
        self.fingerprint = entry.normalize_fingerprint(fingerprint)
        self._write_lock = threading.Lock()
        self._touches = Touches()
        self._warned: set[str] = set()
        self._env, self._policy, self.capacity, self._users = open_files(
            path, capacity, evict, max_readers, self._count
        )
        self.evict = self._policy.name
        self._data, self._meta, self._lru, self._info = self._policy.dbs

    @property
    def _live_env(self) -> lmdb.Environment:
        """The open environment; using a closed store is the caller's bug, reported as such."""
        if self._env is None:
            raise RuntimeError(f"LMDB store {self.path} is closed")
        return self._env

    # -- accounting ---------------------------------------------------------------------------------
    @property
    def max_entry_bytes(self) -> int:
        return self.capacity // ENTRY_FRACTION

    def _read_counters(self, txn) -> Counters:
        """The counters; records that fail their check are rebuilt from the stored entries in `txn`."""
        counts, rebuilt = counters.load(txn, self._policy)
        if rebuilt:
            self._count(counters_rebuilt=len(rebuilt))
            log.warning("LMDB store %s: counters rebuilt from its entries: %s", self.path, counters.describe(rebuilt))
        return counts

    def _put_counters(self, txn, counts: Counters) -> None:
        counters.write(txn, self._policy, counts)

    def _committed(self, counts: Counters) -> None:
        self._touches.done()
        self._count(evictions=counts.evicted, evicted_bytes=counts.evicted_bytes)
        self._policy.committed(counts)

    # -- writes -------------------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        views = self._views(items)
        written = [False] * len(views)
        latest: dict[bytes, int] = {}  # key -> index of its value now in the store (this batch)
        evicted: list[bytes] | None = [] if self._on_evict is not None else None  # collected only if watched
        with self._write_lock:
            for chunk in self._chunks(views):
                self._put_chunk(views, chunk, written, latest, evicted)
        ok = sum(written)
        self._count(
            puts=ok, put_bytes=sum(v.nbytes for (_, v), w in zip(views, written) if w), dropped_puts=len(views) - ok
        )
        if evicted:  # after the write lock: a listener may take other stores' locks
            self._report_evicted([key for key in dict.fromkeys(evicted) if key not in latest])
        return written

    def _chunks(self, views) -> list[list[int]]:
        """Consecutive runs charged at most `max_entry_bytes` (one write transaction each)."""
        chunks: list[list[int]] = []
        size = self.max_entry_bytes
        for i, (_, view) in enumerate(views):
            charge = self._policy.charge(view.nbytes)
            if size + charge > self.max_entry_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += charge
        return chunks

    def _put_chunk(
        self, views, chunk: list[int], written: list[bool], latest: dict[bytes, int], evicted: list[bytes] | None
    ) -> None:
        """One write transaction for `chunk`. When the map has no room for it, room is made in rounds
        (`_make_room`): the cap's byte minimum first, then more victims, one a round (from the eighth
        on, a quarter of those so far), until a run of free pages is long enough. `evicted` (when not
        None) gets the keys committed transactions evicted."""
        extra = total = 0  # victims beyond the byte minimum: in the next round, and so far
        for _ in range(_ROOM_ROUNDS):
            events: list = []
            victims: list[bytes] = []
            try:
                with self._live_env.begin(write=True, buffers=True) as txn:
                    counts = self._write_chunk(txn, views, chunk, events, victims)
            except lmdb.MapFullError:
                self._touches.give_back()
                events = []
                made = self._make_room(views, chunk, extra, events)
                self._replay(views, events, written, latest)
                if evicted is not None:
                    evicted += events  # that transaction's events are all evictions
                if not made:
                    break
                total += extra
                extra = max(1, total // 4)
                continue
            except (lmdb.Error, OSError) as exc:  # a failed write is a dropped write, never a crash
                self._touches.give_back()
                self._warn_once("write", "LMDB store %s: write failed: %s", self.path, exc)
                break
            self._committed(counts)
            self._replay(views, events, written, latest)
            if evicted is not None:
                evicted += victims
            return
        self._warn_once(
            "dropped",
            "LMDB store %s: %d entries dropped: no room in the map after evicting (counted in dropped_puts)",
            self.path,
            len(chunk),
        )

    def _write_chunk(self, txn, views, chunk: list[int], events: list, victims: list[bytes]) -> Counters:
        counts = self._read_counters(txn)
        self._apply_touches(txn, counts)
        for i in chunk:
            key, view = views[i]
            if self._policy.remove(txn, key, counts) is not None:
                events.append(key)
            need = self._policy.charge(view.nbytes)
            while counts.used + need > self.capacity:
                victim = self._policy.evict_next(txn, counts)
                if victim is None:  # nothing left to evict: the count had drifted
                    counts.used = counts.small = 0
                    break
                events.append(victim)
                victims.append(victim)
            tick = self._policy.insert(counts, key, need)
            txn.put(key, view, db=self._data)
            self._policy.place(txn, key, entry.encode_header(self.fingerprint, view), tick)
            counts.used += need
            counts.entries += 1
            events.append(i)
        self._put_counters(txn, counts)
        return counts

    def _make_room(self, views, chunk: list[int], extra: int, events: list) -> str | None:
        """After `chunk` found no room in the map: evict, in policy order and in a transaction of its
        own, what the cap needs for it (less what its overwrites free) and `extra` victims more, for a
        run of free pages long enough; then commit once more, so that the next transaction may reuse
        the pages those evictions freed (see the module docstring). "evicted", "settled" (nothing to
        evict: the commit alone releases pages freed just before), or None (nothing left to free)."""
        try:
            with self._live_env.begin(write=True, buffers=True) as txn:
                counts = self._read_counters(txn)
                self._apply_touches(txn, counts)  # the order as read so far
                need = sum(self._policy.charge(views[i][1].nbytes) for i in chunk)
                overwritten = {
                    key: self._policy.charge(len(payload))
                    for key in (views[i][0] for i in chunk)
                    if (payload := txn.get(key, db=self._data)) is not None
                }
                while True:
                    short = counts.used + need - sum(overwritten.values()) > self.capacity
                    if not short and extra <= 0:
                        break
                    victim = self._policy.evict_next(txn, counts)
                    if victim is None:
                        break
                    events.append(victim)
                    overwritten.pop(victim, None)
                    extra -= not short
                self._put_counters(txn, counts)
        except lmdb.Error as exc:
            self._touches.give_back()
            self._warn_once("evict", "LMDB store %s: cannot evict: %s", self.path, exc)
            return None
        self._committed(counts)
        if not events:
            return "settled" if extra <= 0 else None
        try:
            with self._live_env.begin(write=True, buffers=True) as txn:  # the write that frees them for reuse
                self._put_counters(txn, self._read_counters(txn))
        except lmdb.Error as exc:
            self._warn_once("evict", "LMDB store %s: cannot evict: %s", self.path, exc)
            return None
        return "evicted"

    @staticmethod
    def _replay(views, events: list, written: list[bool], latest: dict[bytes, int]) -> None:
        """Apply a committed transaction's events in order -- an index written, a key removed (evicted
        or overwritten) -- so an entry this batch wrote and then lost reports False."""
        for event in events:
            if isinstance(event, int):
                written[event] = True
                latest[views[event][0]] = event
            elif event in latest:
                written[latest.pop(event)] = False

    def _warn_once(self, what: str, message: str, *args) -> None:
        (log.debug if what in self._warned else log.warning)(message, *args)
        self._warned.add(what)

    # -- recency and hits ---------------------------------------------------------------------------
    def _apply_touches(self, txn, counts: Counters) -> None:
        """Reads stay read-only transactions; a write applies their hits (the policy's `hit`: LRU, the
        touched keys become the most recent, in the order they were read; S3-FIFO, their hit counts rise)."""
        self._policy.apply_hits(txn, self._touches.take(), counts)

    def flush(self, wait: bool = True) -> None:
        """Persist pending hits (done by every write, by `close`, and every few thousand reads; a
        reader does not wait for a writer: `wait=False` leaves the touches to that writer)."""
        if not self._touches or not self._write_lock.acquire(blocking=wait):
            return
        try:
            with self._live_env.begin(write=True, buffers=True) as txn:
                counts = self._read_counters(txn)
                self._apply_touches(txn, counts)
                self._put_counters(txn, counts)
        finally:
            self._touches.done()  # recency is advisory: a failed flush loses its touches
            self._write_lock.release()

    def _persist_touches(self, wait: bool) -> None:
        try:
            self.flush(wait)
        except (lmdb.Error, OSError) as exc:  # recency is advisory: losing it must not fail a read
            self._warn_once("touch", "LMDB store %s: could not persist LRU order: %s", self.path, exc)

    # -- reads --------------------------------------------------------------------------------------
    def read_many(self, keys: Sequence[bytes], consume: Callable[[int, memoryview], None]) -> list[bool]:
        """Verified values, each handed to `consume` zero-copy from the map. A read of many bytes is split
        over `readers` threads, each in its own read transaction, checksumming and consuming its part:
        `consume` may then run on several threads at once (for distinct indices)."""
        env = self._live_env
        results = self._readers.run(
            self._readers.split(env, self._meta, keys),
            lambda part: read_part(env, self._meta, self._data, self.fingerprint, keys, part, consume),
        )
        served = [False] * len(keys)
        bad: dict[bytes, str] = {}
        nbytes = errors = 0
        for indices, part_bad, part_bytes, error in results:
            for i in indices:
                served[i] = True
            bad.update(part_bad)
            nbytes += part_bytes
            if error is not None:  # a damaged tree, a full reader table: what was not served is a miss
                errors += 1
                self._warn_once("read", "LMDB store %s: read failed: %s", self.path, error)
        if errors:
            self._count(read_errors=errors)
        hits = sum(served)
        self._count(hits=hits, misses=len(keys) - hits, get_bytes=nbytes)
        if hits:
            self._touches.add([k for k, ok in zip(keys, served) if ok])
            if len(self._touches) >= 4096:  # a read-only process persists recency in batches
                self._persist_touches(wait=False)
        if bad:
            self._drop_bad(bad)
        return served

    def advise(self, keys: Sequence[bytes]) -> None:
        """Read `keys`' values into the page cache in the background, in order (`Readers.ahead`)."""
        if keys:
            self._readers.ahead(self._live_env, self._data, keys)

    def _drop_bad(self, bad: dict[bytes, str]) -> None:
        """Entries that failed verification are deleted (another layout's entries are left alone)."""
        for problem in bad.values():
            self._count(**{problem: 1})
            log.warning("LMDB store %s: entry failed verification (%s); treated as a miss", self.path, problem)
        doomed = [k for k, p in bad.items() if p != "fingerprint_mismatch"]
        if doomed:
            self._delete(doomed)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        try:
            with self._live_env.begin(buffers=True) as txn:
                return [txn.get(k, db=self._meta) is not None for k in keys]
        except lmdb.Error as exc:
            self._warn_once("read", "LMDB store %s: lookup failed: %s", self.path, exc)
            self._count(read_errors=1)
            return [False] * len(keys)

    def delete(self, key: bytes) -> bool:
        return self._delete([key]) > 0

    def _delete(self, keys: Sequence[bytes]) -> int:
        try:
            with self._write_lock, self._live_env.begin(write=True, buffers=True) as txn:
                counts = self._read_counters(txn)
                removed = [self._policy.remove(txn, k, counts) for k in keys]
                self._put_counters(txn, counts)
        except lmdb.Error as exc:
            self._warn_once("delete", "LMDB store %s: delete failed: %s", self.path, exc)
            return 0
        return sum(r is not None for r in removed)

    def claim(self, owner: str) -> None:
        """Recorded in the file: every process and later run sees who uses this directory."""
        try:
            with self._write_lock, self._live_env.begin(write=True) as txn:
                txn.put(_OWNER + owner.encode(), b"", db=self._info)
        except lmdb.Error as exc:
            self._warn_once("claim", "LMDB store %s: cannot record namespace %r: %s", self.path, owner, exc)

    def clear(self, owner: str) -> bool:
        """Every entry, in one transaction (readers keep their snapshot), if no other namespace ever
        claimed this directory; the byte accounting restarts at zero."""
        try:
            with self._write_lock, self._live_env.begin(write=True, buffers=True) as txn:
                cursor = txn.cursor(db=self._info)
                owners = set()
                if cursor.set_range(_OWNER):
                    for key in cursor.iternext(values=False):
                        if not bytes(key).startswith(_OWNER):
                            break
                        owners.add(bytes(key)[len(_OWNER) :].decode(errors="replace"))
                others = owners - {owner}
                if not others:
                    counts = self._read_counters(txn)
                    for db in (self._data, self._meta, self._lru):
                        txn.drop(db, delete=False)
                    counts.used = counts.small = counts.entries = 0
                    self._put_counters(txn, counts)
        except lmdb.Error as exc:
            log.warning("LMDB store %s: clear failed: %s", self.path, exc)
            return False
        if others:
            log.warning(
                "LMDB store %s: not cleared: namespace(s) %s use it too (give each deployment its own "
                "directory, or delete this one)",
                self.path,
                sorted(others),
            )
            return False
        self._touches.clear()
        with self._write_lock:
            self._policy.clear()
        return True

    def _usage(self) -> dict[str, int]:
        try:
            with self._live_env.begin(buffers=True) as txn:  # a damaged record reads -1 (the next write rebuilds it)
                used, small, entries = (
                    counters.decode(name, txn.get(name, db=self._info))[0]
                    for name in (counters.USED, counters.SMALL, counters.ENTRIES)
                )
                entries = txn.stat(self._meta)["entries"] if entries is None else entries
        except lmdb.Error:
            entries = used = small = None
        used, small, entries = (-1 if v is None else v for v in (used, small, entries))
        usage = {
            "entries": entries,
            "bytes_used": used,
            "map_size": self._live_env.info()["map_size"],
            "configured_capacity": self.configured_capacity,
        }
        if self._policy.small_queue:
            usage["small_bytes"] = small  # S3-FIFO's small queue (the rest is main)
        return usage

    def close(self) -> None:
        self._readers.close()  # no reader may be inside the environment when it closes
        if self._env is not None:
            self._persist_touches(wait=True)
            self._env.close()
            self._env = None
        if self._users is not None:
            os.close(self._users)
            self._users = None
