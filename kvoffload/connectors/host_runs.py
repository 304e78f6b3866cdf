"""Host memory the device transfer copies by address: the runs of arena slots adjacent both in host
memory and in staging (one DMA per run instead of one per page), and tensors over them (torch sees the
arena's page-locked chunks as pinned, so the copies are asynchronous)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..store.buffers import host_bytes


def runs(
    addresses: Sequence[int] | np.ndarray,
    sizes: np.ndarray,
    offsets: np.ndarray,
    room: np.ndarray | None = None,
) -> list[tuple[int, int, int]]:
    """(host address, staging offset, length) of each run of pages adjacent both in host memory and in
    staging: one DMA per run instead of one per page. Pages are adjacent when the step to the next one
    is the same in host memory and in staging and lies within the first one's `room` (its arena slot,
    default: its size): the bytes between two pages are then the first slot's own padding and staging
    that nobody uses, so pages whose size is not a multiple of the slot's still join. A room of 0 ends a
    run (a chunk's last slot: one copy must not cross into another allocation). A page at address
    0 (a miss, no room) is skipped. Vectorised: a batch of small pages costs no Python per page here."""
    at, n, o = np.asarray(addresses, dtype=np.int64), sizes, offsets
    fits = n if room is None else np.asarray(room, dtype=np.int64)
    if not (at.all() and n.all()):  # sizes are never negative
        keep = (at != 0) & (n > 0)
        at, n, o, fits = at[keep], n[keep], o[keep], fits[keep]
    if not len(at):
        return []
    step = at[1:] - at[:-1]
    joined = (step == o[1:] - o[:-1]) & (step >= n[:-1]) & (step <= fits[:-1])
    if joined.all():  # one run: a batch in freshly freed slots, mostly
        first, offset, length = at[:1], o[:1], o[-1:] + n[-1:] - o[:1]
    else:
        first = np.flatnonzero(np.concatenate(([True], ~joined)))
        last = np.append(first[1:], len(at)) - 1  # each run's last page
        first, offset, length = at[first], o[first], o[last] + n[last] - o[first]
    return list(zip(first.tolist(), offset.tolist(), length.tolist()))


def host_tensor(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over host memory the caller holds (an arena run): torch sees it is pinned."""
    return torch.from_numpy(host_bytes(address, nbytes))
