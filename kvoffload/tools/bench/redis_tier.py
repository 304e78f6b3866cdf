"""The Redis tier's save and load GB/s against raw pipelined `SET`/`GET` of the same bytes through the
same client and connection, same run, on a local redis-server started for the run (maxmemory sized
for the data, allkeys-lru). The difference is kvoffload's own work: the entry header with its
xxh3-128 checksum on write, its verification on read, the key prefix, and per-node routing."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from ...store import open_store
from ...store.redis_store import RedisStore
from .common import machine, median_seconds
from .redis_server import Server

FULL_SIZES_KIB, QUICK_SIZES_KIB = [64, 1024, 4096], [64, 1024]


def _gbps(fn, nbytes: int, repeats: int) -> float:
    return round(nbytes / median_seconds(fn, repeats) / 1e9, 3)


def _row(store: RedisStore, kib: int, count: int, repeats: int) -> dict[str, Any]:
    """One value size: kvoffload's save and load against raw pipelined SET/GET of the same bytes."""
    client = store.client
    values = [os.urandom(kib << 10) for _ in range(count)]
    keys = [f"{kib}-{i}".encode() for i in range(count)]
    raw_keys = [b"raw:" + k for k in keys]
    nbytes = count * (kib << 10)

    def raw_set():
        pipe = client.pipeline(transaction=False)
        for key, value in zip(raw_keys, values):
            pipe.set(key, value)
        pipe.execute()

    def raw_get():
        pipe = client.pipeline(transaction=False)
        for key in raw_keys:
            pipe.get(key)
        assert all(v is not None for v in pipe.execute())

    def save():
        assert all(store.put_many(list(zip(keys, values))))

    def load():
        assert all(store.read_many(keys, lambda i, view: None))

    row: dict[str, Any] = {
        "value_KiB": kib,
        "values": count,
        "bytes": nbytes,
        "raw_set_GBps": _gbps(raw_set, nbytes, repeats),
        "save_GBps": _gbps(save, nbytes, repeats),
        "raw_get_GBps": _gbps(raw_get, nbytes, repeats),
        "load_GBps": _gbps(load, nbytes, repeats),
    }
    row["ratios"] = {
        "save_vs_raw_set": round(row["save_GBps"] / row["raw_set_GBps"], 3),
        "load_vs_raw_get": round(row["load_GBps"] / row["raw_get_GBps"], 3),
    }
    return row


def run(quick: bool = False, repeats: int = 3, progress=None) -> dict:
    total = (8 if quick else 256) << 20
    progress = progress or (lambda message: None)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvoffload-redis-bench-") as tmp:
        server = Server(tmp, maxmemory=f"{4 * total}")
        try:
            store = open_store(f"redis://{server.address}/0?namespace=bench", fingerprint=b"bench-layout")
            if not isinstance(store, RedisStore):
                raise TypeError(f"bench redis: opened a {type(store).__name__}, not a Redis store")
            for kib in QUICK_SIZES_KIB if quick else FULL_SIZES_KIB:
                count = max(total // (kib << 10), 2)
                row = _row(store, kib, count, repeats)
                rows.append(row)
                store.client.flushdb()
                progress(
                    f"[bench redis] {kib} KiB x {count}: save {row['save_GBps']} GB/s (raw SET "
                    f"{row['raw_set_GBps']}), load {row['load_GBps']} GB/s (raw GET {row['raw_get_GBps']})"
                )
            store.close()
        finally:
            server.stop()
    return {
        "benchmark": "redis",
        "quick": quick,
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "server": "redis-server 6.2 on 127.0.0.1 (loopback TCP), no persistence",
        "results": rows,
    }
