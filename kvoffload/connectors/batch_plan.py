"""Where a call's pages go in device staging, and in which batches: the device transfer's host-side
planning, in numpy over columns of the pages (no Python per page), apart from the copies it drives.

A call's pages become columns (`columns`): their distinct groups, each page's group, size, key and block.
`grouped` puts each group's pages together, largest pages first; `place` gives each page its offset in
staging and cuts the call into batches that fit a staging slot (`cuts`); `segments` plans a long call a
batch's worth first. Outcomes computed in the planned order go back to the caller's (`ungrouped`,
`in_call_order`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from operator import itemgetter
from typing import NamedTuple

import numpy as np

from ..spec import CacheGroup
from ..store.arena import PAGE as SLOT_ALIGN
from .plan import Page

# Pages per batch at most: a batch's host work (slots, leases, publication) overlaps the neighbouring
# batch's DMA, so small pages (72 KiB: ~1.4 us of DMA each) want several batches, not two; each batch
# also costs ~0.1-0.3 ms of fixed host work. On the H200 (2,048 72 KiB pages): 512 moved them fastest
# (32 / 128 / 256 / 512 / unbounded: save 0.12 / 0.27 / 0.28 / 0.37 / 0.33 of a raw copy).
BATCH_PAGES = 512
# A call's first batch is held (a load) or reserved (a save) in two parts: its first LEAD_BYTES cross the
# link while the host takes the rest (a lease or reservation of 512 small pages costs 0.15-0.4 ms, which
# would otherwise all precede the call's first DMA).
LEAD_BYTES = 8 << 20


class Columns(NamedTuple):
    """A call's pages as columns: their distinct groups, each page's group (an index into those), size,
    key and block."""

    groups: list[CacheGroup]
    which: np.ndarray
    sizes: np.ndarray
    keys: Sequence[bytes]
    blocks: np.ndarray


class Placed(NamedTuple):
    """The columns, in the staging order, with each page's offset in that order and where each batch
    starts (and, last, the end)."""

    groups: list[CacheGroup]
    which: np.ndarray
    sizes: np.ndarray
    keys: Sequence[bytes]
    blocks: np.ndarray
    page_at: np.ndarray
    cuts: list[int]


def columns(items: Sequence[Page]) -> Columns:
    """One pass over the pages, in C (a transpose): their distinct groups in order of first appearance,
    each page's group (an index into those), size, key and block. Thousands of small pages cost no
    Python per page here, and a restore's hundred pages no numpy sort."""
    if not items:
        return Columns([], np.zeros(0, np.int64), np.zeros(0, np.int64), (), np.zeros(0, np.int64))
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
    return Columns(groups, which, sizes, keys, blocks)


def grouped(items: Sequence[Page]) -> tuple[Columns, np.ndarray | None]:
    """The items' columns with each group's pages next to each other (in their order otherwise), the
    groups of the largest pages first, and the permutation made (None: none was needed; `permuted`
    applies it to the items). An arena hands out one size class's slots one after another, so a save or
    load of interleaved groups (every group's page of a block, block after block) then moves runs of
    adjacent slots in one copy each instead of a copy per page. Largest first: a call's first copy is
    then one long DMA (a restore's KDA checkpoint, tens of MB, before its small MLA pages) that runs
    while the host takes the rest of the batch, where a small first copy would leave the link idle."""
    made = columns(items)
    groups, which = made.groups, made.which
    if len(groups) <= 1:
        return made, None
    by_size = sorted(range(len(groups)), key=lambda g: -groups[g].used_bytes_per_block)  # stable: ties keep order
    if by_size != list(range(len(groups))):
        rank = np.empty(len(groups), dtype=np.int64)
        rank[by_size] = np.arange(len(groups))
        groups, which = [groups[g] for g in by_size], rank[which]
    if not (np.diff(which) < 0).any():  # grouped already, in that order
        return made._replace(groups=groups, which=which), None
    order = np.argsort(which, kind="stable")
    keys = list(itemgetter(*order.tolist())(made.keys))  # >= 2 keys: a tuple
    return Columns(groups, which[order], made.sizes[order], keys, made.blocks[order]), order


