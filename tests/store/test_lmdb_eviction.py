"""The LMDB tier's eviction policies (`lmdb://...?evict=lru|s3fifo`): S3-FIFO keeps a hit working set
through a one-off scan that flushes LRU; both keep the hard cap, exact accounting and crash safety; a
store keeps the policy it was written with. `check_file` reads the file itself: every entry's records
agree, bytes_used and S3-FIFO's small_bytes are what the entries take."""

from __future__ import annotations

import logging
import random
import select
import signal
import struct
import subprocess
import sys
import time

import lmdb
import numpy as np
import pytest

from conftest import subprocess_env
from kvoffload import open_store
from kvoffload.store import StoreConfigError, parse_store_url
from kvoffload.store.lmdb_store import entry_charge, read_stats
from kvoffload.store.url_config import LMDBSpec, MemorySpec, TieredSpec

MAIN = 1 << 63
SIZE = 20_000  # an entry of 24 KiB charged: about 40 fit in 1 MiB
U64, TICK = struct.Struct(">Q"), struct.Struct("<Q")


def _policy(evict: str) -> str:
    """The URL option (none for LRU: the LRU cases run unchanged on a store that predates the option)."""
    return "" if evict == "lru" else f"&evict={evict}"


def _value(key: bytes, n: int = SIZE) -> bytes:
    return np.random.default_rng(list(key)).integers(0, 256, n, dtype=np.uint8).tobytes()


def check_file(path: str) -> dict:
    """The store's records, read raw (the store closed): every entry has its payload, meta and one
    index record at its meta's tick, and the counters are what the entries take."""
    env = lmdb.open(path, max_dbs=8)
    try:
        data_db, meta_db, index_db, info_db = (env.open_db(n) for n in (b"data", b"meta", b"lru", b"info"))
        with env.begin() as txn:
            sizes = {k: len(v) for k, v in txn.cursor(db=data_db)}
            ticks = {k: TICK.unpack(v[-8:])[0] for k, v in txn.cursor(db=meta_db)}
            index = [(U64.unpack(k[:8])[0], k[8:]) for k in txn.cursor(db=index_db).iternext(values=False)]
            info = {k: txn.get(k, db=info_db) for k in (b"bytes_used", b"small_bytes", b"tick", b"evict")}
    finally:
        env.close()
    assert set(sizes) == set(ticks) and sorted(index) == sorted((t, k) for k, t in ticks.items()), "records disagree"
    assert U64.unpack(info[b"bytes_used"][:8])[0] == sum(entry_charge(n) for n in sizes.values())
    evict = (info[b"evict"] or b"lru").decode()
    if evict == "s3fifo":
        small = [k for t, k in index if t < MAIN]
        assert U64.unpack(info[b"small_bytes"][:8])[0] == sum(entry_charge(sizes[k]) for k in small)
        assert all(t & (MAIN - 4) <= U64.unpack(info[b"tick"][:8])[0] for t, _ in index), "a counter ahead of the tick"
        assert len({t & (MAIN - 4) for t, _ in index}) == len(index), "two entries at one queue position"
    return {"evict": evict, "sizes": sizes, "main": {k for t, k in index if t >= MAIN},
            "hits": {k: t & 3 for t, k in index}}


def _edit_info(path: str, edit) -> None:
    env = lmdb.open(path, max_dbs=8)
    info = env.open_db(b"info")
    with env.begin(write=True) as txn:
        assert edit(txn, info) is not False
    env.close()


def _scan_after_working_set(store, prefix: bytes = b"") -> list[bool]:
    """A working set put and read three times, then a one-off scan of seven times the store: which
    of the working set is still there."""
    hot = [prefix + b"hot%d" % i for i in range(6)]
    assert store.put_many([(k, _value(k)) for k in hot]) == [True] * len(hot)
    for _ in range(3):
        assert all(store.get(k) == _value(k) for k in hot)
    scans = 7 * store.capacity // entry_charge(SIZE)
    for i in range(scans):
        assert store.put(prefix + b"scan%d" % i, _value(b"scan%d" % i))
        assert store.stats()["bytes_used"] <= store.capacity
    assert store.stats()["evictions"] >= scans - store.capacity // entry_charge(SIZE)
    return [store.get(k) == _value(k) for k in hot]


@pytest.mark.parametrize("evict", ["lru", "s3fifo"])
def test_a_hit_working_set_survives_a_one_off_scan_under_s3fifo_and_not_under_lru(tmp_path, evict):
    path = f"{tmp_path}/db"
    with open_store(f"lmdb://{path}?capacity=1MiB" + _policy(evict)) as store:
        assert store.evict == evict
        kept = _scan_after_working_set(store)
    assert all(kept) if evict == "s3fifo" else not any(kept)
    state = check_file(path)
    assert state["evict"] == evict
    assert (len(state["main"]) == len(kept)) if evict == "s3fifo" else not state["main"]


