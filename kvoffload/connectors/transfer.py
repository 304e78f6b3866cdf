"""Moving pages between a cache's backing buffer and a store. A page is the concatenation of the used
bytes of its group's layers in one block (padding and other groups are never copied).

`Transfer` is what the offloader and its jobs use; `HostTransfer` implements it on a host buffer with
plain copies (CPU), `device_transfer.DeviceTransfer` on a GPU buffer through pinned staging and its own
streams. `make_transfer` picks one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from ..spec import CacheGroup
from ..store import Store
from .plan import Page


@runtime_checkable
class Transfer(Protocol):
    """Moves pages (placed at their physical blocks, `Page.block`) between a cache and a store."""

    gpu: bool  # copies run on device streams: a save waits on them without the GIL (see `jobs`)

    def warm_up(self, groups: Sequence[CacheGroup]) -> float:
        """Set up now what the first move of these groups' pages needs (buffers, kernels); seconds spent."""

    def fence(self):
        """An ordering token for `after` (None where copies need none)."""

    def gather(self, group: CacheGroup, block: int, *, after=None) -> np.ndarray:
        """A copy of one page, as the cache holds it once the device work before `after` is done."""

    def save(self, store: Store, pages: Sequence[Page], after=None) -> list[bool]:
        """Store the pages; True per page made durable."""

    def load(self, store: Store, pages: Sequence[Page], after=None) -> list[bool]:
        """Restore the pages; True per page that arrived whole (any other is left untouched)."""


def placed_block(page: Page) -> int:
    """The physical block of a page to move (a transfer moves placed pages only)."""
    if page.block is None:
        raise ValueError(f"page {page.key.hex()[:16]} (block index {page.index}) is not placed at a physical block")
    return page.block


def page_spans(group: CacheGroup, block: int) -> list[tuple[int, int]]:
    """(offset, length) of every layer's used bytes of `group` in physical `block` (`CacheGroup.page_spans`)."""
    return group.page_spans(block)


def _as_bytes(buffer) -> np.ndarray:
    if type(buffer).__module__.startswith("torch"):
        if buffer.device.type != "cpu":
            raise TypeError("HostTransfer needs a host buffer; device caches need a device transfer")
        import torch

        return buffer.view(torch.uint8).reshape(-1).numpy()
    return np.frombuffer(buffer, dtype=np.uint8) if not isinstance(buffer, np.ndarray) else buffer.view(np.uint8)


class HostTransfer:
    gpu = False

    def __init__(self, buffer):
        self.buffer = _as_bytes(buffer)

    def warm_up(self, groups: Sequence[CacheGroup]) -> float:
        """Plain copies need no set-up."""
        return 0.0

    def fence(self) -> None:
        """Host copies need no ordering token (the device transfer returns an event)."""
        return None

    def gather(self, group: CacheGroup, block: int, out: np.ndarray | None = None, *, after=None) -> np.ndarray:
        spans = page_spans(group, block)
        out = np.empty(sum(n for _, n in spans), dtype=np.uint8) if out is None else out
        at = 0
        for offset, n in spans:
            out[at : at + n] = self.buffer[offset : offset + n]
            at += n
        return out

    def scatter(self, group: CacheGroup, block: int, page: np.ndarray) -> None:
        at = 0
        for offset, n in page_spans(group, block):
            self.buffer[offset : offset + n] = page[at : at + n]
            at += n

    def save(self, store: Store, pages: Sequence[Page], after=None) -> list[bool]:
        """Gather each page straight into the store's destination (an arena slot, or a buffer a
        persistent tier then writes); True per page made durable."""

        def fill(destinations: list[np.ndarray | None]) -> list[bool]:
            for p, out in zip(pages, destinations):
                if out is not None:
                    self.gather(p.group, placed_block(p), out)
            return [out is not None for out in destinations]

        return store.write_many([(p.key, p.group.used_bytes_per_block) for p in pages], fill) if pages else []

    def load(self, store: Store, pages: Sequence[Page], after=None) -> list[bool]:
        """Fetch the batch and scatter every page that arrived verified and of the exact page size; a
        page of any other size is a miss (another layout's bytes can never land in this cache)."""
        ok = [False] * len(pages)

        def consume(i: int, view: memoryview) -> None:
            p = pages[i]
            if view.nbytes == p.group.used_bytes_per_block:
                self.scatter(p.group, placed_block(p), np.frombuffer(view, dtype=np.uint8))
                ok[i] = True

        if pages:
            store.read_many([p.key for p in pages], consume)
        return ok


def make_transfer(buffer, **options) -> Transfer:
    """The transfer for a cache buffer: plain copies on the host, the staged engine on a GPU."""
    if type(buffer).__module__.startswith("torch") and buffer.device.type != "cpu":
        from .device_transfer import DeviceTransfer

        return DeviceTransfer(buffer, **options)
    return HostTransfer(buffer)
