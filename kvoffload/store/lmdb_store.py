"""Disk tier on LMDB: persistent across restarts, crash-safe commits, checksummed entries, a hard
byte capacity enforced by eviction (LRU, or S3-FIFO), many reader processes beside one writer at a time.

Layout of the environment (four named databases, all updated in one transaction per batch):
  data: key -> payload            meta: key -> header (entry.py) + tick (u64)
  lru:  tick (big-endian u64) + key -> b"" (the eviction order)
  info: format_version, tick, bytes_used, capacity, evict (the policy), small_bytes (S3-FIFO)
The payload and its header live in separate records, so a page is copied into the map once.

Eviction takes the `lru` index's order. LRU: the tick is a counter, a hit moves the key to the end.
S3-FIFO (lmdb_s3fifo.py): the tick is a queue, a place in it and a hit count, so the records are
LRU's, sized alike; a hit rewrites the count in place, a move (to main, or back to main's tail)
rewrites the entry's `meta` and `lru` records and never a payload page: one transaction copies at most
every B-tree page of `meta` and `lru` once, as a batch of LRU hits can, so the map's headroom below
holds for both. The policy is written into `info` at creation: a store with entries keeps its own (no
record: LRU) whatever is asked, with a warning; an empty store opened alone takes the one asked for.

The map is sized once, at open, from the capacity (`map_size_for`), and its whole file range -- and the
lock file's -- is allocated on disk (`posix_fallocate`) before LMDB may touch it: a full disk can never
turn a write or a read into a SIGBUS, and no map ever grows at run time, so there is no resize protocol
between processes. Why `writemap=True`: writes at raw-disk speed (see BENCHMARKS.md), paired with full
syncing (never NOSYNC). Under `writemap` LMDB sets the file to the map size on open, so a process that
finds the store open elsewhere adopts the file's size and only a process alone may change it.

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
  3. `_write_lock` (this process's writers) -> LMDB's writer lock (other processes' writers);
  4. `_touch_lock`, `_counter_lock`: leaves, held for a few dictionary operations.
Readers take none of 1-3: read transactions never wait for a writer.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import lmdb

from ..flock import flock_within
from . import entry, lmdb_counters as counters, lmdb_s3fifo as s3
from .base import Store
from .buffers import Buffer
from .errors import IncompatibleStoreError, StoreConfigError
from .eviction import POLICIES
from .lmdb_counters import Counters, entry_charge

log = logging.getLogger(__name__)

DATA_FILE, LOCK_FILE, OPEN_LOCK, USERS_LOCK = "data.mdb", "lock.mdb", "open.lock", "users.lock"
ACCOUNTING = b"pages-v2"  # how bytes_used is charged; a store counted otherwise is recounted at open
ENTRY_FRACTION = 4  # an entry (and one write transaction) takes at most capacity / ENTRY_FRACTION
MAX_KEY_BYTES = 500  # LMDB's key limit (511) less the LRU tick that prefixes a key in `lru`
_U64 = struct.Struct(">Q")
_TICK = struct.Struct("<Q")
_MAIN_KEY = _U64.pack(s3.MAIN)  # S3-FIFO: the main queue's index records sort from here on
_META_BYTES = entry.HEADER_BYTES + _TICK.size
_MAP_SLACK = 4 << 20  # meta pages, the free list, B-tree copies of a small store
_LOCK_BYTES = 64 << 10  # the reader table: 64-byte slots for max_readers, allocated up front
_OPEN_WAIT_SECONDS = 60.0
_ROOM_ROUNDS = 64  # a chunk's tries for room in the map (`_make_room`) before it is dropped
_DISK_RESERVE = 20  # never take the last 1/20 of a filesystem's space at open
_MIN_MAP = _MAP_SLACK + (1 << 20)
MIN_CAPACITY = 64 << 10
_OWNER = b"owner:"  # info records: the key namespaces that use this directory (see Store.clear)
# An open that finds these has a damaged file (not a permission or I/O problem): reset it.
_DAMAGE = (lmdb.CorruptedError, lmdb.InvalidError, lmdb.PageNotFoundError, lmdb.PanicError,
           lmdb.IncompatibleError, lmdb.BadValsizeError, lmdb.BadChecksumError, lmdb.ProblemError)


def map_size_for(capacity: int) -> int:
    """The data file's size for a capacity: the capacity, a transaction's worth of pages that its own
    evictions cannot yet free (1/4), B-tree copy-on-write (1/16), and a fixed slack."""
    return capacity + capacity // ENTRY_FRACTION + capacity // 16 + _MAP_SLACK


def capacity_for_map(map_size: int) -> int:
    """The largest capacity `map_size_for` fits in `map_size` (a map cut short by a full disk)."""
    return max(0, (map_size - _MAP_SLACK) * 16 // 21)


class _Damaged(Exception):
    """The data file cannot be used as it is (truncated, a damaged page, a foreign file)."""


def _mkdir_private(path: str) -> None:
    """Create `path` and every missing parent 0700, whatever the umask."""
    parent = os.path.dirname(path)
    if parent != path and not os.path.exists(parent):
        _mkdir_private(parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    os.chmod(path, 0o700)


def prepare_directory(path: str) -> None:
    """Create the store directory 0700 (or tighten an existing one); fail clearly if unusable."""
    if not os.path.isabs(path):
        raise StoreConfigError(f"LMDB store path must be absolute, got {path!r} (use lmdb:///abs/dir)")
    try:
        _mkdir_private(path)
    except NotADirectoryError:
        raise StoreConfigError(f"LMDB store path {path!r} has a file where a directory should be") from None
    except OSError as exc:
        raise StoreConfigError(f"cannot create LMDB store directory {path!r}: {exc.strerror}") from None
    if not os.path.isdir(path):
        raise StoreConfigError(f"LMDB store path {path!r} exists and is not a directory")
    _tighten(path, 0o700, "store directory")
    for name in (DATA_FILE, LOCK_FILE):
        file = os.path.join(path, name)
        try:
            info = os.lstat(file)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(info.st_mode):
            raise StoreConfigError(f"{file} is a symlink or not a regular file; an LMDB store keeps its own "
                                   "files (remove it or use another directory)")
        if not os.access(file, os.R_OK | os.W_OK):
            raise StoreConfigError(f"cannot read and write {file}: permission denied (fix its owner or mode)")
        _tighten(file, 0o600, "store file")
    probe = os.path.join(path, f".write-probe-{os.getpid()}")
    try:
        with open(probe, "wb"):
            pass
        os.unlink(probe)
    except OSError as exc:
        raise StoreConfigError(f"LMDB store directory {path!r} is not writable: {exc.strerror}") from None


def _tighten(path: str, mode: int, what: str) -> None:
    current = stat.S_IMODE(os.stat(path).st_mode)
    if current & 0o077:
        try:
            os.chmod(path, current & mode)
        except OSError as exc:
            raise StoreConfigError(f"{what} {path!r} is readable by others and cannot be made private: "
                                   f"{exc.strerror}") from None
        log.warning("tightened permissions of %s %s from %o to %o", what, path, current, current & mode)


def _allocate(path: str, nbytes: int) -> bool:
    """Reserve disk blocks for the first `nbytes` of a file; False if the disk is full."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return True
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return False
        raise
    finally:
        os.close(fd)


