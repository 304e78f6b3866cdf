"""Copy many byte spans of a device buffer into one contiguous staging buffer and back, in one launch.

A batch of pages is thousands of small spans (one per layer per block per group); one copy each runs
at a fraction of link speed. The spans are cut into tiles described by one small table (in pinned
host memory, read by the kernel across the link), and one Triton program per tile moves it (the same
kernel on NVIDIA and AMD GPUs). Without Triton (or on the CPU) the same spans move through
`torch._foreach_copy_`, which batches the copies into a few launches.
All sizes are in words of the widest integer type that divides every offset and length.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build: the foreach path only
    triton = None

log = logging.getLogger(__name__)

TILE_WORDS = 32768  # per program: long spans are cut into tiles of at most this many words
BLOCK_WORDS = 2048  # per loop step of a program
_WORD_TYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

if triton is not None:

    @triton.jit
    def _copy_tiles(src, dst, table, BLOCK: tl.constexpr):
        """Tile i: copy table[i, 2] words from src + table[i, 0] to dst + table[i, 1]."""
        i = tl.program_id(0).to(tl.int64)
        src_at = tl.load(table + 3 * i)
        dst_at = tl.load(table + 3 * i + 1)
        n = tl.load(table + 3 * i + 2)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + dst_at + offs, tl.load(src + src_at + offs, mask=mask), mask=mask)


def word_size(offsets: np.ndarray, lengths: np.ndarray) -> int:
    g = math.gcd(int(np.gcd.reduce(offsets)) if len(offsets) else 0, int(np.gcd.reduce(lengths)) if len(lengths) else 0)
    return next(w for w in (8, 4, 2, 1) if g % w == 0)


class SpanCopier:
    """Gather spans of `buffer` (flat uint8, any device) into staging, or scatter staging into them.
    Spans are numpy arrays: buffer offsets, lengths, and staging offsets, all in bytes."""

    def __init__(self, buffer: torch.Tensor, use_triton: bool | None = None):
        self.buffer = buffer
        on_gpu = buffer.device.type == "cuda"
        self.use_triton = (triton is not None and on_gpu) if use_triton is None else use_triton
        if self.use_triton and (triton is None or not on_gpu):
            raise ValueError("the Triton span copy needs triton and a GPU buffer")
        self._words: dict[int, torch.Tensor] = {}  # word size -> the buffer seen in words of that size

    def move(
        self,
        offsets: np.ndarray,
        lengths: np.ndarray,
        staging: torch.Tensor,
        at: np.ndarray,
        table: TileTable | None = None,
        *,
        gather: bool,
        word: int | None = None,
    ) -> None:
        """gather: buffer[offsets[i] : +lengths[i]] -> staging[at[i] : +lengths[i]]; else the other way;
        on the current stream. `table` is where the tile table is built (reuse one only after the last
        copy with it ran); `word`, a word size that divides every span (the caller's, for a plan of many
        batches: found once), else found here."""
        if len(offsets) == 0:
            return
        if int((at + lengths).max()) > staging.numel() or int((offsets + lengths).max()) > self.buffer.numel():
            raise ValueError("a span lies outside the staging buffer or the cache buffer")
        if self.use_triton:
            w = word or word_size(np.concatenate([offsets, at]), lengths)
            g = math.gcd(w, self.buffer.storage_offset(), self.buffer.numel(), staging.numel())
            w = next(size for size in (8, 4, 2, 1) if g % size == 0)
            src_at, dst_at = (offsets // w, at // w) if gather else (at // w, offsets // w)
            table = table or TileTable(self.buffer.device, mapped=False)  # uploaded: freed safely after
            tiles = table.fill(src_at, dst_at, lengths // w)
            buffer = self._words.get(w)
            if buffer is None:
                buffer = self._words[w] = self.buffer.view(_WORD_TYPES[w])
            stage = staging.view(_WORD_TYPES[w])
            src, dst = (buffer, stage) if gather else (stage, buffer)
            try:
                _copy_tiles[(tiles.shape[0],)](src, dst, tiles, BLOCK=BLOCK_WORDS, num_warps=8)
            except ValueError:  # Triton: "cannot be accessed" (a device that does not map page-locked memory)
                if not table.mapped:
                    raise
                log.info("span copy: the device cannot read mapped host memory; tile tables are uploaded")
                table.mapped = False
                tiles = table.upload(tiles.shape[0])
                _copy_tiles[(tiles.shape[0],)](src, dst, tiles, BLOCK=BLOCK_WORDS, num_warps=8)
        else:
            parts = [self.buffer[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist())]
            staged = [staging[a : a + n] for a, n in zip(at.tolist(), lengths.tolist())]
            targets, sources = (staged, parts) if gather else (parts, staged)
            torch._foreach_copy_(targets, sources)


class TileTable:
    """(src, dst, words) per tile in pinned host memory, which the kernel reads across the link (the
    device maps page-locked memory): no upload, so a batch's table never waits on the copy engine
    behind the large copies queued before it (a load's scatters would otherwise all run after the last
    batch's DMA, and a save's gathers behind a concurrent load's copies). Kept per staging slot and
    refilled only once the slot's last kernel ran, so no batch pays for a pinned allocation. Not
    `mapped` (a device that cannot read host memory, or a table freed right after its one use), it is
    uploaded to the device on the current stream instead."""

    def __init__(self, device: torch.device, mapped: bool = True):
        self.device, self.rows, self.mapped = device, 0, mapped
        self.host: torch.Tensor | None = None
        self.on_device: torch.Tensor | None = None

    def reserve(self, rows: int) -> None:
        """Room for at least `rows` tiles (grown by doubling: a few pinned allocations in a lifetime)."""
        if rows > self.rows:
            self.rows = max(rows, 2 * self.rows, 1024)
            self.host = torch.empty((self.rows, 3), dtype=torch.int64, pin_memory=True)
            self.on_device = None

    def fill(self, src_at: np.ndarray, dst_at: np.ndarray, words: np.ndarray) -> torch.Tensor:
        """The table of these spans cut in tiles: the host rows themselves where `mapped`, else uploaded."""
        if int(words.max()) <= TILE_WORDS:  # every span one tile (a batch of small pages): the spans as they are
            tiles = len(words)
            self.reserve(tiles)
            assert self.host is not None
            np.stack((src_at, dst_at, words), axis=1, out=self.host.numpy()[:tiles])
        else:
            count = (words + TILE_WORDS - 1) // TILE_WORDS
            span = np.repeat(np.arange(len(words)), count)
            step = (np.arange(len(span)) - np.repeat(np.cumsum(count) - count, count)) * TILE_WORDS
            tiles = len(span)
            self.reserve(tiles)
            assert self.host is not None  # reserved: a move has at least one tile
            rows = self.host.numpy()[:tiles]
            rows[:, 0] = src_at[span] + step
            rows[:, 1] = dst_at[span] + step
            rows[:, 2] = np.minimum(words[span] - step, TILE_WORDS)
        return self.host[:tiles] if self.mapped else self.upload(tiles)

    def upload(self, count: int) -> torch.Tensor:
        """The first `count` rows copied to the device (on the current stream, not waited for)."""
        assert self.host is not None
        if self.on_device is None:
            self.on_device = torch.empty((self.rows, 3), dtype=torch.int64, device=self.device)
        on_device = self.on_device[:count]
        on_device.copy_(self.host[:count], non_blocking=True)
        return on_device
