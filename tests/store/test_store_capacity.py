"""Capacity is a hard cap on stored bytes, enforced least-recently-used first; a watcher hears exactly
which keys the store evicted."""

import numpy as np
import pytest

from kvoffload import open_store
from kvoffload.store import EntryTooLargeError, TieredStore

CAP = 64 * 1024


@pytest.fixture(params=["memory", "lmdb", "tiered"])
def small_store(request, tmp_path):
    url = {
        "memory": f"memory://?capacity={CAP}",
        "lmdb": f"lmdb://{tmp_path}/db?capacity={CAP}",
        # a memory front smaller than the disk tier: both caps must hold independently
        "tiered": f"tiered://?memory={CAP // 2}&lmdb={tmp_path}/t&lmdb_capacity={CAP}",
    }[request.param]
    with open_store(url) as store:
        yield store


def _settle(store):
    """A tiered store writes its disk tier behind: wait for it, so each put sees the disk's evictions
    (and the memory tier is not held by values waiting for the disk)."""
    if isinstance(store, TieredStore):
        assert store.flush(10)


def _stored_bytes(store, keys):
    return sum(len(v) for v in (store.get(k) for k in keys) if v is not None)


def test_cap_holds_after_every_put(small_store):
    rng = np.random.default_rng(7)
    keys = []
    for i in range(300):
        key = b"k%d" % int(rng.integers(0, 120))  # overwrites mixed in
        value = rng.integers(0, 256, int(rng.integers(1, CAP // 4)), dtype=np.uint8)
        if i % 10 == 0:
            batch = [(b"b%d-%d" % (i, j), value[: max(1, value.nbytes // 3)]) for j in range(3)]
            assert small_store.put_many(batch) == [True] * 3
            keys += [k for k, _ in batch]
        else:
            assert small_store.put(key, value)
            keys.append(key)
        _settle(small_store)
        stats = small_store.stats()
        assert stats["bytes_used"] <= CAP
    assert _stored_bytes(small_store, set(keys)) <= CAP
    assert small_store.stats()["evictions"] > 0


def test_least_recently_used_goes_first(small_store):
    third = CAP // 5 + 1  # an LMDB entry takes at most a quarter of the capacity, with its pages and index
    for name in (b"a", b"b", b"c"):
        assert small_store.put(name, bytes([name[0]]) * third)
        _settle(small_store)
    assert small_store.get(b"a") is not None  # a is now more recent than b
    assert small_store.put(b"d", b"d" * third)
    _settle(small_store)
    assert small_store.put(b"e", b"e" * third)  # needs room: b goes first, then c
    _settle(small_store)
    present = {k for k in (b"a", b"b", b"c", b"d", b"e") if small_store.get(k) is not None}
    assert b"b" not in present
    assert {b"a", b"e"} <= present


def test_value_larger_than_capacity_is_refused_and_loses_nothing(small_store):
    assert small_store.put(b"keep", b"x" * 100)
    with pytest.raises(EntryTooLargeError, match="capacity"):
        small_store.put_many([(b"ok", b"y" * 10), (b"huge", b"z" * (CAP + 1))])
    assert small_store.get(b"keep") == b"x" * 100
    assert small_store.get(b"ok") is None  # the batch was refused whole, before any write


def test_lmdb_capacity_survives_restart(tmp_path):
    url = f"lmdb://{tmp_path}/db?capacity={CAP}"
    for round_ in range(3):
        with open_store(url) as store:
            for i in range(20):
                store.put(b"r%d-%d" % (round_, i), b"v" * (CAP // 8))
            assert store.stats()["bytes_used"] <= CAP
    with open_store(url) as store:
        assert store.stats()["bytes_used"] <= CAP
        assert store.get(b"r2-19") == b"v" * (CAP // 8)  # the newest survive
        assert store.get(b"r0-0") is None


def test_a_watcher_hears_exactly_the_keys_that_left_the_store(small_store):
    """`watch_evictions`: after every write, the keys reported are exactly the keys written that the store
    no longer holds (a tiered store: in neither tier, so a value evicted from memory but on disk is still
    held); nothing once unwatched."""
    heard: list[bytes] = []
    small_store.watch_evictions(heard.extend)
    rng = np.random.default_rng(3)
    written, gone = set(), set()
    for i in range(150):
        batch = [(b"k%d" % k, bytes(int(rng.integers(1, CAP // 8)))) for k in rng.choice(60, 1 + i % 3, replace=False)]
        assert all(small_store.put_many(batch))
        _settle(small_store)
        if i % 5 == 0:  # reads refresh recency, and promote a disk hit into memory
            small_store.get(b"k%d" % int(rng.integers(0, 60)))
        written.update(k for k, _ in batch)
        gone.difference_update(k for k, _ in batch)
        gone.update(heard)
        heard.clear()
        assert gone == {k for k in written if not small_store.contains(k)}, i
    assert len(gone) > 10
    small_store.watch_evictions(None)
    for i in range(20):
        assert small_store.put(b"late%d" % i, bytes(CAP // 8))
        _settle(small_store)
    assert heard == [] and not small_store.contains(b"late0")


def test_lmdb_reports_evictions_not_deletes_nor_keys_the_batch_writes_again(tmp_path):
    size = CAP // 8  # five entries fit (with their pages and index records)
    with open_store(f"lmdb://{tmp_path}/db?capacity={CAP}") as store:
        heard: list[list[bytes]] = []
        store.watch_evictions(heard.append)
        for i in range(5):
            assert store.put(b"k%d" % i, b"v" * size)
        assert store.delete(b"k4") and heard == []  # a delete is no eviction
        assert store.get(b"k0") is not None  # k0 is now more recent than k1
        assert store.put_many([(b"k5", b"v" * size), (b"k6", b"v" * size)]) == [True, True]
        assert heard == [[b"k1"]]
        # LRU order k2 k3 k0 k5 k6: k7 evicts k2, which the batch writes again, evicting k3
        assert store.put_many([(b"k7", b"v" * size), (b"k2", b"w" * size)]) == [True, True]
        assert heard == [[b"k1"], [b"k3"]] and store.get(b"k2") == b"w" * size
        assert store.stats()["evictions"] == 3


def test_tiered_reports_a_key_only_once_neither_tier_holds_it(tmp_path):
    """Memory for 8 values in front of LMDB for 5: LMDB evicts values memory still holds (not reported),
    then memory evicts the oldest of them (reported)."""
    size = CAP // 8
    with open_store(f"tiered://?memory={8 * size}&lmdb={tmp_path}/t&lmdb_capacity={CAP}") as store:
        heard: list[bytes] = []
        store.watch_evictions(heard.extend)
        for i in range(8):
            assert store.put(b"k%d" % i, b"v" * size)
            _settle(store)
        assert store.back.contains_many([b"k0", b"k1", b"k2", b"k3"]) == [False, False, False, True]
        assert heard == [] and all(store.contains_many([b"k%d" % i for i in range(8)]))
        assert store.put(b"k8", b"v" * size)
        _settle(store)
        assert heard == [b"k0"] and not store.contains(b"k0")  # LMDB's k3 went too, still in memory
        assert store.contains(b"k3") and not store.back.contains(b"k3")