def test_a_key_evicted_from_small_and_put_again_goes_to_main_and_survives_a_scan(tmp_path):
    path = f"{tmp_path}/db"
    with open_store(f"lmdb://{path}?capacity=1MiB&evict=s3fifo") as store:
        fit = store.capacity // entry_charge(SIZE)
        assert store.put(b"again", _value(b"again"))
        for i in range(fit + 4):  # it leaves through the small queue unhit: into this process's ghost
            assert store.put(b"fill%d" % i, _value(b"fill%d" % i))
        assert not store.contains(b"again")
        assert store.put(b"again", _value(b"again"))  # remembered: straight to main
        assert store.put(b"new", _value(b"new"))  # never seen: small
        assert store.stats()["small_bytes"] < store.stats()["bytes_used"]
        for i in range(3 * fit):
            assert store.put(b"scan%d" % i, _value(b"scan%d" % i))
        assert store.get(b"again") == _value(b"again") and store.get(b"new") is None
    assert b"again" in check_file(path)["main"]


def test_main_spends_a_hit_per_pass_and_evicts_what_was_not_hit(tmp_path):
    """Main filled from the ghost: entries hit once go round once more while the others leave, and
    leave on the next pass."""
    path = f"{tmp_path}/db"
    with open_store(f"lmdb://{path}?capacity=1MiB&evict=s3fifo") as store:
        fit = store.capacity // entry_charge(SIZE)
        main = [b"m%d" % i for i in range(fit // 2)]
        for key in main + [b"f%d" % i for i in range(fit)]:  # the m's leave small unhit: ghosts
            assert store.put(key, _value(key))
        assert not any(store.contains(k) for k in main)
        for key in main:  # back: into main
            assert store.put(key, _value(key))
        assert store.stats()["small_bytes"] <= store.stats()["bytes_used"] - len(main) * entry_charge(SIZE)
        hit = main[:3]
        assert all(store.get(k) == _value(k) for k in hit)
        fresh = [fit]

        def churn(gone: list[bytes]) -> int:
            """A new key (small) and a key that left (a ghost: main), until `gone` have all left."""
            for step in range(6 * fit):
                if not any(store.contains(k) for k in gone):
                    return step
                left = next(b"f%d" % i for i in range(fresh[0]) if not store.contains(b"f%d" % i))
                for key in (b"f%d" % fresh[0], left):
                    assert store.put(key, _value(key))
                fresh[0] += 1
            raise AssertionError(f"still there after {6 * fit} steps: {[k for k in gone if store.contains(k)]}")

        churn(main[3:])  # the unhit ones leave main...
        assert all(store.contains(k) for k in hit)  # ...while the hit ones went round, spending their hit
        churn(hit)  # not hit again: they leave on the next pass
    check_file(path)


@pytest.mark.parametrize("evict", ["lru", "s3fifo"])
def test_cap_and_accounting_hold_under_a_random_mixed_workload(tmp_path, evict, caplog):
    path, url = f"{tmp_path}/db", f"lmdb://{tmp_path}/db?capacity=1MiB" + _policy(evict)
    rng = random.Random(3)
    versions: dict[bytes, int] = {}  # key -> the version last put (absent: deleted or never put)

    def value(key: bytes, version: int) -> bytes:
        n = random.Random(key + b"/%d" % version).randint(1, 240_000)
        return _value(key + b"/%d" % version, n)

    evictions = 0
    for session in range(4):  # closed and checked on disk between sessions
        with open_store(url) as store:
            for _ in range(250):
                key = b"k%d" % rng.randrange(60)
                op = rng.random()
                if op < 0.45:
                    version = rng.randrange(1 << 30)
                    if store.put(key, value(key, version)):
                        versions[key] = version
                elif op < 0.55:
                    batch = {b"k%d" % rng.randrange(60): rng.randrange(1 << 30) for _ in range(rng.randint(2, 5))}
                    ok = store.put_many([(k, value(k, v)) for k, v in batch.items()])
                    versions.update({k: v for (k, v), good in zip(batch.items(), ok) if good})
                elif op < 0.9:
                    got = store.get(key)
                    assert got is None or (key in versions and got == value(key, versions[key]))
                else:
                    store.delete(key)
                    versions.pop(key, None)
                stats = store.stats()
                assert stats["bytes_used"] <= store.capacity
                assert evict == "lru" or 0 <= stats["small_bytes"] <= stats["bytes_used"]
            evictions += store.stats()["evictions"]
        state = check_file(path)
        assert state["evict"] == evict and sum(entry_charge(n) for n in state["sizes"].values()) <= store.capacity
        for key, n in state["sizes"].items():
            assert key in versions and n == len(value(key, versions[key]))
    assert evictions > 100
    # a put_many over the capacity loses its own first entries (False); a write never failed
    assert not [r for r in caplog.records if "dropped" in r.getMessage() or "failed" in r.getMessage()]
    assert evict == "lru" or state["main"], "nothing ever reached main"


def test_the_policy_is_kept_in_the_file_and_adopted_with_one_warning(tmp_path, caplog):
    path = f"{tmp_path}/db"
    with open_store(f"lmdb://{path}?capacity=1MiB&evict=s3fifo") as store:
        assert store.put(b"first", b"x" * 100)
    assert read_stats(path)["evict"] == "s3fifo"
    with caplog.at_level(logging.WARNING, logger="kvoffload.store.lmdb_store"):
        with open_store(f"lmdb://{path}?capacity=1MiB") as store:  # asks for lru
            assert store.evict == "s3fifo" and "small_bytes" in store.stats()
            kept = _scan_after_working_set(store)
    assert all(kept), "the store asked for lru evicts by the file's s3fifo"
    adopted = [r for r in caplog.records if "ordered for evict=s3fifo, not lru" in r.getMessage()]
    assert len(adopted) == 1
    assert check_file(path)["evict"] == "s3fifo"


def test_a_store_without_a_policy_record_is_lru(tmp_path, caplog):
    """Written before there was a choice: its ticks are LRU's, whatever is asked."""
    path = f"{tmp_path}/db"
    with open_store(f"lmdb://{path}?capacity=1MiB") as store:
        assert store.put(b"old", b"x" * 100)
    _edit_info(path, lambda txn, info: txn.delete(b"evict", db=info))
    assert read_stats(path)["evict"] == "lru"
    with caplog.at_level(logging.WARNING, logger="kvoffload.store.lmdb_store"):
        with open_store(f"lmdb://{path}?capacity=1MiB&evict=s3fifo") as store:
            assert store.evict == "lru" and "small_bytes" not in store.stats()
            kept = _scan_after_working_set(store)
    assert not any(kept)
    assert any("ordered for evict=lru, not s3fifo" in r.getMessage() for r in caplog.records)
    assert check_file(path)["evict"] == "lru"


def test_an_empty_store_takes_the_policy_asked_for_unless_another_process_has_it_open(tmp_path):
    path = f"{tmp_path}/db"
    with open_store(f"lmdb://{path}?capacity=1MiB") as store:
        assert store.evict == "lru"
        assert store.put_many([(b"a", b"1"), (b"b", b"2"), (b"c", b"3")]) == [True] * 3  # LRU tick 3
        assert store.clear("ns")
    with open_store(f"lmdb://{path}?capacity=1MiB&evict=s3fifo") as store:  # empty, alone: switched
        assert store.evict == "s3fifo"
        assert store.put(b"new", b"x")
    assert check_file(path)["hits"] == {b"new": 0}  # a fresh entry, not one with hits
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kvoffload import open_store; "
         f"s = open_store('lmdb://{path}?capacity=1MiB&evict=s3fifo'); print('open', flush=True); "
         "sys.stdin.readline(); assert s.evict == 's3fifo'; assert s.put(b'h', b'x'); s.close()"],
        env=subprocess_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open", holder.stderr.read()
        with open_store(f"lmdb://{path}?capacity=1MiB") as store:  # empty but in use: the file's policy
            assert store.evict == "s3fifo"
            assert store.put(b"p", b"y")
        holder.stdin.write("go\n")
        holder.stdin.flush()
        _, err = holder.communicate(timeout=60)
        assert holder.returncode == 0, err[-2000:]
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.communicate()
    assert check_file(path)["evict"] == "s3fifo"


@pytest.mark.parametrize("record, raw", [(b"small_bytes", b"\x01\x02"), (b"small_bytes", U64.pack(1 << 40)),
                                         (b"tick", b"garbage!!"), (b"accounting", b"pages-v1"),
                                         (b"evict", b"clock")])
def test_damaged_s3fifo_counters_are_rebuilt_from_the_index(tmp_path, record, raw):
    path, url = f"{tmp_path}/db", f"lmdb://{tmp_path}/db?capacity=1MiB&evict=s3fifo"
    with open_store(url) as store:
        _scan_after_working_set(store)  # entries in both queues
    before = check_file(path)
    assert before["main"]
    _edit_info(path, lambda txn, info: txn.put(record, raw, db=info))
    with open_store(url) as store:
        assert store.evict == "s3fifo" and store.stats()["small_bytes"] <= store.stats()["bytes_used"]
    after = check_file(path)  # rebuilt exactly
    assert after["main"] == before["main"] and after["sizes"] == before["sizes"]
    with open_store(url) as store:  # the next inserts take counters after every entry's
        for i in range(3 * store.capacity // entry_charge(SIZE)):
            assert store.put(b"next%d" % i, _value(b"next%d" % i))
            assert store.stats()["bytes_used"] <= store.capacity
        assert all(store.get(b"hot%d" % i) == _value(b"hot%d" % i) for i in range(6))
    check_file(path)


def test_urls_name_the_lmdb_policy_and_tiered_passes_it_to_its_disk_tier(tmp_path):
    assert parse_store_url("lmdb:///d?capacity=1MiB&evict=S3FIFO") == LMDBSpec("/d", 1 << 20, "s3fifo")
    assert parse_store_url("lmdb:///d?capacity=1MiB") == LMDBSpec("/d", 1 << 20)
    tiered = parse_store_url("tiered://?memory=1MiB&lmdb=/d&lmdb_evict=s3fifo")
    assert tiered == TieredSpec(MemorySpec(1 << 20), LMDBSpec("/d", 16 << 30, "s3fifo"))
    for spec in (parse_store_url("lmdb:///d?evict=s3fifo"), tiered):
        assert parse_store_url(spec.url(redact=False)) == spec
    assert "evict" not in LMDBSpec("/d", 1 << 20).url()  # LRU URLs are as they were
    for url, option in (("lmdb:///d?evict=arc", "evict="), ("tiered://?lmdb=/d&lmdb_evict=lfu", "lmdb_evict="),
                        ("tiered://?redis=redis://h:1/0&lmdb_evict=s3fifo", "lmdb_evict= needs lmdb=")):
        with pytest.raises(StoreConfigError, match=option):
            parse_store_url(url)
    with open_store(f"tiered://?memory=1MiB&lmdb={tmp_path}/t&lmdb_capacity=4MiB&lmdb_evict=s3fifo") as store:
        assert store.back.evict == "s3fifo" and store.front.evict == "lru"
        assert "disk_small_bytes" in store.stats()


# -- crash safety: a writer SIGKILLed while S3-FIFO moves and evicts ---------------------------------

WRITER = r"""
import random, sys
import numpy as np
from kvoffload import open_store

def value_of(k, v):
    n = random.Random(k * 7919 + v).randint(1, 120_000)
    return (b"%08d%08d" % (k, v) + np.random.default_rng([k, v]).integers(0, 256, n, dtype=np.uint8).tobytes())

store = open_store(sys.argv[1])
rng = random.Random(int(sys.argv[2]))
print("ready", flush=True)
while True:
    k = rng.randrange(48)
    if rng.random() < 0.4:
        store.get(b"k%d" % k)
    elif rng.random() < 0.1:
        store.delete(b"k%d" % k)
    else:
        batch = {rng.randrange(48): rng.randrange(10**8) for _ in range(rng.choice((1, 1, 3)))}
        store.put_many([(b"k%d" % k, value_of(k, v)) for k, v in batch.items()])
"""


@pytest.mark.parametrize("evict", ["lru", "s3fifo"])
def test_sigkilled_writer_leaves_consistent_records_and_counters(tmp_path, evict):
    path, url = f"{tmp_path}/db", f"lmdb://{tmp_path}/db?capacity=1MiB" + _policy(evict)
    ns: dict = {}
    exec(WRITER.split("store = open_store")[0], ns)
    rng = random.Random(5)
    moved = False
    for rnd in range(8):
        child = subprocess.Popen([sys.executable, "-c", WRITER, url, str(rnd)], env=subprocess_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            ready, _, _ = select.select([child.stdout], [], [], 60)
            assert ready and child.stdout.readline().strip() == b"ready", child.stderr.read()[-2000:]
            time.sleep(rng.uniform(0.05, 0.5))
            assert child.poll() is None, child.stderr.read()[-2000:]
        finally:
            child.send_signal(signal.SIGKILL)
            child.communicate()
        state = check_file(path)  # consistent at whatever commit the kill left
        assert state["evict"] == evict
        moved |= bool(state["main"])
        with open_store(url) as store:
            for key, n in state["sizes"].items():
                got = store.get(key)
                k, v = int(got[:8]), int(got[8:16])
                assert key == b"k%d" % k and got == ns["value_of"](k, v)
            stats = store.stats()
            assert stats["checksum_failures"] == stats["read_errors"] == stats.get("damaged_files_reset", 0) == 0
            assert stats["bytes_used"] <= store.capacity
    assert moved == (evict == "s3fifo")  # hit entries moved to main (S3-FIFO)
    # the writer ran under pressure: 48 keys of 60 KB on average in 1 MiB
    assert len(state["sizes"]) < 48 and sum(entry_charge(n) for n in state["sizes"].values()) > (1 << 20) // 2
