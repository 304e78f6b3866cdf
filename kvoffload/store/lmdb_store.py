"""Disk tier on LMDB: persistent across restarts, crash-safe commits, checksummed entries, a hard
byte capacity enforced by LRU eviction, many reader processes beside one writer at a time.

Layout of the environment (four named databases, all updated in one transaction per batch):
  data: key -> payload            meta: key -> header (entry.py) + LRU tick (u64)
  lru:  tick (big-endian u64) + key -> b""      info: format_version, tick, bytes_used
The payload and its header live in separate records, so a page is copied into the map once.

Why `writemap=True`: it brings writes to raw-disk speed (see BENCHMARKS.md). It is paired with full
syncing (never NOSYNC) and with a map that grows in steps whose file range is allocated with
`posix_fallocate` first, so a full disk is an error we see (fewer hits), never a SIGBUS in a hole.
Under `writemap` LMDB also truncates the data file to the map size on every open and resize, so map
changes are serialized across processes (`map.lock`) and no process ever sets a map smaller than the
file: that would cut the file under another process's writable map.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import lmdb

from . import entry
from .base import Store
from .buffers import Buffer
from .errors import IncompatibleStoreError, StoreConfigError

log = logging.getLogger(__name__)

DATA_FILE = "data.mdb"
MAP_LOCK_FILE = "map.lock"
_U64 = struct.Struct(">Q")
_TICK = struct.Struct("<Q")
_META_BYTES = entry.HEADER_BYTES + _TICK.size
_INITIAL_MAP = 64 << 20
_MAP_SLACK = 16 << 20
_MAX_GROWTH_STEP = 1 << 30
# Bytes LMDB spends per entry beyond the payload (overflow-page rounding, three tree records),
# used only to size the map, never the capacity.
_PER_ENTRY_OVERHEAD = 4096 + 256
_MAX_PENDING_TOUCHES = 4096  # a read-only process persists recency in batches of this many keys


class _SharedExclusiveLock:
    """Readers in parallel; `set_mapsize` alone (LMDB requires no open transaction in the process)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextmanager
    def shared(self):
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self):
        with self._cond:
            while self._writer or self._readers:
                self._cond.wait()
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


def prepare_directory(path: str) -> None:
    """Create the store directory 0700 (or tighten an existing one); fail clearly if unusable."""
    if not os.path.isabs(path):
        raise StoreConfigError(f"LMDB store path must be absolute, got {path!r} (use lmdb:///abs/dir)")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        raise StoreConfigError(f"LMDB store path {path!r} exists and is not a directory") from None
    except OSError as exc:
        raise StoreConfigError(f"cannot create LMDB store directory {path!r}: {exc.strerror}") from None
    if not os.path.isdir(path):
        raise StoreConfigError(f"LMDB store path {path!r} exists and is not a directory")
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        try:
            os.chmod(path, 0o700)
            log.warning("tightened permissions of store directory %s from %o to 700", path, mode)
        except OSError as exc:
            raise StoreConfigError(f"store directory {path!r} is readable by others and cannot be "
                                   f"made private: {exc.strerror}") from None
    probe = os.path.join(path, f".write-probe-{os.getpid()}")
    try:
        with open(probe, "wb"):
            pass
        os.unlink(probe)
    except OSError as exc:
        raise StoreConfigError(f"LMDB store directory {path!r} is not writable: {exc.strerror}") from None


