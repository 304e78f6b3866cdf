"""tiered:// writes its disk tier behind: a put waits for memory only, a background thread commits to
the back. Bounded (bytes, age), ordered (latest wins, deletes stay deleted), failures counted, and a
SIGKILL mid-stream leaves on disk exactly what was reported durable, byte-exact."""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import subprocess_env
from kvoffload import open_store
from kvoffload.store import MemoryStore, StoreConfigError, TieredStore
from kvoffload.store.base import Store
from support.clock import FakeClock

WAIT = 20.0  # seconds any wait in these tests may take before it is a failure


def value_of(key: bytes, size: int | None = None) -> bytes:
    """A value derived from its key: any stored value can be checked without a record of what was put."""
    rng = np.random.default_rng(int.from_bytes(key, "little") % (1 << 63))
    size = int(rng.integers(1, 64 << 10)) if size is None else size
    return rng.integers(0, 256, size, dtype=np.uint8).tobytes()


class GatedStore(Store):
    """A back tier whose writes wait on `gate` (so a test controls when the disk 'happens') and can fail."""

    def __init__(self, inner: Store):
        super().__init__()
        self.inner, self.capacity, self.url = inner, inner.capacity, "gated://"
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()
        self.batches: list[list[tuple[bytes, bytes]]] = []
        self.durable: list[bytes] = []  # the keys this tier reported written, in order
        self.fail: str | None = None  # "raise" or "false"
        self.callers: set[int] = set()  # the threads that called put_many
        self.inside = 0  # put_many calls not yet returned (a batch being committed)

    def put_many(self, items):
        self.callers.add(threading.get_ident())
        self.inside += 1
        try:
            return self._put_many(items)
        finally:
            self.inside -= 1

    def _put_many(self, items):
        self.entered.set()
        if not self.gate.wait(WAIT):
            raise RuntimeError("gate never opened")
        self.batches.append([(k, bytes(memoryview(v))) for k, v in items])
        if self.fail == "raise":
            raise OSError("the disk is on fire")
        if self.fail == "false":
            return [False] * len(items)
        written = self.inner.put_many(items)
        self.durable.extend(k for (k, _), ok in zip(items, written) if ok)
        return written

    def read_many(self, keys, consume):
        return self.inner.read_many(keys, consume)

    def contains_many(self, keys):
        return self.inner.contains_many(keys)

    def delete(self, key):
        return self.inner.delete(key)

    def _usage(self):
        return self.inner._usage()

    def close(self):
        self.inner.close()

    def written(self) -> list[bytes]:
        return [k for batch in self.batches for k, _ in batch]


def without_the_disk(back: GatedStore, call):
    """call()'s result, checking it never waits for the back: run in a thread (joined with a WAIT watchdog,
    so a call that does wait fails rather than hangs), it returns while the back's gate is still closed,
    without having called the back itself. (No bound in seconds: a slow machine cannot fail it.)"""
    assert not back.gate.is_set()
    result, errors = [], []

    def run():
        try:
            result.append(call())
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(WAIT)
    assert not thread.is_alive(), "the call is blocked (on the gated back?)"
    if errors:
        raise errors[0]
    assert not back.gate.is_set() and thread.ident not in back.callers  # the disk never saw this thread
    return result[0]


@pytest.fixture
def gated():
    """gated(**TieredStore options) -> (store, back): memory in front of a gated memory 'disk'."""
    made = []

    def make(memory=8 << 20, **options):
        back = GatedStore(MemoryStore(64 << 20, pinned=False))
        store = TieredStore(MemoryStore(memory, pinned=False), back, **options)
        made.append((store, back))
        return store, back

    yield make
    for store, back in made:
        back.gate.set()
        store.close()


def test_put_returns_before_the_disk_write(gated):
    store, back = gated()
    back.gate.clear()
    items = [(b"k%d" % i, value_of(b"k%d" % i)) for i in range(20)]
    assert without_the_disk(back, lambda: store.put_many(items)) == [True] * 20
    assert without_the_disk(back, lambda: store.put(b"one more", b"x" * 1000))
    assert back.entered.wait(WAIT)
    assert [store.get(k) for k, _ in items] == [v for _, v in items]  # served by memory meanwhile
    assert not any(back.inner.contains_many([k for k, _ in items]))
    stats = store.stats()
    assert stats["behind_queued"] == 21 and stats["behind_written"] == 0
    assert stats["behind_queued_bytes"] == sum(len(v) for _, v in items) + 1000
    assert not store.flush(0.2)  # still blocked
    back.gate.set()
    assert store.flush(WAIT)
    assert [back.inner.get(k) for k, _ in items] == [v for _, v in items]
    stats = store.stats()
    assert stats["behind_queued"] == 0 and stats["behind_queued_bytes"] == 0
    assert stats["behind_written"] == 21 and stats["behind_written_bytes"] == sum(len(v) for _, v in items) + 1000
    assert stats["behind_dropped"] == stats["behind_failed"] == 0


