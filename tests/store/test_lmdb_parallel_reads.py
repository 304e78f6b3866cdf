"""A large LMDB read is split over reader threads (`LMDBStore.readers`), each in its own transaction:
every value still arrives byte for byte in its slot, a corrupt or missing one is still a counted miss,
and small reads stay on the caller's thread."""

import threading

import numpy as np
import pytest

from kvoffload.store import entry, lmdb_reads
from kvoffload.store.lmdb_reads import PARALLEL_READ_BYTES
from kvoffload.store.lmdb_store import LMDBStore
from kvoffload.store.tiered import TieredStore
from kvoffload.store.memory import MemoryStore

SIZE = 1 << 20
COUNT = 2 * PARALLEL_READ_BYTES // SIZE  # twice the bytes that split a read


def _values(n: int = COUNT) -> dict[bytes, bytes]:
    return {b"k%03d" % i: np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8).tobytes() for i in range(n)}


def _read(store, keys):
    got, threads = {}, set()

    def consume(i, view):
        got[i] = bytes(view)
        threads.add(threading.current_thread().name)

    return store.read_many(keys, consume), got, threads


def test_a_large_read_is_split_over_readers_byte_for_byte(tmp_path):
    values = _values()
    with LMDBStore(str(tmp_path / "db"), 256 << 20, readers=4) as store:
        assert all(store.put_many(list(values.items())))
        keys = [b"absent"] + list(values) + [b"also-absent"]
        served, got, threads = _read(store, keys)
        assert served == [False] + [True] * len(values) + [False]
        assert [got[i] for i in range(1, len(keys) - 1)] == list(values.values())
        assert [len(part) for part in store._readers.split(store._live_env, store._meta, keys)] == [9, 8, 8, 9]  # four runs of ~equal bytes
        assert any(name.startswith("kvoffload-lmdb-read") for name in threads) and len(threads) >= 2
        stats = store.stats()
        assert (stats["hits"], stats["misses"], stats["get_bytes"]) == (len(values), 2, len(values) * SIZE)


def test_small_reads_and_one_reader_stay_on_the_callers_thread(tmp_path):
    values = _values()
    with LMDBStore(str(tmp_path / "one"), 256 << 20, readers=1) as store:
        assert all(store.put_many(list(values.items())))
        served, got, threads = _read(store, list(values))
        assert all(served) and threads == {threading.current_thread().name}
    with LMDBStore(str(tmp_path / "small"), 64 << 20, readers=4) as store:
        small = _values(4)  # 4 MiB: under the split threshold
        assert all(store.put_many(list(small.items())))
        served, got, threads = _read(store, list(small))
        assert all(served) and threads == {threading.current_thread().name}


def test_a_corrupt_value_in_a_readers_part_is_a_counted_miss(tmp_path):
    values = _values()
    victim = list(values)[-3]  # in the last reader's part
    path = tmp_path / "db"
    with LMDBStore(str(path), 256 << 20, readers=4) as store:
        assert all(store.put_many(list(values.items())))
    with open(path / "data.mdb", "r+b") as f:
        data = f.read()
        at = data.find(values[victim][:64]) + 100
        f.seek(at)
        f.write(bytes([data[at] ^ 0xFF]))
    with LMDBStore(str(path), 256 << 20, readers=4) as store:
        served, got, _ = _read(store, list(values))
        assert served == [key != victim for key in values]
        assert all(got[i] == value for i, (key, value) in enumerate(values.items()) if key != victim)
        assert store.stats()["checksum_failures"] == 1 and not store.contains(victim)


def test_close_stops_the_readers_and_a_tiered_read_counts_once(tmp_path):
    values = _values()
    back = LMDBStore(str(tmp_path / "db"), 256 << 20, readers=4)
    assert all(back.put_many(list(values.items())))
    store = TieredStore(MemoryStore(64 << 20, pinned=False), back)
    served, got, threads = _read(store, list(values))  # every value from the back, consumed on its readers
    assert all(served) and len(threads) > 1
    stats = store.stats()
    assert (stats["hits"], stats["disk_hits"], stats["get_bytes"]) == (len(values), len(values), len(values) * SIZE)
    store.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvoffload-lmdb-read")]


