"""Gather a batch of one group's pages from a paged cache into a staging buffer, or scatter them back,
in one launch.

A page is one span per layer of its group in a block (`CacheGroup.page_spans`): a batch of small pages is
thousands of spans. The spans are the same in every block but for the block's place (each region's block
stride), so a group's page is described once, on the device, as a template of tiles (offset in block 0,
block stride, words, offset in the page; a long span cut in tiles of at most TILE_WORDS words). A launch
gets that template and one row per page (its block, its byte offset in staging) in a page table in
pinned host memory, which the kernel reads across the link; one Triton program per page and tile works
out its addresses and moves its words (the same kernel on NVIDIA and AMD GPUs). The host's work per batch
is the page table: no span arithmetic per page. Without Triton (or on the CPU) the same spans are worked
out on the host and move through `torch._foreach_copy_`, which batches the copies into a few launches.
Words are of the widest integer type that divides every offset, stride and length of the group's spans,
the buffer's offset and size, and the staging offsets (multiples of `ALIGN`).
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import numpy as np
import torch

from ..spec import CacheGroup

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build: the foreach path only
    triton = None

log = logging.getLogger(__name__)

TILE_WORDS = 32768  # per program: long spans are cut into tiles of at most this many words
BLOCK_WORDS = 2048  # per loop step of a program
ALIGN = 8  # staging offsets are multiples of this (the widest word)
_WORD_TYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

if triton is not None:

    @triton.jit(do_not_specialize=["tiles_per_page", "gather"])
    def _copy_pages(cache, stage, pages, tiles, tiles_per_page, gather, WORD: tl.constexpr, BLOCK: tl.constexpr):
        """Program i: tile i % tiles_per_page of page i // tiles_per_page. pages[p] = (block, byte offset
        in staging); tiles[t] = (words into block 0, words per block, words, words into the page).
        gather: cache -> staging, else staging -> cache."""
        i = tl.program_id(0).to(tl.int64)
        p = i // tiles_per_page
        t = i % tiles_per_page
        block = tl.load(pages + 2 * p)
        page_at = tl.load(pages + 2 * p + 1) // WORD
        cache_at = tl.load(tiles + 4 * t) + block * tl.load(tiles + 4 * t + 1)
        n = tl.load(tiles + 4 * t + 2)
        stage_at = page_at + tl.load(tiles + 4 * t + 3)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            if gather:
                tl.store(stage + stage_at + offs, tl.load(cache + cache_at + offs, mask=mask), mask=mask)
            else:
                tl.store(cache + cache_at + offs, tl.load(stage + stage_at + offs, mask=mask), mask=mask)


def word_size(*values: np.ndarray | int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) dividing every value."""
    g = 0
    for v in values:
        g = math.gcd(g, int(np.gcd.reduce(np.asarray(v, dtype=np.int64).ravel())))
    return next(w for w in (8, 4, 2, 1) if g % w == 0)


class Template(NamedTuple):
    """A group's page, for a cache buffer: its spans in block 0 (bytes: offset, block stride, length,
    offset in the page), the word they move in, its tiles on the device (in words; None on the CPU path)
    and the last block whose spans lie in the buffer."""

    group: CacheGroup
    base: np.ndarray
    stride: np.ndarray
    length: np.ndarray
    rel: np.ndarray
    word: int
    tiles: torch.Tensor | None
    last_block: int