def test_write_many_is_queued_too(gated):
    store, back = gated()
    values = [value_of(b"w%d" % i, 5000 + i) for i in range(4)]

    def fill(dests):
        for dest, value in zip(dests, values):
            dest[:] = np.frombuffer(value, np.uint8)
        return [True] * len(dests)

    assert store.write_many([(b"w%d" % i, len(v)) for i, v in enumerate(values)], fill) == [True] * 4
    assert store.flush(WAIT)
    assert [back.inner.get(b"w%d" % i) for i in range(4)] == values


def test_flush_and_close_leave_lmdb_byte_exact(tmp_path):
    url = f"tiered://?memory=16MiB&lmdb={tmp_path}/db&lmdb_capacity=64MiB"
    keys = [b"key%d" % i for i in range(200)]
    with open_store(url) as store:
        assert store.behind_bytes == 8 << 20  # min(memory / 2, 2 GiB)
        assert all(store.put_many([(k, value_of(k)) for k in keys]))
        assert store.flush(WAIT)
        assert store.stats()["behind_written"] == len(keys)
        assert store.put(b"at close", b"c" * 777)  # close flushes
    with open_store(f"lmdb://{tmp_path}/db?capacity=64MiB") as disk:
        assert [disk.get(k) for k in keys] == [value_of(k) for k in keys]
        assert disk.get(b"at close") == b"c" * 777


def test_back_pressure_drops_exactly_and_never_blocks(gated):
    store, back = gated(behind_bytes=10_000)
    back.gate.clear()
    puts = without_the_disk(back, lambda: [store.put(b"p%d" % i, bytes([i]) * 1000) for i in range(40)])
    assert puts == [True] * 40  # held in memory either way
    stats = store.stats()
    assert stats["behind_queued"] == 10 and stats["behind_queued_bytes"] == 10_000
    assert stats["behind_dropped"] == 30 and stats["behind_dropped_bytes"] == 30_000
    assert all(store.get(b"p%d" % i) == bytes([i]) * 1000 for i in range(40))
    back.gate.set()
    assert store.flush(WAIT)
    assert back.written() == [b"p%d" % i for i in range(10)]
    assert store.stats()["behind_written"] == 10


def test_age_bound(gated):
    clock = FakeClock()  # the age bound's seconds: advanced here, never slept through
    store, back = gated(behind_age=0.5, clock=clock)
    back.gate.clear()
    assert store.put(b"first", b"1")
    assert back.entered.wait(WAIT)  # the writer holds "first", blocked in the back
    assert store.put_many([(b"old1", b"2"), (b"old2", b"3")]) == [True, True]
    clock.advance(0.5)
    assert store.put(b"fresh0", b"0")  # at the bound: not too old yet
    assert store.stats()["behind_dropped"] == 0
    clock.advance(0.3)
    assert store.put(b"fresh", b"4")  # queueing drops what waited too long
    assert store.stats()["behind_dropped"] == 2 and store.stats()["behind_dropped_bytes"] == 2
    back.gate.set()
    assert store.flush(WAIT)
    assert back.written() == [b"first", b"fresh0", b"fresh"]
    # and the writer drops what waited too long by the time it gets to it
    back.gate.clear()
    back.entered.clear()
    assert store.put(b"second", b"5")
    assert back.entered.wait(WAIT)
    assert store.put(b"late", b"6")
    clock.advance(0.8)
    back.gate.set()
    assert store.flush(WAIT)
    assert back.written() == [b"first", b"fresh0", b"fresh", b"second"]
    assert store.stats()["behind_dropped"] == 3 and store.get(b"late") == b"6"  # kept in memory