class LMDBStore(Store):
    max_key_bytes = MAX_KEY_BYTES

    def __init__(self, path: str, capacity: int, fingerprint: bytes | None = None,
                 url: str | None = None, max_readers: int = 256, evict: str = "lru"):
        super().__init__()
        if evict not in POLICIES:
            raise StoreConfigError(f"LMDB store: evict= takes {' or '.join(POLICIES)}, got {str(evict)[:40]!r}")
        self.evict = evict  # the file's own, once open (`_settle_policy`)
        self._count(checksum_failures=0, read_errors=0, counters_rebuilt=0)
        self._env = None
        self._users = None
        self.path = path
        self.configured_capacity = self.capacity = capacity
        self.url = url or f"lmdb://{path}?capacity={capacity}" + ("&evict=s3fifo" if evict == "s3fifo" else "")
        self.fingerprint = entry.normalize_fingerprint(fingerprint)
        self._max_readers = max_readers
        self._write_lock = threading.Lock()
        self._pending_touches: dict[bytes, int] = {}  # key -> hits since the last write, oldest first
        self._taken_touches: dict[bytes, int] = {}  # those a write transaction under way took
        self._touch_lock = threading.Lock()
        self._warned: set[str] = set()
        if capacity < MIN_CAPACITY:
            raise StoreConfigError(f"LMDB capacity {capacity} bytes is too small: at least {MIN_CAPACITY >> 10} KiB")
        prepare_directory(path)
        self._users = os.open(os.path.join(path, USERS_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with self._open_lock():
                alone = self._try_flock(fcntl.LOCK_EX)
                try:
                    self._open(alone)
                finally:
                    fcntl.flock(self._users, fcntl.LOCK_SH)  # held while open (downgrades EX)
        except BaseException:
            self.close()
            raise
        self._ghost = s3.Ghost(self.capacity)  # S3-FIFO: used under `_write_lock` only

    # -- opening ------------------------------------------------------------------------------------
    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @contextmanager
    def _open_lock(self):
        """Opens of one directory take turns (a bounded wait: a hung opener is an error, not a hang)."""
        fd = os.open(self._file(OPEN_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if not flock_within(fd, _OPEN_WAIT_SECONDS):
                raise StoreConfigError(f"LMDB store {self.path!r}: another process has been opening it "
                                       f"for over {_OPEN_WAIT_SECONDS:.0f} s")
            yield
        finally:
            os.close(fd)

    def _try_flock(self, mode: int) -> bool:
        try:
            fcntl.flock(self._users, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def _open(self, alone: bool) -> None:
        try:
            self._open_env(alone)
        except _Damaged as exc:
            if not alone:
                raise StoreConfigError(f"LMDB store {self.path!r} is damaged ({exc}) and other processes have it "
                                       "open: stop them and open it again (it is then reset), or use another "
                                       "directory") from None
            self._move_aside(str(exc))
            self._open_env(alone)

    def _open_env(self, alone: bool) -> None:
        data = self._file(DATA_FILE)
        size = os.path.getsize(data) if os.path.exists(data) else 0
        # Alone, the map follows the capacity (never below the file: LMDB cannot shrink it); otherwise
        # it is the file's size, which every other user has mapped.
        map_size = max(size, self._affordable(map_size_for(self.configured_capacity), size)) if alone or not size \
            else size
        if not _allocate(self._file(LOCK_FILE), _LOCK_BYTES):
            raise StoreConfigError(f"LMDB store {self.path!r}: the disk is full (cannot create its lock file)")
        try:
            env = lmdb.open(self.path, map_size=map_size, subdir=True, max_dbs=8, mode=0o600,
                            # readahead: values are large runs of overflow pages, read sequentially
                            writemap=True, sync=True, metasync=True, readahead=True,
                            max_readers=self._max_readers, lock=True)
        except lmdb.VersionMismatchError as exc:
            raise IncompatibleStoreError(f"{data} was written by an incompatible LMDB version: {exc}") from None
        except _DAMAGE as exc:
            raise _Damaged(str(exc)) from None
        except lmdb.Error as exc:
            raise StoreConfigError(f"cannot open LMDB store {self.path!r}: {exc}") from None
        self._env = env
        try:
            self._psize = env.stat()["psize"]
            info = env.info()
            committed = (info["last_pgno"] + 1) * self._psize
            if size and size < committed:  # cut short: reads past its end would kill the process
                raise _Damaged(f"{size} bytes on disk, {committed} committed")
            self._back_map(info["map_size"], max(committed, size), alone)
            self._data, self._meta, self._lru, self._info = (env.open_db(n) for n in (b"data", b"meta", b"lru", b"info"))
            self._dbs = counters.Databases(self._data, self._meta, self._lru, self._info)
            self._check_format(alone)
        except _DAMAGE as exc:
            self._close_env()
            raise _Damaged(str(exc)) from None
        except BaseException:
            self._close_env()
            raise

    def _affordable(self, target: int, size: int) -> int:
        """`target`, or less when the filesystem's free space (keeping a reserve) cannot back it."""
        fs = os.statvfs(self.path)
        room = fs.f_bavail * fs.f_frsize - fs.f_blocks * fs.f_frsize // _DISK_RESERVE
        if target - size <= room:
            return target
        cut = max(_MIN_MAP, size + max(room, 0)) >> 20 << 20
        self._disk_full(f"the filesystem has {max(room, 0) >> 20} MiB to spare for a {target >> 20} MiB map")
        return min(cut, target)

    def _back_map(self, map_size: int, floor: int, alone: bool) -> None:
        """Allocate the map's whole file range (halving the growth on ENOSPC); the capacity follows."""
        size = map_size
        while not _allocate(self._file(DATA_FILE), size):
            gap = (size - floor) // 2
            if not alone or size <= floor or gap < (1 << 20):
                raise StoreConfigError(f"LMDB store {self.path!r}: the disk is full (cannot reserve "
                                       f"{size >> 20} MiB for its data file)")
            size = floor + gap
        if size < map_size:
            self._disk_full(f"only {size >> 20} MiB of a {map_size >> 20} MiB map could be reserved")
            self._env.set_mapsize(size)
        self.capacity = min(self.configured_capacity, capacity_for_map(size))
        if self.capacity < self.configured_capacity:
            log.warning("LMDB store %s: capacity %d bytes instead of %d (the data file is %d bytes)", self.path,
                        self.capacity, self.configured_capacity, size)
        if self.capacity < MIN_CAPACITY:
            raise StoreConfigError(f"LMDB store {self.path!r}: the disk is full (room for {self.capacity} bytes of "
                                   "entries only)")

    def _disk_full(self, why: str) -> None:
        log.warning("LMDB store %s: disk full: %s; the store holds less", self.path, why)
        self._count(disk_full=1)

    def _check_format(self, alone: bool) -> None:
        """The format version (a damaged record is a damaged file), the eviction policy, the capacity
        record, and the counters (lmdb_counters.py): checked, and rebuilt from the entries where they
        fail, are implausible, or were counted under another policy or accounting."""
        with self._env.begin(write=True, buffers=True) as txn:
            stored = txn.get(b"format_version", db=self._info)
            if stored is None:
                if txn.stat(self._data)["entries"]:
                    raise _Damaged("entries without a format version")
                txn.put(b"format_version", _U64.pack(entry.FORMAT_VERSION), db=self._info)
                txn.put(b"accounting", ACCOUNTING, db=self._info)
            elif len(stored) != _U64.size:
                raise _Damaged("a damaged format version record")
            elif _U64.unpack(stored)[0] != entry.FORMAT_VERSION:
                version = _U64.unpack(stored)[0]
                raise IncompatibleStoreError(
                    f"LMDB store {self.path!r} has format version {version}; this kvoffload reads version "
                    f"{entry.FORMAT_VERSION}. Point the store at a new directory (or delete this one).")
            recount = not self._settle_policy(txn, alone) or txn.get(b"accounting", db=self._info) != ACCOUNTING
            started = time.perf_counter()
            _, rebuilt = counters.load(txn, self._dbs, self._s3fifo, self._psize, force=recount,
                                       max_entry_bytes=capacity_for_map(self._env.info()["map_size"]) // ENTRY_FRACTION)
            txn.put(b"accounting", ACCOUNTING, db=self._info)
            txn.put(b"capacity", _U64.pack(self.configured_capacity), db=self._info)
        self._count(counters_rebuilt=len(rebuilt))
        if rebuilt or recount:
            log.warning("LMDB store %s: counters rebuilt from its entries in %.3f s: %s", self.path,
                        time.perf_counter() - started,
                        ", ".join(f"{n.decode()} ({why})" for n, why in rebuilt.items()) or "none differed")

    def _settle_policy(self, txn, alone: bool) -> bool:
        """One policy per file (their index orders differ): a store with entries keeps the one it was
        written with (no record: LRU, written before there was a choice); the one asked for applies to
        an empty store opened alone. False when the record was damaged (the counters are recounted)."""
        record = txn.get(b"evict", db=self._info)
        found = "lru" if record is None else bytes(record).decode("ascii", "replace")
        empty = not txn.stat(self._lru)["entries"] and not txn.stat(self._data)["entries"]
        if found not in POLICIES:
            log.warning("LMDB store %s: damaged eviction policy record %r; using %s", self.path, found[:40],
                        self.evict)
        elif found != self.evict and not (empty and alone):
            log.warning("LMDB store %s: its entries are ordered for evict=%s, not %s: it keeps evicting by %s "
                        "(use another directory for another policy)", self.path, found, self.evict, found)
            self.evict = found
        if record is None or found != self.evict:
            txn.put(b"evict", self.evict.encode(), db=self._info)
        return found in POLICIES

    def _move_aside(self, reason: str) -> None:
        """Keep the damaged file for inspection (only the latest: each is as large as the map)."""
        data = self._file(DATA_FILE)
        for old in glob.glob(f"{glob.escape(data)}.damaged-*"):
            os.unlink(old)
        aside = f"{data}.damaged-{int(time.time())}"
        os.replace(data, aside)
        log.error("LMDB store %s is damaged (%s); moved it to %s and starting empty", self.path, reason, aside)
        self._count(damaged_files_reset=1)

    # -- accounting ---------------------------------------------------------------------------------
    def _charge(self, nbytes: int) -> int:
        return entry_charge(nbytes, self._psize)

    @property
    def max_entry_bytes(self) -> int:
        return self.capacity // ENTRY_FRACTION

    @property
    def _s3fifo(self) -> bool:
        return self.evict == "s3fifo"

    def _read_counters(self, txn) -> Counters:
        """The counters; records that fail their check are rebuilt from the stored entries in `txn`."""
        counts, rebuilt = counters.load(txn, self._dbs, self._s3fifo, self._psize)
        if rebuilt:
            self._count(counters_rebuilt=len(rebuilt))
            log.warning("LMDB store %s: counters rebuilt from its entries: %s", self.path,
                        ", ".join(f"{n.decode()} ({why})" for n, why in rebuilt.items()))
        return counts

    def _put_counters(self, txn, counts: Counters) -> None:
        counters.write(txn, self._dbs, counts, self._s3fifo)

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
        self._count(puts=ok, put_bytes=sum(v.nbytes for (_, v), w in zip(views, written) if w),
                    dropped_puts=len(views) - ok)
        if evicted:  # after the write lock: a listener may take other stores' locks
            self._report_evicted([key for key in dict.fromkeys(evicted) if key not in latest])
        return written

    def _chunks(self, views) -> list[list[int]]:
        """Consecutive runs charged at most `max_entry_bytes` (one write transaction each)."""
        chunks, size = [], self.max_entry_bytes
        for i, (_, view) in enumerate(views):
            charge = self._charge(view.nbytes)
            if size + charge > self.max_entry_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += charge
        return chunks

    def _put_chunk(self, views, chunk: list[int], written: list[bool], latest: dict[bytes, int],
                   evicted: list[bytes] | None) -> None:
        """One write transaction for `chunk`. When the map has no room for it, room is made in rounds
        (`_make_room`): the cap's byte minimum first, then more victims, one a round (from the eighth
        on, a quarter of those so far), until a run of free pages is long enough. `evicted` (when not
        None) gets the keys committed transactions evicted."""
        extra = total = 0  # victims beyond the byte minimum: in the next round, and so far
        for _ in range(_ROOM_ROUNDS):
            events: list = []
            victims: list[bytes] = []
            ghosted: list = []
            try:
                with self._env.begin(write=True, buffers=True) as txn:
                    counts = self._write_chunk(txn, views, chunk, events, victims, ghosted)
            except lmdb.MapFullError:
                self._give_back_touches()
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
                self._give_back_touches()
                self._warn_once("write", "LMDB store %s: write failed: %s", self.path, exc)
                break
            self._committed(counts, ghosted)
            self._replay(views, events, written, latest)
            if evicted is not None:
                evicted += victims
            return
        self._warn_once("dropped", "LMDB store %s: %d entries dropped: no room in the map after evicting (counted "
                        "in dropped_puts)", self.path, len(chunk))

    def _write_chunk(self, txn, views, chunk: list[int], events: list, victims: list[bytes],
                     ghosted: list) -> Counters:
        counts = self._read_counters(txn)
        counts.tick = self._apply_touches(txn, counts.tick)
        for i in chunk:
            key, view = views[i]
            if self._remove(txn, key, counts) is not None:
                events.append(key)
            need = self._charge(view.nbytes)
            while counts.used + need > self.capacity:
                victim = self._evict_next(txn, counts, ghosted)
                if victim is None:  # nothing left to evict: the count had drifted
                    counts.used = counts.small = 0
                    break
                events.append(victim)
                victims.append(victim)
            tick = self._insert_tick(counts, key, need)
            txn.put(key, view, db=self._data)
            txn.put(key, entry.encode_header(self.fingerprint, view) + _TICK.pack(tick), db=self._meta)
            txn.put(_U64.pack(tick) + key, b"", db=self._lru)
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
        ghosted: list = []
        try:
            with self._env.begin(write=True, buffers=True) as txn:
                counts = self._read_counters(txn)
                counts.tick = self._apply_touches(txn, counts.tick)  # the order as read so far
                need = sum(self._charge(views[i][1].nbytes) for i in chunk)
                overwritten = {key: self._charge(len(payload)) for key in (views[i][0] for i in chunk)
                               if (payload := txn.get(key, db=self._data)) is not None}
                while True:
                    short = counts.used + need - sum(overwritten.values()) > self.capacity
                    if not short and extra <= 0:
                        break
                    victim = self._evict_next(txn, counts, ghosted)
                    if victim is None:
                        break
                    events.append(victim)
                    overwritten.pop(victim, None)
                    extra -= not short
                self._put_counters(txn, counts)
        except lmdb.Error as exc:
            self._give_back_touches()
            self._warn_once("evict", "LMDB store %s: cannot evict: %s", self.path, exc)
            return None
        self._committed(counts, ghosted)
        if not events:
            return "settled" if extra <= 0 else None
        try:
            with self._env.begin(write=True, buffers=True) as txn:  # the write that frees them for reuse
                self._put_counters(txn, self._read_counters(txn))
        except lmdb.Error as exc:
            self._warn_once("evict", "LMDB store %s: cannot evict: %s", self.path, exc)
            return None
        return "evicted"

    def _insert_tick(self, counts: Counters, key: bytes, need: int) -> int:
        """A new entry's tick: LRU's next; S3-FIFO's next counter in small, or in main for a key the
        ghost remembers."""
        if not self._s3fifo:
            counts.tick += 1
            return counts.tick
        self._next_position(counts)
        if self._ghost.take(key):
            return s3.MAIN | counts.tick
        counts.small += need
        return counts.tick

    @staticmethod
    def _next_position(counts: Counters) -> None:
        """S3-FIFO's next counter (the tick of a store that was LRU while empty is aligned first)."""
        counts.tick = (counts.tick & s3.COUNTER) + s3.STEP

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

    def _remove(self, txn, key: bytes, counts: Counters) -> int | None:
        """Delete `key`'s records in `txn`, taking from `counts` the bytes it was charged (from the
        stored payload itself): those bytes, or None if it was not there."""
        payload = txn.get(key, db=self._data)
        meta = txn.get(key, db=self._meta)
        if payload is None and meta is None:
            return None
        freed = self._charge(len(payload)) if payload is not None else 0
        txn.delete(key, db=self._data)
        if meta is not None:
            if len(meta) == _META_BYTES:
                tick = _TICK.unpack(meta[entry.HEADER_BYTES:])[0]
                txn.delete(_U64.pack(tick) + key, db=self._lru)
                if self._s3fifo and s3.in_small(tick):
                    counts.small -= freed
            txn.delete(key, db=self._meta)
            counts.entries -= 1
        counts.used -= freed
        return freed

    def _evict(self, txn, key: bytes, counts: Counters) -> int | None:
        """`_remove`, tallied in `counts` as an eviction (counted in stats() once committed)."""
        freed = self._remove(txn, key, counts)
        if freed is not None:
            counts.evicted += 1
            counts.evicted_bytes += freed
        return freed

    def _committed(self, counts: Counters, ghosted: list) -> None:
        self._taken_touches = {}
        self._count(evictions=counts.evicted, evicted_bytes=counts.evicted_bytes)
        self._remember(ghosted)

    def _evict_next(self, txn, counts: Counters, ghosted: list) -> bytes | None:
        """Remove the entry the policy evicts next: its key; None when the store is empty. `ghosted`
        gets (key, bytes) of S3-FIFO's evictions from small, for the ghost once committed."""
        return self._evict_s3fifo(txn, counts, ghosted) if self._s3fifo else self._evict_oldest(txn, counts)

    def _evict_oldest(self, txn, counts: Counters) -> bytes | None:
        """Remove the entry first in the index (LRU: the least recently used); an index record whose
        entry is gone is dropped on the way."""
        for db in (self._lru, self._data):  # an entry without its index record goes too, after the rest
            cursor = txn.cursor(db=db)
            while cursor.first():
                key = bytes(cursor.key())
                if db is self._lru:
                    cursor.delete()
                    key = key[_U64.size:]
                if self._evict(txn, key, counts) is not None:
                    return key
        return None

    def _evict_s3fifo(self, txn, counts: Counters, ghosted: list) -> bytes | None:
        """S3-FIFO (lmdb_s3fifo.py): from small's head while small holds its share (or main is empty),
        else from main's head; a head with hits moves on instead (index and meta records only: no
        payload page is copied). Each move takes an entry out of small or spends one of its hits, so
        a victim is found within small + 3 x entries moves; the bound below only guards that."""
        cursor = txn.cursor(db=self._lru)
        from_small = None  # the queue chosen, kept until it has a victim (or, small, until it is empty)
        for _ in range(4 * txn.stat(self._lru)["entries"] + 1):
            in_main = cursor.set_range(_MAIN_KEY)
            in_small = cursor.first() and bytes(cursor.key()[:8]) < _MAIN_KEY
            if not in_small and not in_main:
                break
            if not in_small:
                counts.small = 0  # a drifted count must not keep choosing an empty queue
            if from_small is None or (from_small and not in_small):
                from_small = in_small and (counts.small >= self.capacity // s3.SMALL_SHARE or not in_main)
            if not from_small:
                cursor.set_range(_MAIN_KEY)
            record = bytes(cursor.key())
            tick, key = _U64.unpack(record[:8])[0], record[8:]
            cursor.delete()
            meta = txn.get(key, db=self._meta)
            moves = s3.hits(tick) and meta is not None and len(meta) == _META_BYTES and \
                _TICK.unpack(meta[entry.HEADER_BYTES:])[0] == tick
            if not moves:
                freed = self._evict(txn, key, counts)
                if freed is None:  # an index record whose entry is gone
                    continue
                if from_small:
                    ghosted.append((key, freed))
                return key
            self._next_position(counts)
            if from_small:  # hit while in small: to main's tail, its hits kept for main's clock
                payload = txn.get(key, db=self._data)
                counts.small -= self._charge(len(payload)) if payload is not None else 0
                moved = s3.MAIN | counts.tick | s3.hits(tick)
            else:  # main's head with hits: back to main's tail with one less
                moved = s3.MAIN | counts.tick | (s3.hits(tick) - 1)
            txn.put(key, bytes(meta[:entry.HEADER_BYTES]) + _TICK.pack(moved), db=self._meta)
            txn.put(_U64.pack(moved) + key, b"", db=self._lru)
        return self._evict_oldest(txn, counts)  # an empty index (entries without one), or the guard

    def _remember(self, ghosted: list) -> None:
        """Committed evictions from S3-FIFO's small queue enter the ghost."""
        for key, nbytes in ghosted:
            self._ghost.add(key, nbytes)

    def _warn_once(self, what: str, message: str, *args) -> None:
        (log.debug if what in self._warned else log.warning)(message, *args)
        self._warned.add(what)

    # -- recency and hits ---------------------------------------------------------------------------
    def _touch(self, keys: Sequence[bytes]) -> None:
        """Reads stay read-only transactions; their hits are applied by the next write."""
        with self._touch_lock:
            for key in keys:
                self._pending_touches[key] = self._pending_touches.pop(key, 0) + 1

    def _apply_touches(self, txn, tick: int) -> int:
        """LRU: the touched keys become the most recent, in the order they were read. S3-FIFO: their hit
        counts rise (at most to 3), in place."""
        with self._touch_lock:
            touched, self._pending_touches = self._pending_touches, {}
        self._taken_touches = touched  # given back if the transaction does not commit
        for key, times in touched.items():
            meta = txn.get(key, db=self._meta)
            if meta is None or len(meta) != _META_BYTES:
                continue
            meta = bytes(meta)
            old = _TICK.unpack(meta[entry.HEADER_BYTES:])[0]
            if self._s3fifo:
                new = old - s3.hits(old) + min(s3.hits(old) + times, s3.MAX_FREQ)
                if new == old:
                    continue
            else:
                tick += 1
                new = tick
            txn.delete(_U64.pack(old) + key, db=self._lru)
            txn.put(key, meta[: entry.HEADER_BYTES] + _TICK.pack(new), db=self._meta)
            txn.put(_U64.pack(new) + key, b"", db=self._lru)
        return tick

    def _give_back_touches(self) -> None:
        """A transaction that took the touches did not commit: they are pending again (before any since)."""
        touched, self._taken_touches = self._taken_touches, {}
        with self._touch_lock:
            for key, times in self._pending_touches.items():
                touched[key] = touched.pop(key, 0) + times
            self._pending_touches = touched

    def flush(self, wait: bool = True) -> None:
        """Persist pending hits (done by every write, by `close`, and every few thousand reads; a
        reader does not wait for a writer: `wait=False` leaves the touches to that writer)."""
        if not self._pending_touches or not self._write_lock.acquire(blocking=wait):
            return
        try:
            with self._env.begin(write=True, buffers=True) as txn:
                counts = self._read_counters(txn)
                counts.tick = self._apply_touches(txn, counts.tick)
                self._put_counters(txn, counts)
        finally:
            self._taken_touches = {}  # recency is advisory: a failed flush loses its touches
            self._write_lock.release()

    def _persist_touches(self, wait: bool) -> None:
        try:
            self.flush(wait)
        except (lmdb.Error, OSError) as exc:  # recency is advisory: losing it must not fail a read
            self._warn_once("touch", "LMDB store %s: could not persist LRU order: %s", self.path, exc)

    # -- reads --------------------------------------------------------------------------------------
    def read_many(self, keys: Sequence[bytes], consume: Callable[[int, memoryview], None]) -> list[bool]:
        served = [False] * len(keys)
        bad: dict[bytes, str] = {}
        nbytes = 0
        try:
            with self._env.begin(buffers=True) as txn:
                for i, key in enumerate(keys):
                    meta = txn.get(key, db=self._meta)
                    if meta is None:
                        continue
                    payload = txn.get(key, db=self._data)
                    problem = entry.verify(entry.decode_header(meta), self.fingerprint, payload)
                    if problem:
                        bad[key] = problem
                        continue
                    consume(i, payload)
                    served[i] = True
                    nbytes += payload.nbytes
        except lmdb.Error as exc:  # a damaged tree, a full reader table: what was not served is a miss
            self._warn_once("read", "LMDB store %s: read failed: %s", self.path, exc)
            self._count(read_errors=1)
        hits = sum(served)
        self._count(hits=hits, misses=len(keys) - hits, get_bytes=nbytes)
        if hits:
            self._touch([k for k, ok in zip(keys, served) if ok])
            if len(self._pending_touches) >= 4096:  # a read-only process persists recency in batches
                self._persist_touches(wait=False)
        if bad:
            self._drop_bad(bad)
        return served

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
            with self._env.begin(buffers=True) as txn:
                return [txn.get(k, db=self._meta) is not None for k in keys]
        except lmdb.Error as exc:
            self._warn_once("read", "LMDB store %s: lookup failed: %s", self.path, exc)
            self._count(read_errors=1)
            return [False] * len(keys)

    def delete(self, key: bytes) -> bool:
        return self._delete([key]) > 0

    def _delete(self, keys: Sequence[bytes]) -> int:
        try:
            with self._write_lock, self._env.begin(write=True, buffers=True) as txn:
                counts = self._read_counters(txn)
                removed = [self._remove(txn, k, counts) for k in keys]
                self._put_counters(txn, counts)
        except lmdb.Error as exc:
            self._warn_once("delete", "LMDB store %s: delete failed: %s", self.path, exc)
            return 0
        return sum(r is not None for r in removed)

    def claim(self, owner: str) -> None:
        """Recorded in the file: every process and later run sees who uses this directory."""
        try:
            with self._write_lock, self._env.begin(write=True) as txn:
                txn.put(_OWNER + owner.encode(), b"", db=self._info)
        except lmdb.Error as exc:
            self._warn_once("claim", "LMDB store %s: cannot record namespace %r: %s", self.path, owner, exc)

    def clear(self, owner: str) -> bool:
        """Every entry, in one transaction (readers keep their snapshot), if no other namespace ever
        claimed this directory; the byte accounting restarts at zero."""
        try:
            with self._write_lock, self._env.begin(write=True, buffers=True) as txn:
                cursor = txn.cursor(db=self._info)
                owners = set()
                if cursor.set_range(_OWNER):
                    for key in cursor.iternext(values=False):
                        if not bytes(key).startswith(_OWNER):
                            break
                        owners.add(bytes(key)[len(_OWNER):].decode(errors="replace"))
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
            log.warning("LMDB store %s: not cleared: namespace(s) %s use it too (give each deployment its own "
                        "directory, or delete this one)", self.path, sorted(others))
            return False
        with self._touch_lock:
            self._pending_touches.clear()
        with self._write_lock:
            self._ghost.clear()
        return True

    def _usage(self) -> dict[str, int]:
        try:
            with self._env.begin(buffers=True) as txn:  # a damaged record reads -1 (the next write rebuilds it)
                used, small, entries = (counters.decode(name, txn.get(name, db=self._info))[0]
                                        for name in (counters.USED, counters.SMALL, counters.ENTRIES))
                entries = txn.stat(self._meta)["entries"] if entries is None else entries
        except lmdb.Error:
            entries = used = small = None
        used, small, entries = (-1 if v is None else v for v in (used, small, entries))
        usage = {"entries": entries, "bytes_used": used, "map_size": self._env.info()["map_size"],
                 "configured_capacity": self.configured_capacity}
        if self._s3fifo:
            usage["small_bytes"] = small  # S3-FIFO's small queue (the rest is main)
        return usage

    def _close_env(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None

    def close(self) -> None:
        if self._env is not None:
            self._persist_touches(wait=True)
        self._close_env()
        if self._users is not None:
            os.close(self._users)
            self._users = None


def read_stats(path: str) -> dict[str, int | str]:
    """A store's figures read without changing anything: no directory, file or record is created and no
    permission is tightened (what `kvoffload inspect` needs of a path that may not be a store)."""
    if not os.path.isabs(path):
        raise StoreConfigError(f"LMDB store path must be absolute, got {path!r} (use lmdb:///abs/dir)")
    data = os.path.join(path, DATA_FILE)
    if not os.path.isfile(data):
        raise StoreConfigError(f"no LMDB store at {path!r} (it has no {DATA_FILE})")
    if not os.access(data, os.R_OK):
        raise StoreConfigError(f"cannot read {data}: permission denied")
    try:
        env = lmdb.open(path, readonly=True, lock=os.path.exists(os.path.join(path, LOCK_FILE)), max_dbs=8)
        try:
            info_db, meta_db = env.open_db(b"info", create=False), env.open_db(b"meta", create=False)
            with env.begin(buffers=True) as txn:
                record = {k: bytes(v) if (v := txn.get(k, db=info_db)) is not None else None
                          for k in (b"format_version", b"capacity", b"evict")}
                used = counters.decode_value(counters.USED, txn.get(counters.USED, db=info_db))
                entries = counters.decode_value(counters.ENTRIES, txn.get(counters.ENTRIES, db=info_db))
                entries = txn.stat(meta_db)["entries"] if entries is None else entries
            map_size = env.info()["map_size"]
        finally:
            env.close()
    except lmdb.Error as exc:
        raise StoreConfigError(f"cannot read the LMDB store at {path!r}: {exc}") from None
    evict = (record.pop(b"evict") or b"lru").decode("ascii", "replace")
    number = {k.decode(): _U64.unpack(v)[0] if v is not None and len(v) == 8 else None for k, v in record.items()}
    return {"url": f"lmdb://{path}", "format_version": number["format_version"] or 0,
            "capacity": number["capacity"] or capacity_for_map(map_size), "entries": entries,
            "bytes_used": used if used is not None else -1, "map_size": map_size,
            "evict": evict,
            "damaged_files": len(glob.glob(f"{glob.escape(data)}.damaged-*"))}