class PageCopier:
    """Gather pages of `buffer` (flat uint8, any device) into staging, or scatter staging into them: one
    group's pages a call, given as their blocks and their byte offsets in staging (multiples of ALIGN)."""

    def __init__(self, buffer: torch.Tensor, use_triton: bool | None = None):
        self.buffer = buffer
        on_gpu = buffer.device.type == "cuda"
        self.use_triton = (triton is not None and on_gpu) if use_triton is None else use_triton
        if self.use_triton and (triton is None or not on_gpu):
            raise ValueError("the page copy needs triton and a GPU buffer")
        self._templates: dict[int, Template] = {}
        self._words: dict[int, torch.Tensor] = {}  # word size -> the buffer seen in words of that size

    def template(self, group: CacheGroup) -> Template:
        """The group's page template, made on first use (the warm start makes every group's)."""
        known = self._templates.get(id(group))
        if known is not None and known.group is group:
            return known
        spans = np.asarray(group.page_spans(0), dtype=np.int64).reshape(-1, 2)
        base, length = spans[:, 0], spans[:, 1]
        stride = np.asarray([r.block_stride for r in group.regions for _ in range(r.num_layers)], dtype=np.int64)
        rel = np.cumsum(length) - length
        offset, size = int(self.buffer.storage_offset()), int(self.buffer.numel())
        word = word_size(base, stride, length, offset, size, ALIGN)
        reach = size - base - length  # block b's span lies in the buffer while b * stride <= reach
        moving = stride > 0
        last = -1 if (reach < 0).any() else int((reach[moving] // stride[moving]).min()) if moving.any() else 1 << 62
        tiles = None
        if self.use_triton:
            count = np.maximum((length // word + TILE_WORDS - 1) // TILE_WORDS, 1)
            span = np.repeat(np.arange(len(length)), count)
            step = (np.arange(len(span)) - np.repeat(np.cumsum(count) - count, count)) * TILE_WORDS
            words = np.minimum(length[span] // word - step, TILE_WORDS)
            rows = np.stack((base[span] // word + step, stride[span] // word, words, rel[span] // word + step), axis=1)
            tiles = torch.from_numpy(np.ascontiguousarray(rows)).to(self.buffer.device)
        made = self._templates[id(group)] = Template(group, base, stride, length, rel, word, tiles, last)
        return made

    def move(
        self,
        group: CacheGroup,
        blocks: np.ndarray,
        at: np.ndarray,
        staging: torch.Tensor,
        table: PageTable | None = None,
        row: int = 0,
        *,
        gather: bool,
    ) -> None:
        """gather: the group's page of each block -> staging[at[i]:], its spans back to back; else the
        other way; on the current stream. The pages' rows go in `table` from `row` on (reuse rows only
        once the last copy with them ran; None: a table of its own, uploaded)."""
        if len(blocks) == 0:
            return
        t = self.template(group)
        if int(blocks.min()) < 0 or int(blocks.max()) > t.last_block:
            raise ValueError(f"a block of {group.name} lies outside the cache buffer")
        if int(at.max()) + group.used_bytes_per_block > staging.numel() or int(at.min()) < 0:
            raise ValueError("a page lies outside the staging buffer")
        if (at % ALIGN).any():
            raise ValueError(f"staging offsets must be multiples of {ALIGN} bytes")
        if self.use_triton:
            assert t.tiles is not None
            table = table or PageTable(self.buffer.device, mapped=False)  # uploaded: freed safely after
            rows = table.fill(blocks, at, row)
            w = t.word
            cache = self._words.get(w)
            if cache is None:
                cache = self._words[w] = self.buffer.view(_WORD_TYPES[w])
            stage = staging.view(_WORD_TYPES[w])
            count = len(blocks) * len(t.tiles)
            try:
                _copy_pages[(count,)](
                    cache, stage, rows, t.tiles, len(t.tiles), int(gather), WORD=w, BLOCK=BLOCK_WORDS, num_warps=8
                )
            except ValueError:  # Triton: "cannot be accessed" (a device that does not map page-locked memory)
                if not table.mapped:
                    raise
                log.info("page copy: the device cannot read mapped host memory; page tables are uploaded")
                table.mapped = False
                rows = table.upload(row, len(blocks))
                _copy_pages[(count,)](
                    cache, stage, rows, t.tiles, len(t.tiles), int(gather), WORD=w, BLOCK=BLOCK_WORDS, num_warps=8
                )
        else:
            self._move_spans(t, blocks, at, staging, gather)

    def _move_spans(self, t: Template, blocks: np.ndarray, at: np.ndarray, staging: torch.Tensor, gather: bool):
        """`move` without Triton: each span of the template moves for every page at once, between a view of
        the cache (a row per block, indexed by `blocks`) and one of staging (a row per page slot, the pages'
        common spacing its stride, indexed by the pages' offsets): a few tensor calls per span of a page,
        none per page. Where rows would overlap (spans that overlap from block to block, pages closer than
        a page) each span of each page is its own copy."""
        page = int(t.rel[-1] + t.length[-1])
        first = int(at.min())
        step = int(np.gcd.reduce(at - first)) or page  # one page, or pages at the same offset: any step
        overlap = step < page or ((t.stride > 0) & (t.stride < t.length)).any()
        if overlap or (not gather and (t.stride == 0).any()):  # a scatter into one span many times, too
            offsets = (t.base + blocks[:, None] * t.stride).ravel().tolist()
            lengths = np.tile(t.length, len(blocks)).tolist()
            into = (at[:, None] + t.rel).ravel().tolist()
            parts = [self.buffer[o : o + n] for o, n in zip(offsets, lengths)]
            staged = [staging[a : a + n] for a, n in zip(into, lengths)]
            targets, sources = (staged, parts) if gather else (parts, staged)
            torch._foreach_copy_(targets, sources)
            return
        device = self.buffer.device
        index = torch.from_numpy(np.ascontiguousarray(blocks)).to(device)
        slots = (at - first) // step
        into = torch.from_numpy(np.ascontiguousarray(slots)).to(device)
        rows, stage_rows = int(blocks.max()) + 1, int(slots.max()) + 1
        cache_at, stage_at = self.buffer.storage_offset(), staging.storage_offset() + first
        for base, stride, length, rel in zip(t.base.tolist(), t.stride.tolist(), t.length.tolist(), t.rel.tolist()):
            cache = self.buffer.as_strided((rows, length), (stride, 1), cache_at + base)
            staged_rows = staging.as_strided((stage_rows, length), (step, 1), stage_at + rel)
            if gather:
                staged_rows.index_copy_(0, into, cache.index_select(0, index))
            else:
                cache.index_copy_(0, index, staged_rows.index_select(0, into))


class PageTable:
    """(block, staging offset) per page in pinned host memory, which the kernel reads across the link (the
    device maps page-locked memory): no upload, so a batch's table never waits on the copy engine behind
    the large copies queued before it (a load's scatters would otherwise all run after the last batch's
    DMA, and a save's gathers behind a concurrent load's copies). Kept per staging slot and refilled only
    once the slot's last kernel ran, so no batch pays for a pinned allocation. Not `mapped` (a device that
    cannot read host memory, or a table freed right after its one use), it is uploaded to the device on
    the current stream instead."""

    def __init__(self, device: torch.device, mapped: bool = True):
        self.device, self.rows, self.mapped = device, 0, mapped
        self.host: torch.Tensor | None = None
        self.on_device: torch.Tensor | None = None

    def reserve(self, rows: int) -> None:
        """Room for at least `rows` pages (grown by doubling: a few pinned allocations in a lifetime)."""
        if rows > self.rows:
            self.rows = max(rows, 2 * self.rows, 1024)
            self.host = torch.empty((self.rows, 2), dtype=torch.int64, pin_memory=True)
            self.on_device = None

    def fill(self, blocks: np.ndarray, at: np.ndarray, row: int = 0) -> torch.Tensor:
        """The pages' rows, from `row` on: the host rows themselves where `mapped`, else uploaded."""
        end = row + len(blocks)
        self.reserve(end)
        assert self.host is not None
        np.stack((blocks, at), axis=1, out=self.host.numpy()[row:end])
        return self.host[row:end] if self.mapped else self.upload(row, len(blocks))

    def upload(self, row: int, count: int) -> torch.Tensor:
        """`count` rows from `row` on, copied to the device (on the current stream, not waited for)."""
        assert self.host is not None
        if self.on_device is None:
            self.on_device = torch.empty((self.rows, 2), dtype=torch.int64, device=self.device)
        on_device = self.on_device[row : row + count]
        on_device.copy_(self.host[row : row + count], non_blocking=True)
        return on_device