def test_a_rewritten_key_is_written_latest_last(gated):
    store, back = gated()
    back.gate.clear()
    assert store.put(b"k", b"v1")
    assert back.entered.wait(WAIT)  # v1 is being committed
    assert store.put(b"k", b"v2")
    assert store.put(b"other", b"o")
    assert store.put(b"k", b"v3")  # replaces v2 in the queue
    back.gate.set()
    assert store.flush(WAIT)
    assert [dict(batch).get(b"k") for batch in back.batches if b"k" in dict(batch)] == [b"v1", b"v3"]
    assert back.inner.get(b"k") == b"v3" and store.get(b"k") == b"v3"
    stats = store.stats()
    assert stats["behind_dropped"] == 0 and stats["behind_written"] == 3 and stats["behind_queued_bytes"] == 0


def test_delete_is_not_resurrected(gated):
    store, back = gated()
    back.gate.clear()
    assert store.put(b"inflight", b"a" * 100)
    assert back.entered.wait(WAIT)
    assert store.put(b"queued", b"b" * 100)
    # only queued: taken out of the queue, no wait for the disk (still committing "inflight" meanwhile)
    assert without_the_disk(back, lambda: store.delete(b"queued"))
    assert back.inside == 1 and back.batches == []
    results = []
    deleter = threading.Thread(target=lambda: results.append(store.delete(b"inflight")), daemon=True)
    deleter.start()
    deleter.join(0.3)
    assert deleter.is_alive()  # waits for the batch that is committing its key
    back.gate.set()
    deleter.join(WAIT)
    if deleter.is_alive():
        pytest.fail("delete never returned")
    assert results == [True]
    assert store.flush(WAIT)
    assert back.written() == [b"inflight"]  # the queued value was never written
    for key in (b"inflight", b"queued"):
        assert store.get(key) is None and not store.contains(key) and not back.inner.contains(key)
    assert not store.delete(b"queued")


def test_disk_hits_are_promoted_into_memory_slots(tmp_path):
    url = f"tiered://?memory=1MiB&lmdb={tmp_path}/db&lmdb_capacity=64MiB"
    keys = [b"r%d" % i for i in range(8)]
    big = value_of(b"big", 3 << 20)  # larger than the memory tier: written through, leased as a copy
    with open_store(url) as store:
        assert all(store.put_many([(k, value_of(k, 20_000)) for k in keys]))
        assert store.put(b"big", big)
    with open_store(url) as store:  # memory empty after a restart
        outs = [np.zeros(20_000, np.uint8) for _ in keys]
        assert store.get_many(keys, outs) == [20_000] * len(keys)
        assert all(out.tobytes() == value_of(k, 20_000) for k, out in zip(keys, outs))
        assert all(store.front.contains_many(keys))
        stats = store.stats()
        assert stats["disk_hits"] == len(keys) and stats["promotions"] == len(keys) and stats["memory_hits"] == 0
        assert [store.get(k) for k in keys] == [value_of(k, 20_000) for k in keys]
        assert store.stats()["memory_hits"] == len(keys)
        assert store.stats()["behind_queued"] == 0 and store.stats()["behind_written"] == 0  # nothing re-written
        assert store.front.delete(keys[0]) and store.front.delete(keys[1])
        leases = store.acquire([keys[0], keys[1], keys[2], b"big", b"absent"])
        try:
            assert leases[4] is None
            assert [bytes(lease.view) for lease in leases[:3]] == [value_of(k, 20_000) for k in keys[:3]]
            assert bytes(leases[3].view) == big and leases[3].slot is None
            assert all(store.front.contains_many(keys[:2]))  # promoted, then leased from memory
            if store.in_place:
                assert all(lease.slot is not None for lease in leases[:3])
        finally:
            store.release(leases)
        assert store.stats()["promotions"] == len(keys) + 2


@pytest.mark.parametrize("failure", ["raise", "false"])
def test_a_failing_back_is_counted_never_raised(gated, failure, caplog):
    store, back = gated()
    durable = back.durable
    back.fail = failure
    assert store.put_many([(b"f%d" % i, b"x" * 10) for i in range(5)]) == [True] * 5
    assert store.flush(WAIT)
    assert store.stats()["behind_failed"] == 5 and store.stats()["behind_written"] == 0
    assert durable == [] and store.get(b"f0") == b"x" * 10
    assert store.stats()["behind_queued_bytes"] == 0  # the leases were given back
    back.fail = None
    assert store.put(b"after", b"y")
    assert store.flush(WAIT)
    assert durable == [b"after"] and back.inner.get(b"after") == b"y"


