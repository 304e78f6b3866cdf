"""`Offloader.load` results as values: a `LoadResult` names the pages that did not arrive; a load that
raises anywhere (store, transfer, observer) is a miss of every page, reported, never raised."""

import numpy as np
import torch

from glm_integration.cache import PagedCache
from glm_integration.config import preset
from kvoffload import open_store
from kvoffload.connectors.jobs import Jobs
from kvoffload.connectors.offloader import LoadResult, Offloader
from kvoffload.connectors.plan import pages_for_load
from kvoffload.connectors.transfer import HostTransfer, make_transfer, page_spans

BLOCK = 16


def _setup(observer=None):
    cache = PagedCache(preset("tiny"), BLOCK, 64)
    cache.buffer.view(torch.uint8).random_(0, 256)
    store = open_store("memory://?capacity=64MiB&pinned=false")
    return cache, store, Offloader(store, cache.layout, make_transfer(cache.buffer), observer)


def _keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}/{i}".encode().ljust(16, b".") for i in range(n)]


def test_a_load_result_names_the_pages_that_did_not_arrive():
    cache, store, offloader = _setup()
    keys = _keys("a", 4)
    assert offloader.save(keys, 2, [1], list(range(2))) > 0  # blocks 0-1 stored, 2-3 not
    result = offloader.load(keys, 0, 4, list(range(10, 14)))
    assert isinstance(result, LoadResult) and not result.ok and not result
    wanted = pages_for_load(offloader.layout, keys, 0, 4, list(range(10, 14)))
    expected = [p for p, there in zip(wanted, store.contains_many([p.key for p in wanted])) if not there]
    assert expected and len(expected) < len(wanted)  # some pages there, some not
    assert list(result.missing) == expected and result.missing_keys == tuple(p.key for p in expected)
    assert all(p.index >= 2 for p in result.missing) and all(p.block == p.index + 10 for p in result.missing)
    assert offloader.counters["pages_missing"] == len(expected)

    full = offloader.load(keys, 0, 2, list(range(20, 22)))  # blocks 0-1 restore whole
    assert full.ok and full and full.missing == () and full.missing_keys == ()
    for group in offloader.layout.cacheable_groups:
        blocks = [(0, 20), (1, 21)] if group.kind.name == "PAGED" else [(1, 21)]
        for src, dst in blocks:
            assert np.array_equal(offloader.transfer.gather(group, src), offloader.transfer.gather(group, dst))


def test_a_load_that_raises_reports_every_page_missing():
    """A store that serves the first page, then fails: every page of the load is missing (some were
    written into the cache, but the load as a whole did not happen), and so for an observer that raises."""
    cache, store, offloader = _setup()
    keys = _keys("b", 3)
    assert offloader.save(keys, 3, [2], list(range(3))) > 0
    wanted = pages_for_load(offloader.layout, keys, 0, 3, [30, 31, 32])
    real = store.read_many

    def first_then_fail(keys_, consume):
        real(keys_[:1], consume)
        raise OSError("disk on fire")

    store.read_many = first_then_fail
    result = offloader.load(keys, 0, 3, [30, 31, 32])
    assert not result.ok and result.missing_keys == tuple(p.key for p in wanted)
    store.read_many = real

    class Raising:
        def saved(self, page, data):
            pass

        def loaded(self, page):
            raise RuntimeError("observer broke")

    offloader.observer = Raising()
    result = offloader.load(keys, 0, 3, [30, 31, 32])
    assert not result.ok and result.missing == tuple(wanted)

    jobs = Jobs(offloader)  # a background load reports the same keys
    jobs.submit_load("l", keys, 0, 3, [40, 41, 42])
    assert jobs.drain(timeout=60)
    (job,) = jobs.poll()
    jobs.close()
    assert not job.ok and job.missing == tuple(p.key for p in pages_for_load(offloader.layout, keys, 0, 3))
    assert offloader.counters["load_failures"] == 3


