"""Flipped payload bytes and truncated files read as counted misses, never as wrong bytes."""

import os

import numpy as np
import pytest

from conftest import store_urls
from kvoffload import open_store


def _fill(url, n=12, size=50_000):
    values = {b"key%d" % i: np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
              for i in range(n)}
    with open_store(url) as store:
        assert all(store.put_many(list(values.items())))
    return values


def _flip_inside(path, needle: bytes, at: int):
    with open(path, "r+b") as f:
        data = f.read()
        pos = data.find(needle)
        assert pos >= 0, "payload not found in the data file"
        f.seek(pos + at)
        f.write(bytes([data[pos + at] ^ 0xFF]))


@pytest.mark.parametrize("at", [0, 1234, 49_999])
def test_flipped_payload_byte_is_a_counted_miss(tmp_path, at):
    url = f"lmdb://{tmp_path}/db?capacity=64MiB"
    values = _fill(url)
    victim = b"key5"
    _flip_inside(f"{tmp_path}/db/data.mdb", values[victim][:64] if at >= 64 else values[victim][at:at + 64],
                 at if at >= 64 else 0)
    with open_store(url) as store:
        assert store.get(victim) is None
        out = bytearray(len(values[victim]))
        assert store.get_into(victim, out) is None
        stats = store.stats()
        assert stats["checksum_failures"] == 1
        assert not store.contains(victim)  # the corrupt entry was deleted
        for key, value in values.items():
            if key != victim:
                assert store.get(key) == value
        assert store.stats()["checksum_failures"] == 1


def test_every_payload_flipped_serves_nothing_wrong(tmp_path):
    url = f"lmdb://{tmp_path}/db?capacity=64MiB"
    values = _fill(url, n=6)
    for key, value in values.items():
        _flip_inside(f"{tmp_path}/db/data.mdb", value[:64], 100 + int(key[3:]) * 7)
    with open_store(url) as store:
        assert [store.get(k) for k in values] == [None] * len(values)
        assert store.stats()["checksum_failures"] == len(values)


def test_truncated_data_file_reads_as_misses(tmp_path):
    url = f"lmdb://{tmp_path}/db?capacity=64MiB"
    values = _fill(url, n=40)
    data = f"{tmp_path}/db/data.mdb"
    os.truncate(data, 300 * 1024)  # well inside the committed pages
    with open_store(url) as store:
        for key, value in values.items():
            assert store.get(key) in (None, value)
        stats = store.stats()
        assert stats["misses"] == len(values)
        assert stats["damaged_files_reset"] == 1
        assert store.put(b"after", b"works")  # the store is usable again
        assert store.get(b"after") == b"works"
    assert any(name.startswith("data.mdb.damaged-") for name in os.listdir(f"{tmp_path}/db"))


def test_truncation_of_unused_tail_loses_nothing(tmp_path):
    url = f"lmdb://{tmp_path}/db?capacity=64MiB"
    values = _fill(url, n=10)
    import lmdb

    env = lmdb.open(f"{tmp_path}/db", readonly=True, lock=False, max_dbs=8)
    committed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    env.close()
    os.truncate(f"{tmp_path}/db/data.mdb", committed)  # only the preallocated, unused tail goes
    with open_store(url) as store:
        assert all(store.get(k) == v for k, v in values.items())
        assert store.stats().get("damaged_files_reset", 0) == 0


def test_header_record_corruption_is_a_miss(tmp_path):
    """A damaged header (wrong length field) must not let a short or long payload through."""
    url = f"lmdb://{tmp_path}/db?capacity=64MiB"
    _fill(url, n=3)
    import lmdb

    env = lmdb.open(f"{tmp_path}/db", max_dbs=8)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        raw = bytearray(txn.get(b"key1", db=meta))
        raw[24] ^= 0x01  # inside the payload-length field
        txn.put(b"key1", bytes(raw), db=meta)
    env.close()
    with open_store(url) as store:
        assert store.get(b"key1") is None
        assert store.stats()["length_mismatch"] == 1


@pytest.mark.parametrize("tier", ["lmdb", "tiered"])
def test_counter_reads_what_stats_reports_without_usage(tmp_path, tier):
    """`counter` is the per-step form of `stats()` (vLLM's worker metrics): the same figures, a tiered
    store's checksum failures being its disk tier's."""
    url = store_urls(tmp_path)[tier]
    values = _fill(url, n=6)
    path = f"{tmp_path}/{tier}/data.mdb"
    _flip_inside(path, values[b"key2"][:64], 100)
    with open_store(url) as store:
        assert store.get(b"key2") is None and store.get(b"key3") == values[b"key3"] and store.get(b"none") is None
        stats = store.stats()
        assert stats["checksum_failures"] == 1
        for name in (*store.COUNTERS, "checksum_failures"):
            assert store.counter(name) == stats[name], name
