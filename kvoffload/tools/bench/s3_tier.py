"""The S3 tier's save and load GB/s and per-value p50/p99 latency, on a real S3 server started for the
run (SeaweedFS `weed mini` on 127.0.0.1), for 72 KiB pages, 2 MiB and 50 MiB values and a whole
GLM-5.3-Flash block (vLLM's 4352-token block at TP 1: one value per cache group), against, in the same
run on the same bytes:

- the raw clients on the same server: obstore (the one the tier uses) and boto3 (where installed; not
  a kvoffload dependency), the same concurrency (THREADS requests at once) and no entry header;
- LMDB on the local disk (the tier in front of it);
- a raw loopback HTTP copy: PUT and GET of the same bytes to a minimal in-process HTTP/1.1 server that
  keeps them in memory (what moving the bytes over loopback HTTP costs without any object store).

The difference between the tier and raw obstore is kvoffload's own work (the header and its xxh3-128
checksum, verification, the index); between raw obstore and the loopback copy, the S3 server's."""

from __future__ import annotations

import http.client
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ...store import open_store
from ...store.s3_store import THREADS
from .common import median_seconds, new_result
from .s3_server import ACCESS_KEY, SECRET_KEY, Server

KIB, MIB = 1 << 10, 1 << 20
FULL_SIZES = [("72KiB", [72 * KIB]), ("2MiB", [2 * MIB]), ("50MiB", [50 * MIB])]
QUICK_SIZES = [("72KiB", [72 * KIB]), ("2MiB", [2 * MIB])]
LATENCY_SAMPLES = 20  # single-value requests per size for p50/p99


def glm_block() -> list[int]:
    """The bytes of each cache group's page set of one vLLM block of GLM-5.3-Flash (TP 1)."""
    from glm_integration.cache import PagedCache
    from glm_integration.config import preset

    from .footprint import vllm_block_size

    config = preset("full")
    layout = PagedCache(config, vllm_block_size(config), 1, index_format="fp8", device="meta").layout
    return [g.used_bytes_per_block for g in layout.cacheable_groups]


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered) * 1e3, 2),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 2),
    }


class _Sink(BaseHTTPRequestHandler):
    """PUT keeps the body in memory, GET sends it back: HTTP/1.1 keep-alive, no logging."""

    protocol_version = "HTTP/1.1"
    data: dict[str, bytearray] = {}

    def do_PUT(self):  # noqa: N802 - http.server's name
        body = bytearray(int(self.headers["Content-Length"]))
        self.rfile.readinto(body)
        self.data[self.path] = body
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):  # noqa: N802
        body = self.data[self.path]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _SinkServer(ThreadingHTTPServer):
    request_queue_size = 128  # THREADS clients connect at once
    daemon_threads = True


class _Loopback:
    """Clients of the sink: one connection per thread."""

    def __init__(self):
        self.server = _SinkServer(("127.0.0.1", 0), _Sink)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        if not hasattr(self.local, "conn"):
            self.local.conn = http.client.HTTPConnection("127.0.0.1", self.server.server_address[1])
        return self.local.conn

    def put(self, key: str, value: bytes) -> None:
        conn = self._conn()
        conn.request("PUT", "/" + key, body=value)
        conn.getresponse().read()

    def get(self, key: str) -> bytes:
        conn = self._conn()
        conn.request("GET", "/" + key)
        return conn.getresponse().read()

    def close(self) -> None:
        self.server.shutdown()
        _Sink.data.clear()


def _clients(server: Server, loopback: _Loopback) -> dict[str, tuple[Callable, Callable]]:
    """name -> (put(key, value), get(key)) of the raw baselines."""
    import obstore

    raw = server.client()
    clients: dict[str, tuple[Callable, Callable]] = {
        "obstore": (lambda k, v: obstore.put(raw, "raw/" + k, v), lambda k: obstore.get(raw, "raw/" + k).bytes()),
        "loopback_http": (loopback.put, loopback.get),
    }
    try:
        import boto3
        import botocore.config
    except ImportError:
        return clients
    b3 = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        config=botocore.config.Config(max_pool_connections=THREADS, retries={"max_attempts": 1}),
    )
    clients["boto3"] = (
        lambda k, v: b3.put_object(Bucket=server.bucket, Key="boto/" + k, Body=v),
        lambda k: b3.get_object(Bucket=server.bucket, Key="boto/" + k)["Body"].read(),
    )
    return clients


