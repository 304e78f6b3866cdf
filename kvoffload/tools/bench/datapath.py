"""The data path end to end, through the real tiers, with fresh keys every repetition (real saves, never
keys already stored), against baselines measured in the same run on the same bytes:

- memory tier (the pinned arena): save (device -> arena slots), load (arena slots -> device) and both
  at once (two threads, each with its own transfer), against a raw pinned memcpy each way and both
  ways at once. The arena is filled before timing (its chunks page-locked once, as in a running engine)
  and every timed save evicts; `first_fill` reports the cold arena separately;
- tiered memory + LMDB (write-behind): what the save keeps the engine waiting (the memory-tier save),
  the background drain to LMDB against a raw write + fsync of the same bytes to the same file system,
  and a load of a prefix that is only on LMDB (page cache dropped), through `tiered://` and through
  `lmdb://` (the same LMDB store alone), against a raw sequential read and against a plain-file read
  path (as many bytes, `pread` by as many threads as LMDB's readers into pinned memory, then one copy
  to the device): whether LMDB's map, not the disk, is the ceiling;
- `lmdb://` with its data in the page cache -> device, on one reader and on `READERS` reader threads,
  against a raw read of as many bytes of the same file by as many threads into pinned memory: the
  software ceiling of the disk tier, independent of this machine's disk.

Two workloads, as `bench transfer`: every cacheable page of each block, and MLA latent + indexer pages
only. Without a GPU the same code runs on a host buffer (it checks the benchmark, not the link). The
heap is frozen after set-up (`gc.freeze`), as vLLM's engine freezes it once started: thousands of small
pages a save allocate enough objects to trigger collections, which would otherwise walk torch's heap."""

from __future__ import annotations

import gc
import os
import tempfile
import threading
import time
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from ...connectors.device_transfer import DeviceTransfer
from ...spec import GroupKind
from ...store import MemoryStore, TieredStore, open_store
from ...store.lmdb_reads import READERS
from .common import new_result
from .transfer import _device_name, _median_gbps, _nbytes, _sync, pages_of

RAW_FILE = "raw.bin"  # the raw write and read baselines' file, read again by the plain-file path


def _moved(items: list, half: int) -> list:
    """The same pages (keys) placed `half` blocks further on: where a load puts them back."""
    return [p._replace(block=p.block + half) for p in items]


def run(
    quick: bool = False,
    progress=None,
    preset: str = "pruned-4l",
    block_size: int = 64,
    blocks: int = 256,
    mla_blocks: int = 2048,
    repeats: int = 7,
    disk_dir: str | None = None,
) -> dict:
    from glm_integration.cache import PagedCache
    from glm_integration.config import preset as make_preset

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if quick or device.type != "cuda":
        preset, blocks, repeats = ("pruned-4l", 16, 3) if device.type == "cuda" else ("tiny", 32, 3)
        mla_blocks = blocks // 2
    # MLA pages are small (tens of KiB a block): their workload takes many more blocks of the cache.
    cache = PagedCache(make_preset(preset), block_size, max(blocks, 2 * mla_blocks), device=device)
    cache.buffer.random_(0, 256)
    gc.collect()
    gc.freeze()  # as vLLM's engine does once started: a collection walks what came after, not torch's heap
    progress = progress or (lambda message: None)
    workloads = {
        "all_groups": ({GroupKind.PAGED, GroupKind.STATE}, blocks // 2),
        "mla_pages": ({GroupKind.PAGED}, mla_blocks),
    }
    results = {}
    for name, (kinds, half) in workloads.items():
        results[name] = _memory_tier(cache, kinds, half, device, repeats)
        progress(
            f"[bench datapath] {name} memory tier: {results[name]['bytes'] / 2**30:.2f} GiB each way; "
            + ", ".join(f"{k} {v}" for k, v in results[name]["ratios"].items())
        )
    with tempfile.TemporaryDirectory(dir=disk_dir, prefix="kvoffload-datapath-") as tmp:
        results["all_groups"]["tiered_lmdb"] = _tiered(
            cache, workloads["all_groups"][0], blocks // 2, device, max(2, repeats // 2), tmp
        )
        progress(f"[bench datapath] tiered+lmdb: {results['all_groups']['tiered_lmdb']['ratios']}")
        results["all_groups"]["lmdb_page_cache"] = _lmdb_resident(
            cache, workloads["all_groups"][0], blocks // 2, device, repeats, tmp
        )
        progress(f"[bench datapath] lmdb in the page cache: {results['all_groups']['lmdb_page_cache']}")
    geometry = {"preset": preset, "block_size": block_size, "repeats": repeats}
    geometry["blocks_per_workload"] = {name: half for name, (_, half) in workloads.items()}
    return new_result("datapath", quick, _device_name(device), geometry=geometry, results=results)


def _raw(nbytes: int, device, repeats: int) -> dict:
    gpu = device.type == "cuda"
    src, back = (torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2))
    host_out, host_in = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=gpu) for _ in range(2))
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)] if gpu else []

    def save():
        with torch.cuda.stream(streams[0]) if streams else nullcontext():
            host_out.copy_(src, non_blocking=gpu)

    def load():
        with torch.cuda.stream(streams[1]) if streams else nullcontext():
            back.copy_(host_in, non_blocking=gpu)

    rows = {
        "raw_memcpy_save_GBps": _median_gbps(save, nbytes, repeats, device),
        "raw_memcpy_load_GBps": _median_gbps(load, nbytes, repeats, device),
        "raw_memcpy_both_GBps": _median_gbps(lambda: (save(), load()), 2 * nbytes, repeats, device),
    }
    return rows