def test_a_bad_block_table_is_a_miss_of_every_page():
    cache, store, offloader = _setup()
    keys = _keys("c", 3)
    result = offloader.load(keys, 0, 3, [5])  # a table shorter than the load
    assert not result.ok
    assert result.missing_keys == tuple(p.key for p in pages_for_load(offloader.layout, keys, 0, 3))


class _DeferredWrites(HostTransfer):
    """A host transfer that behaves like a device one: the forward's writes land only once its fence is
    waited on (`after`), as a GPU save stream sees them only after the compute queued before the fence."""

    def __init__(self, buffer):
        super().__init__(buffer)
        self.pending = []

    def fence(self):
        pending, self.pending = self.pending, []
        return pending

    def _wait(self, after):
        for offset, data in after or ():
            self.buffer[offset:offset + len(data)] = data

    def gather(self, group, block, out=None, *, after=None):
        self._wait(after)
        return super().gather(group, block, out)

    def save(self, store, pages, after=None):
        self._wait(after)
        return super().save(store, pages)


def test_the_observer_sees_a_saved_page_as_the_save_reads_it_after_the_fence():
    """The observer's copy of a page is taken after the save's fence: on a GPU a copy taken before it
    would show the block before the forward wrote it (and verification would report a false difference)."""
    seen = {}

    class Observer:
        def saved(self, page, data):
            seen[page.key] = bytes(data)

        def loaded(self, page):
            pass

    cache = PagedCache(preset("tiny"), BLOCK, 64)
    store = open_store("memory://?capacity=64MiB&pinned=false")
    transfer = _DeferredWrites(cache.buffer)
    offloader = Offloader(store, cache.layout, transfer, Observer())
    keys = _keys("fence", 2)
    pages = [p for p in pages_for_load(cache.layout, keys, 0, 2, [0, 1]) if p.group.kind.name == "PAGED"]
    for page in pages:  # the "forward": its writes are queued, visible only after the fence
        for offset, n in page_spans(page.group, page.block):
            transfer.pending.append((offset, np.full(n, 0xA5, dtype=np.uint8)))
    written = offloader.save_pages(pages, after=transfer.fence())
    assert written == pages
    for page in pages:
        assert bytes(store.get(page.key)) == seen[page.key] == b"\xa5" * page.group.used_bytes_per_block


def test_construction_rehearses_a_restore_that_leaves_no_trace(caplog):
    """The offloader runs a restore's host path twice at construction (a process's first restore then runs
    no code for the first time), on keys no store holds, through its own transfer into a private store:
    the cache, the engine's store and the counters are untouched. A rehearsal that fails is logged and
    the offloader works."""
    cache = PagedCache(preset("tiny"), BLOCK, 64)
    cache.buffer.view(torch.uint8).random_(0, 256)
    before = cache.buffer.clone()
    store = open_store("memory://?capacity=64MiB&pinned=false")
    calls = []

    class Spy(HostTransfer):
        def load(self, into, pages, after=None):
            calls.append((into, len(pages)))
            return super().load(into, pages, after)

    offloader = Offloader(store, cache.layout, Spy(cache.buffer))
    layout = cache.layout
    blocks = 2 * layout.hit_alignment // layout.block_size
    paged = sum(g.kind.name == "PAGED" for g in layout.cacheable_groups)
    state = len(layout.cacheable_groups) - paged
    assert [n for _, n in calls] == [blocks * paged + state] * 2 and all(into is not store for into, _ in calls)
    assert torch.equal(cache.buffer, before) and not offloader.counters and offloader.warm_up_s > 0
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["puts"], stats["entries"]) == (0, 0, 0, 0)

    class Broken(HostTransfer):
        def load(self, into, pages, after=None):
            raise RuntimeError("no copy engine")

    broken = Offloader(store, cache.layout, Broken(cache.buffer))
    assert "restore rehearsal failed (no copy engine)" in caplog.text
    keys = _keys("r", 2)
    assert broken.save(keys, 2, [1], list(range(2))) > 0 and offloader.load(keys, 0, 2, [40, 41]).ok
