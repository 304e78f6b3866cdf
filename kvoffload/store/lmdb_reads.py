"""LMDB reads on several threads. A large `read_many` is cut into contiguous runs of about equal bytes,
one per reader; each reader opens its own read transaction (readers never wait for the writer, nor
for each other), verifies and hands its values to the caller's `consume` straight from the map. The
checksum of a value over 64 KiB (xxhash's `update`), the copy a `consume` makes out of the map and their
page faults run without the GIL, so readers overlap where one thread would wait for each in turn; each
takes the GIL back per value, so a reader waits for an engine thread's Python once per value (`bench
store`, beside engine steps). Before it verifies anything a reader asks the kernel for every page of its
values at once (`madvise(MADV_WILLNEED)`): a cold read then keeps the disk's queue full instead of
faulting the map in one readahead window at a time. A load of many batches
advises all of its values before its first batch (`Readers.ahead`, on a thread of its own), so the disk
stays busy across the batches, not only within each.

Locks: `Readers._lock` only guards making and stopping the thread pools; nothing is called under it and no
other lock is taken inside it (a leaf of the store's lock order, see lmdb_store.py). Readers take no
store lock: read transactions never wait for the writer."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import lmdb
import numpy as np

from . import entry
from .base import host_address

READERS = max(1, min(8, (os.cpu_count() or 2) // 2))  # default threads of one large read
PARALLEL_READ_BYTES = 16 << 20  # a read of fewer bytes stays on the caller's thread
PAGE = mmap.PAGESIZE

# One reader's outcome: indices served, entries that failed verification (key -> why), bytes served,
# and the lmdb.Error that ended its run early (what it did not serve is a miss).
PartResult = tuple[list[int], dict[bytes, str], int, "lmdb.Error | None"]


def read_part(
    env: lmdb.Environment,
    meta_db,
    data_db,
    fingerprint: bytes,
    keys: Sequence[bytes],
    indices: range,
    consume: Callable[[int, memoryview], None],
) -> PartResult:
    """Read and verify `keys[i]` for i in `indices` in one transaction; `consume` each good value."""
    served: list[int] = []
    bad: dict[bytes, str] = {}
    nbytes = 0
    try:
        with env.begin(buffers=True) as txn:
            found = []  # (index, key, header, payload): where each value lies in the map (no page read yet)
            for i in indices:
                key = keys[i]
                meta = txn.get(key, db=meta_db)
                if meta is not None:
                    found.append((i, key, meta, txn.get(key, db=data_db)))
            will_need(payload for *_, payload in found)
            for i, key, meta, payload in found:
                problem = entry.verify(entry.decode_header(meta), fingerprint, payload)
                if problem:
                    bad[key] = problem
                    continue
                assert payload is not None  # verify() passes no missing payload
                consume(i, payload)
                served.append(i)
                nbytes += payload.nbytes
    except lmdb.Error as exc:
        return served, bad, nbytes, exc
    return served, bad, nbytes, None


def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise (None where there is none: prefetching is advice, never needed)."""
    try:
        call = ctypes.CDLL(None, use_errno=True).madvise
    except (AttributeError, OSError):
        return None
    call.argtypes, call.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return call


_MADVISE = _madvise() if hasattr(mmap, "MADV_WILLNEED") else None


def will_need(payloads: Iterable[memoryview | None]) -> None:
    """Ask the kernel to read every page of these views of the map now, asynchronously (a view is
    read-only map memory; the advice changes no byte and a failure is ignored). The call releases the
    GIL (ctypes); on pages already in memory it costs ~0.5 ms per GiB."""
    if _MADVISE is None:
        return
    for payload in payloads:
        if payload is not None and payload.nbytes:
            address = host_address(np.frombuffer(payload, np.uint8))
            start = address - address % PAGE
            _MADVISE(start, address + payload.nbytes - start, mmap.MADV_WILLNEED)


def _advise(env: lmdb.Environment, data_db, keys: Sequence[bytes], stopping: threading.Event) -> None:
    """`will_need` of `keys`' values, in order, in one read transaction (advice: errors are ignored)."""
    try:
        with env.begin(buffers=True) as txn:
            for key in keys:
                if stopping.is_set():
                    return
                will_need((txn.get(key, db=data_db),))
    except lmdb.Error:
        pass


class Readers:
    """A store's reader threads: `split` a read into runs, `run` them (the first on the caller's thread);
    `ahead` advises a later read's values on a thread of its own."""

    def __init__(self, count: int | None = None):
        self.count = READERS if count is None else max(1, int(count))
        self._pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid, executor): made on a first large read
        self._advisor: tuple[int, ThreadPoolExecutor] | None = None  # (pid, executor): made on a first `ahead`
        self._stopping = threading.Event()  # set by `close`: advice still queued or running ends early
        self._lock = threading.Lock()

    def split(self, env: lmdb.Environment, meta_db, keys: Sequence[bytes]) -> list[range]:
        """Contiguous runs of `keys` of about equal bytes, one per reader; one run for a read under
        PARALLEL_READ_BYTES (sizes from the headers: a hint only, each reader reads its own again)."""
        if self.count < 2 or len(keys) < 2:
            return [range(len(keys))]
        try:
            with env.begin(buffers=True) as txn:
                sizes = [
                    getattr(entry.decode_header(meta), "length", 0) if (meta := txn.get(k, db=meta_db)) else 0
                    for k in keys
                ]
        except lmdb.Error:
            return [range(len(keys))]
        total = sum(sizes)
        if total < PARALLEL_READ_BYTES:
            return [range(len(keys))]
        n = min(self.count, len(keys))
        cuts, running, target = [0], 0, total / n
        for i, size in enumerate(sizes):
            running += size
            if running >= target * len(cuts) and len(cuts) < n and i + 1 < len(keys):
                cuts.append(i + 1)
        cuts.append(len(keys))
        return [range(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]

    def run(self, parts: list[range], read: Callable[[range], PartResult]) -> list[PartResult]:
        if len(parts) == 1:
            return [read(parts[0])]
        pool = self._executor()
        futures = [pool.submit(read, part) for part in parts[1:]]
        return [read(parts[0])] + [future.result() for future in futures]

    def ahead(self, env: lmdb.Environment, data_db, keys: Sequence[bytes]) -> None:
        """Ask the kernel for the pages of `keys`' values now, in order, on the advising thread (`will_need`
        per value; the caller does not wait). Where the pages are in memory already this costs ~0.5 ms per
        GiB and a lookup per key, off the caller's thread."""
        if _MADVISE is not None and not self._stopping.is_set():
            with self._lock:
                if self._advisor is None or self._advisor[0] != os.getpid():
                    self._advisor = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="kvoffload-lmdb-ahead"))
                self._advisor[1].submit(_advise, env, data_db, list(keys), self._stopping)

    def _executor(self) -> ThreadPoolExecutor:
        """The threads (made on first use, and again in a forked child: threads do not survive a fork)."""
        with self._lock:
            if self._pool is None or self._pool[0] != os.getpid():
                executor = ThreadPoolExecutor(self.count - 1, thread_name_prefix="kvoffload-lmdb-read")
                self._pool = (os.getpid(), executor)
            return self._pool[1]

    def close(self) -> None:
        """Stop advising, wait for running readers and stop the threads (a store closes its environment
        after this)."""
        self._stopping.set()
        with self._lock:
            pools, self._pool, self._advisor = (self._pool, self._advisor), None, None
        for pool in pools:
            if pool is not None and pool[0] == os.getpid():
                pool[1].shutdown(wait=True)