def test_url_options(tmp_path):
    base = f"tiered://?memory=4MiB&lmdb={tmp_path}/db&lmdb_capacity=8MiB"
    for options, message in [("&write=sideways", "write= takes behind or through"),
                             ("&behind_age=-1", "behind_age= takes a positive"),
                             ("&behind_age=nan", "behind_age= takes a positive"),
                             ("&behind_age=soon", "behind_age= takes a positive"),
                             ("&behind_bytes=0", "behind_bytes must be positive"),
                             ("&behind_bytes=lots", "invalid behind_bytes"),
                             ("&write=through&behind_age=5", "apply to write=behind only"),
                             ("&admit=0", "admit= takes a number of uses"),
                             ("&admit=two", "admit= takes a number of uses"),
                             ("&write=through&admit=2", "admit= above 1 needs write=behind"),
                             ("&behind_ages=5", "unknown option")]:
        with pytest.raises(StoreConfigError, match=message):
            open_store(base + options)
    assert not os.path.exists(tmp_path / "db")  # refused before anything was opened
    with open_store(base + "&behind_bytes=1MiB&behind_age=2.5") as store:
        assert (store.write, store.behind_bytes, store.behind_age) == ("behind", 1 << 20, 2.5)
    with open_store(base + "&admit=3") as store:
        assert store.admit == 3
    with open_store(base + "&write=through") as store:
        assert store.put(b"k", b"durable now")
        assert store.back.get(b"k") == b"durable now"  # on disk when put returned
        assert store.stats()["behind_queued"] == 0 and store._behind._thread is None


def test_a_process_exiting_without_close_writes_what_is_queued(tmp_path):
    script = ("import sys; from kvoffload import open_store; store = open_store(sys.argv[1]); "
              "assert all(store.put_many([(b'e%d' % i, bytes([i]) * 50_000) for i in range(40)]))")
    url = f"tiered://?memory=16MiB&lmdb={tmp_path}/db&lmdb_capacity=64MiB"
    out = subprocess.run([sys.executable, "-c", script, url], env=subprocess_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    with open_store(f"lmdb://{tmp_path}/db?capacity=64MiB") as disk:
        assert [disk.get(b"e%d" % i) for i in range(40)] == [bytes([i]) * 50_000 for i in range(40)]


CHILD = """
import os, sys, time
sys.path[:0] = [os.path.join(os.environ["KVOFFLOAD_ROOT"], "tests", "store"), os.path.join(os.environ["KVOFFLOAD_ROOT"], "tests")]
from test_write_behind import value_of
from kvoffload.store import LMDBStore, MemoryStore, TieredStore

directory, log_path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

class Reporting(LMDBStore):  # the disk tier, logging (synced) the keys it reported written
    def put_many(self, items):
        written = super().put_many(items)
        os.write(fd, b"".join(k + b"\\n" for (k, _), ok in zip(items, written) if ok))
        os.fsync(fd)
        return written

store = TieredStore(MemoryStore(32 << 20), Reporting(directory, 64 << 20))
for i in range(n):
    key = b"key%06d" % i
    assert store.put(key, value_of(key))
    time.sleep(0.003)
print("all put", flush=True)
time.sleep(120)
"""


def test_sigkill_during_write_behind_loses_only_unreported_entries(tmp_path):
    from conftest import ROOT

    n = 1000  # about 32 MiB of values: the LMDB tier (64 MiB) never evicts, so a missing key was never written
    log_path = tmp_path / "durable.log"
    # the child's store: tiered://?memory=32MiB&lmdb={tmp_path}/db&lmdb_capacity=64MiB, its disk tier reporting
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "db"), str(log_path), str(n)],
                             env=subprocess_env(KVOFFLOAD_ROOT=ROOT), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and child.poll() is None:
            if log_path.exists() and log_path.read_bytes().count(b"\n") >= 50:
                break
            time.sleep(0.01)
        else:
            out, err = child.communicate(timeout=WAIT) if child.poll() is not None else ("", "")
            pytest.fail(f"the child reported no durable entries in time (rc {child.poll()}): {err[-2000:]}")
        os.kill(child.pid, signal.SIGKILL)
        out, err = child.communicate(timeout=WAIT)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(WAIT)
    assert child.returncode == -signal.SIGKILL
    assert "all put" not in out  # killed mid-stream
    reported = [line for line in log_path.read_bytes().split(b"\n") if line]
    assert len(reported) >= 50 and len(set(reported)) == len(reported)
    with open_store(f"lmdb://{tmp_path}/db?capacity=64MiB") as disk:
        present = {}
        for i in range(n):
            key = b"key%06d" % i
            got = disk.get(key)
            if got is not None:
                present[key] = got
    assert set(reported) <= set(present), sorted(set(reported) - set(present))[:5]
    bad = [k for k, v in present.items() if v != value_of(k)]
    assert not bad, bad[:5]


