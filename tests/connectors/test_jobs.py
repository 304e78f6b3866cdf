"""Saves and loads as background jobs (`connectors.jobs`): byte-exact pages, in submission order, failures
reported as results (never raised), several submitting threads with evictions under a watchdog."""

import threading
import time

import numpy as np
import pytest
import torch

from glm_integration.cache import PagedCache
from glm_integration.config import preset
from kvoffload import open_store
from kvoffload.connectors.jobs import Jobs
from kvoffload.connectors.offloader import Offloader
from kvoffload.connectors.plan import pages_for_save
from kvoffload.connectors.transfer import make_transfer

BLOCK = 16
WATCHDOG_S = 60.0


def _setup(store_url="memory://?capacity=64MiB&pinned=false", blocks=96):
    cache = PagedCache(preset("tiny"), BLOCK, blocks)
    cache.buffer.view(torch.uint8).random_(0, 256)
    store = open_store(store_url)
    offloader = Offloader(store, cache.layout, make_transfer(cache.buffer))
    return cache, store, offloader


def _keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}/{i}".encode().ljust(16, b".") for i in range(n)]


def _save_pages(offloader, keys, source: list[int]):
    return pages_for_save(offloader.layout, keys, len(keys), range(len(keys)), source)


def _same(offloader, a: list[int], b: list[int], upto: int) -> bool:
    """Every cacheable page of blocks a[i] and b[i] equal, for i < upto (STATE: the last one only)."""
    transfer = offloader.transfer
    for group in offloader.layout.cacheable_groups:
        rows = range(upto) if group.kind.name == "PAGED" else [upto - 1]
        for i in rows:
            if not np.array_equal(transfer.gather(group, a[i]), transfer.gather(group, b[i])):
                return False
    return True


def _drained(jobs: Jobs) -> None:
    if not jobs.drain(timeout=WATCHDOG_S):
        pytest.fail(f"jobs stalled: {jobs.pending} still pending after {WATCHDOG_S} s")


def test_a_load_after_a_save_finds_its_pages_byte_exact():
    cache, store, offloader = _setup()
    jobs = Jobs(offloader)
    keys, source, target = _keys("a", 6), list(range(0, 6)), list(range(40, 46))
    jobs.submit_save(1, "s", _save_pages(offloader, keys, source))
    jobs.submit_load("l", keys, 0, 6, target)  # queued behind the save: it must see the pages
    _drained(jobs)
    results = {r.req_id: r for r in jobs.poll()}
    assert results["s"].ok and len(results["s"].written) == len(_save_pages(offloader, keys, source))
    assert results["l"].ok and not results["l"].missing
    assert _same(offloader, source, target, 6)
    assert jobs.poll() == []  # reported once
    jobs.close()


def test_failures_are_results_never_exceptions():
    cache, store, offloader = _setup()
    jobs = Jobs(offloader)
    jobs.submit_load("missing", _keys("none", 3), 0, 3, [50, 51, 52])

    def broken(*args, **kwargs):
        raise OSError("disk on fire")

    store.read_many = broken
    store.contains_many = broken
    jobs.submit_load("broken", _keys("none", 2), 0, 2, [60, 61])
    jobs.submit_save(1, "broken-save", _save_pages(offloader, _keys("b", 2), [0, 1]))
    _drained(jobs)
    results = {r.req_id: r for r in jobs.poll()}
    assert not results["missing"].ok and results["missing"].missing
    assert not results["broken"].ok and results["broken"].missing
    assert results["broken-save"].written == ()
    assert offloader.counters["save_errors"] == 1 and offloader.counters["load_failures"] == 2
    jobs.close()
    with pytest.raises(RuntimeError, match="after close"):
        jobs.submit_load("late", _keys("x", 1), 0, 1, [0])


def test_close_finishes_queued_saves():
    cache, store, offloader = _setup()
    jobs = Jobs(offloader)
    for n in range(5):
        jobs.submit_save(n, f"c{n}", _save_pages(offloader, _keys(f"c{n}", 4), list(range(4))))
    jobs.close()
    assert all(store.contains_many([p.key for p in _save_pages(offloader, _keys(f"c{n}", 4), list(range(4)))])
               for n in range(5))


