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
On a CPU buffer the same code runs, streams and events standing in as no-ops (`_HostQueue`): the tests of
machines without a GPU run the GPU's paths, the arena's in-place ones included."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np
import torch

from ..spec import CacheGroup
from ..store import Store
from ..store.base import HeldBatch, ItemColumns, Reservation, host_address
from . import batch_plan as plan
from .batch_plan import Placed
from .host_runs import host_tensor, runs
from .plan import Page
from .span_copy import PageCopier, PageTable

DEFAULT_STAGING_BYTES = 128 << 20  # per slot, made by `warm_up`
# Staging slots per direction: batches in flight into and out of the arena (the host waits for the oldest
# while the others' copies run: a DMA queued ahead covers the host's bookkeeping and a GIL hand-over to a
# transfer on another thread). Two suffice for a transfer through host staging (`_staged`).
STAGING_SLOTS = 3


class _HostQueue:
    """A stream's and an event's stand-in on a CPU buffer, where work is done when it is queued: nothing to
    order or wait for. The GPU's code paths run unchanged on it (the tests' machines have no GPU)."""

    def record(self, stream=None) -> None:
        """As `torch.cuda.Event.record`: nothing is pending."""

    def synchronize(self) -> None:
        """As a stream's or an event's: nothing is pending."""

    def wait_event(self, event) -> None:
        """As `torch.cuda.Stream.wait_event`: nothing is pending."""


_HOST: Any = _HostQueue()  # typed as the stream or event it stands in for


class _Slot:
    def __init__(self, nbytes: int, device: torch.device):
        gpu = device.type == "cuda"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=gpu)
        self.device = torch.empty(nbytes, dtype=torch.uint8, device=device) if gpu else self.host
        self.done = torch.cuda.Event() if gpu else _HOST  # the slot's last use is done
        self.filled = torch.cuda.Event() if gpu else _HOST  # its device buffer is filled (in-place paths)
        self.table = PageTable(device) if gpu else None
        self.host_bytes = self.host.numpy()


