"""The LMDB tier's files: the store directory's hygiene and the open protocol -- the map's size and its
disk, the damage checks and the reset of a damaged file, the format and policy records, the counters'
check at open. Kept apart from the store (lmdb_store.py), which only reads and writes the environment
this module hands it (`open_files`); `read_stats` is the read-only look at a directory (`inspect`).

The map is sized once, at open, from the capacity (`map_size_for`), and its whole file range -- and the
lock file's -- is allocated on disk (`posix_fallocate`) before LMDB may touch it: a full disk can never
turn a write or a read into a SIGBUS, and no map ever grows at run time, so there is no resize protocol
between processes. Why `writemap=True`: writes at raw-disk speed (see BENCHMARKS.md), paired with full
syncing (never NOSYNC). Under `writemap` LMDB sets the file to the map size on open, so a process that
finds the store open elsewhere adopts the file's size and only a process alone may change it.

The eviction policy is written into `info` at creation: a store with entries keeps its own (no record:
LRU) whatever is asked, with a warning; an empty store opened alone takes the one asked for.

Locks (the first two of the store's order, lmdb_store.py; none is held while waiting for an earlier one):
  1. `open.lock` (flock, exclusive): only while opening -- the damage checks, a reset, the map size;
  2. `users.lock` (flock, shared while the store is open, the store holds its descriptor): a process
     alone may resize or reset.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import logging
import os
import stat
import struct
import time
from contextlib import contextmanager
from typing import NamedTuple

import lmdb

from ..flock import flock_within
from . import entry
from . import lmdb_counters as counters
from .errors import IncompatibleStoreError, StoreConfigError
from .eviction import POLICIES
from .lmdb_lru import LRUPolicy
from .lmdb_policy import Policy
from .lmdb_s3fifo import S3FIFOPolicy

log = logging.getLogger(f"{__package__}.lmdb_store")  # the tier's one logger, whichever module logs

DATA_FILE, LOCK_FILE, OPEN_LOCK, USERS_LOCK = "data.mdb", "lock.mdb", "open.lock", "users.lock"
ACCOUNTING = b"pages-v2"  # how bytes_used is charged; a store counted otherwise is recounted at open
ENTRY_FRACTION = 4  # an entry (and one write transaction) takes at most capacity / ENTRY_FRACTION
_U64 = struct.Struct(">Q")
_MAP_SLACK = 4 << 20  # meta pages, the free list, B-tree copies of a small store
_LOCK_BYTES = 64 << 10  # the reader table: 64-byte slots for max_readers, allocated up front
_OPEN_WAIT_SECONDS = 60.0
_DISK_RESERVE = 20  # never take the last 1/20 of a filesystem's space at open
_MIN_MAP = _MAP_SLACK + (1 << 20)
MIN_CAPACITY = 64 << 10
_POLICIES: dict[str, type[Policy]] = {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy}

# An open that finds these has a damaged file (not a permission or I/O problem): reset it.
_DAMAGE = (
    lmdb.CorruptedError,
    lmdb.InvalidError,
    lmdb.PageNotFoundError,
    lmdb.PanicError,
    lmdb.IncompatibleError,
    lmdb.BadValsizeError,
    lmdb.BadChecksumError,
    lmdb.ProblemError,
)


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
    if os.statvfs(path).f_flag & os.ST_RDONLY:
        raise StoreConfigError(f"LMDB store directory {path!r} is on a read-only filesystem")
    # every refusal before any change: a store directory that cannot be used is left as it was found
    files = []
    for name in (DATA_FILE, LOCK_FILE):
        file = os.path.join(path, name)
        try:
            info = os.lstat(file)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(info.st_mode):
            raise StoreConfigError(
                f"{file} is a symlink or not a regular file; an LMDB store keeps its own "
                "files (remove it or use another directory)"
            )
        if not os.access(file, os.R_OK | os.W_OK):
            raise StoreConfigError(f"cannot read and write {file}: permission denied (fix its owner or mode)")
        files.append(file)
    probe = os.path.join(path, f".write-probe-{os.getpid()}")
    try:
        with open(probe, "wb"):
            pass
        os.unlink(probe)
    except OSError as exc:
        raise StoreConfigError(f"LMDB store directory {path!r} is not writable: {exc.strerror}") from None
    _tighten(path, 0o700, "store directory")
    for file in files:
        _tighten(file, 0o600, "store file")


def _tighten(path: str, mode: int, what: str) -> None:
    current = stat.S_IMODE(os.stat(path).st_mode)
    if current & 0o077:
        try:
            os.chmod(path, current & mode)
        except OSError as exc:
            raise StoreConfigError(
                f"{what} {path!r} is readable by others and cannot be made private: {exc.strerror}"
            ) from None
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


class Opened(NamedTuple):
    """What an open hands the store."""

    env: lmdb.Environment
    policy: Policy  # the file's own, over its databases
    capacity: int  # the configured one, or less where the disk could not back it
    users: int  # `users.lock`'s descriptor, held shared until the store closes it


def open_files(path: str, capacity: int, evict: str, max_readers: int, count) -> Opened:
    """Open (creating, checking, resetting a damaged file when alone) the store in `path`; `count` gets
    the store's counters (disk_full, damaged_files_reset, counters_rebuilt)."""
    if capacity < MIN_CAPACITY:
        raise StoreConfigError(f"LMDB capacity {capacity} bytes is too small: at least {MIN_CAPACITY >> 10} KiB")
    prepare_directory(path)
    return _Opener(path, capacity, evict, max_readers, count).open()