def test_threads_saving_loading_and_evicting_give_byte_exact_pages():
    """Three submitting threads (each its own keys and blocks) and an evicting writer on a small store:
    a load may miss (evicted), but a load reported ok restored exactly the saved bytes. Bounded by
    count and time; a stall fails the test."""
    cache, store, offloader = _setup("memory://?capacity=3MiB&pinned=false", blocks=128)
    jobs = Jobs(offloader)
    page_bytes = sum(g.used_bytes_per_block for g in offloader.layout.cacheable_groups)
    deadline = time.monotonic() + 4.0
    submitted: dict[str, tuple] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def submitter(t: int) -> None:
        try:
            base = 8 + t * 40
            for n in range(30):
                if time.monotonic() > deadline:
                    break
                keys, source, target = _keys(f"t{t}/{n}", 4), list(range(base, base + 4)), list(range(base + 20, base + 24))
                jobs.submit_save(n, f"s{t}/{n}", _save_pages(offloader, keys, source))
                jobs.submit_load(f"l{t}/{n}", keys, 0, 4, target)
                with lock:
                    submitted[f"l{t}/{n}"] = (source, target)
                _drained(jobs)  # this thread's blocks are reused next round: its jobs must have run
                for result in [r for r in jobs.poll()]:
                    with lock:
                        submitted.setdefault("results", []).append(result)
                with lock:
                    for result in submitted["results"]:
                        if result.kind == "load" and result.ok and result.req_id.startswith(f"l{t}/"):
                            src, dst = submitted[result.req_id]
                            assert _same(offloader, src, dst, 4), result.req_id
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def evictor() -> None:
        rng = np.random.default_rng(0)
        n = 0
        while time.monotonic() < deadline and n < 2000:
            store.put(f"junk{n}".encode(), rng.integers(0, 256, page_bytes // 3, dtype=np.uint8))
            n += 1

    threads = [threading.Thread(target=submitter, args=(t,)) for t in range(3)] + [threading.Thread(target=evictor)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=WATCHDOG_S)
        if thread.is_alive():
            pytest.fail("a thread stalled")
    if errors:
        raise errors[0]
    _drained(jobs)
    results = submitted.get("results", []) + jobs.poll()
    loads = [r for r in results if r.kind == "load"]
    for result in loads:
        if result.ok:
            assert _same(offloader, *submitted[result.req_id], 4), result.req_id
    assert loads and any(r.ok for r in loads)
    jobs.close()


@pytest.mark.parametrize("url", ["memory://?capacity=1KiB&pinned=false", "lmdb://{tmp}/store?capacity=64KiB"])
def test_a_store_smaller_than_a_page_is_said_once_and_saves_skip_quietly(tmp_path, caplog, url):
    """A capacity below one page: one WARNING at start-up naming the capacity and the page size; every
    save then skips (counted), without an ERROR per save."""
    import logging

    with caplog.at_level(logging.WARNING):
        cache, store, offloader = _setup(url.format(tmp=tmp_path))
        page = max(g.used_bytes_per_block for g in offloader.layout.cacheable_groups)
        assert not store.fits(page)
        jobs = Jobs(offloader)
        for round in range(3):
            keys = _keys(f"r{round}", 4)
            jobs.submit_save(round, f"r{round}", _save_pages(offloader, keys, list(range(4))))
        _drained(jobs)
        results = jobs.poll()
        jobs.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "raise its capacity" in r.message]
    assert len(warnings) == 1 and f"a page is {page} bytes" in warnings[0].message
    assert f"capacity {store.capacity} bytes" in warnings[0].message
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert all(not r.written for r in results) and len(results) == 3
    assert offloader.counters["save_skipped_too_large"] == 3 * len(_save_pages(offloader, _keys("x", 4), range(4)))
    assert store.stats()["entries"] == 0
    store.close()


def test_wait_results_returns_with_the_first_result_or_at_once_when_idle():
    """An engine step with nothing to compute waits here (bounded) rather than spinning."""
    cache, store, offloader = _setup()
    jobs = Jobs(offloader)
    try:
        # nothing pending: no wait at all, even with a timeout of days (a waiting call would hold its thread
        # far past the watchdog; no bound in seconds is asserted)
        idle: list[bool] = []
        waiter = threading.Thread(target=lambda: idle.append(jobs.wait_results(1e6)), daemon=True)
        waiter.start()
        waiter.join(WATCHDOG_S)
        assert not waiter.is_alive(), "nothing pending, yet wait_results waited"
        assert idle == [False]
        keys = _keys("w", 4)
        jobs.submit_save(1, "s", _save_pages(offloader, keys, list(range(4))))
        assert jobs.wait_results(WATCHDOG_S) is True
        assert [r.req_id for r in jobs.poll()] == ["s"]
    finally:
        jobs.close()


def test_a_long_host_load_is_read_in_slices_and_stays_byte_exact():
    """A background host load hands the GIL back every STORE_CALL_PAGES pages, as a save does: the engine's
    thread never waits a whole switch interval behind a long prefix."""
    from kvoffload.connectors.plan import STORE_CALL_PAGES

    cache, store, offloader = _setup(blocks=96)
    jobs = Jobs(offloader)
    try:
        n = 40
        keys, source, target = _keys("slice", n), list(range(n)), list(range(48, 48 + n))
        jobs.submit_save(1, "s", _save_pages(offloader, keys, source))
        _drained(jobs)
        calls = []
        read_many = store.read_many
        store.read_many = lambda ks, consume: (calls.append(len(ks)), read_many(ks, consume))[1]
        jobs.submit_load("l", keys, 0, n, target)
        _drained(jobs)
        assert [r.ok for r in jobs.poll() if r.req_id == "l"] == [True]
        assert len(calls) > 1 and max(calls) <= STORE_CALL_PAGES, calls
        assert _same(offloader, source, target, n)
    finally:
        jobs.close()
