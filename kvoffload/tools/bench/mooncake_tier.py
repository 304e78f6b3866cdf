"""The Mooncake tier's save and load GB/s and per-value p50/p99 latency, on a real `mooncake_master`
started for the run (127.0.0.1, TCP transport, this process contributing the pool's memory), for 72 KiB
pages and 2 MiB and 50 MiB values, against, in the same run on the same bytes:

- the raw Mooncake client: the same `upsert_batch` / `get_batch` calls in the same buffer-sized
  batches, no entry header (what kvoffload's own work costs: the header, its checksum, verification);
- the Redis tier on a local redis-server (the other shared tier);
- a raw loopback TCP copy: PUT and GET of the same bytes to a minimal in-process HTTP/1.1 server that
  keeps them in memory (what moving the bytes over loopback costs without any store)."""

from __future__ import annotations

import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...store import open_store
from .common import new_result
from .mooncake_server import Master
from .redis_server import Server as RedisServer
from .s3_tier import KIB, LATENCY_SAMPLES, MIB, _Loopback, _measure, _store_target

FULL_SIZES = [("72KiB", 72 * KIB), ("2MiB", 2 * MIB), ("50MiB", 50 * MIB)]
QUICK_SIZES = [("72KiB", 72 * KIB), ("2MiB", 2 * MIB)]
THREADS = 8  # the loopback copy's concurrent connections


def _raw_target(store, keys: list[str], values: list[bytes]):
    """The tier's own client, its batch calls, no entry header."""
    client, names = store.client, [f"raw-{k}" for k in keys]
    runs = store._batches([len(v) for v in values])

    def save():
        for a, b in runs:
            if client.upsert_batch(names[a:b], values[a:b]) != 0:
                raise RuntimeError("bench mooncake: a raw upsert failed")

    def load():
        for a, b in runs:
            if any(len(v) != len(values[a + i]) for i, v in enumerate(client.get_batch(names[a:b]))):
                raise RuntimeError("bench mooncake: a raw get returned other bytes")

    return save, load, lambda i: client.upsert(names[i], values[i]), lambda i: client.get(names[i])


def _loopback_target(loopback: _Loopback, pool, keys: list[str], values: list[bytes]):
    def save():
        list(pool.map(loopback.put, keys, values))

    def load():
        if any(len(v) != len(values[i]) for i, v in enumerate(pool.map(loopback.get, keys))):
            raise RuntimeError("bench mooncake: a loopback get returned other bytes")

    return save, load, lambda i: loopback.put(keys[i], values[i]), lambda i: loopback.get(keys[i])


def _row(name: str, size: int, total: int, stores: dict, loopback: _Loopback, pool, repeats: int) -> dict:
    import os

    count = max(total // size, 2)
    values = [os.urandom(size) for _ in range(count)]
    keys = [f"{name}-{i}" for i in range(count)]
    nbytes = count * size
    samples = min(LATENCY_SAMPLES, count)
    row: dict[str, Any] = {"value": name, "values": count, "bytes": nbytes}
    targets = {label: _store_target(store, label, keys, values, "mooncake") for label, store in stores.items()}
    targets["raw_mooncake"] = _raw_target(stores["mooncake"], keys, values)
    targets["raw_loopback_tcp"] = _loopback_target(loopback, pool, keys, values)
    for label, (save, load, put1, get1) in targets.items():
        row[label] = _measure(save, load, put1, get1, nbytes, samples, repeats)
    return row


def run(quick: bool = False, repeats: int = 3, progress=None) -> dict:
    progress = progress or (lambda message: None)
    total = (8 if quick else 64) * MIB
    sizes = QUICK_SIZES if quick else FULL_SIZES
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvoffload-mooncake-bench-") as tmp, Master() as master:
        redis = RedisServer(tmp, maxmemory=f"{4 * total + 256 * MIB}")
        loopback = _Loopback()
        stores: dict[str, Any] = {}
        try:
            # the pool holds the tier's and the raw client's copies of every size at once
            segment, buffer = 8 * total + 512 * MIB, 128 * MIB
            stores["mooncake"] = open_store(master.url(segment=segment, buffer=buffer), fingerprint=b"bench-layout")
            stores["redis"] = open_store(f"redis://{redis.address}/0?timeout=30", fingerprint=b"bench-layout")
            with ThreadPoolExecutor(THREADS) as pool:
                for name, size in sizes:
                    row = _row(name, size, total, stores, loopback, pool, repeats)
                    rows.append(row)
                    shown = [f"{k} {v['save_GBps']}/{v['load_GBps']}" for k, v in row.items() if isinstance(v, dict)]
                    progress(f"[bench mooncake] {name} x {row['values']}: {', '.join(shown)} GB/s save/load")
        finally:
            for store in stores.values():
                store.close()
            loopback.close()
            redis.stop()
    from importlib.metadata import version

    return new_result(
        "mooncake",
        quick,
        server=f"mooncake_master {version('mooncake-transfer-engine-non-cuda')} on 127.0.0.1, TCP transport, "
        "its HTTP metadata server; redis-server on 127.0.0.1",
        results=rows,
    )