def test_a_cold_prefix_is_read_by_several_readers_into_memory_slots(tmp_path):
    """`acquire` of values only on disk splits the reads over reader threads: every value lands in its
    own memory slot byte-exact, whichever thread read it."""
    url = f"tiered://?memory=8MiB&lmdb={tmp_path}/db&lmdb_capacity=64MiB"
    keys = [b"c%d" % i for i in range(41)]
    with open_store(url) as store:
        assert all(store.put_many([(k, value_of(k, 30_000 + i)) for i, k in enumerate(keys)]))
    with open_store(url) as store:
        leases = store.acquire(keys)
        try:
            assert [bytes(lease.view) for lease in leases] == [value_of(k, 30_000 + i) for i, k in enumerate(keys)]
            assert len({lease.slot for lease in leases}) == len(keys) and store.stats()["disk_hits"] == len(keys)
        finally:
            store.release(leases)
        assert store._readers is not None  # the reads went through the reader pool


def test_admission_writes_a_value_behind_only_on_its_nth_use(gated):
    """admit=3: a put is the first use, a read served from memory or a put again the next; a value goes to
    disk on its third use, and one used fewer times stays in memory only (counted, never lost from it)."""
    store, back = gated(admit=3)
    items = {k: value_of(k) for k in (b"once", b"twice", b"thrice", b"recomputed")}
    assert all(store.put_many(list(items.items())))
    assert store.get(b"twice") == items[b"twice"]
    for _ in range(2):
        assert store.get(b"thrice") == items[b"thrice"]
    store.release(store.acquire([b"thrice"]))  # past admission: nothing more to count or write
    assert store.put(b"recomputed", items[b"recomputed"])
    lease = store.acquire([b"recomputed"])  # a load: the third use
    assert store.flush(WAIT)
    assert back.written() == [b"thrice", b"recomputed"]  # exactly once each
    store.release(lease)
    assert [back.inner.get(k) for k in (b"thrice", b"recomputed")] == [items[b"thrice"], items[b"recomputed"]]
    stats = store.stats()
    assert stats["behind_not_admitted"] == 5 and stats["behind_admitted"] == 2  # puts waiting; admitted
    assert stats["admission_waiting"] == 2 and stats["behind_written"] == 2
    assert [store.get(k) for k in items] == list(items.values())  # the rest: memory only, still served
    assert store.flush(WAIT)  # ... and that read was "twice"'s third use
    assert back.written() == [b"thrice", b"recomputed", b"twice"]
    plain, plain_back = gated()
    assert all(plain.put_many(list(items.items()))) and plain.flush(WAIT)
    assert sorted(plain_back.written()) == sorted(items)  # admit=1 (default): everything goes behind


def _at(address: int, size: int) -> bytes:
    import ctypes

    return ctypes.string_at(address, size)


def test_a_batch_held_whole_by_the_memory_front_is_the_fronts_own(tmp_path):
    """A warm restore from tiered:// holds its batch in the memory front by address, one handle, as a
    memory:// store does; a batch with a page only the back tier has takes the general path (promotion),
    same bytes either way, and every hold is given back."""
    with open_store(f"tiered://?memory=4MiB&lmdb={tmp_path}/db&lmdb_capacity=8MiB&write=through") as store:
        values = {b"k%d" % i: bytes([i]) * (1000 + i) for i in range(6)}
        assert all(store.put_many(list(values.items())))
        held = store.acquire_batch(list(values))
        assert type(held.handle).__name__ == "_FrontBatch" and store.front.stats()["held"] == 6
        assert [_at(a, s) for a, s in zip(held.addresses.tolist(), held.sizes.tolist())] == list(values.values())
        store.release_batch(held)
        assert store.front.stats()["held"] == 0 and store.stats()["memory_hits"] == 6
        store.front.delete(b"k2")  # now only on disk
        held = store.acquire_batch([b"k1", b"k2", b"missing"])
        assert type(held.handle).__name__ != "_FrontBatch"
        assert held.addresses[2] == 0 and held.sizes[2] == 0
        assert [_at(a, s) for a, s in zip(held.addresses[:2].tolist(), held.sizes[:2].tolist())] == [
            values[b"k1"], values[b"k2"]]
        store.release_batch(held)
        assert store.front.stats()["held"] == 0 and store.stats()["disk_hits"] == 1