def _measure(save, load, put1, get1, nbytes: int, samples: int, repeats: int) -> dict[str, Any]:
    """Batch save/load GB/s (median of `repeats`), then p50/p99 of `samples` single-value puts and gets."""
    save_s, load_s = median_seconds(save, repeats), median_seconds(load, repeats)
    puts, gets = [], []
    for i in range(samples):
        t = time.perf_counter()
        put1(i)
        puts.append(time.perf_counter() - t)
        t = time.perf_counter()
        get1(i)
        gets.append(time.perf_counter() - t)
    return {
        "save_GBps": _gbps(nbytes, save_s),
        "load_GBps": _gbps(nbytes, load_s),
        "put": _percentiles(puts),
        "get": _percentiles(gets),
    }


def _ignore(i: int, view: memoryview) -> None:
    pass


def _store_target(store, label: str, keys: list[str], values: list[bytes], bench: str = "s3"):
    bkeys = [f"{label}-{k}".encode() for k in keys]

    def save():
        if not all(store.put_many(list(zip(bkeys, values)))):
            raise RuntimeError(f"bench {bench}: {label} dropped a value")

    def load():
        if not all(store.read_many(bkeys, lambda i, v: None)):
            raise RuntimeError(f"bench {bench}: {label} missed a value")

    return save, load, lambda i: store.put_many([(bkeys[i], values[i])]), lambda i: store.read_many([bkeys[i]], _ignore)


def _client_target(put, get, pool, keys: list[str], values: list[bytes]):
    def save():
        list(pool.map(put, keys, values))

    def load():
        if any(len(v) != len(values[i]) for i, v in enumerate(pool.map(get, keys))):
            raise RuntimeError("bench s3: a raw get returned other bytes")

    return save, load, lambda i: put(keys[i], values[i]), lambda i: get(keys[i])


def _row(name: str, sizes: list[int], total: int, stores: dict, clients: dict, pool, repeats: int) -> dict:
    count = max(total // sum(sizes), 1 if len(sizes) > 1 else 2) * len(sizes)  # a GLM block: one, whole
    values = [os.urandom(sizes[i % len(sizes)]) for i in range(count)]
    keys = [f"{name}-{i}" for i in range(count)]
    nbytes = sum(map(len, values))
    samples = min(LATENCY_SAMPLES, count)
    row: dict[str, Any] = {"value": name, "values": count, "bytes": nbytes}
    for label, store in stores.items():
        save, load, put1, get1 = _store_target(store, label, keys, values)
        row[label] = _measure(save, load, put1, get1, nbytes, samples, repeats)
    for label, (put, get) in clients.items():
        save, load, put1, get1 = _client_target(put, get, pool, keys, values)
        row["raw_" + label] = _measure(save, load, put1, get1, nbytes, samples, repeats)
    return row


def run(quick: bool = False, repeats: int = 3, progress=None) -> dict:
    progress = progress or (lambda message: None)
    total = (8 if quick else 64) * MIB
    sizes = list(QUICK_SIZES if quick else FULL_SIZES)
    if not quick:
        sizes.append(("glm_block", glm_block()))
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvoffload-s3-bench-") as tmp:
        server = Server(os.path.join(tmp, "weed"))
        loopback = _Loopback()
        saved = {k: os.environ.get(k) for k in server.env()}
        os.environ.update(server.env())
        stores: dict[str, Any] = {}
        try:
            capacity = 64 * total
            stores["s3"] = open_store(
                f"s3://{server.bucket}/bench?endpoint={server.endpoint}&capacity={capacity}&timeout=30",
                fingerprint=b"bench-layout",
            )
            stores["lmdb"] = open_store(
                f"lmdb://{tmp}/lmdb?capacity={8 * total + 4 * (200 * MIB)}", fingerprint=b"bench-layout"
            )
            clients = _clients(server, loopback)
            with ThreadPoolExecutor(THREADS) as pool:
                # the server allocates its volumes on the first writes: not in anyone's figures
                _row("warm-up", [2 * MIB], 32 * MIB, stores, clients, pool, 1)
                for name, group_sizes in sizes:
                    row = _row(name, group_sizes, total, stores, clients, pool, repeats)
                    rows.append(row)
                    shown = [f"{k} {v['save_GBps']}/{v['load_GBps']}" for k, v in row.items() if isinstance(v, dict)]
                    progress(f"[bench s3] {name} x {row['values']}: {', '.join(shown)} GB/s save/load")
        finally:
            for store in stores.values():
                store.close()
            loopback.close()
            server.stop()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return new_result(
        "s3",
        quick,
        server="SeaweedFS 4.48 `weed mini` on 127.0.0.1 (master, volume, filer, S3 gateway in one process)",
        threads=THREADS,
        results=rows,
    )
