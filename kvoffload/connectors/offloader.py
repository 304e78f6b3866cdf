"""The engine-facing offload API: lookup, load and save for one request's blocks, over `plan` and a
transfer. An engine integrates by handing it block keys (kvoffload's key chain) and block IDs.

Failures never propagate: a store error or a missing, corrupt or wrong-sized page makes `load` return a
failed `LoadResult` naming the pages that did not arrive (the engine recomputes those blocks) and `save`
store fewer pages; both are counted."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter, not_
from typing import Protocol

import numpy as np

from ..spec import CacheLayout
from ..store import MemoryStore, Store
from ..store.url import redact_url
from .plan import BlockTable, Page, hit_blocks, pages_for_load, pages_for_save
from .transfer import Transfer, placed_block

log = logging.getLogger(__name__)

_key = attrgetter("key")  # a page's store key, and its bytes: read in C over a batch's pages
_page_bytes = attrgetter("group.used_bytes_per_block")


@dataclass(frozen=True)
class LoadResult:
    """What a load restored: all of its pages (true) or not (false: `missing` names the pages that did
    not arrive; after an exception, every page of the load)."""

    missing: tuple[Page, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.missing

    @property
    def missing_keys(self) -> tuple[bytes, ...]:
        return tuple(p.key for p in self.missing)

    def __bool__(self) -> bool:
        return self.ok


class Observer(Protocol):
    """Optional hooks for verification and metrics."""

    def saved(self, page: Page, data: np.ndarray) -> None: ...

    def loaded(self, page: Page) -> None: ...


class Offloader:
    def __init__(self, store: Store, layout: CacheLayout, transfer: Transfer, observer: Observer | None = None):
        self.store, self.layout, self.observer = store, layout, observer
        self.transfer: Transfer = transfer
        # The first request pays no set-up: staging, kernels (see `Transfer.warm_up`), a rehearsed
        # restore (`_rehearse`); its cost, seconds:
        started = time.perf_counter()
        transfer.warm_up(layout.cacheable_groups)
        self._rehearse()
        self.warm_up_s = time.perf_counter() - started
        self.counters: Counter[str] = Counter()
        self._counter_lock = threading.Lock()  # loads and saves may run on background threads (`jobs`)
        # A store that can never take some group's page (a capacity below one page) can never serve a hit
        # (a hit needs every group's page): said once here; saves are then skipped and counted, rather than
        # an error on every save.
        too_large = sorted(
            (g.used_bytes_per_block, g.name) for g in layout.cacheable_groups if not store.fits(g.used_bytes_per_block)
        )
        self.saves_off = bool(too_large)
        if too_large:
            log.warning(
                "kvoffload: store %s (capacity %d bytes) takes entries up to %d bytes, but a page is "
                "%d bytes (group %s): nothing is saved to or served from it (pages counted in "
                "save_skipped_too_large); raise its capacity",
                redact_url(store.url),
                store.capacity,
                store.max_entry_bytes - store.entry_overhead,
                *too_large[-1],
            )

    def _rehearse(self) -> None:
        """Run a restore's host path (lookup, page list, load) twice on keys no store holds, through an
        empty private memory tier: nothing is copied, written or counted, but a process's first restore
        then runs no code for the first time. CPython specialises bytecode on its first runs and numpy
        sets up its first calls: on the H100/H200 hosts a first restore's host lead cost ~0.3 ms more
        than the second's. A failure here is logged; the first restore then pays that set-up."""
        blocks = 2 * (self.layout.hit_alignment // self.layout.block_size)
        keys = [b"kvoffload rehearsal %d" % i for i in range(blocks)]  # block keys of no request: pages in no store
        scratch = MemoryStore(1 << 20, pinned=False, reserve=False)  # never holds a value
        try:
            for _ in range(2):
                hit = hit_blocks(self.layout, keys, blocks * self.layout.block_size + 1, lambda ks: [True] * len(ks))
                arrived = self.transfer.load(scratch, pages_for_load(self.layout, keys, 0, hit, list(range(hit))))
                if any(arrived):
                    raise RuntimeError("a rehearsed restore found a page in an empty store")
        except Exception as exc:  # noqa: BLE001 - a warm-up never stops an engine
            log.warning("kvoffload: the restore rehearsal failed (%s): the first restore pays its set-up", exc)
        finally:
            scratch.close()

    def _count(self, **deltas: int) -> None:
        with self._counter_lock:
            self.counters.update(deltas)

    def lookup(self, block_keys: Sequence[bytes], num_prompt_tokens: int, have_blocks: int = 0) -> int:
        """Blocks a load could restore in total (>= have_blocks, what the engine already holds)."""
        try:
            found = hit_blocks(self.layout, block_keys, num_prompt_tokens, self.store.contains_many, have_blocks)
        except Exception as exc:  # noqa: BLE001 - a broken store is a miss, never a crash
            log.error("kvoffload lookup failed: %s", exc, exc_info=True)
            self._count(lookup_errors=1)
            return have_blocks
        self._count(lookups=1, hit_blocks=found - have_blocks)
        return found

    def load(
        self,
        block_keys: Sequence[bytes],
        start: int,
        end: int,
        block_ids: BlockTable,
        after=None,
        step: int | None = None,
    ) -> LoadResult:
        """Restore blocks [start, end) into the request's block table; all or nothing. Any thread may
        call it (`jobs`): `after` is the transfer's fence, device work queued before it is done before
        the load writes. `step`: pages per transfer call, the GIL handed back between calls (a
        background load of a long prefix then never holds the engine's thread for a switch interval)."""
        pages: list[Page] = []
        started = time.perf_counter()
        try:
            pages = pages_for_load(self.layout, block_keys, start, end, block_ids)
            step = step or len(pages) or 1
            ok = []
            for at in range(0, len(pages), step):
                ok += self.transfer.load(self.store, pages[at : at + step], after=after)
                if step < len(pages):
                    time.sleep(0)
            elapsed = time.perf_counter() - started
            if all(ok) and self.observer:
                for page in pages:
                    self.observer.loaded(page)
        except Exception as exc:  # noqa: BLE001 - every page of a load that raised is a miss
            log.error("kvoffload load failed: %s", exc, exc_info=True)
            pages = pages or pages_for_load(self.layout, block_keys, start, end)  # a bad block table
            ok = [False] * len(pages)
        if not all(ok):
            self._count(load_failures=1, pages_missing=ok.count(False))
            return LoadResult(tuple(compress(pages, map(not_, ok))))
        self._count(
            load_microseconds=int(elapsed * 1e6),
            loaded_pages=len(pages),
            loaded_bytes=sum(map(_page_bytes, pages)),
        )
        return LoadResult()

    def save(
        self, block_keys: Sequence[bytes], full_blocks: int, state_blocks: Sequence[int], block_ids: BlockTable
    ) -> int:
        """Store the pages of computed blocks that the store lacks; the number of pages written."""
        return len(self.save_pages(pages_for_save(self.layout, block_keys, full_blocks, state_blocks, block_ids)))

    def save_pages(self, pages: Sequence[Page], after=None) -> list[Page]:
        """Store explicit pages (placed at their physical blocks), skipping pages already stored; the
        pages written. `after` is the transfer's fence: the pages are read after the device work queued
        before it."""
        if self.saves_off:
            self._count(save_skipped_too_large=len(pages))
            return []
        try:
            present = self.store.contains_many(list(map(_key, pages)))  # in C, as below: no step per page
            todo = list(compress(pages, map(not_, present))) if any(present) else pages
            if self.observer:  # the page as the save reads it: after the fence, not before the forward wrote it
                for page in todo:
                    self.observer.saved(page, self.transfer.gather(page.group, placed_block(page), after=after))
            started = time.perf_counter()
            written = self.transfer.save(self.store, todo, after=after)
        except Exception as exc:  # noqa: BLE001
            log.error("kvoffload save failed: %s", exc, exc_info=True)
            self._count(save_errors=1)
            return []
        self._count(
            save_microseconds=int((time.perf_counter() - started) * 1e6),
            saved_pages=sum(written),
            saved_bytes=sum(compress(map(_page_bytes, todo), written)),
            save_skipped_present=len(pages) - len(todo),
            save_dropped=len(written) - sum(written),
        )
        return list(compress(todo, written))
