"""Page moves for a cache in GPU memory at link speed: the pages of many blocks are gathered on the device
into one staging buffer, a launch per group (`span_copy`), then cross the link in one copy to pinned host
memory; loads go the other way. Saves and loads run on their own streams, ordered after
the compute that wrote the blocks (saves) or before the compute that reads them (loads) by stream
waits and events, so compute is never stalled by the host. Several staging slots per direction let the
next batches move while the store takes the last one.

Warm start (`warm_up`, run by the `Offloader` that owns the transfer, so at an engine's start): the
staging slots (`STAGING_SLOTS` per direction), their page tables, every group's page template on the
device, the copy kernel for every word size they move in and the wrapping of host memory by address are
made before the first request. Made lazily, they cost the first restore of a process (the restart that
offload exists for) some 100-200 ms: page-locking 768 MiB and compiling kernels.

Only torch's stream, event and pinned-memory calls are used: on ROCm builds of torch they are HIP's.
On a CPU buffer the same code runs without streams (used by the tests on machines without a GPU)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from operator import itemgetter
from typing import NamedTuple, TypeVar

import numpy as np
import torch

from ..spec import CacheGroup
from ..store import Store
from ..store.arena import PAGE as SLOT_ALIGN
from ..store.base import HeldBatch, ItemColumns, Reservation, host_address
from .host_runs import host_tensor, runs
from .plan import Page
from .span_copy import PageCopier, PageTable

_T = TypeVar("_T")

DEFAULT_STAGING_BYTES = 128 << 20  # per slot, made by `warm_up`
# Staging slots per direction: batches in flight into and out of the arena (the host waits for the oldest
# while the others' copies run: a DMA queued ahead covers the host's bookkeeping and a GIL hand-over to a
# transfer on another thread). Two suffice for a transfer through host staging (`_staged`).
STAGING_SLOTS = 3
# Pages per batch at most: a batch's host work (slots, leases, publication) overlaps the neighbouring
# batch's DMA, so small pages (72 KiB: ~1.4 us of DMA each) want several batches, not two; each batch
# also costs ~0.1-0.3 ms of fixed host work. On the H200 (2,048 72 KiB pages): 512 moved them fastest
# (32 / 128 / 256 / 512 / unbounded: save 0.12 / 0.27 / 0.28 / 0.37 / 0.33 of a raw copy).
BATCH_PAGES = 512
# A call's first batch is held (a load) or reserved (a save) in two parts: its first LEAD_BYTES cross the
# link while the host takes the rest (a lease or reservation of 512 small pages costs 0.15-0.4 ms, which
# would otherwise all precede the call's first DMA).
LEAD_BYTES = 8 << 20


class _Slot:
    def __init__(self, nbytes: int, device: torch.device):
        gpu = device.type == "cuda"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=gpu)
        self.device = torch.empty(nbytes, dtype=torch.uint8, device=device) if gpu else self.host
        self.event = torch.cuda.Event() if gpu else None  # the slot's last use is done
        self.staged = torch.cuda.Event() if gpu else None  # its device buffer is filled (in-place paths)
        self.table = PageTable(device) if gpu else None
        self.host_bytes = self.host.numpy()

    @property
    def done(self) -> torch.cuda.Event:
        """`event`: recorded and waited for on the GPU paths only."""
        return _gpu_only(self.event)

    @property
    def filled(self) -> torch.cuda.Event:
        """`staged`: recorded and waited for on the GPU paths only."""
        return _gpu_only(self.staged)

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


@contextmanager
def on_stream(stream: torch.cuda.Stream) -> Iterator[None]:
    """Queue work on `stream`, as `torch.cuda.stream(stream)` does without its two lookups of the current
    device per use (each through `torch.cuda.is_available`: an environment read and a device count). A
    2,048-page save switches streams eight times; on an H100 host an MLA-only save and load went from 0.702
    / 0.766 to 0.706 / 0.782 of a raw copy (medians of six, interleaved). Another device current (a
    multi-GPU process) takes torch's own context, which switches devices too."""
    index = stream.device_index
    if torch.cuda.current_device() != index:
        with torch.cuda.stream(stream):
            yield
        return
    previous = torch.cuda.current_stream(index)
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(previous)


