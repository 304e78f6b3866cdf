"""Store throughput: memory and LMDB put/get GB/s per value size, against baselines measured in the same
run on the same bytes: memcpy (memory tier), and raw sequential file write with fsync and raw read of
the same bytes on the same disk (LMDB). LMDB reads start from a dropped page cache where allowed.

Beside an engine: the same gets (LMDB from the page cache) and memcpy on a background thread, as a load
runs on the connector's transfer thread, while this thread runs engine-like steps (ENGINE_STEP_MS of
Python holding the GIL, then as long blocked without it, as a CUDA-graph step waits for the device).
A read that hands the GIL back and takes it again per value waits for the engine's Python each time;
the steps show what the read's own Python costs the engine."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ...store import Store, open_store
from .common import drop_page_cache, median_seconds, new_result

FULL_SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [64 << 10, 1 << 20]
ENGINE_STEP_MS = (1.5, 1.5)  # an engine step beside the reads: ms of Python (GIL held), then ms blocked


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def _copy_all(outs: list[np.ndarray], values: list[np.ndarray]) -> None:
    for out, value in zip(outs, values):
        np.copyto(out, value)


def _put_all(store: Store, keys: list[bytes], values: list[np.ndarray]) -> list[bool]:
    return store.put_many(list(zip(keys, values)))


def _python_for(seconds: float) -> None:
    """Run Python bytecode (holding the GIL but at switch intervals) for `seconds`."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def beside_engine_steps(read: Callable[[], object], nbytes: int, steps: int = 200) -> dict[str, float]:
    """`read()` (`nbytes` each) again and again on a background thread while this thread runs `steps`
    engine steps (ENGINE_STEP_MS) or more, until a read ends: the reads' GB/s, and the steps' p50 / p99
    in ms against the step alone."""
    busy, idle = (ms / 1e3 for ms in ENGINE_STEP_MS)
    enough = threading.Event()
    times: list[float] = []
    failed: list[BaseException] = []
    reads, took = [0], [0.0]  # reads done, seconds they took

    def reading() -> None:
        start = time.perf_counter()
        try:
            while not enough.is_set():
                read()
                reads[0] += 1
        except BaseException as exc:  # re-raised on this thread
            failed.append(exc)
            enough.set()
        took[0] = time.perf_counter() - start

    thread = threading.Thread(target=reading, name="kvoffload-bench-reads", daemon=True)
    thread.start()
    while not failed and (len(times) < steps or not reads[0]):
        step = time.perf_counter()
        _python_for(busy)
        time.sleep(idle)
        times.append(time.perf_counter() - step)
    enough.set()
    thread.join()
    if failed:
        raise failed[0]
    times.sort()
    return {
        "GBps": _gbps(reads[0] * nbytes, took[0]),
        "step_p50_ms": round(1e3 * times[len(times) // 2], 3),
        "step_p99_ms": round(1e3 * times[min(len(times) - 1, int(0.99 * len(times)))], 3),
        "step_alone_ms": round(1e3 * (busy + idle), 3),
        "steps": len(times),
    }


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
                lmdb_warm = median_seconds(functools.partial(disk.get_many, keys, outs), repeats)
                lmdb_beside = beside_engine_steps(functools.partial(disk.get_many, keys, outs), nbytes)
            memcpy_beside = beside_engine_steps(functools.partial(_copy_all, outs, values), nbytes)
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
                "lmdb_get_warm_GBps": _gbps(nbytes, lmdb_warm),
                "beside_engine_steps": {"lmdb_get_warm": lmdb_beside, "memcpy": memcpy_beside},
            }
            row["ratios"] = {
                "memory_get_vs_memcpy": round(row["memory_get_GBps"] / row["memcpy_GBps"], 3),
                "lmdb_put_vs_raw_write": round(row["lmdb_put_GBps"] / row["raw_write_fsync_GBps"], 3),
                "lmdb_get_vs_raw_read": round(row["lmdb_get_GBps"] / row["raw_read_GBps"], 3),
                "lmdb_get_warm_beside_engine_vs_alone": round(lmdb_beside["GBps"] / row["lmdb_get_warm_GBps"], 3),
                "memcpy_beside_engine_vs_alone": round(memcpy_beside["GBps"] / row["memcpy_GBps"], 3),
                "engine_step_p99_beside_lmdb_vs_alone": round(
                    lmdb_beside["step_p99_ms"] / lmdb_beside["step_alone_ms"], 3
                ),
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
    return new_result("store", quick, targets=targets, engine_step_ms=list(ENGINE_STEP_MS), results=rows)