def test_every_value_read_is_advised_to_the_kernel_before_it_is_verified(tmp_path, monkeypatch):
    """A reader asks for the pages of all its values at once (MADV_WILLNEED), each value's range whole and
    page-aligned, before the first checksum: the cold read keeps the disk's queue full."""
    if lmdb_reads._MADVISE is None:
        pytest.skip("no madvise on this platform")
    advised: list[tuple[int, int]] = []
    verified_after: list[int] = []
    real_madvise, real_verify = lmdb_reads._MADVISE, entry.verify

    def madvise(start, length, advice):
        assert advice == lmdb_reads.mmap.MADV_WILLNEED and start % lmdb_reads.PAGE == 0
        advised.append((start, start + length))
        return real_madvise(start, length, advice)

    def verify(*args):
        verified_after.append(len(advised))
        return real_verify(*args)

    monkeypatch.setattr(lmdb_reads, "_MADVISE", madvise)
    monkeypatch.setattr(entry, "verify", verify)
    values = _values(8)
    with LMDBStore(str(tmp_path / "db"), 64 << 20, readers=1) as store:
        assert all(store.put_many(list(values.items())))
        addresses = []
        served, got, _ = _read(store, list(values))
        assert all(served) and [got[i] for i in range(len(values))] == list(values.values())

        def where(i, view):
            addresses.append(np.frombuffer(view, np.uint8).__array_interface__["data"][0])

        store.read_many(list(values), where)
    assert len(advised) == 2 * len(values) and verified_after[0] == len(values)  # all advised, then verified
    for address in addresses:  # every value of the second read lies whole inside a range advised for it
        assert any(a <= address and address + SIZE <= b for a, b in advised[len(values):])


def _advice(monkeypatch) -> list[tuple[int, int]]:
    """The ranges madvised from now on (recorded, then advised for real)."""
    if lmdb_reads._MADVISE is None:
        pytest.skip("no madvise on this platform")
    advised: list[tuple[int, int]] = []
    real = lmdb_reads._MADVISE

    def madvise(start, length, advice):
        assert advice == lmdb_reads.mmap.MADV_WILLNEED and start % lmdb_reads.PAGE == 0
        advised.append((start, start + length))
        return real(start, length, advice)

    monkeypatch.setattr(lmdb_reads, "_MADVISE", madvise)
    return advised


def _addresses(store, keys) -> list[int]:
    found: dict[int, int] = {}
    store.read_many(keys, lambda i, view: found.__setitem__(i, np.frombuffer(view, np.uint8).ctypes.data))
    return [found[i] for i in range(len(keys))]


def test_advice_reads_ahead_every_value_in_order_on_a_thread_of_its_own(tmp_path, monkeypatch):
    """`advise` asks the kernel for each present value's pages, in the keys' order, off the caller's thread
    (a load's later batches then find their pages read); an absent key is skipped; nothing changes."""
    values = _values(8)
    with LMDBStore(str(tmp_path / "db"), 64 << 20, readers=1) as store:
        assert all(store.put_many(list(values.items())))
        keys = list(values)[::-1]
        advised = _advice(monkeypatch)
        callers: set[str] = set()
        real_advise = lmdb_reads._advise

        def advise(*args):
            callers.add(threading.current_thread().name)
            real_advise(*args)

        monkeypatch.setattr(lmdb_reads, "_advise", advise)
        store.advise([b"absent", *keys])
        store._readers._advisor[1].submit(lambda: None).result()  # the advice is done
        assert callers == {"kvoffload-lmdb-ahead_0"}
        assert len(advised) == len(keys)
        for (start, end), address in zip(advised, _addresses(store, keys)):  # in order, each value whole
            assert start <= address and address + SIZE <= end
        served, got, _ = _read(store, list(values))
        assert all(served) and [got[i] for i in range(len(values))] == list(values.values())
        assert store.stats()["misses"] == 0  # advice reads nothing: no hit or miss counted
    assert not [t for t in threading.enumerate() if t.name.startswith("kvoffload-lmdb-ahead")]


def test_close_ends_advice_still_queued_and_later_advice_is_ignored(tmp_path, monkeypatch):
    values = _values(8)
    store = LMDBStore(str(tmp_path / "db"), 64 << 20, readers=1)
    assert all(store.put_many(list(values.items())))
    advised = _advice(monkeypatch)
    gate = threading.Event()
    store._readers.ahead(store._live_env, store._data, [])  # the advising thread exists
    store._readers._advisor[1].submit(gate.wait)  # holds the thread while more advice queues
    store.advise(list(values))
    closer = threading.Thread(target=store.close)
    closer.start()
    assert store._readers._stopping.wait(timeout=30)
    gate.set()
    closer.join(timeout=30)
    assert not closer.is_alive() and advised == []  # the queued advice saw the store closing: nothing advised
    store._readers.ahead(None, None, list(values))  # after close: no thread made, nothing advised
    assert store._readers._advisor is None and advised == []


def test_a_tiered_store_advises_its_back_of_what_memory_lacks(tmp_path):
    values = _values(6)
    back = LMDBStore(str(tmp_path / "db"), 64 << 20, readers=1)
    asked: list[list[bytes]] = []
    back.advise = asked.append  # type: ignore[method-assign]
    with TieredStore(MemoryStore(64 << 20, pinned=False), back) as store:
        assert all(store.put_many(list(values.items())))
        assert store.flush(timeout=30)
        keys = list(values)
        store.front.delete(keys[1])
        store.front.delete(keys[4])
        store.advise(keys)
        assert asked == [[keys[1], keys[4]]]
        store.advise(keys[:1])  # all in memory: the back is not asked
        assert len(asked) == 1