def permuted(items: Sequence[Page], order: np.ndarray | None) -> Sequence[Page]:
    """The items in the order `grouped` made (as they are where it made none)."""
    return items if order is None else list(itemgetter(*order.tolist())(items))  # >= 2 items: a tuple


def ungrouped(done: Sequence[bool] | np.ndarray, order: np.ndarray | None) -> list[bool]:
    """Per-page outcomes of grouped items (`grouped`) back in the caller's order."""
    if order is None:
        return done.tolist() if isinstance(done, np.ndarray) else list(done)
    back = np.empty(len(order), dtype=bool)
    back[order] = done
    return back.tolist()


def cuts(sizes: np.ndarray, staging_bytes: int) -> list[int]:
    """Where each batch starts (and, last, the end): greedily as many pages as fit the staging bytes, at
    most `BATCH_PAGES`, at least one. One search per batch, not a step per page."""
    ends = np.cumsum(sizes)
    out = [0]
    while out[-1] < len(sizes):
        start = out[-1]
        base = int(ends[start - 1]) if start else 0
        fits = int(np.searchsorted(ends, base + staging_bytes, side="right"))
        out.append(max(start + 1, min(fits, start + BATCH_PAGES)))
    return out


def place(made: Columns, staging_bytes: int) -> Placed:
    """Where each of the columns' pages goes in staging, and the batch cuts. Offsets are multiples of the
    arena's slot size, so pages in adjacent slots are adjacent in staging too: one DMA for both."""
    groups, which, sizes, keys, blocks = made
    spaced = -(-sizes // SLOT_ALIGN) * SLOT_ALIGN
    page_at = np.cumsum(spaced) - spaced
    return Placed(groups, which, sizes, keys, blocks, page_at, cuts(spaced, staging_bytes))


def batches(items: Sequence[Page], staging_bytes: int) -> list[Sequence[Page]]:
    """Consecutive runs of items whose pages fit one staging slot (a larger page goes alone)."""
    at = place(columns(items), staging_bytes).cuts
    return [items[a:b] for a, b in zip(at, at[1:])]


def segments(pages: Sequence[Page], staging_bytes: int) -> Iterator[tuple[Placed, np.ndarray | None]]:
    """The call's pages grouped and placed a segment at a time, each with its grouping's permutation
    (None: none). A call of more than two batches' worth of pages makes its first batch's worth first:
    the first DMA waits for the columns of those pages only, and the rest's are made while it runs
    (2,048 small pages: ~0.2-0.5 ms of the host's time)."""
    head = BATCH_PAGES if len(pages) > 2 * BATCH_PAGES else len(pages)
    for part in (pages[:head], pages[head:]):
        if part:
            made, order = grouped(part)
            yield place(made, staging_bytes), order


def in_call_order(done: Sequence[bool] | np.ndarray, parts: list[tuple[int, np.ndarray | None]]) -> list[bool]:
    """Per-page outcomes of the segments (`segments`: each one's length and permutation) back in the
    caller's order."""
    out: list[bool] = []
    at = 0
    for count, order in parts:
        out += ungrouped(done[at : at + count], order)
        at += count
    return out


def group_runs(which: np.ndarray, groups: Sequence[CacheGroup]) -> list[tuple[CacheGroup, int, int]]:
    """(group, start, end) of each run of pages of one group (a call's pages are grouped: one run per
    group)."""
    if not len(which):
        return []
    if len(groups) == 1:  # a batch of small pages: no search for group changes
        return [(groups[0], 0, len(which))]
    at = [0, *(np.flatnonzero(np.diff(which)) + 1).tolist(), len(which)]
    return [(groups[int(which[a])], a, b) for a, b in zip(at, at[1:])]


def lead_parts(page_at: np.ndarray, first: int, end: int, k: int) -> tuple[tuple[int, int], ...]:
    """Batch `k`'s pages [first, end) as the leases or reservations they are queued in: the first batch's
    first LEAD_BYTES alone (they cross the link while the host takes the rest), any other batch whole."""
    if k:
        return ((first, end),)
    mid = min(end, int(np.searchsorted(page_at, page_at[first] + LEAD_BYTES)))  # > first
    return ((first, mid), (mid, end)) if mid < end else ((first, end),)