class LMDBStore(Store):
    def __init__(self, path: str, capacity: int, fingerprint: bytes | None = None,
                 url: str | None = None, max_readers: int = 256):
        super().__init__()
        self._count(checksum_failures=0, read_errors=0)
        self._env = None
        self.path = path
        self.capacity = capacity
        self.url = url or f"lmdb://{path}?capacity={capacity}"
        self.fingerprint = entry.normalize_fingerprint(fingerprint)
        self._max_map = capacity + capacity // 4 + _MAP_SLACK
        self._resize = _SharedExclusiveLock()
        self._write_lock = threading.Lock()
        self._pending_touches: dict[bytes, None] = {}
        self._touch_lock = threading.Lock()
        prepare_directory(path)
        self._check_not_truncated()
        self._env = self._open_env(max_readers)
        self._env.reader_check()  # free reader slots left by killed processes
        self._data, self._meta, self._lru, self._info = (
            self._env.open_db(name) for name in (b"data", b"meta", b"lru", b"info"))
        self._check_format_version()

    # -- opening ------------------------------------------------------------------------------------
    def _data_path(self) -> str:
        return os.path.join(self.path, DATA_FILE)

    def _check_not_truncated(self) -> None:
        """A data file shorter than its committed pages cannot be mapped safely (reads past the end
        of a mapping kill the process). Move it aside and start empty: every key is then a miss."""
        data = self._data_path()
        if not os.path.exists(data):
            return
        size = os.path.getsize(data)
        try:
            probe = lmdb.open(self.path, readonly=True, lock=False, max_dbs=8)
            try:
                needed = (probe.info()["last_pgno"] + 1) * probe.stat()["psize"]
            finally:
                probe.close()
        except lmdb.Error as exc:
            if isinstance(exc, lmdb.VersionMismatchError):
                raise IncompatibleStoreError(f"{data} was written by an incompatible LMDB version: {exc}") from None
            needed, reason = None, str(exc)
        else:
            reason = f"{size} bytes on disk, {needed} committed"
        if needed is not None and size >= needed:
            return
        aside = f"{data}.damaged-{int(time.time())}"
        os.replace(data, aside)
        log.error("LMDB store %s is damaged (%s); moved it to %s and starting empty", self.path, reason, aside)
        self._count(damaged_files_reset=1)

    @contextmanager
    def _map_lock(self):
        """Exclusive across processes and threads (each call opens its own file description)."""
        fd = os.open(os.path.join(self.path, MAP_LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _file_size(self) -> int:
        return os.path.getsize(self._data_path()) if os.path.exists(self._data_path()) else 0

    def _open_env(self, max_readers: int) -> lmdb.Environment:
        with self._map_lock():
            size = self._file_size()
            map_size = max(size, min(_INITIAL_MAP, self._max_map))
            try:
                env = lmdb.open(self.path, map_size=map_size, subdir=True, max_dbs=8, mode=0o600,
                                # readahead: values are large runs of overflow pages, read sequentially
                                writemap=True, sync=True, metasync=True, readahead=True,
                                max_readers=max_readers, lock=True)
            except lmdb.Error as exc:
                raise StoreConfigError(f"cannot open LMDB store {self.path!r}: {exc}") from None
            # LMDB has just extended the file to the map size as a sparse file: back it with real blocks.
            info = env.info()
            committed = (info["last_pgno"] + 1) * env.stat()["psize"]
            allocated = self._allocate_up_to(info["map_size"], floor=max(committed, size))
            if allocated < info["map_size"]:
                env.set_mapsize(allocated)
        return env

    def _allocate_up_to(self, target: int, floor: int) -> int:
        """The largest size in [floor, target] (halving the gap on ENOSPC) whose file range is backed
        by disk blocks, so that LMDB never writes into a hole the disk cannot fill."""
        size = target
        while size > floor:
            if self._allocate_file(size):
                return size
            gap = (size - floor) // 2
            size = floor + gap if gap >= (1 << 20) else floor
        if target > floor:
            # said once per store; every occurrence is counted in stats()["disk_full"]
            (log.debug if self._counters.get("disk_full") else log.warning)(
                "LMDB store %s: disk full, cannot grow the store to %d bytes; evicting instead", self.path, target)
            self._count(disk_full=1)
        return floor

    def _allocate_file(self, nbytes: int) -> bool:
        """Reserve disk blocks for the first `nbytes` of the data file; False if the disk is full."""
        fd = os.open(self._data_path(), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return True
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                return False
            raise
        finally:
            os.close(fd)

    def _check_format_version(self) -> None:
        with self._txn(write=True) as txn:
            stored = txn.get(b"format_version", db=self._info)
            if stored is None:
                txn.put(b"format_version", _U64.pack(entry.FORMAT_VERSION), db=self._info)
                return
            version = _U64.unpack(bytes(stored))[0]
        if version != entry.FORMAT_VERSION:
            self._env.close()
            raise IncompatibleStoreError(
                f"LMDB store {self.path!r} has format version {version}; this kvoffload reads version "
                f"{entry.FORMAT_VERSION}. Point the store at a new directory (or delete this one).")

    @contextmanager
    def _txn(self, write: bool = False):
        """A transaction, adopting a map another process has grown meanwhile."""
        for _ in range(3):
            with self._resize.shared():
                try:
                    txn = self._env.begin(write=write, buffers=True)
                except lmdb.MapResizedError:
                    pass
                else:
                    with txn:
                        yield txn
                    return
            # another process grew the map: adopt the file's size (never less: see the module doc)
            with self._resize.exclusive(), self._map_lock():
                self._env.set_mapsize(max(self._file_size(), self._env.info()["map_size"]))
        raise lmdb.MapResizedError("map resized repeatedly by other processes")

    # -- writes -------------------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        views = self._views(items, overhead=_META_BYTES)
        if not views:
            return []
        headers = [entry.encode_header(self.fingerprint, v) for _, v in views]
        batch_bytes = sum(v.nbytes + _PER_ENTRY_OVERHEAD for _, v in views)
        with self._write_lock:
            for attempt in range(8):
                try:
                    self._write_batch(views, headers)
                    self._count(puts=len(views), put_bytes=sum(v.nbytes for _, v in views))
                    return [True] * len(views)
                except lmdb.MapFullError:
                    if not self._grow(batch_bytes) and not self._evict_bytes(batch_bytes * (attempt + 1)):
                        break
                except (lmdb.Error, OSError) as exc:  # a failed write is a dropped write, never a crash
                    log.error("LMDB store %s: write failed: %s", self.path, exc)
                    break
        self._count(dropped_puts=len(views))
        return [False] * len(views)

    def _write_batch(self, views, headers) -> None:
        with self._txn(write=True) as txn:
            tick, used = self._counters_in(txn)
            tick = self._apply_touches(txn, tick)
            for (key, view), header in zip(views, headers):
                used -= self._remove(txn, key)
                need = view.nbytes + _META_BYTES
                while used + need > self.capacity:
                    freed = self._evict_oldest(txn)
                    if not freed:
                        raise lmdb.MapFullError("capacity exhausted")  # cannot happen: sizes were validated
                    used -= freed
                tick += 1
                txn.put(key, view, db=self._data)
                txn.put(key, header + _TICK.pack(tick), db=self._meta)
                txn.put(_U64.pack(tick) + key, b"", db=self._lru)
                used += need
            txn.put(b"tick", _U64.pack(tick), db=self._info)
            txn.put(b"bytes_used", _U64.pack(used), db=self._info)

    def _counters_in(self, txn) -> tuple[int, int]:
        tick = txn.get(b"tick", db=self._info)
        used = txn.get(b"bytes_used", db=self._info)
        return (_U64.unpack(bytes(tick))[0] if tick else 0, _U64.unpack(bytes(used))[0] if used else 0)

    def _remove(self, txn, key: bytes) -> int:
        """Delete `key`'s three records in `txn`; the bytes it counted against the capacity."""
        meta = txn.get(key, db=self._meta)
        if meta is None:
            return 0
        meta = bytes(meta)
        header = entry.decode_header(meta)
        txn.delete(key, db=self._data)
        txn.delete(key, db=self._meta)
        if len(meta) == _META_BYTES:
            txn.delete(_U64.pack(_TICK.unpack(meta[entry.HEADER_BYTES:])[0]) + key, db=self._lru)
        return (header.length if header else 0) + _META_BYTES

    def _evict_oldest(self, txn) -> int:
        cursor = txn.cursor(db=self._lru)
        if not cursor.first():
            return 0
        key = bytes(cursor.key())[_U64.size:]
        freed = self._remove(txn, key)
        if not freed:  # an lru record without its entry: drop it and report progress anyway
            cursor.delete()
            freed = 1
        self._count(evictions=1, evicted_bytes=freed)
        return freed

    def _evict_bytes(self, nbytes: int) -> bool:
        """Free at least `nbytes` of entries (oldest first) to make room in a map that cannot grow."""
        freed = 0
        with self._txn(write=True) as txn:
            tick, used = self._counters_in(txn)
            while freed < nbytes:
                step = self._evict_oldest(txn)
                if not step:
                    break
                freed += step
            txn.put(b"bytes_used", _U64.pack(max(used - freed, 0)), db=self._info)
        return freed > 0

    def _grow(self, batch_bytes: int) -> bool:
        with self._map_lock():
            current = self._env.info()["map_size"]
            target = self._file_size()  # another process may have grown (and allocated) it already
            if target <= current:
                target = min(current + max(2 * batch_bytes, min(current, _MAX_GROWTH_STEP)), self._max_map)
                target = self._allocate_up_to(target, floor=current)
                if target <= current:
                    return False
            with self._resize.exclusive():
                self._env.set_mapsize(target)
        log.debug("LMDB store %s: map grown to %d bytes", self.path, target)
        return True

    # -- LRU touches --------------------------------------------------------------------------------
    def _touch(self, keys: Sequence[bytes]) -> None:
        """Reads stay read-only transactions; their recency is applied by the next write."""
        with self._touch_lock:
            for key in keys:
                self._pending_touches.pop(key, None)
                self._pending_touches[key] = None

    def _apply_touches(self, txn, tick: int) -> int:
        with self._touch_lock:
            touched, self._pending_touches = self._pending_touches, {}
        for key in touched:
            meta = txn.get(key, db=self._meta)
            if meta is None or len(meta) != _META_BYTES:
                continue
            meta = bytes(meta)
            txn.delete(_U64.pack(_TICK.unpack(meta[entry.HEADER_BYTES:])[0]) + key, db=self._lru)
            tick += 1
            txn.put(key, meta[: entry.HEADER_BYTES] + _TICK.pack(tick), db=self._meta)
            txn.put(_U64.pack(tick) + key, b"", db=self._lru)
        return tick

    def flush(self) -> None:
        """Persist pending LRU recency (done by every write, by `close`, and every few thousand reads)."""
        if self._pending_touches:
            with self._write_lock, self._txn(write=True) as txn:
                tick, _ = self._counters_in(txn)
                txn.put(b"tick", _U64.pack(self._apply_touches(txn, tick)), db=self._info)

    def _persist_touches(self) -> None:
        try:
            self.flush()
        except (lmdb.Error, OSError) as exc:  # recency is advisory: losing it must not fail a read
            log.warning("LMDB store %s: could not persist LRU order: %s", self.path, exc)

    # -- reads --------------------------------------------------------------------------------------
    def read_many(self, keys: Sequence[bytes], consume: Callable[[int, memoryview], None]) -> list[bool]:
        served = [False] * len(keys)
        bad: dict[bytes, str] = {}
        nbytes = 0
        try:
            with self._txn() as txn:
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
        except lmdb.Error as exc:  # a damaged tree: what was not served is a miss
            log.error("LMDB store %s: read failed: %s", self.path, exc)
            self._count(read_errors=1)
        hits = sum(served)
        self._count(hits=hits, misses=len(keys) - hits, get_bytes=nbytes)
        if hits:
            self._touch([k for k, ok in zip(keys, served) if ok])
            if len(self._pending_touches) >= _MAX_PENDING_TOUCHES:
                self._persist_touches()
        if bad:
            self._drop_bad(bad)
        return served

    def _drop_bad(self, bad: dict[bytes, str]) -> None:
        """Entries that failed verification are deleted (another layout's entries are left alone)."""
        for problem in bad.values():
            self._count(**{problem: 1})
            log.warning("LMDB store %s: entry failed verification (%s); treated as a miss", self.path, problem)
        doomed = [k for k, p in bad.items() if p != "fingerprint_mismatch"]
        if not doomed:
            return
        try:
            with self._write_lock, self._txn(write=True) as txn:
                tick, used = self._counters_in(txn)
                for key in doomed:
                    used -= self._remove(txn, key)
                txn.put(b"bytes_used", _U64.pack(max(used, 0)), db=self._info)
        except lmdb.Error as exc:
            log.error("LMDB store %s: could not delete corrupt entries: %s", self.path, exc)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        try:
            with self._txn() as txn:
                return [txn.get(k, db=self._meta) is not None for k in keys]
        except lmdb.Error as exc:
            log.error("LMDB store %s: lookup failed: %s", self.path, exc)
            self._count(read_errors=1)
            return [False] * len(keys)

    def delete(self, key: bytes) -> bool:
        with self._write_lock, self._txn(write=True) as txn:
            tick, used = self._counters_in(txn)
            freed = self._remove(txn, key)
            txn.put(b"bytes_used", _U64.pack(max(used - freed, 0)), db=self._info)
        return freed > 0

    def _usage(self) -> dict[str, int]:
        with self._txn() as txn:
            _, used = self._counters_in(txn)
            entries = txn.stat(self._meta)["entries"]
        return {"entries": entries, "bytes_used": used, "map_size": self._env.info()["map_size"]}

    def close(self) -> None:
        if self._env is None:
            return
        self._persist_touches()
        self._env.close()
        self._env = None