def _memory_tier(cache, kinds, half: int, device, repeats: int) -> dict:
    probe = pages_of(cache.layout, range(half), kinds, "probe/")
    nbytes = _nbytes(probe)
    rows = _raw(nbytes, device, repeats)
    # Room for three repetitions' pages: the timed saves evict, and the pages a load reads stay.
    store = MemoryStore(3 * nbytes + (256 << 20))
    saver, loader = DeviceTransfer(cache.buffer), DeviceTransfer(cache.buffer)
    counter = iter(range(1 << 30))

    def fresh() -> list:
        return pages_of(cache.layout, range(half), kinds, f"r{next(counter)}/")

    def timed(fn) -> float:
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - start

    first = fresh()
    first_fill = timed(lambda: saver.save(store, first))
    for _ in range(3):  # the arena reaches its capacity: from here on every save evicts
        saver.save(store, fresh())
    saves, loads, both = [], [], []
    previous = fresh()
    assert all(saver.save(store, previous)), "the memory tier dropped pages of a fresh save"
    for _ in range(repeats):
        items = fresh()
        saves.append(timed(lambda items=items: _all(saver.save(store, items), "save")))
        into = _moved(items, half)
        loads.append(timed(lambda into=into: _all(loader.load(store, into), "load")))
        next_items = fresh()
        both.append(_both(saver, loader, store, next_items, _moved(items, half), device))
    _check_round_trip(cache, items, half)
    median = lambda xs, n=nbytes: round(n / float(np.median(xs)) / 1e9, 2)  # noqa: E731
    rows.update(
        {
            "arena_save_GBps": median(saves),
            "arena_load_GBps": median(loads),
            "arena_both_GBps": median(both, 2 * nbytes),
            "first_fill_save_GBps": round(nbytes / first_fill / 1e9, 2),
        }
    )
    stats = store.stats()
    store.close()
    ratio = lambda a, b: round(rows[a] / rows[b], 3)  # noqa: E731
    return {
        "pages": len(probe),
        "bytes": nbytes,
        **rows,
        "arena_evictions": stats["evictions"],
        "ratios": {
            "save_vs_memcpy": ratio("arena_save_GBps", "raw_memcpy_save_GBps"),
            "load_vs_memcpy": ratio("arena_load_GBps", "raw_memcpy_load_GBps"),
            "both_vs_memcpy": ratio("arena_both_GBps", "raw_memcpy_both_GBps"),
        },
    }


def _all(ok: list[bool], what: str) -> None:
    if not all(ok):
        raise RuntimeError(f"bench datapath: {ok.count(False)} of {len(ok)} pages failed to {what}")