@contextmanager
def on_stream(stream: torch.cuda.Stream) -> Iterator[None]:
    """Queue work on `stream`, as `torch.cuda.stream(stream)` does without its two lookups of the current
    device per use (each through `torch.cuda.is_available`: an environment read and a device count). A
    2,048-page save switches streams eight times; on an H100 host an MLA-only save and load went from 0.702
    / 0.766 to 0.706 / 0.782 of a raw copy (medians of six, interleaved). Another device current (a
    multi-GPU process) takes torch's own context, which switches devices too. A CPU buffer's stand-in
    (`_HOST`) queues nothing."""
    if stream is _HOST:
        yield
        return
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
        directions = ("save", "load", "save_kernel", "load_kernel")
        self.streams = {d: torch.cuda.Stream(self.device) if self.gpu else _HOST for d in directions}
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
            fit = (max(1, self.staging_bytes // max(1, g.used_bytes_per_block)) for g in groups)
            rows = min(plan.BATCH_PAGES, max(fit))
            for direction in ("save", "load"):
                for index in range(STAGING_SLOTS):
                    slot = self._slot(direction, index, size)
                    if slot.table is not None:
                        slot.table.reserve(max(rows, len(groups)))
            slot = self._slots[("save", 0)]
            zero = np.zeros(1, dtype=np.int64)
            with self._on("save"):
                for row, group in enumerate(groups):  # block 0's page, read: compiles (or loads) its word's kernel
                    self.copier.move(group, zero, zero, slot.device, slot.table, row, gather=True)
                # The arena paths wrap host memory by address: the first wrap pays for numpy's set-up.
                slot.device[:1].copy_(host_tensor(slot.host.data_ptr(), 1), non_blocking=True)
            # The host's planning of a batch (a page of each group): numpy's first calls cost ~0.1 ms each.
            columns, _ = plan.grouped([Page(b"", g, 0, 0) for g in groups])
            plan.group_runs(plan.place(columns, self.staging_bytes).which, columns.groups)
            runs(np.ones(1, np.int64), np.ones(1, np.int64), np.zeros(1, np.int64))
            torch.cuda.synchronize(self.device)
        self.warm_up_s = time.perf_counter() - started
        return self.warm_up_s

    # -- batches and staging -------------------------------------------------------------------------
    def _slot(self, direction: str, index: int, nbytes: int) -> _Slot:
        slot = self._slots.get((direction, index))
        if slot is not None:
            slot.done.synchronize()  # its last copy must be done before it is refilled or freed
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

    def _move(self, placed: Placed, first: int, end: int, slot: _Slot, gather: bool, keep=None) -> None:
        """Queue the kernels moving pages [first, end) between the cache and `slot`'s device staging (page
        i at `page_at[i] - page_at[first]`), one launch per run of one group's pages; `keep`: only the
        pages it marks (a load's pages that arrived)."""
        blocks, which = placed.blocks[first:end], placed.which[first:end]
        at = placed.page_at[first:end] - placed.page_at[first]
        if keep is not None and not keep.all():
            blocks, which, at = blocks[keep], which[keep], at[keep]
        if slot.table is not None:
            slot.table.reserve(len(blocks))  # grown before the first launch: rows are not moved under a kernel
        for group, a, b in plan.group_runs(which, placed.groups):
            self.copier.move(group, blocks[a:b], at[a:b], slot.device, slot.table, a, gather=gather)

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

    def _staged(self, items: Sequence[Page], placed: Placed, after=None):
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
            slot.done.synchronize()
            first, end = cuts[k], cuts[k + 1]
            yield items[first:end], slot, (page_at[first:end] - page_at[first]).tolist()

    def _pack(self, items: Sequence[Page], after=None) -> Iterator[tuple[Sequence[Page], list[np.ndarray]]]:
        """Yield (batch, a pinned host view of each page) batch by batch, each group's pages together (the
        batch names them); valid until the next batch."""
        columns, order = plan.grouped(items)
        return self._packed(plan.permuted(items, order), columns, after)

    def _packed(
        self, items: Sequence[Page], columns: plan.Columns, after
    ) -> Iterator[tuple[Sequence[Page], list[np.ndarray]]]:
        """`_pack` of items grouped already (`batch_plan.grouped`'s columns of them, `permuted`)."""
        for batch, slot, offsets in self._staged(items, plan.place(columns, self.staging_bytes), after):
            yield batch, [slot.host_bytes[o : o + item.group.used_bytes_per_block] for item, o in zip(batch, offsets)]

    # -- host -> device ------------------------------------------------------------------------------
    def _unpack_batch(
        self, batch: Sequence[Page], fill: Callable[[np.ndarray, list[int]], list[bool]], index: int = 0, after=None
    ) -> list[bool]:
        """`fill(host staging, page offsets)` writes the batch's pages into pinned staging and says which
        arrived; those are copied to the device and scattered into their blocks. Compute queued after
        this call waits for them; the host does not."""
        placed = plan.place(plan.columns(batch), self.staging_bytes)
        return self._unpack(placed, 0, len(batch), fill, index, after) if batch else []

    def _unpack(self, placed: Placed, first: int, end: int, fill, index: int, after) -> list[bool]:
        """`_unpack_batch` of the placed pages [first, end) (one batch) through load staging slot `index`."""
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
            slot.done.record()
        if self.gpu:
            torch.cuda.current_stream(self.device).wait_event(slot.done)
        return ok

    # -- the transfer interface ----------------------------------------------------------------------
    def gather(self, group: CacheGroup, block: int, *, after=None) -> np.ndarray:
        """A copy of one page, read on the save stream after `after` (or the compute queued so far)."""
        for _, views in self._pack([Page(b"", group, 0, block)], after):
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
        self._unpack_batch([Page(b"", group, 0, block)], fill)

    def save(self, store: Store, pages: Sequence[Page], after=None) -> list[bool]:
        """Gather and store the pages batch by batch; True per page stored. Into an arena (`in_place`
        store) each page is copied by DMA from device staging straight into its slot; other stores
        take pinned host staging."""
        if not store.in_place:
            columns, order = plan.grouped(pages)
            items = plan.permuted(pages, order)
            written: list[bool] = []
            batches = 0
            for batch, views in self._packed(items, columns, after):  # grouped once
                written += store.put_many([(item.key, view) for item, view in zip(batch, views)])
                batches += 1
            if batches > 1 and any(written):  # a later batch may have evicted an earlier one's pages
                written = self._kept(store, list(columns.keys), written, None)  # None: every written page
            return plan.ungrouped(written, order)
        return self._save_in_place(store, pages, after)

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
            for placed, order in plan.segments(pages, self.staging_bytes):
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
                        for a, b in plan.lead_parts(page_at, first, end, k):
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
        return plan.in_call_order(self._kept(store, keys, written, doubt), segments)

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
        kept = np.asarray(written, dtype=bool)
        asked = kept if doubt is None else kept & np.fromiter(map(doubt.__contains__, keys), bool, len(keys))
        at = np.flatnonzero(asked).tolist()
        if not at:
            return written
        kept[at] = store.contains_many(list(itemgetter(*at)(keys)) if len(at) > 1 else [keys[at[0]]])
        return kept.tolist()

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
        return list(chain.from_iterable(store.publish(r, r.filled_all()) for r in reservations))

    def load(self, store: Store, pages: Sequence[Page], after=None) -> list[bool]:
        """Restore the pages batch by batch; a page missing, failing its checksum or of another size is a
        miss and is not scattered. From an arena the pages are copied by DMA straight from their slots;
        from other stores they are read into pinned staging first. A load of several batches is advised to
        the store first (`Store.advise`: a disk tier reads ahead across the batches). With `after` (a
        background load) the writes into the cache start after it and this returns once they are done;
        without, compute queued after this call waits for them and the host does not."""
        if store.in_place:
            return self._load_in_place(store, pages, after)
        columns, order = plan.grouped(pages)
        placed = plan.place(columns, self.staging_bytes)
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
                    self._slots[("load", index)].done.synchronize()
        return plan.ungrouped(ok, order)

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
            for placed, order in plan.segments(pages, self.staging_bytes):
                sizes, page_at, cuts, keys = placed.sizes, placed.page_at, placed.cuts, placed.keys
                if len(cuts) > 2 or len(keys) < len(pages):  # a tier behind the arena reads ahead
                    store.advise(keys)
                here = np.zeros(len(keys), dtype=bool)  # the segment's pages that arrived
                segments.append((len(keys), order))
                for first, end in zip(cuts, cuts[1:]):
                    base = int(page_at[first])
                    slot = self._slot("load", k % STAGING_SLOTS, int(page_at[end - 1] + sizes[end - 1]) - base)
                    with on_stream(copies):
                        for a, b in plan.lead_parts(page_at, first, end, k):
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
        return plan.in_call_order(arrived, segments)

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
