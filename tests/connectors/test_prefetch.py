"""Prefetch: a queued request's stored prefix promoted from the slow tier into memory before its load
(`Store.prefetch`, `connectors.prefetch.Prefetcher`). The vLLM scheduler's side is in
test_vllm_scheduler_glm.py, the real engine in test_vllm_connector.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvoffload.connectors.plan import STORE_CALL_PAGES as SLICE
from kvoffload.connectors.plan import Page
from kvoffload.connectors.prefetch import Prefetcher
from kvoffload.store import open_store


def _value(key: bytes, n: int = 64 << 10) -> bytes:
    return np.random.default_rng(int.from_bytes(key[-4:], "little")).integers(0, 256, n, np.uint8).tobytes()


def _tiered(tmp_path, memory="4MiB"):
    return open_store(f"tiered://?memory={memory}&lmdb={tmp_path}/db&lmdb_capacity=64MiB&pinned=false")


def _on_disk_only(store, keys):
    """`keys` in the back tier only (as after a restart)."""
    assert all(store.back.put_many([(k, _value(k)) for k in keys]))
    assert store.front.contains_many(keys) == [False] * len(keys)


def test_tiered_prefetch_promotes_back_values_byte_exact(tmp_path):
    keys = [b"page-%04d" % i for i in range(12)]
    with _tiered(tmp_path) as store:
        _on_disk_only(store, keys)
        store.front.put_many([(keys[0], _value(keys[0]))])  # already in memory: not read again
        assert store.prefetch(keys) == len(keys) - 1
        assert store.front.contains_many(keys) == [True] * len(keys)
        stats = store.stats()
        assert stats["prefetched"] == len(keys) - 1 and stats["prefetched_bytes"] == (len(keys) - 1) * (64 << 10)
        got = {}
        assert all(store.read_many(keys, lambda i, view: got.__setitem__(i, bytes(view))))
        assert all(got[i] == _value(k) for i, k in enumerate(keys))
        after = store.stats()
        assert after["memory_hits"] - stats["memory_hits"] == len(keys) and after["disk_hits"] == stats["disk_hits"]
        assert store.prefetch(keys + [b"absent"]) == 0  # nothing left to move; a missing key is no error


def test_prefetch_beyond_the_memory_tier_keeps_its_cap(tmp_path):
    keys = [b"page-%04d" % i for i in range(40)]  # 2.5 MiB of values into a 1 MiB memory tier
    with _tiered(tmp_path, memory="1MiB") as store:
        _on_disk_only(store, keys)
        store.prefetch(keys)
        assert store.front.stats()["bytes_used"] <= 1 << 20
        assert sum(store.front.contains_many(keys)) <= 16


def test_single_tier_stores_have_nothing_to_prefetch(tmp_path):
    with open_store(f"lmdb://{tmp_path}/db?capacity=16MiB") as store:
        store.put_many([(b"k", b"v" * 100)])
        assert store.prefetch([b"k"]) == 0


# -- Prefetcher ----------------------------------------------------------------------------------------
GROUP = SimpleNamespace(name="g", used_bytes_per_block=1000)  # all a Prefetcher reads of a page's group


def _pages(prefix: str, n: int) -> list[Page]:
    return [Page(f"{prefix}-{i}".encode(), GROUP, i) for i in range(n)]


class _SlowStore:
    """Records prefetch calls; each waits until the test opens the gate."""

    def __init__(self):
        self.calls: list[list[bytes]] = []
        self.gate = threading.Event()
        self.entered = threading.Event()

    def prefetch(self, keys):
        self.calls.append(list(keys))
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        return len(keys)


@pytest.fixture
def slow():
    store = _SlowStore()
    yield store
    store.gate.set()


def test_prefetcher_promotes_every_page_in_slices(slow):
    slow.gate.set()
    prefetcher = Prefetcher(slow, budget=10**9)
    try:
        assert prefetcher.submit("r", _pages("r", 2 * SLICE + 3))
        assert prefetcher.idle(10)
        assert [len(c) for c in slow.calls] == [SLICE, SLICE, 3]
        assert prefetcher.counters["prefetched_pages"] == 2 * SLICE + 3
        assert prefetcher.charged == 1000 * (2 * SLICE + 3), "budget is held until the request is scheduled"
        prefetcher.done(["r"])
        assert prefetcher.charged == 0
    finally:
        prefetcher.close()


def test_prefetcher_budget_skips_and_done_gives_it_back(slow):
    slow.gate.set()
    prefetcher = Prefetcher(slow, budget=5000)
    try:
        assert prefetcher.submit("a", _pages("a", 4))
        assert not prefetcher.submit("b", _pages("b", 2)), "4000 + 2000 bytes is over a 5000-byte budget"
        assert prefetcher.counters["prefetch_skipped"] == 1
        prefetcher.done(["a"])
        assert prefetcher.submit("b", _pages("b", 2))
        assert prefetcher.idle(10)
    finally:
        prefetcher.close()


def test_done_cancels_a_queued_job_and_stops_a_running_one(slow):
    prefetcher = Prefetcher(slow, budget=10**9)
    try:
        prefetcher.submit("running", _pages("running", 3 * SLICE))
        assert slow.entered.wait(10)
        prefetcher.submit("queued", _pages("queued", 4))
        prefetcher.done(["queued", "running"])  # both scheduled (or gone) before their prefetch ended
        slow.gate.set()
        assert prefetcher.idle(10)
        assert len(slow.calls) == 1, "the running job went on after its request was scheduled"
        assert not any(k.startswith(b"queued") for call in slow.calls for k in call)
        assert prefetcher.counters["prefetch_cancelled"] == 2 and prefetcher.charged == 0
    finally:
        prefetcher.close()


def test_cancel_all_waits_for_the_running_promotion(slow):
    """A store reset clears memory after `cancel_all`: no promotion may land after it."""
    prefetcher = Prefetcher(slow, budget=10**9)
    try:
        prefetcher.submit("running", _pages("running", 3 * SLICE))
        prefetcher.submit("queued", _pages("queued", 2))
        assert slow.entered.wait(10)
        assert not prefetcher.cancel_all(timeout=0.2), "returned while a promotion was still running"
        slow.gate.set()
        assert prefetcher.cancel_all(timeout=10)
        assert len(slow.calls) == 1 and prefetcher.charged == 0
    finally:
        prefetcher.close()


def test_a_failing_store_is_counted_and_the_thread_lives_on():
    class Broken:
        def prefetch(self, keys):
            raise OSError("disk gone")

    prefetcher = Prefetcher(Broken(), budget=10**9)
    try:
        prefetcher.submit("a", _pages("a", 2))
        prefetcher.submit("b", _pages("b", 2))
        assert prefetcher.idle(WATCHDOG_S)  # both jobs ran (an error is counted before the job ends)
        assert prefetcher.counters["prefetch_errors"] == 2
        assert prefetcher.submit("c", _pages("c", 2)) and prefetcher.idle(WATCHDOG_S)  # the thread lives on
        assert prefetcher.counters["prefetch_errors"] == 3
    finally:
        prefetcher.close()


WATCHDOG_S = 60.0


def test_prefetch_beside_loads_saves_and_evictions_stays_byte_exact(tmp_path):
    """A Prefetcher promoting (and being cancelled) while threads read, lease and write a tiered store
    whose memory tier keeps evicting: every value served is byte-exact, memory never exceeds its cap,
    and no thread stalls (watchdog). Bounded: 3 s or 3000 operations per thread."""
    keys = [b"stress-%04d" % i for i in range(120)]  # 7.5 MiB of values through a 2 MiB memory tier
    with _tiered(tmp_path, memory="2MiB") as store:
        _on_disk_only(store, keys[:60])
        prefetcher = Prefetcher(store, budget=1 << 20)
        errors: list[str] = []
        progress = {name: 0 for name in ("submit", "read", "lease", "write")}
        deadline = time.monotonic() + 3.0

        def check(key: bytes, view) -> None:
            if bytes(view) != _value(key):
                errors.append(f"wrong bytes for {key!r}")

        def loop(name, step):
            try:
                local = np.random.default_rng(list(progress).index(name))
                while time.monotonic() < deadline and progress[name] < 3000 and not errors:
                    step(local)
                    progress[name] += 1
            except Exception as exc:  # noqa: BLE001 - reported by the test
                errors.append(f"{name}: {exc!r}")

        def submit(local):
            picked = [keys[i] for i in local.choice(len(keys), 8, replace=False)]
            req = f"r{progress['submit']}"
            prefetcher.submit(req, [Page(k, SimpleNamespace(used_bytes_per_block=64 << 10), i)
                                    for i, k in enumerate(picked)])
            if local.random() < 0.5:
                prefetcher.done([req])
            elif progress["submit"] > 4:
                prefetcher.done([f"r{progress['submit'] - 4}"])

        def read(local):
            picked = [keys[i] for i in local.choice(len(keys), 6, replace=False)]
            store.read_many(picked, lambda i, view: check(picked[i], view))

        def lease(local):
            picked = [keys[i] for i in local.choice(len(keys), 4, replace=False)]
            leases = store.acquire(picked)
            for key, lease in zip(picked, leases):
                if lease is not None:
                    check(key, lease.view)
            store.release(leases)

        def write(local):
            picked = [keys[i] for i in local.choice(len(keys), 3, replace=False)]
            store.put_many([(k, _value(k)) for k in picked])
            if store.front.stats()["bytes_used"] > 2 << 20:
                errors.append("the memory tier went over its capacity")

        threads = [threading.Thread(target=loop, args=(name, fn), daemon=True)
                   for name, fn in (("submit", submit), ("read", read), ("lease", lease), ("write", write))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=WATCHDOG_S)
            if thread.is_alive():
                pytest.fail(f"a thread stalled for {WATCHDOG_S:.0f} s (deadlock?); progress {progress}")
        prefetcher.done([f"r{i}" for i in range(progress["submit"] + 1)])
        assert prefetcher.idle(WATCHDOG_S), "the prefetch thread stalled"
        prefetcher.close()
        assert not errors, errors[:5]
        assert all(progress.values()), progress
        assert prefetcher.charged == 0
        assert store.stats()["prefetched"] > 0