def _both(saver, loader, store, save_items, load_items, device) -> float:
    """A save of fresh pages and a load of stored ones at once, each on its own thread and streams."""
    errors = []

    def work(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    _sync(device)
    start = time.perf_counter()
    threads = [
        threading.Thread(target=work, args=(lambda: _all(saver.save(store, save_items), "save"),)),
        threading.Thread(target=work, args=(lambda: _all(loader.load(store, load_items), "load"),)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _sync(device)
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def _check_round_trip(cache, items, half: int) -> None:
    """The loaded blocks equal the saved ones, byte for byte (a fast path that moved the wrong bytes
    would otherwise look fast)."""
    from ...connectors.transfer import page_spans

    for p in items[:64]:
        for (src, n), (dst, _) in zip(page_spans(p.group, p.block), page_spans(p.group, p.block + half)):
            if not torch.equal(cache.buffer[src : src + n], cache.buffer[dst : dst + n]):
                raise RuntimeError(f"bench datapath: block {p.block} of {p.group.name} came back different")


def _tiered(cache, kinds, half: int, device, repeats: int, tmp: str) -> dict:
    items = pages_of(cache.layout, range(half), kinds, "probe/")
    nbytes = _nbytes(items)
    lmdb_capacity = (repeats + 1) * nbytes + (256 << 20)
    url = (
        f"tiered://?memory={2 * nbytes + (256 << 20)}&lmdb={tmp}/store&lmdb_capacity={lmdb_capacity}"
        f"&behind_bytes={2 * nbytes}"
    )
    store = open_store(url)
    if not isinstance(store, TieredStore):
        raise TypeError(f"bench datapath: {url} opened a {type(store).__name__}, not a tiered store")
    saver, loader = DeviceTransfer(cache.buffer), DeviceTransfer(cache.buffer)
    waits, drains, raw_writes, raw_reads = [], [], [], []
    loads: list[float] = []
    lmdb_loads: list[float] = []
    plain_reads: list[float] = []
    for rep in range(repeats):
        fresh = pages_of(cache.layout, range(half), kinds, f"t{rep}/")
        _sync(device)
        start = time.perf_counter()
        _all(saver.save(store, fresh), "save")
        waits.append(time.perf_counter() - start)
        if not store.flush(timeout=600):
            raise RuntimeError("bench datapath: the write-behind did not drain in 10 minutes")
        drains.append(time.perf_counter() - start)
        raw_writes.append(_raw_write(tmp, nbytes))
    stats = store.stats()
    store.close()
    # A prefix only on LMDB: a fresh process's view (empty memory tier), the data file out of the page cache;
    # through `tiered://` and through the same LMDB store opened alone (`lmdb://`). The plain-file path's
    # buffers are made once, outside its timing.
    gpu = device.type == "cuda"
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=gpu)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device) if gpu else None
    for rep in range(repeats):
        into = _moved(pages_of(cache.layout, range(half), kinds, f"t{rep}/"), half)
        for timings, store_url in ((loads, url), (lmdb_loads, f"lmdb://{tmp}/store?capacity={lmdb_capacity}")):
            _drop_file_cache(os.path.join(tmp, "store", "data.mdb"))
            store = open_store(store_url)
            timings.append(timed_load(loader, store, into, device))
            store.close()
        raw_reads.append(_raw_read(tmp, nbytes))
        plain_reads.append(_plain_file_load(tmp, pinned, on_device, device))
    gbps = lambda xs: round(nbytes / float(np.median(xs)) / 1e9, 2)  # noqa: E731
    rows: dict[str, Any] = {
        "bytes": nbytes,
        "engine_wait_GBps": gbps(waits),
        "drain_GBps": gbps(drains),
        "raw_write_fsync_GBps": gbps(raw_writes),
        "lmdb_only_load_GBps": gbps(loads),
        "lmdb_store_load_GBps": gbps(lmdb_loads),
        "raw_sequential_read_GBps": gbps(raw_reads),
        "plain_file_load_GBps": gbps(plain_reads),
        "behind_written": stats.get("behind_written"),
        "behind_dropped": stats.get("behind_dropped"),
    }
    rows["ratios"] = {
        "drain_vs_write_fsync": round(rows["drain_GBps"] / rows["raw_write_fsync_GBps"], 3),
        "lmdb_load_vs_sequential_read": round(rows["lmdb_only_load_GBps"] / rows["raw_sequential_read_GBps"], 3),
        "lmdb_store_load_vs_sequential_read": round(rows["lmdb_store_load_GBps"] / rows["raw_sequential_read_GBps"], 3),
        "lmdb_store_load_vs_plain_file_load": round(rows["lmdb_store_load_GBps"] / rows["plain_file_load_GBps"], 3),
    }
    return rows


def _plain_file_load(tmp: str, pinned: torch.Tensor, on_device: torch.Tensor | None, device) -> float:
    """Seconds to load the bytes of the raw file (`_raw_write`, as many as the pages) cold from it instead
    of LMDB, read with `pread` by READERS threads straight into `pinned` memory (no map, no checksum, one
    run per thread), then one copy `on_device`: the plain-file read path LMDB's map is compared with."""
    path = os.path.join(tmp, RAW_FILE)
    _drop_file_cache(path)
    _sync(device)
    start = time.perf_counter()
    _threaded_pread(path, pinned.numpy(), READERS, chunk=16 << 20)
    if on_device is not None:
        on_device.copy_(pinned, non_blocking=True)
    _sync(device)
    return time.perf_counter() - start


def timed_load(loader, store, items, device) -> float:
    _sync(device)
    start = time.perf_counter()
    _all(loader.load(store, items), "load")
    _sync(device)
    return time.perf_counter() - start


def _lmdb_resident(cache, kinds, half: int, device, repeats: int, tmp: str) -> dict:
    """Load a prefix from `lmdb://` whose data file is in the page cache (just written), with one reader
    and with READERS threads, against a threaded raw read of the file into pinned memory."""
    from ...store.lmdb_store import LMDBStore

    items = pages_of(cache.layout, range(half), kinds, "resident/")
    nbytes = _nbytes(items)
    path = os.path.join(tmp, "resident")
    capacity = 2 * nbytes + (256 << 20)
    with LMDBStore(path, capacity) as store:
        _all(DeviceTransfer(cache.buffer).save(store, items), "save")
    into = _moved(items, half)
    loader = DeviceTransfer(cache.buffer)
    rows: dict[str, Any] = {"bytes": nbytes, "readers": READERS}
    for readers in sorted({1, READERS}):
        with LMDBStore(path, capacity, readers=readers) as store:
            timed_load(loader, store, into, device)  # the map's pages faulted in once, as in a running engine
            rows[f"load_GBps_{readers}_readers"] = round(
                nbytes / float(np.median([timed_load(loader, store, into, device) for _ in range(repeats)])) / 1e9, 2
            )
    _check_round_trip(cache, items, half)
    rows["raw_threaded_read_GBps"] = round(
        nbytes / _raw_threaded_read(os.path.join(path, "data.mdb"), nbytes, READERS, repeats) / 1e9, 2
    )
    rows["ratios"] = {
        "load_vs_threaded_read": round(rows[f"load_GBps_{READERS}_readers"] / rows["raw_threaded_read_GBps"], 3)
    }
    return rows


def _raw_threaded_read(path: str, nbytes: int, threads: int, repeats: int) -> float:
    """Median seconds for `threads` threads to pread `nbytes` of `path` (in the page cache) into pinned memory."""
    size = min(nbytes, os.path.getsize(path))
    target = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available()).numpy()
    _threaded_pread(path, target, threads)
    return float(np.median([_threaded_pread(path, target, threads) for _ in range(repeats)])) * nbytes / size


