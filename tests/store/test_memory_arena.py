"""The memory tier's pinned arena: size-class slots in chunks under a hard byte cap, LRU eviction that
moves memory between classes, held slots (reads, leases, in-flight writes) that nothing overwrites; the
invariants again with each eviction policy (evict=lru|s3fifo)."""

import random
import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch

from kvoffload.store import EntryTooLargeError
from kvoffload.store.arena import PAGE, SHIFT, SLOT_MASK
from kvoffload.store.base import HeldBatch, ItemColumns
from kvoffload.store.memory import MemoryStore

KiB = 1024


def _bytes(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def audit(store: MemoryStore) -> None:
    """Invariants of the arena, from its bookkeeping (no write in flight)."""
    stats = store.stats()
    assert stats["arena_bytes"] <= store.capacity
    assert stats["bytes_used"] <= stats["arena_bytes"]
    assert sum(c.size for c in store._arena.chunks.values()) == stats["arena_bytes"]
    assert stats["bytes_used"] == sum(n for _, n in store._index.values())
    slots = [slot for slot, _ in store._index.values()] + list(store._orphans)
    assert len(set(slots)) == len(slots), "two values share a slot"
    per_chunk = Counter(slot >> 32 for slot in slots)
    for cid, chunk in store._arena.chunks.items():
        assert chunk.used == per_chunk[cid]
        assert (chunk.used == 0) == (cid in store._arena.pool)
        assert chunk.carved <= (chunk.size // chunk.slot_bytes if chunk.slot_bytes else 0)
    for slot, n in store._index.values():
        assert n <= store._arena.chunks[slot >> 32].slot_bytes
    policy = store._policy  # the eviction policy orders exactly the indexed keys
    tracked = policy._order if store.evict == "lru" else {**policy._small, **policy._main}
    assert store.evict == "s3fifo" or policy._order is store._index  # LRU: the index's own order
    assert set(tracked) == set(store._index)
    if store.evict == "s3fifo":
        assert set(policy._freq) == set(store._index) and policy._small_bytes == sum(policy._small.values())


def test_byte_exact_round_trips_across_size_classes():
    store = MemoryStore(16 << 20, pinned=False)
    sizes = [0, 1, 4095, 4096, 4097, 12288, 65537, 1 << 20, (3 << 20) + 5]
    values = {b"k%d" % i: _bytes(i, n) for i, n in enumerate(sizes)}
    assert store.put_many(list(values.items())) == [True] * len(values)
    for key, value in values.items():
        assert store.get(key) == value
        out = bytearray(len(value) + 3)
        assert store.get_into(key, out) == len(value) and out[:len(value)] == value
    leases = store.acquire(list(values) + [b"absent"])
    assert leases[-1] is None
    for lease, (key, value) in zip(leases, values.items()):
        assert lease.key == key and lease.view.tobytes() == value
    store.release(leases)
    stats = store.stats()
    assert stats["entries"] == len(values) and stats["bytes_used"] == sum(sizes) and stats["held"] == 0
    assert stats["chunks"] >= 6  # one class per chunk: 4K, 8K, 12K, 68K, 1M, 3M+4K
    audit(store)


@pytest.mark.parametrize("evict", ["lru", "s3fifo"])
def test_capacity_is_never_exceeded_under_a_random_mixed_workload(evict):
    cap = 1 << 20
    store = MemoryStore(cap, pinned=False, evict=evict)
    rng = np.random.default_rng(3)
    model: dict[bytes, bytes] = {}
    leases = []
    for step in range(1500):
        op = rng.random()
        key = b"k%d" % rng.integers(0, 150)
        size = int(rng.choice([1, 3000, 4096, 7000, 20000, 60000, 200000])) + int(rng.integers(0, 50))
        if op < 0.5:
            value = _bytes(step, size)
            stored = store.put(key, value)
            assert stored or leases, "a value under the chunk size always fits when nothing is held"
            if stored:
                model[key] = value
        elif op < 0.6:
            value = _bytes(step, size)

            def fill(dests, value=value):
                if dests[0] is not None:
                    dests[0][:] = np.frombuffer(value, np.uint8)
                return [dests[0] is not None and rng.random() < 0.8]

            if store.write_many([(key, size)], fill)[0]:
                model[key] = value
        elif op < 0.7:
            store.delete(key)
            model.pop(key, None)
        elif op < 0.8 and len(leases) < 4:
            leases += [(lease, lease.view.tobytes()) for lease in store.acquire([key]) if lease]
        elif op < 0.85 and leases:
            lease, original = leases.pop(0)
            assert lease.view.tobytes() == original  # never overwritten while held
            store.release([lease])
        else:
            got = store.get(key)
            assert got is None or got == model[key]
        for k in [k for k in model if not store.contains(k)]:
            del model[k]  # evicted
        audit(store)
    for key, value in model.items():
        assert store.get(key) == value
    store.release([lease for lease, _ in leases])
    assert store.stats()["evictions"] > 0 and store.stats()["held"] == 0
    audit(store)


def test_eviction_is_least_recently_used_and_moves_memory_between_classes():
    store = MemoryStore(1 << 20, pinned=False)  # 64 KiB chunks
    small = {b"a%03d" % i: _bytes(i, 4096) for i in range(256)}  # exactly fills the arena
    assert store.put_many(list(small.items())) == [True] * 256
    assert store.stats()["arena_bytes"] == 1 << 20
    assert store.get(b"a000") == small[b"a000"]  # now the most recent
    allocations = []
    allocate = store._arena.allocate
    store._arena.allocate = lambda n: allocations.append(n) or allocate(n)
    large = {b"b%d" % i: _bytes(1000 + i, 60000) for i in range(4)}  # another class: needs whole chunks
    assert store.put_many(list(large.items())) == [True] * 4
    assert allocations == []  # the emptied chunks were taken over, not reallocated
    for key, value in large.items():
        assert store.get(key) == value
    order = [k for k in small if k != b"a000"]  # recency order, oldest first
    present = [store.contains(k) for k in order]
    gone = present.index(True)
    assert gone >= 4 * 16 - 1 and not any(present[:gone]) and all(present[gone:])  # a prefix went
    assert store.contains(b"a000")
    assert store.stats()["evictions"] == gone and store.stats()["arena_bytes"] <= 1 << 20
    audit(store)
    # and back: small values take the large class's chunks once they are free
    assert store.put_many([(b"c%03d" % i, b"c" * 4096) for i in range(256)]) == [True] * 256
    assert not any(store.contains(k) for k in large) and allocations == []
    audit(store)


@pytest.mark.parametrize("evict", ["lru", "s3fifo"])
def test_a_held_lease_is_never_overwritten_and_its_slot_is_reused_after_release(evict):
    store = MemoryStore(64 * KiB, pinned=False, evict=evict)  # 16 slots of 4 KiB
    original = _bytes(1, 4096)
    assert store.put(b"k", original)
    (lease,) = store.acquire([b"k"])
    assert store.put(b"k", _bytes(2, 4096))  # overwritten: the key moves to a new slot
    for i in range(40):  # pressure: everything evictable goes, repeatedly
        assert store.put(b"f%d" % i, _bytes(100 + i, 4096))
    assert lease.view.tobytes() == original
    stats = store.stats()
    assert stats["entries"] == 15 and stats["held"] == 1 and stats["arena_bytes"] == 64 * KiB
    store.release([lease])
    assert store.stats()["held"] == 0 and not store._orphans
    for i in range(40, 56):
        assert store.put(b"f%d" % i, _bytes(100 + i, 4096))
    assert store.stats()["entries"] == 16  # the freed slot holds a value again
    with pytest.raises(ValueError, match="released twice"):
        store.release([lease])
    store.release([None])
    audit(store)


@pytest.mark.parametrize("evict", ["lru", "s3fifo"])
def test_leased_entries_stay_indexed_and_intact_under_eviction_pressure(evict):
    store = MemoryStore(64 * KiB, pinned=False, evict=evict)  # 16 slots of 4 KiB
    values = {b"v%d" % i: _bytes(i, 4096) for i in range(16)}
    assert store.put_many(list(values.items())) == [True] * 16
    leased = [b"v0", b"v1", b"v7", b"v15"]
    leases = store.acquire(leased, touch=False)  # not a hit: only the hold protects them
    for i in range(60):
        assert store.put(b"new%d" % i, _bytes(100 + i, 4096))
        assert all(store.contains(k) for k in leased), i
    assert [lease.view.tobytes() for lease in leases] == [values[k] for k in leased]
    store.release(leases)
    assert [store.get(k) for k in leased] == [values[k] for k in leased]
    assert store.stats()["entries"] == 16 and store.stats()["evictions"] == 60
    audit(store)


@pytest.mark.parametrize("evict", ["lru", "s3fifo"])
def test_a_value_held_by_a_reader_is_evicted_only_after_the_read(evict):
    store = MemoryStore(16 * KiB, pinned=False, evict=evict)
    values = {b"r%d" % i: _bytes(i, 4096) for i in range(4)}
    store.put_many(list(values.items()))
    seen = []

    def consume(i, view):
        for j in range(8):  # each put evicts the oldest unheld value, never this one
            assert store.put(b"new%d-%d" % (i, j), _bytes(50 + j, 4096))
        seen.append(bytes(view))

    assert store.read_many([b"r0"], consume) == [True]
    assert seen == [values[b"r0"]] and store.get(b"r0") == values[b"r0"]
    assert store.stats()["evictions"] == 8
    audit(store)


@pytest.mark.parametrize("evict", ["lru", "s3fifo"])
def test_nothing_evictable_drops_the_put_and_counts_it(evict):
    store = MemoryStore(16 * KiB, pinned=False, evict=evict)
    assert store.put_many([(b"h%d" % i, b"x" * 4096) for i in range(4)]) == [True] * 4
    leases = store.acquire([b"h%d" % i for i in range(4)])
    assert store.put(b"more", b"y" * 10) is False
    assert all(store.contains(b"h%d" % i) for i in range(4))  # held: still there, not evicted
    seen = []
    assert store.write_many([(b"w", 10)], lambda dests: seen.extend(dests) or [False]) == [False]
    assert seen == [None]
    assert store.stats()["dropped_puts"] == 2 and not store.contains(b"more")
    store.release(leases)
    assert store.put(b"more", b"y" * 10)
    audit(store)


def test_a_batch_reports_what_it_evicted_or_overwrote_itself():
    store = MemoryStore(16 * KiB, pinned=False)
    ok = store.put_many([(b"b%d" % i, _bytes(i, 4000)) for i in range(10)])
    assert ok == [False] * 6 + [True] * 4
    assert [store.contains(b"b%d" % i) for i in range(10)] == ok
    assert store.put_many([(b"dup", b"one"), (b"dup", b"two")]) == [False, True]
    assert store.get(b"dup") == b"two"
    assert store.stats()["dropped_puts"] == 7
    audit(store)


def test_write_many_fills_invisible_slots_then_publishes():
    store = MemoryStore(1 << 20, pinned=False)
    store.put(b"old", b"previous")
    items = [(b"a", 5), (b"b", 4096 + 1), (b"old", 3), (b"c", 0)]
    during = {}

    def fill(dests):
        during["sizes"] = [d.nbytes for d in dests]
        during["writable"] = all(d.flags.writeable and d.dtype == np.uint8 for d in dests)
        during["visible"] = store.contains_many([k for k, _ in items])
        during["read"] = store.get(b"a"), store.get(b"old")  # no deadlock: fill runs outside the lock
        for (key, n), dest in zip(items, dests):
            dest[:] = np.frombuffer((key * n)[:n], np.uint8)
        return [True] * len(items)

    assert store.write_many(items, fill) == [True] * 4
    assert during == {"sizes": [5, 4097, 3, 0], "writable": True, "visible": [False, False, True, False],
                      "read": (None, b"previous")}
    for key, n in items:
        assert store.get(key) == (key * n)[:n]
    assert store.stats()["puts"] == 5 and store.stats()["held"] == 0
    audit(store)


def test_write_many_publishes_only_what_fill_wrote():
    store = MemoryStore(1 << 20, pinned=False)
    store.put(b"keep", b"old value")

    def fill(dests):
        for dest in dests:
            dest[:] = 7
        return [False, True]

    assert store.write_many([(b"keep", 4), (b"new", 4)], fill) == [False, True]
    assert store.get(b"keep") == b"old value" and store.get(b"new") == b"\x07" * 4
    assert store.stats()["dropped_puts"] == 0  # declined by the caller, not dropped by the tier

    def broken(dests):
        raise RuntimeError("device copy failed")

    with pytest.raises(RuntimeError, match="device copy"):
        store.write_many([(b"x", 10), (b"y", 10)], broken)
    assert not store.contains(b"x") and store.stats()["held"] == 0
    audit(store)


def test_values_over_the_chunk_size_are_refused_whole():
    store = MemoryStore(1 << 20, pinned=False, chunk_bytes=64 * KiB)
    assert store.max_entry_bytes == 64 * KiB
    assert store.put(b"edge", b"e" * (64 * KiB))
    with pytest.raises(EntryTooLargeError, match="entries up to 65536"):
        store.put_many([(b"ok", b"1"), (b"huge", b"h" * (64 * KiB + 1))])
    with pytest.raises(EntryTooLargeError, match="entries up to 65536"):
        store.write_many([(b"ok", 1), (b"huge", 64 * KiB + 1)], lambda dests: [True] * len(dests))
    with pytest.raises(TypeError, match="non-empty bytes"):
        store.write_many([(b"ok", 1), ("str", 1)], lambda dests: [True] * len(dests))
    assert not store.contains(b"ok") and store.get(b"edge") == b"e" * (64 * KiB)
    assert MemoryStore(1000, pinned=False).put(b"tiny", b"t" * 1000)  # a capacity under a page still works


def test_acquire_touch_counts_and_refreshes_only_when_asked():
    store = MemoryStore(8 * KiB, pinned=False)  # two slots
    store.put_many([(b"a", b"1" * 100), (b"b", b"2" * 100)])
    before = store.stats()
    store.release(store.acquire([b"a", b"zz"], touch=False))
    after = store.stats()
    assert (after["hits"], after["misses"], after["get_bytes"]) == (before["hits"], before["misses"], 0)
    store.put(b"c", b"3")  # a was not refreshed: it goes
    assert not store.contains(b"a") and store.contains(b"b")
    store.release(store.acquire([b"b", b"zz"]))
    assert (store.stats()["hits"], store.stats()["misses"], store.stats()["get_bytes"]) == (1, 1, 100)
    store.put(b"d", b"4")  # b was refreshed: c goes
    assert store.contains(b"b") and not store.contains(b"c")


# -- concurrency --------------------------------------------------------------------------------------

def _value(kid: int, ver: int, n: int) -> np.ndarray:
    """Self-describing: a header (key id, version, size) and a body derived from it."""
    out = ((np.arange(n, dtype=np.uint32) * (2 * kid + 1) + ver) % 251).astype(np.uint8)
    out[:12] = np.array([kid, ver, n], dtype="<u4").view(np.uint8)
    return out


def _check(kid: int, view) -> None:
    got = np.frombuffer(view, np.uint8)
    k, ver, n = np.frombuffer(got[:12].tobytes(), "<u4")
    assert k == kid and n == got.nbytes, (kid, k, n, got.nbytes)
    assert np.array_equal(got, _value(kid, int(ver), int(n))), f"torn value for key {kid}"


@pytest.mark.parametrize("evict", ["lru", "s3fifo"])
def test_concurrent_mixed_operations_stay_consistent(evict):
    store = MemoryStore(512 * KiB, pinned=False, evict=evict)
    nkeys, errors, deadline = 24, [], time.monotonic() + 3.0
    sizes = [100, 4096, 9000, 20000, 50000]

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for step in range(4000):
                if time.monotonic() > deadline:
                    return
                kid = int(rng.integers(0, nkeys))
                key, n, op = b"k%d" % kid, int(rng.choice(sizes)) + int(rng.integers(0, 64)), rng.random()
                if op < 0.25:
                    store.put_many([(key, _value(kid, step, n)), (b"k%d" % ((kid + 1) % nkeys),
                                                                  _value((kid + 1) % nkeys, step, n // 2 + 12))])
                elif op < 0.45:
                    def fill(dests):
                        for dest in dests:
                            if dest is not None:
                                dest[:] = _value(kid, step, n)
                        return [d is not None and rng.random() < 0.9 for d in dests]
                    store.write_many([(key, n)], fill)
                elif op < 0.7:
                    ids = [int(i) for i in rng.integers(0, nkeys, 3)]
                    store.read_many([b"k%d" % i for i in ids], lambda i, view: _check(ids[i], view))
                elif op < 0.9:
                    leases = store.acquire([key], touch=bool(rng.random() < 0.5))
                    if leases[0] is not None:
                        before = leases[0].view.tobytes()
                        _check(kid, before)
                        time.sleep(0)  # let the others overwrite and evict meanwhile
                        assert leases[0].view.tobytes() == before
                    store.release(leases)
                else:
                    store.delete(key)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
        if t.is_alive():
            pytest.fail("a store operation stalled for 30 s (deadlock?)")
    assert not errors, errors[0]
    stats = store.stats()
    assert stats["held"] == 0 and not store._orphans and stats["evictions"] > 0
    audit(store)
    for kid in range(nkeys):
        store.read_many([b"k%d" % kid], lambda _, view, kid=kid: _check(kid, view))


# -- on a GPU: the slots are pinned memory ----------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) device")
def test_slots_are_pinned_for_device_copies():
    reserved = MemoryStore(64 << 20)  # pinned: the whole arena is page-locked at open
    assert reserved.stats()["arena_bytes"] == 64 << 20
    reserved.close()
    store = MemoryStore(64 << 20, reserve=False)
    assert store.stats()["pinned"] == 1
    page = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")

    def fill(dests):
        dest = torch.from_numpy(dests[0])
        assert dest.is_pinned()
        dest.copy_(page, non_blocking=True)
        torch.cuda.synchronize()
        return [True]

    assert store.write_many([(b"p", page.numel())], fill) == [True]
    (lease,) = store.acquire([b"p"])
    held = torch.from_numpy(lease.view)
    assert held.is_pinned() and torch.equal(held.to("cuda", non_blocking=True), page)
    store.release([lease])
    assert store.stats()["arena_bytes"] % PAGE == 0 and store.stats()["chunks"] == 1


@pytest.mark.parametrize("evict", ["lru", "s3fifo"])
def test_the_bulk_paths_hand_out_and_evict_what_the_per_value_path_does(evict):
    """Batches of small pages take the bulk paths (`_reserve_run`, bulk publish and leases); a store
    forced onto the per-value path, fed the same random operations (one and several sizes, repeated
    keys, stored keys, unfilled slots, held leases, deletes), must hold the same slots, holds, leases
    and orphans after every step, and end with the same order, bytes and counters."""
    rng = random.Random(11)
    fast = MemoryStore(64 * PAGE, pinned=False, chunk_bytes=16 * PAGE, evict=evict)
    slow = MemoryStore(64 * PAGE, pinned=False, chunk_bytes=16 * PAGE, evict=evict)
    slow._bulk = False  # every batch value by value
    held: dict[int, list] = {id(fast): [], id(slow): []}
    names = [b"k%d" % i for i in range(120)]
    bulk = 0
    for step in range(400):
        keys = [rng.choice(names) for _ in range(rng.randint(1, 12))]
        if rng.random() < 0.6:
            keys = list(dict.fromkeys(keys))  # all distinct: the bulk path's case
        sizes = [PAGE] * len(keys) if rng.random() < 0.7 else [rng.choice([PAGE, 2 * PAGE]) for _ in keys]
        action, unfilled = rng.random(), rng.random() < 0.1
        for store in (fast, slow):
            if action < 0.6:
                pairs = list(zip(keys, sizes))
                reservation = store.reserve(ItemColumns(keys, sizes) if store is fast and step % 2 else pairs)
                assert list(reservation.items) == pairs
                flags = [d is not None for d in reservation.destinations]
                store.publish(reservation, [False] + flags[1:] if unfilled else flags)
            elif action < 0.7:
                held[id(store)].append(store.acquire(keys))
            elif action < 0.8:  # by address: one batch lease
                batch = store.acquire_batch(keys)
                slots = [store._index[k][0] if k in store._index else -1 for k in keys]
                assert batch.addresses.tolist() == store._arena.locate(slots)[0].tolist()
                held[id(store)].append(batch)
            elif action < 0.9 and held[id(store)]:
                leases = held[id(store)].pop(0)
                store.release_batch(leases) if isinstance(leases, HeldBatch) else store.release(leases)
            else:
                store.delete(keys[0])
        bulk += action < 0.6 and len(set(sizes)) == 1 and len(set(keys)) == len(keys)
        assert fast._index == slow._index and fast._holds == slow._holds, step
        assert fast._orphans == slow._orphans and sorted(fast._leases.values()) == sorted(slow._leases.values())
        assert sorted(sorted(s) for s, _ in fast._batches.values()) == sorted(sorted(s) for s, _ in slow._batches.values())
    assert fast.stats() == slow.stats() and fast.stats()["evictions"] > 50 and bulk > 50
    if evict == "lru":
        assert list(fast._policy._order) == list(slow._policy._order)


@pytest.mark.parametrize("batch", [3, 16, 17, 200])
def test_a_held_batch_says_each_values_address_and_room_across_many_chunks(batch):
    """`acquire_batch` locates slots by a table of chunks (Python for a few, numpy for many): each
    address is the value's own bytes, a miss is 0, and the table grows past its first 64 chunks."""
    store = MemoryStore(8 << 20, pinned=False, chunk_bytes=64 * KiB)  # 128 chunks of 64 KiB
    sizes = [PAGE, 3 * PAGE, 5 * PAGE - 7, 9 * PAGE]
    keys = [b"k%d" % i for i in range(300)]
    for i, key in enumerate(keys):
        assert store.put(key, _bytes(i, sizes[i % 4]))
    assert store.stats()["chunks"] > 64

    def check(values: dict[bytes, bytes]) -> None:
        chosen = random.Random(batch).sample(sorted(values), batch - 1) + [b"missing"]
        random.Random(batch + 1).shuffle(chosen)
        held = store.acquire_batch(chosen)
        leases = store.acquire(chosen)
        try:
            for key, address, size, room, lease in zip(chosen, held.addresses, held.sizes, held.room, leases):
                if lease is None:
                    assert (key, address, size, room) == (b"missing", 0, 0, 0)
                    continue
                assert address == lease.view.ctypes.data and size == lease.view.nbytes
                slot = store._index[key][0]
                chunk = store._arena.chunks[slot >> SHIFT]
                ends_chunk = (slot & SLOT_MASK) == chunk.size // chunk.slot_bytes - 1  # no copy runs on past it
                assert room == (0 if ends_chunk else -(-size // PAGE) * PAGE)
                assert lease.view.tobytes() == values[key]
        finally:
            store.release(leases)
            store.release_batch(held)
        audit(store)

    check({key: _bytes(i, sizes[i % 4]) for i, key in enumerate(keys)})
    # Every chunk back in the pool, then carved again for another size: the table follows.
    for key in keys:
        assert store.delete(key)
    again = {b"j%d" % i: _bytes(1000 + i, 6 * PAGE) for i in range(200)}
    assert all(store.put_many(list(again.items())))
    check(again)


def test_a_reservation_of_item_columns_is_one_of_pairs():
    """`ItemColumns` (a batch's keys and sizes as two columns) reserves, fills and publishes as the same
    (key, size) pairs do, and its reservation names what making room evicted."""
    store = MemoryStore(4 * 4096, pinned=False)
    first = store.reserve(ItemColumns([b"a", b"b", b"c", b"d"], [4096] * 4))
    assert list(first.items) == [(b"a", 4096), (b"b", 4096), (b"c", 4096), (b"d", 4096)] and first.evicted == []
    for i, out in enumerate(first.destinations):
        out[:] = i
    assert store.publish(first, first.filled_all()) == [True] * 4
    second = store.reserve(ItemColumns([b"e", b"f"], [100, 4096]))
    assert list(second.items[1:]) == [(b"f", 4096)] and sorted(second.evicted) == [b"a", b"b"]  # LRU victims
    second.destinations[0][:] = 9
    second.destinations[1][:] = 8
    assert store.publish(second, second.filled_all()) == [True, True]
    assert store.get(b"e") == bytes([9]) * 100 and store.get(b"c") == bytes([2]) * 4096 and not store.contains(b"a")
    with pytest.raises(ValueError):
        ItemColumns([b"x"], [1, 2])
