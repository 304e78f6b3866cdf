"""Store throughput: memory and LMDB put/get GB/s per value size, against baselines measured in the same
run on the same bytes: memcpy (memory tier), and raw sequential file write with fsync and raw read of
the same bytes on the same disk (LMDB). LMDB reads start from a dropped page cache where allowed."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from ...store import Store, open_store
from .common import drop_page_cache, median_seconds, new_result

FULL_SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [64 << 10, 1 << 20]


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def _copy_all(outs: list[np.ndarray], values: list[np.ndarray]) -> None:
    for out, value in zip(outs, values):
        np.copyto(out, value)


def _put_all(store: Store, keys: list[bytes], values: list[np.ndarray]) -> list[bool]:
    return store.put_many(list(zip(keys, values)))


def _raw_file(directory: str, values: list[np.ndarray]) -> tuple[float, float, str]:
    """Seconds to write (one file per value, fsynced) and read back the same bytes."""
    paths = [os.path.join(directory, f"raw{i}") for i in range(len(values))]
    start = time.perf_counter()
    for path, value in zip(paths, values):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, value.data)
        os.fsync(fd)
        os.close(fd)
    write = time.perf_counter() - start
    cache = drop_page_cache()
    out = np.empty(values[0].nbytes, dtype=np.uint8)
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            f.readinto(out.data)
    read = time.perf_counter() - start
    for path in paths:
        os.unlink(path)
    return write, read, cache


def run(quick: bool = False, directory: str | None = None, progress=None) -> dict:
    sizes = QUICK_SIZES if quick else FULL_SIZES
    total = (16 << 20) if quick else (256 << 20)
    repeats = 3 if quick else 5
    rng = np.random.default_rng(0)
    work = tempfile.mkdtemp(prefix="kvoffload-bench-", dir=directory)
    rows = []
    try:
        for size in sizes:
            count = max(total // size, 2)
            values = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]
            outs = [np.empty_like(v) for v in values]
            keys = [b"k%d" % i for i in range(count)]
            nbytes = size * count
            memcpy = median_seconds(functools.partial(_copy_all, outs, values), repeats)
            with open_store(f"memory://?capacity={2 * nbytes + (64 << 20)}&pinned=false") as mem:
                mem_put = median_seconds(functools.partial(_put_all, mem, keys, values), repeats)
                mem_get = median_seconds(functools.partial(mem.get_many, keys, outs), repeats)
            raw_write, raw_read, cache = _raw_file(work, values)
            path = os.path.join(work, f"lmdb-{size}")
            with open_store(f"lmdb://{path}?capacity={4 * nbytes + (256 << 20)}") as disk:
                batch = max(1, (64 << 20) // size)
                start = time.perf_counter()
                for i in range(0, count, batch):
                    assert all(disk.put_many(list(zip(keys[i : i + batch], values[i : i + batch]))))
                lmdb_put = time.perf_counter() - start
            cache = drop_page_cache()
            with open_store(f"lmdb://{path}?capacity={4 * nbytes + (256 << 20)}") as disk:
                start = time.perf_counter()
                sizes_read = disk.get_many(keys, outs)
                lmdb_get = time.perf_counter() - start
                assert all(s == size for s in sizes_read) and np.array_equal(outs[-1], values[-1])
            shutil.rmtree(path)
            row: dict[str, Any] = {
                "value_bytes": size,
                "values": count,
                "bytes": nbytes,
                "memcpy_GBps": _gbps(nbytes, memcpy),
                "memory_put_GBps": _gbps(nbytes, mem_put),
                "memory_get_GBps": _gbps(nbytes, mem_get),
                "raw_write_fsync_GBps": _gbps(nbytes, raw_write),
                "raw_read_GBps": _gbps(nbytes, raw_read),
                "lmdb_put_GBps": _gbps(nbytes, lmdb_put),
                "lmdb_get_GBps": _gbps(nbytes, lmdb_get),
                "page_cache_before_reads": cache,
            }
            row["ratios"] = {
                "memory_get_vs_memcpy": round(row["memory_get_GBps"] / row["memcpy_GBps"], 3),
                "lmdb_put_vs_raw_write": round(row["lmdb_put_GBps"] / row["raw_write_fsync_GBps"], 3),
                "lmdb_get_vs_raw_read": round(row["lmdb_get_GBps"] / row["raw_read_GBps"], 3),
            }
            rows.append(row)
            if progress:
                progress(
                    f"[bench store] {size >> 10} KiB x {count}: "
                    + ", ".join(f"{k} {v}" for k, v in row["ratios"].items())
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    targets = {"memory_get_vs_memcpy": 0.9, "lmdb_put_vs_raw_write": 0.7, "lmdb_get_vs_raw_read": 0.8}
    return new_result("store", quick, targets=targets, results=rows)
