"""Eviction policies (kvoffload/store/eviction.py) alone, then in the memory arena and its store URLs:
S3-FIFO keeps a frequently hit working set through a one-off scan that flushes it out of LRU."""

import numpy as np
import pytest

from kvoffload.store import StoreConfigError, open_store
from kvoffload.store.eviction import S3FIFO, make_policy
from kvoffload.store.memory import MemoryStore

KiB = 1024


class Cache:
    """A byte-capped cache driven by a policy, as the arena drives it: evict until the new key fits. The
    policy is made over the cache's dict of sizes (LRU keeps its order there, as in the arena's index)."""

    def __init__(self, name: str, capacity: int):
        self.capacity, self.sizes, self.held = capacity, {}, set()
        self.policy = make_policy(name, capacity, self.sizes)
        self.evicted: list[bytes] = []

    def get(self, key: bytes) -> bool:
        if key in self.sizes:
            self.policy.touch(key)
        return key in self.sizes

    def put(self, key: bytes, nbytes: int = 1) -> bool:
        if key in self.sizes:
            self.delete(key)
        while sum(self.sizes.values()) + nbytes > self.capacity:
            victim = self.policy.victim(lambda k: k not in self.held)
            if victim is None:
                return False
            assert victim in self.sizes and victim not in self.held, victim
            self.evicted.append(victim)
            self.delete(victim)  # as the arena does
        self.sizes[key] = nbytes
        self.policy.insert(key, nbytes)
        return True

    def delete(self, key: bytes) -> None:
        del self.sizes[key]
        self.policy.remove(key)

    def evict(self, may_go=lambda key: True) -> bytes | None:
        """The policy's next victim, deleted as the arena deletes it."""
        victim = self.policy.victim(may_go)
        if victim is not None:
            self.delete(victim)
        return victim


def _scan_after_working_set(name: str) -> Cache:
    cache = Cache(name, 100)
    hot = [b"hot%d" % i for i in range(20)]
    for _ in range(3):  # a working set, hit again and again
        for key in hot:
            cache.get(key) or cache.put(key)
    for i in range(1000):  # a one-off scan ten times the capacity
        assert cache.put(b"scan%d" % i)
    for key in hot:  # the working set is wanted again
        cache.get(key)
    return cache


def test_s3fifo_keeps_a_hit_working_set_through_a_one_off_scan_that_lru_evicts():
    lru, s3 = _scan_after_working_set("lru"), _scan_after_working_set("s3fifo")
    hot = [b"hot%d" % i for i in range(20)]
    assert not any(k in lru.sizes for k in hot)  # LRU: the scan flushed it
    assert all(k in s3.sizes for k in hot)  # S3-FIFO: the scan went through the small queue only
    assert len(s3.sizes) == 100 and sum(s3.sizes.values()) <= 100
    assert not any(k in s3.evicted for k in hot)


def test_a_key_evicted_from_small_and_inserted_again_goes_to_main_and_survives_a_scan():
    cache = Cache("s3fifo", 100)
    cache.put(b"again")
    cache.put(b"once")
    for i in range(150):  # both leave through the small queue unhit: into the ghost
        cache.put(b"fill%d" % i)
    assert b"again" in cache.evicted and b"once" in cache.evicted
    cache.put(b"again")  # remembered: straight to main
    cache.put(b"once-more")  # new: small
    assert b"again" in cache.policy._main and b"once-more" in cache.policy._small
    for i in range(500):  # a scan: the small queue churns, main keeps what it holds
        cache.put(b"scan%d" % i)
    assert b"again" in cache.sizes and b"once-more" not in cache.sizes


def test_the_ghost_remembers_at_most_main_capacity_and_forgets_oldest_first():
    cache = Cache("s3fifo", 1000)
    policy = cache.policy
    for i in range(5000):
        cache.put(b"k%d" % i, 7)
    assert policy._ghost_bytes == sum(policy._ghost.values()) <= 1000 - 100
    assert len(policy._ghost) == (1000 - 100) // 7
    oldest = next(iter(policy._ghost))
    assert int(oldest[1:]) > 5000 - 1000 // 7 - (1000 - 100) // 7 - 1  # the most recent evictions only
    cache.put(b"k0", 7)  # forgotten long ago: a new key
    assert b"k0" in policy._small


@pytest.mark.parametrize("name", ["lru", "s3fifo"])
def test_a_policy_never_offers_a_held_key_and_offers_every_other_exactly_once(name):
    rng = np.random.default_rng(5)
    cache = Cache(name, 64 * KiB)
    for step in range(3000):
        key, op = b"k%d" % rng.integers(0, 300), rng.random()
        if op < 0.5:
            cache.put(key, int(rng.integers(1, 8 * KiB)))
        elif op < 0.75:
            cache.get(key)
        elif op < 0.85 and key in cache.sizes:
            cache.held.add(key) if len(cache.held) < 6 else cache.held.clear()
        elif op < 0.9 and key in cache.sizes and key not in cache.held:
            cache.delete(key)
        assert sum(cache.sizes.values()) <= 64 * KiB
    # Everything not held comes out once, then nothing: the policy tracks exactly the cached keys.
    out, cached, held = [], set(cache.sizes), set(cache.held)
    while (victim := cache.evict(lambda k: k not in cache.held)) is not None:
        assert victim in cached and victim not in held and victim not in out
        out.append(victim)
        assert len(out) <= 300
    assert set(out) == cached - held and set(cache.sizes) == held
    cache.held.clear()
    assert {cache.evict() for _ in range(len(held))} == held
    assert cache.evict() is None and not cache.sizes