def test_a_batch_is_written_in_pieces_latest_values_only_and_every_hold_given_back(gated):
    """One put_many of 600 values waits behind (a lease on each value in the front); meanwhile one of its
    keys is put again, one deleted and one dropped from the front by the front itself. The writer commits
    them in pieces of at most BATCH_ENTRIES: the new value (in a piece of its own, after), not the replaced
    one; not the deleted one; the one the front let go from its index, still leased; byte-exact. Then
    nothing is held any more."""
    from kvoffload.store.tiered_behind import BATCH_ENTRIES

    store, back = gated(memory=16 << 20)
    back.gate.clear()
    keys = [b"b%d" % i for i in range(600)]
    values = {k: value_of(k, 2000 + i) for i, k in enumerate(keys)}
    assert without_the_disk(back, lambda: store.put_many(list(values.items()))) == [True] * 600
    assert back.entered.wait(WAIT)  # the writer took the first piece and waits at the gate
    assert store.front.stats()["held"] == 600  # every value's slot, leased for the writer
    assert store.put(b"b450", b"newer")
    assert store.delete(b"b451")
    assert store.front.delete(b"b452")  # the front's index forgets it; the queued bytes stay held
    assert store.contains(b"b452")  # found waiting behind
    back.gate.set()
    assert store.flush(WAIT)
    assert all(len(batch) <= BATCH_ENTRIES for batch in back.batches)
    assert back.written()[:598] == [k for k in keys if k not in (b"b450", b"b451")]
    assert back.written()[598:] == [b"b450"]
    assert back.inner.get(b"b450") == b"newer" and not back.inner.contains(b"b451")
    assert all(back.inner.get(k) == values[k] for k in keys if k not in (b"b450", b"b451"))
    stats = store.stats()
    assert stats["behind_written"] == 599 and stats["behind_queued"] == 0 and stats["behind_queued_bytes"] == 0
    assert stats["behind_dropped"] == 0 and store.front.stats()["held"] == 0


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_concurrent_puts_and_deletes_leave_the_back_with_each_keys_last_word(gated, monkeypatch, seed):
    """Four threads put batches (new values of keys seen before among them), delete keys and write values
    too large for the front (straight to the back) while the writer commits in small pieces behind a
    back that stalls at random. Each thread owns its keys, so each key's last word is known: after a
    flush the back holds exactly the last value put of every key last put, none of a key last deleted,
    and the front holds nothing for the writer."""
    import random

    from kvoffload.store import tiered_behind

    monkeypatch.setattr(tiered_behind, "BATCH_ENTRIES", 7)
    monkeypatch.setattr(tiered_behind, "BATCH_BYTES", 64 << 10)
    store, back = gated(memory=2 << 20, behind_bytes=1 << 20)
    large = store.front.max_entry_bytes + 1  # 2 MiB + 1, 3% of the steps: ~14 in all fit the 64 MiB back
    stalls = random.Random(seed)
    inner_put = back._put_many

    def stalling_put(items):
        if stalls.random() < 0.5:
            time.sleep(0.003)
        return inner_put(items)

    back._put_many = stalling_put
    last: dict[bytes, bytes | None] = {}
    errors: list[BaseException] = []

    def work(thread: int) -> None:
        rng = random.Random(seed * 100 + thread)
        keys = [b"t%d-k%d" % (thread, i) for i in range(40)]
        try:
            for step in range(120):
                roll = rng.random()
                if roll < 0.75:
                    batch = rng.sample(keys, rng.randint(1, 20))
                    items = [(k, value_of(k + b"@%d" % step, rng.randint(1, 2 << 10))) for k in batch]
                    assert store.put_many(items) == [True] * len(items)
                    last.update(items)
                elif roll < 0.97:
                    key = rng.choice(keys)
                    store.delete(key)
                    last[key] = None
                else:
                    key = rng.choice(keys)
                    value = value_of(key + b"@large%d" % step, large)
                    assert store.put(key, value)
                    last[key] = value
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(4 * WAIT)
    assert not any(thread.is_alive() for thread in threads) and not errors, errors
    assert store.flush(WAIT)
    for key, value in last.items():
        assert back.inner.get(key) == value, key  # None: deleted, and never resurrected
        assert store.get(key) == value, key
    stats = store.stats()
    assert stats["behind_dropped"] == 0 and stats["behind_failed"] == 0
    assert stats["behind_queued"] == 0 and stats["behind_queued_bytes"] == 0 and store.front.stats()["held"] == 0
