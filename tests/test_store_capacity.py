"""Capacity is a hard cap on stored bytes, enforced least-recently-used first."""

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