def test_main_spends_one_hit_per_pass_before_it_evicts():
    policy = S3FIFO(10)
    for key in (b"a", b"b"):
        policy._ghost[key] = 1  # as if evicted from small: inserted again, they go to main
        policy._ghost_bytes += 1
        policy.insert(key, 1)
    for _ in range(5):
        policy.touch(b"a")  # capped at 3
    assert policy._freq == {b"a": 3, b"b": 0}
    assert policy.victim(lambda k: True) == b"b"
    assert policy.victim(lambda k: True) == b"a" and policy._freq == {}


# -- in the arena --------------------------------------------------------------------------------------

def _value(i: int, n: int = 4096) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("evict,kept", [("lru", False), ("s3fifo", True)])
def test_the_arena_keeps_a_working_set_through_a_scan_with_s3fifo_only(evict, kept):
    store = MemoryStore(256 * KiB, pinned=False, evict=evict)  # 64 slots of 4 KiB
    hot = {b"hot%d" % i: _value(i) for i in range(16)}
    assert store.put_many(list(hot.items())) == [True] * 16
    for _ in range(2):
        assert [store.get(k) for k in hot] == list(hot.values())
    for i in range(400):
        assert store.put(b"scan%d" % i, _value(1000 + i))
        assert store.stats()["arena_bytes"] <= 256 * KiB
    assert all(store.contains(k) for k in hot) is kept
    if kept:
        assert [store.get(k) for k in hot] == list(hot.values())  # byte-exact
    assert store.get(b"scan399") == _value(1399) and store.stats()["entries"] == 64


def test_the_option_selects_the_policy_per_store_and_a_bad_value_names_the_choices(tmp_path):
    assert open_store("memory://?capacity=1MiB").evict == "lru"
    assert isinstance(open_store("memory://?capacity=1MiB&evict=S3FIFO")._policy, S3FIFO)
    tiered = open_store(f"tiered://?memory=1MiB&lmdb={tmp_path}/l&lmdb_capacity=64MiB&evict=s3fifo")
    try:
        assert tiered.front.evict == "s3fifo"
    finally:
        tiered.close()
    for url in ("memory://?evict=lfu", f"tiered://?memory=1MiB&lmdb={tmp_path}/m&lmdb_capacity=64MiB&evict="):
        with pytest.raises(StoreConfigError, match="evict= takes lru or s3fifo"):
            open_store(url)
    assert not (tmp_path / "m").exists()  # refused before anything was opened
    with pytest.raises(StoreConfigError, match="lru or s3fifo"):
        MemoryStore(1 << 20, pinned=False, evict="clock")


@pytest.mark.parametrize("evict", ["lru", "s3fifo"])
def test_the_vllm_scheduler_mirror_evicts_as_the_worker_memory_tier_does(evict):
    """vLLM's scheduler predicts a worker's memory:// tier from its reports: with the same policy."""
    pytest.importorskip("vllm.distributed")
    from kvoffload.connectors.store_index import _mirror_for
    from kvoffload.store import parse_store_url
    from kvoffload.connectors.vllm_messages import StoredPages

    url = f"memory://?capacity=64KiB&pinned=false&evict={evict}"
    store, mirror = open_store(url), _mirror_for(parse_store_url(url), 1)
    rng = np.random.default_rng(11)
    hot = [b"hot%d" % i for i in range(6)]
    for step in range(400):
        key = hot[step % 6] if rng.random() < 0.4 else b"scan%d" % step
        if mirror.contains_many([key])[0]:  # a lookup the scheduler answers, then the worker's load
            assert store.get(key) == _value(step % 6 if key in hot else step)
        else:
            assert store.get(key) is None
            assert store.put(key, _value(step % 6 if key in hot else step))
            mirror.update(StoredPages(added={key: 4096}))
        assert set(mirror.sizes) == set(store._index), step
    assert all(k in mirror.sizes for k in hot) is (evict == "s3fifo")
    mirror.clear()  # reset_cache: nothing held, and nothing left to offer as a victim
    assert mirror.used == 0 and mirror.policy.victim(lambda k: True) is None
    assert mirror.update(StoredPages(added={b"after": 4096})) == set()
    with pytest.raises(StoreConfigError, match="lru or s3fifo"):
        _mirror_for(parse_store_url("memory://?evict=arc"), 1)