class _Opener:
    """One open of a directory: `open.lock` held throughout, `users.lock` tried exclusive (alone) and
    left shared."""

    def __init__(self, path: str, capacity: int, evict: str, max_readers: int, count):
        self.path, self.configured_capacity, self.capacity, self.evict = path, capacity, capacity, evict
        self._max_readers, self._count = max_readers, count
        self._env: lmdb.Environment | None = None
        self.policy: Policy | None = None

    def open(self) -> Opened:
        users = os.open(self._file(USERS_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with self._open_lock():
                alone = _try_flock(users, fcntl.LOCK_EX)
                try:
                    self._open(alone)
                finally:
                    fcntl.flock(users, fcntl.LOCK_SH)  # held while open (downgrades EX)
        except BaseException:
            self._close_env()
            os.close(users)
            raise
        env, policy = self._env, self.policy
        assert env is not None and policy is not None  # `_open` set both, or raised
        return Opened(env, policy, self.capacity, users)

    def _close_env(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @contextmanager
    def _open_lock(self):
        """Opens of one directory take turns (a bounded wait: a hung opener is an error, not a hang)."""
        fd = os.open(self._file(OPEN_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if not flock_within(fd, _OPEN_WAIT_SECONDS):
                raise StoreConfigError(
                    f"LMDB store {self.path!r}: another process has been opening it for over {_OPEN_WAIT_SECONDS:.0f} s"
                )
            yield
        finally:
            os.close(fd)

    def _open(self, alone: bool) -> None:
        try:
            self._open_env(alone)
        except _Damaged as exc:
            if not alone:
                raise StoreConfigError(
                    f"LMDB store {self.path!r} is damaged ({exc}) and other processes have it "
                    "open: stop them and open it again (it is then reset), or use another "
                    "directory"
                ) from None
            self._move_aside(str(exc))
            self._open_env(alone)

    def _open_env(self, alone: bool) -> None:
        data = self._file(DATA_FILE)
        size = os.path.getsize(data) if os.path.exists(data) else 0
        # Alone, the map follows the capacity (never below the file: LMDB cannot shrink it); otherwise
        # it is the file's size, which every other user has mapped.
        map_size = (
            max(size, self._affordable(map_size_for(self.configured_capacity), size)) if alone or not size else size
        )
        if not _allocate(self._file(LOCK_FILE), _LOCK_BYTES):
            raise StoreConfigError(f"LMDB store {self.path!r}: the disk is full (cannot create its lock file)")
        try:
            env = lmdb.open(
                self.path,
                map_size=map_size,
                subdir=True,
                max_dbs=8,
                mode=0o600,
                # readahead: values are large runs of overflow pages, read sequentially
                writemap=True,
                sync=True,
                metasync=True,
                readahead=True,
                max_readers=self._max_readers,
                lock=True,
            )
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
            self._back_map(env, info["map_size"], max(committed, size), alone)
            self._data, self._meta, self._lru, self._info = (
                env.open_db(n) for n in (b"data", b"meta", b"lru", b"info")
            )
            self._dbs = counters.Databases(self._data, self._meta, self._lru, self._info)
            self._check_format(env, alone)
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

    def _back_map(self, env: lmdb.Environment, map_size: int, floor: int, alone: bool) -> None:
        """Allocate the map's whole file range (halving the growth on ENOSPC); the capacity follows."""
        size = map_size
        while not _allocate(self._file(DATA_FILE), size):
            gap = (size - floor) // 2
            if not alone or size <= floor or gap < (1 << 20):
                raise StoreConfigError(
                    f"LMDB store {self.path!r}: the disk is full (cannot reserve {size >> 20} MiB for its data file)"
                )
            size = floor + gap
        if size < map_size:
            self._disk_full(f"only {size >> 20} MiB of a {map_size >> 20} MiB map could be reserved")
            env.set_mapsize(size)
        self.capacity = min(self.configured_capacity, capacity_for_map(size))
        if self.capacity < self.configured_capacity:
            log.warning(
                "LMDB store %s: capacity %d bytes instead of %d (the data file is %d bytes)",
                self.path,
                self.capacity,
                self.configured_capacity,
                size,
            )
        if self.capacity < MIN_CAPACITY:
            raise StoreConfigError(
                f"LMDB store {self.path!r}: the disk is full (room for {self.capacity} bytes of entries only)"
            )

    def _disk_full(self, why: str) -> None:
        log.warning("LMDB store %s: disk full: %s; the store holds less", self.path, why)
        self._count(disk_full=1)

    def _check_format(self, env: lmdb.Environment, alone: bool) -> None:
        """The format version (a damaged record is a damaged file), the eviction policy, the capacity
        record, and the counters (lmdb_counters.py): checked, and rebuilt from the entries where they
        fail, are implausible, or were counted under another policy or accounting."""
        with env.begin(write=True, buffers=True) as txn:
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
                    f"{entry.FORMAT_VERSION}. Point the store at a new directory (or delete this one)."
                )
            recount = not self._settle_policy(txn, alone) or txn.get(b"accounting", db=self._info) != ACCOUNTING
            self.policy = _POLICIES[self.evict](self._dbs, self._psize, self.capacity)
            started = time.perf_counter()
            _, rebuilt = counters.load(
                txn,
                self.policy,
                force=recount,
                max_entry_bytes=capacity_for_map(env.info()["map_size"]) // ENTRY_FRACTION,
            )
            txn.put(b"accounting", ACCOUNTING, db=self._info)
            recorded = txn.get(b"capacity", db=self._info)
            recorded = _U64.unpack(recorded)[0] if recorded is not None and len(recorded) == _U64.size else None
            txn.put(b"capacity", _U64.pack(self.configured_capacity), db=self._info)
        if not alone and recorded is not None and recorded != self.configured_capacity:
            log.warning(
                "LMDB store %s: another process opened it with capacity %d bytes, this one with %d: each "
                "evicts down to its own at its writes (open every process of a store with one capacity)",
                self.path,
                recorded,
                self.configured_capacity,
            )
        self._count(counters_rebuilt=len(rebuilt))
        if rebuilt or recount:
            log.warning(
                "LMDB store %s: counters rebuilt from its entries in %.3f s: %s",
                self.path,
                time.perf_counter() - started,
                counters.describe(rebuilt) or "none differed",
            )

    def _settle_policy(self, txn, alone: bool) -> bool:
        """One policy per file (their index orders differ): a store with entries keeps the one it was
        written with (no record: LRU, written before there was a choice); the one asked for applies to
        an empty store opened alone. False when the record was damaged (the counters are recounted)."""
        record = txn.get(b"evict", db=self._info)
        found = "lru" if record is None else bytes(record).decode("ascii", "replace")
        empty = not txn.stat(self._lru)["entries"] and not txn.stat(self._data)["entries"]
        if found not in POLICIES:
            log.warning("LMDB store %s: damaged eviction policy record %r; using %s", self.path, found[:40], self.evict)
        elif found != self.evict and not (empty and alone):
            log.warning(
                "LMDB store %s: its entries are ordered for evict=%s, not %s: it keeps evicting by %s "
                "(use another directory for another policy)",
                self.path,
                found,
                self.evict,
                found,
            )
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


def _try_flock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def read_stats(path: str) -> dict[str, int | str]:
    """A store's figures read without changing anything: no directory, file or record is created and no
    permission is tightened (what `kvoffload inspect` needs of a path that may not be a store)."""
    if not os.path.isabs(path):
        raise StoreConfigError(f"LMDB store path must be absolute, got {path!r} (use lmdb:///abs/dir)")
    data = os.path.join(path, DATA_FILE)
    if os.path.islink(data):
        raise StoreConfigError(f"{data} is a symbolic link: stores refuse one, so it is not inspected either")
    if not os.path.isfile(data):
        raise StoreConfigError(f"no LMDB store at {path!r} (it has no {DATA_FILE})")
    if not os.access(data, os.R_OK):
        raise StoreConfigError(f"cannot read {data}: permission denied")
    file_stat = os.stat(data)
    if file_stat.st_size == 0:
        raise StoreConfigError(f"no LMDB store at {path!r} (its {DATA_FILE} is empty)")
    try:
        env = lmdb.open(path, readonly=True, lock=os.path.exists(os.path.join(path, LOCK_FILE)), max_dbs=8)
        try:
            info_db, meta_db = env.open_db(b"info", create=False), env.open_db(b"meta", create=False)
            with env.begin(buffers=True) as txn:
                record = {
                    k: bytes(v) if (v := txn.get(k, db=info_db)) is not None else None
                    for k in (b"format_version", b"capacity", b"evict")
                }
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
    map_size = max(map_size, file_stat.st_size)  # a read-only open reports its own default, not the file's map
    capacity = number["capacity"] or capacity_for_map(map_size)
    return {
        "url": f"lmdb://{path}",
        "format_version": number["format_version"] or 0,
        "capacity": capacity,
        # what the map really holds: less than `capacity` where a full disk cut the file short
        "usable_capacity": min(capacity, capacity_for_map(map_size)),
        "entries": entries,
        "bytes_used": used if used is not None else -1,
        "map_size": map_size,
        "file_bytes": file_stat.st_size,
        "disk_bytes": file_stat.st_blocks * 512,  # allocated on disk (a sparse file holds less than its size)
        "evict": evict,
        "damaged_files": len(glob.glob(f"{glob.escape(data)}.damaged-*")),
    }