def _gpu_only(part: _T | None) -> _T:
    """A GPU slot's event or page table, on a path that runs on a GPU only (a CPU slot has none)."""
    if part is None:
        raise RuntimeError("a staging slot of a CPU buffer has no events or page table")
    return part


class _Columns(NamedTuple):
    """A call's pages as columns (`DeviceTransfer._columns`): their distinct groups, each page's group (an
    index into those), size, key and block."""

    groups: list[CacheGroup]
    which: np.ndarray
    sizes: np.ndarray
    keys: Sequence[bytes]
    blocks: np.ndarray


class _Placed(NamedTuple):
    """The columns (`_Columns`), in the staging order, with each page's offset in that order and where
    each batch starts (and, last, the end): `DeviceTransfer._place`."""

    groups: list[CacheGroup]
    which: np.ndarray
    sizes: np.ndarray
    keys: Sequence[bytes]
    blocks: np.ndarray
    page_at: np.ndarray
    cuts: list[int]


class DeviceTransfer:
    """The `Transfer` protocol (and `HostTransfer`'s scatter) for a cache buffer on a GPU."""

    def __init__(
        self, buffer: torch.Tensor, *, staging_bytes: int = DEFAULT_STAGING_BYTES, use_triton: bool | None = None
    ):
        self.buffer = buffer.view(torch.uint8).reshape(-1)
        self.device = self.buffer.device
        self.gpu = self.device.type == "cuda"
        self.copier = PageCopier(self.buffer, use_triton)
        self.staging_bytes = staging_bytes
        # In-place paths run kernels (gather, scatter) on their own streams, so one batch's kernel
        # overlaps the neighbouring batch's DMA.
        self.streams = (
            {d: torch.cuda.Stream(self.device) for d in ("save", "load", "save_kernel", "load_kernel")}
            if self.gpu
            else {}
        )
        self._slots: dict[tuple[str, int], _Slot] = {}
        self.warm_up_s: float | None = None  # the warm start's cost, once `warm_up` ran

    def warm_up(self, groups: Sequence[CacheGroup]) -> float:
        """Make now what a first save or load of `groups`' pages would make: both directions' staging
        slots at full size (page-locked host, device), their page tables sized for a full batch, every
        group's page template on the device and the copy kernel for the word it moves in (one gather of
        a page of each into staging), and one pass of the host's batch planning. Returns (and keeps in
        `warm_up_s`) its cost in seconds; nothing to do on the CPU."""
        started = time.perf_counter()
        if self.gpu and groups:
            size = max(self.staging_bytes, max(g.used_bytes_per_block for g in groups))
            rows = max(min(BATCH_PAGES, max(1, self.staging_bytes // max(1, g.used_bytes_per_block))) for g in groups)
            for direction in ("save", "load"):
                for index in range(STAGING_SLOTS):
                    slot = self._slot(direction, index, size)
                    _gpu_only(slot.table).reserve(max(rows, len(groups)))
            slot = self._slots[("save", 0)]
            zero = np.zeros(1, dtype=np.int64)
            with self._on("save"):
                for row, group in enumerate(groups):  # block 0's page, read: compiles (or loads) its word's kernel
                    self.copier.move(group, zero, zero, slot.device, slot.table, row, gather=True)
                # The arena paths wrap host memory by address: the first wrap pays for numpy's set-up.
                slot.device[:1].copy_(host_tensor(slot.host.data_ptr(), 1), non_blocking=True)
            # The host's planning of a batch (a page of each group): numpy's first calls cost ~0.1 ms each.
            columns, _ = self._grouped([Page(b"", g, 0, 0) for g in groups])
            self._group_runs(self._place(columns).which, columns.groups)
            runs(np.ones(1, np.int64), np.ones(1, np.int64), np.zeros(1, np.int64))
            torch.cuda.synchronize(self.device)
        self.warm_up_s = time.perf_counter() - started
        return self.warm_up_s

    # -- batches and staging -------------------------------------------------------------------------
    def batches(self, items: Sequence[Page]) -> list[Sequence[Page]]:
        """Consecutive runs of items whose pages fit one staging slot (a larger page goes alone)."""
        cuts = self._place(self._columns(items)).cuts
        return [items[a:b] for a, b in zip(cuts, cuts[1:])]

    def _cuts(self, sizes: np.ndarray) -> list[int]:
        """Where each batch starts (and, last, the end): greedily as many pages as fit the staging
        bytes, at most `BATCH_PAGES`, at least one. One search per batch, not a step per page."""
        ends = np.cumsum(sizes)
        cuts = [0]
        while cuts[-1] < len(sizes):
            start = cuts[-1]
            base = int(ends[start - 1]) if start else 0
            fits = int(np.searchsorted(ends, base + self.staging_bytes, side="right"))
            cuts.append(max(start + 1, min(fits, start + BATCH_PAGES)))
        return cuts

    def _slot(self, direction: str, index: int, nbytes: int) -> _Slot:
        slot = self._slots.get((direction, index))
        if slot is not None:
            slot.wait()  # its last copy must be done before it is refilled or freed
        if slot is None or slot.host.numel() < nbytes:
            slot = self._slots[(direction, index)] = _Slot(max(nbytes, min(self.staging_bytes, 1 << 20)), self.device)
        return slot

    def _on(self, direction: str, wait: bool = True):
        """Run on the direction's stream (after everything already queued on the compute stream)."""
        if not self.gpu:
            return nullcontext()
        stream = self.streams[direction]
        if wait:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        return on_stream(stream)

    @staticmethod
    def _columns(items: Sequence[Page]) -> _Columns:
        """One pass over the pages, in C (a transpose): their distinct groups in order of first appearance,
        each page's group (an index into those), size, key and block. Thousands of small pages cost no
        Python per page here, and a restore's hundred pages no numpy sort."""
        if not items:
            return _Columns([], np.zeros(0, np.int64), np.zeros(0, np.int64), (), np.zeros(0, np.int64))
        keys, group_of, _, block_of = zip(*items)  # Page: (key, group, index, block)
        blocks = np.array(block_of, dtype=np.int64)
        first = group_of[0]  # one group: counted by identity (a count meeting other groups compares them)
        if group_of[-1] is first and group_of.count(first) == len(items):  # no dict per page
            groups = [first]
            which = np.zeros(len(items), dtype=np.int64)
        else:
            ids = list(map(id, group_of))
            distinct = dict(zip(ids, group_of))  # id -> group, in order of first appearance
            groups = list(distinct.values())
            number = dict(zip(distinct, range(len(groups))))
            which = np.fromiter(map(number.__getitem__, ids), dtype=np.int64, count=len(items))
        sizes = np.asarray([g.used_bytes_per_block for g in groups], dtype=np.int64)[which]
        return _Columns(groups, which, sizes, keys, blocks)

    def _move(self, placed: _Placed, first: int, end: int, slot: _Slot, gather: bool, keep=None) -> None:
        """Queue the kernels moving pages [first, end) between the cache and `slot`'s device staging (page
        i at `page_at[i] - page_at[first]`), one launch per run of one group's pages; `keep`: only the
        pages it marks (a load's pages that arrived)."""
        blocks, which = placed.blocks[first:end], placed.which[first:end]
        at = placed.page_at[first:end] - placed.page_at[first]
        if keep is not None and not keep.all():
            blocks, which, at = blocks[keep], which[keep], at[keep]
        if slot.table is not None:
            slot.table.reserve(len(blocks))  # grown before the first launch: rows are not moved under a kernel
        for group, a, b in self._group_runs(which, placed.groups):
            self.copier.move(group, blocks[a:b], at[a:b], slot.device, slot.table, a, gather=gather)

    @staticmethod
    def _group_runs(which: np.ndarray, groups: Sequence[CacheGroup]) -> list[tuple[CacheGroup, int, int]]:
        """(group, start, end) of each run of pages of one group (a call's pages are grouped: one run per
        group; an ungrouped batch of `unpack` may have more)."""
        if not len(which):
            return []
        if len(groups) == 1:  # a batch of small pages: no search for group changes
            return [(groups[0], 0, len(which))]
        cuts = [0, *(np.flatnonzero(np.diff(which)) + 1).tolist(), len(which)]
        return [(groups[int(which[a])], a, b) for a, b in zip(cuts, cuts[1:])]

    # -- device -> host ------------------------------------------------------------------------------
    def fence(self):
        """An event after the device work queued so far (None on the CPU): a background save or load
        passed it as `after` reads or writes the blocks only once that work is done."""
        if not self.gpu:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _wait(self, direction: str, after) -> None:
        if self.gpu:
            stream = self.streams[direction]
            if after is not None:
                stream.wait_event(after)
            else:
                stream.wait_stream(torch.cuda.current_stream(self.device))

    def _grouped(self, items: Sequence[Page]) -> tuple[_Columns, np.ndarray | None]:
        """The items' columns (`_columns`) with each group's pages next to each other (in their order
        otherwise), the groups of the largest pages first, and the permutation made (None: none was
        needed; `_permuted` applies it to the items, which only a host-staging save needs). An arena hands
        out one size class's slots one after another, so a save or load of interleaved groups (every
        group's page of a block, block after block) then moves runs of adjacent slots in one copy each
        instead of a copy per page. Largest first: a call's first copy is then one long DMA (a restore's
        KDA checkpoint, tens of MB, before its small MLA pages) that runs while the host takes the rest
        of the batch, where a small first copy would leave the link idle."""
        columns = self._columns(items)
        groups, which = columns.groups, columns.which
        if len(groups) <= 1:
            return columns, None
        by_size = sorted(range(len(groups)), key=lambda g: -groups[g].used_bytes_per_block)  # stable: ties keep order
        if by_size != list(range(len(groups))):
            rank = np.empty(len(groups), dtype=np.int64)
            rank[by_size] = np.arange(len(groups))
            groups, which = [groups[g] for g in by_size], rank[which]
        if not (np.diff(which) < 0).any():  # grouped already, in that order
            return columns._replace(groups=groups, which=which), None
        order = np.argsort(which, kind="stable")
        keys = list(itemgetter(*order.tolist())(columns.keys))  # >= 2 keys: a tuple
        return _Columns(groups, which[order], columns.sizes[order], keys, columns.blocks[order]), order

    @staticmethod
    def _permuted(items: Sequence[Page], order: np.ndarray | None) -> Sequence[Page]:
        """The items in the order `_grouped` made (as they are where it made none)."""
        return items if order is None else [items[i] for i in order.tolist()]

    @staticmethod
    def _ungrouped(done: Sequence[bool] | np.ndarray, order: np.ndarray | None) -> list[bool]:
        """Per-page outcomes of grouped items (`_grouped`) back in the caller's order."""
        if order is None:
            return done.tolist() if isinstance(done, np.ndarray) else list(done)
        back = np.empty(len(order), dtype=bool)
        back[order] = done
        return back.tolist()

    def _place(self, columns: _Columns) -> _Placed:
        """Where each of the columns' pages goes in staging, and the batch cuts (`_Placed`). Offsets are
        multiples of the arena's slot size, so pages in adjacent slots are adjacent in staging too: one DMA
        for both."""
        groups, which, sizes, keys, blocks = columns
        spaced = -(-sizes // SLOT_ALIGN) * SLOT_ALIGN
        page_at = np.cumsum(spaced) - spaced
        return _Placed(groups, which, sizes, keys, blocks, page_at, self._cuts(spaced))

    def _staged(self, items: Sequence[Page], placed: _Placed, after=None):
        """Yield (batch, slot, page offsets in the slot) batch by batch, the pages gathered into the slot's
        device buffer and copied to its pinned host buffer; valid until the next batch is requested. The
        next batch's gather is queued before this one is handed out."""
        if not items:
            return
        sizes, page_at, cuts = placed.sizes, placed.page_at, placed.cuts
        self._wait("save", after)  # saved: what compute queued before this call (or `after`) wrote, nothing later

        def queue(k: int) -> _Slot:
            first, end = cuts[k], cuts[k + 1]
            total = int(page_at[end - 1] + sizes[end - 1] - page_at[first])
            slot = self._slot("save", k % 2, total)
            with self._on("save", wait=False):
                self._move(placed, first, end, slot, gather=True)
                if self.gpu:
                    slot.host[:total].copy_(slot.device[:total], non_blocking=True)
                    slot.done.record()
            return slot

        queued = queue(0)
        for k in range(len(cuts) - 1):
            slot = queued
            if k + 2 < len(cuts):
                queued = queue(k + 1)
            slot.wait()
            first, end = cuts[k], cuts[k + 1]
            yield items[first:end], slot, (page_at[first:end] - page_at[first]).tolist()

    def pack(self, items: Sequence[Page], after=None) -> Iterator[tuple[Sequence[Page], list[np.ndarray]]]:
        """Yield (batch, a pinned host view of each page) batch by batch, each group's pages together (the
        batch names them); valid until the next batch."""
        columns, order = self._grouped(items)
        return self._packed(self._permuted(items, order), columns, after)

    def _packed(
        self, items: Sequence[Page], columns: _Columns, after
    ) -> Iterator[tuple[Sequence[Page], list[np.ndarray]]]:
        """`pack` of items grouped already (`_grouped`'s columns of them, `_permuted`)."""
        for batch, slot, offsets in self._staged(items, self._place(columns), after):
            yield batch, [slot.host_bytes[o : o + item.group.used_bytes_per_block] for item, o in zip(batch, offsets)]

    # -- host -> device ------------------------------------------------------------------------------
    def unpack(
        self, batch: Sequence[Page], fill: Callable[[np.ndarray, list[int]], list[bool]], index: int = 0, after=None
    ) -> list[bool]:
        """`fill(host staging, page offsets)` writes the batch's pages into pinned staging and says which
        arrived; those are copied to the device and scattered into their blocks. Compute queued after
        this call waits for them; the host does not."""
        return self._unpack(self._place(self._columns(batch)), 0, len(batch), fill, index, after) if batch else []

    def _unpack(self, placed: _Placed, first: int, end: int, fill, index: int, after) -> list[bool]:
        """`unpack` of the placed pages [first, end) (one batch) through load staging slot `index`."""
        at = placed.page_at[first:end] - placed.page_at[first]
        total = int(at[-1] + placed.sizes[end - 1])
        slot = self._slot("load", index, total)
        ok = fill(slot.host_bytes, at.tolist())
        arrived = np.asarray(ok, dtype=bool)
        if not arrived.any():
            return ok
        self._wait("load", after)
        with self._on("load", wait=False):
            if self.gpu:
                slot.device[:total].copy_(slot.host[:total], non_blocking=True)
            self._move(placed, first, end, slot, gather=False, keep=arrived)
            if self.gpu:
                slot.done.record()
        if self.gpu:
            torch.cuda.current_stream(self.device).wait_event(slot.done)
        return ok

    # -- the transfer interface ----------------------------------------------------------------------
    def gather(self, group: CacheGroup, block: int, *, after=None) -> np.ndarray:
        """A copy of one page, read on the save stream after `after` (or the compute queued so far)."""
        for _, views in self.pack([Page(b"", group, 0, block)], after):
            return views[0].copy()
        raise AssertionError("unreachable")

    def scatter(self, group: CacheGroup, block: int, page: np.ndarray) -> None:
        def fill(host: np.ndarray, offsets: list[int]) -> list[bool]:
            host[offsets[0] : offsets[0] + page.nbytes] = np.frombuffer(page, dtype=np.uint8)
            return [True]

        if np.asarray(page).nbytes != group.used_bytes_per_block:
            raise ValueError(
                f"a {group.name} page is {group.used_bytes_per_block} bytes, got {np.asarray(page).nbytes}"
            )
        self.unpack([Page(b"", group, 0, block)], fill)

    def save(self, store: Store, pages: Sequence[Page], after=None) -> list[bool]:
        """Gather and store the pages batch by batch; True per page stored. Into an arena (`in_place`
        store) each page is copied by DMA from device staging straight into its slot; other stores
        take pinned host staging."""
        if not (store.in_place and self.gpu):
            columns, order = self._grouped(pages)
            items = self._permuted(pages, order)
            written: list[bool] = []
            batches = 0
            for batch, views in self._packed(items, columns, after):  # grouped once
                written += store.put_many([(item.key, view) for item, view in zip(batch, views)])
                batches += 1
            if batches > 1 and any(written):  # a later batch may have evicted an earlier one's pages
                written = self._kept(store, list(columns.keys), written, None)  # None: every written page
            return self._ungrouped(written, order)
        return self._save_in_place(store, pages, after)

    def _segments(self, pages: Sequence[Page]) -> Iterator[tuple[_Placed, np.ndarray | None]]:
        """The call's pages grouped and placed (`_grouped`, `_place`) a segment at a time, each with its
        grouping's permutation (None: none). A call of more than two batches' worth of pages makes its
        first batch's worth first: the first DMA waits for the columns of those pages only, and the rest's
        are made while it runs (2,048 small pages: ~0.2-0.5 ms of the host's time)."""
        head = BATCH_PAGES if len(pages) > 2 * BATCH_PAGES else len(pages)
        for part in (pages[:head], pages[head:]):
            if part:
                columns, order = self._grouped(part)
                yield self._place(columns), order

    @staticmethod
    def _in_call_order(done: Sequence[bool] | np.ndarray, segments: list) -> list[bool]:
        """Per-page outcomes of the segments (`_segments`: their lengths and permutations) back in the
        caller's order."""
        out: list[bool] = []
        at = 0
        for count, order in segments:
            out += DeviceTransfer._ungrouped(done[at : at + count], order)
            at += count
        return out

    def _save_in_place(self, store: Store, pages: Sequence[Page], after) -> list[bool]:
        """Per staging batch: reserve arena slots, gather on the device, copy by DMA straight into the
        slots (one copy per run of adjacent slots). Up to `STAGING_SLOTS` batches are in flight: a batch
        is published once its copies are done, while the next ones' copies run, so the link stays busy
        while the host reserves, publishes or waits for the GIL (a load on another thread). Kernels and
        copies have their own streams, so a gather overlaps the previous batch's DMA."""
        if not pages:
            return []
        self._wait("save_kernel", after)
        kernels, copies = self.streams["save_kernel"], self.streams["save"]
        keys: list[bytes] = []  # the call's, segment after segment, each grouped: the order of `written`
        segments: list[tuple[int, np.ndarray | None]] = []  # each segment's length and permutation
        written: list[bool] = []
        evicted: list[Sequence[bytes] | None] = []  # what each reservation's room cost (None: not told)
        in_flight: deque[tuple[list[Reservation], torch.cuda.Event]] = deque()  # oldest first
        reserved: list[Reservation] = []  # the reservations of the batch being queued
        k = 0  # batches queued
        try:
            for placed, order in self._segments(pages):
                sizes, page_at, cuts = placed.sizes, placed.page_at, placed.cuts
                own = list(placed.keys)
                keys += own
                segments.append((len(own), order))
                for first, end in zip(cuts, cuts[1:]):
                    base = int(page_at[first])
                    slot = self._slot("save", k % STAGING_SLOTS, int(page_at[end - 1] + sizes[end - 1]) - base)
                    with on_stream(kernels):  # the gather runs while the host reserves the slots
                        self._move(placed, first, end, slot, gather=True)
                    slot.filled.record(kernels)
                    copies.wait_event(slot.filled)
                    with on_stream(copies):
                        for a, b in self._parts(page_at, first, end, k):
                            reserved.append(store.reserve(ItemColumns(own[a:b], sizes[a:b].tolist())))
                            evicted.append(reserved[-1].evicted)
                            self._copy_out(reserved[-1], sizes[a:b], page_at[a:b] - base, slot)
                    slot.done.record(copies)
                    in_flight.append((reserved, slot.done))
                    reserved = []
                    k += 1
                    if len(in_flight) == STAGING_SLOTS:  # the oldest batch: published once copied
                        written += self._publish(store, *in_flight.popleft())
            # While the last copies run: which of the call's own keys a later batch evicted (mostly none).
            doubt = self._evicted_own(keys, evicted) if k > 1 else set()
        finally:
            if reserved:  # an error while copying into them: their slots go back, unwritten
                copies.synchronize()
                for reservation in reserved:
                    store.publish(reservation, [False] * len(reservation.items))
            while in_flight:
                written += self._publish(store, *in_flight.popleft())
        return self._in_call_order(self._kept(store, keys, written, doubt), segments)

    @staticmethod
    def _evicted_own(keys: list[bytes], evicted: list[Sequence[bytes] | None]) -> set[bytes] | None:
        """The keys of a multi-batch save that its reservations say they evicted (a later batch took an
        earlier one's slots); None: a reservation did not say, any key may have gone."""
        if None in evicted:
            return None
        gone = set().union(*evicted)  # type: ignore[arg-type]
        return set() if gone.isdisjoint(keys) else gone.intersection(keys)  # mostly: older pages went

    @staticmethod
    def _kept(store: Store, keys: list[bytes], written: list[bool], doubt: set[bytes] | None) -> list[bool]:
        """`written` (per key), less the pages the store no longer holds among those in `doubt` (None:
        every written page), which a later batch of the same save may have evicted; no lookup where
        `doubt` is empty (mostly) or nothing was written."""
        if doubt is not None and not doubt:
            return written
        at = [i for i, ok in enumerate(written) if ok and (doubt is None or keys[i] in doubt)]
        for i, there in zip(at, store.contains_many([keys[i] for i in at]) if at else ()):
            written[i] = there
        return written

    @staticmethod
    def _parts(page_at: np.ndarray, first: int, end: int, k: int) -> tuple[tuple[int, int], ...]:
        """Batch `k`'s pages [first, end) as the leases or reservations they are queued in: the first
        batch's first LEAD_BYTES alone (they cross the link while the host takes the rest), any other
        batch whole."""
        if k:
            return ((first, end),)
        mid = min(end, int(np.searchsorted(page_at, page_at[first] + LEAD_BYTES)))  # > first
        return ((first, mid), (mid, end)) if mid < end else ((first, end),)

    @staticmethod
    def _copy_out(reserved: Reservation, sizes: np.ndarray, at: np.ndarray, slot: _Slot) -> None:
        """Queue the DMAs of staged pages (at offsets `at` of `slot`'s device staging) into their reserved
        slots, on the current stream, one per run of adjacent slots; a page with no slot is not moved."""
        addresses = reserved.addresses
        if addresses is None:  # a store that gives views only
            addresses = np.asarray([0 if out is None else host_address(out) for out in reserved.destinations], np.int64)
        for address, offset, n in runs(addresses, sizes, at, reserved.room):
            host_tensor(address, n).copy_(slot.device[offset : offset + n], non_blocking=True)

    @staticmethod
    def _publish(store: Store, reservations: list[Reservation], event) -> list[bool]:
        event.synchronize()  # published only once the bytes are in the slots
        return [ok for reservation in reservations for ok in store.publish(reservation, reservation.filled_all())]

    def load(self, store: Store, pages: Sequence[Page], after=None) -> list[bool]:
        """Restore the pages batch by batch; a page missing, failing its checksum or of another size is a
        miss and is not scattered. From an arena the pages are copied by DMA straight from their slots;
        from other stores they are read into pinned staging first. A load of several batches is advised to
        the store first (`Store.advise`: a disk tier reads ahead across the batches). With `after` (a
        background load) the writes into the cache start after it and this returns once they are done;
        without, compute queued after this call waits for them and the host does not."""
        if store.in_place and self.gpu:
            return self._load_in_place(store, pages, after)
        columns, order = self._grouped(pages)
        placed = self._place(columns)
        keys, cuts = placed.keys, placed.cuts
        if len(cuts) > 2:  # a disk tier reads the later batches while the first ones move
            store.advise(keys)
        ok: list[bool] = []
        for k, (first, end) in enumerate(zip(cuts, cuts[1:])):
            sizes = placed.sizes[first:end].tolist()

            def fill(host: np.ndarray, offsets: list[int], first=first, end=end, sizes=sizes) -> list[bool]:
                arrived = [False] * len(sizes)

                def consume(j: int, view: memoryview) -> None:
                    if view.nbytes == sizes[j]:  # a value of another size is a miss
                        host[offsets[j] : offsets[j] + sizes[j]] = np.frombuffer(view, dtype=np.uint8)
                        arrived[j] = True

                store.read_many(keys[first:end], consume)
                return arrived

            ok += self._unpack(placed, first, end, fill, k % 2, after)
        if after is not None:
            for index in (0, 1):
                if ("load", index) in self._slots:
                    self._slots[("load", index)].wait()
        return self._ungrouped(ok, order)

    def _load_in_place(self, store: Store, pages: Sequence[Page], after) -> list[bool]:
        """Per staging batch: hold its pages in their arena slots (one batch lease, by address), copy them
        by DMA (one copy per run of adjacent slots) into device staging, scatter. Up to `STAGING_SLOTS`
        batches are in flight: a batch is given back once its copies are done, while the next ones'
        run. Copies and kernels have their own streams; a batch's scatter is queued once its copies are
        (a restore's first DMA waits for no kernel launch). Only the scatters wait for `after` (or the
        compute queued so far): the copies write staging alone, so they run while the compute they must
        not overtake still does."""
        if not pages:
            return []
        self._wait("load_kernel", after)
        kernels, copies = self.streams["load_kernel"], self.streams["load"]
        arrived: list[bool] = []  # per page, segment after segment, each grouped
        segments: list[tuple[int, np.ndarray | None]] = []  # each segment's length and permutation
        in_flight: deque[tuple[list[HeldBatch], torch.cuda.Event]] = deque()  # oldest first
        held: list[HeldBatch] = []  # the leases of the batch being queued
        k = 0  # batches queued
        try:
            for placed, order in self._segments(pages):
                sizes, page_at, cuts, keys = placed.sizes, placed.page_at, placed.cuts, placed.keys
                if len(cuts) > 2 or len(keys) < len(pages):  # a tier behind the arena reads ahead
                    store.advise(keys)
                here = np.zeros(len(keys), dtype=bool)  # the segment's pages that arrived
                segments.append((len(keys), order))
                for first, end in zip(cuts, cuts[1:]):
                    base = int(page_at[first])
                    slot = self._slot("load", k % STAGING_SLOTS, int(page_at[end - 1] + sizes[end - 1]) - base)
                    with on_stream(copies):
                        for a, b in self._parts(page_at, first, end, k):
                            held.append(store.acquire_batch(keys[a:b]))
                            self._copy_in(held[-1], sizes[a:b], page_at[a:b] - base, here[a:b], slot)
                    slot.filled.record(copies)
                    kernels.wait_event(slot.filled)
                    with on_stream(kernels):
                        self._move(placed, first, end, slot, gather=False, keep=here[first:end])
                    slot.done.record(kernels)
                    in_flight.append((held, slot.filled))
                    held = []
                    k += 1
                    if len(in_flight) == STAGING_SLOTS:  # the oldest batch's slots are read: given back
                        self._give_back(store, *in_flight.popleft())
                arrived += here.tolist()
            while in_flight:  # each batch as its copies end: the last one's alone follows the last copy
                self._give_back(store, *in_flight.popleft())
            kernels.synchronize()  # scattered: compute may read the blocks
        finally:
            copies.synchronize()
            for lease in [*held, *(lease for leases, _ in in_flight for lease in leases)]:
                store.release_batch(lease)
        return self._in_call_order(arrived, segments)

    @staticmethod
    def _give_back(store: Store, leases: list[HeldBatch], filled) -> None:
        """Release a batch's leases once its copies out of the slots are done."""
        filled.synchronize()
        deque(map(store.release_batch, leases), maxlen=0)

    @staticmethod
    def _copy_in(held: HeldBatch, sizes: np.ndarray, at: np.ndarray, arrived: np.ndarray, slot: _Slot) -> None:
        """Queue the DMAs of held pages into `slot`'s device staging at offsets `at` (on the current
        stream), one per run of adjacent slots; marks in `arrived` those that did: a miss (size 0) or a
        value of another size is not moved."""
        arrived[:] = ok = held.sizes == sizes
        addresses = held.addresses if ok.all() else np.where(ok, held.addresses, 0)
        for address, offset, n in runs(addresses, sizes, at, held.room):
            slot.device[offset : offset + n].copy_(host_tensor(address, n), non_blocking=True)