def _threaded_pread(path: str, into: np.ndarray, threads: int, chunk: int = 64 << 20) -> float:
    """Seconds for `threads` threads to `pread` the first `into.nbytes` bytes of `path` into `into`, one
    contiguous run each."""
    bounds = np.linspace(0, into.nbytes, threads + 1).astype(np.int64)
    errors: list[BaseException] = []
    fd = os.open(path, os.O_RDONLY)
    try:

        def part(k: int) -> None:
            at, end = int(bounds[k]), int(bounds[k + 1])
            try:
                while at < end:
                    got = os.preadv(fd, [into[at : min(end, at + chunk)].data], at)  # .data: its memoryview
                    if got <= 0:
                        raise OSError(f"bench datapath: {path} ended at byte {at}")
                    at += got
            except OSError as exc:
                errors.append(exc)

        workers = [threading.Thread(target=part, args=(k,)) for k in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
    if errors:
        raise errors[0]
    return seconds


def _raw_write(tmp: str, nbytes: int, chunk: int = 64 << 20) -> float:
    """Write `nbytes` sequentially into a new file and fsync it: the disk's own speed for these bytes."""
    data = np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes()
    path = os.path.join(tmp, RAW_FILE)
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(data[: min(chunk, left)])
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def _raw_read(tmp: str, nbytes: int, chunk: int = 64 << 20) -> float:
    path = os.path.join(tmp, RAW_FILE)
    _drop_file_cache(path)
    buffer = bytearray(chunk)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    return time.perf_counter() - start


def _drop_file_cache(path: str) -> None:
    """Evict one file's pages from the page cache (no root needed: its pages are clean after fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
