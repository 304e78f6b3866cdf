"""Host-memory tier: an LRU of byte arrays under a byte capacity. Values are allocated pinned
(page-locked, through torch's caching host allocator) when CUDA is present, so device copies from
this tier run at link speed without a staging hop."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from .base import Store
from .buffers import Buffer
from .errors import StoreConfigError

log = logging.getLogger(__name__)


def _cuda_present() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


class MemoryStore(Store):
    def __init__(self, capacity: int, pinned: bool | None = None, url: str | None = None):
        super().__init__()
        self.capacity = capacity
        if pinned and not _cuda_present():
            raise StoreConfigError("memory store: pinned=true needs a CUDA or ROCm device (page-locking is a "
                                   "driver call); use pinned=auto or pinned=false on this machine")
        self.pinned = _cuda_present() if pinned is None else pinned
        self.url = url or f"memory://?capacity={capacity}"
        self._entries: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    def _allocate(self, nbytes: int) -> np.ndarray:
        if self.pinned:
            import torch

            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        return np.empty(nbytes, dtype=np.uint8)

    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        views = self._views(items)
        written = [False] * len(views)
        latest: dict[bytes, int] = {}  # key -> index of this batch whose value the store holds
        for i, (key, view) in enumerate(views):
            try:
                array = self._allocate(view.nbytes)  # copy outside the lock: readers keep going
            except (RuntimeError, MemoryError) as exc:  # out of (pinned) host memory: a dropped write
                log.warning("memory store: cannot allocate %d bytes (%s); write dropped", view.nbytes, exc)
                continue
            array[:] = np.frombuffer(view, np.uint8)
            with self._lock:
                old = self._entries.pop(key, None)
                if old is not None:
                    self._used -= old.nbytes
                    if key in latest:
                        written[latest.pop(key)] = False
                while self._used + array.nbytes > self.capacity:
                    victim_key, victim = self._entries.popitem(last=False)
                    self._used -= victim.nbytes
                    self._count(evictions=1, evicted_bytes=victim.nbytes)
                    if victim_key in latest:  # this batch's own entry: no longer held, say so
                        written[latest.pop(victim_key)] = False
                self._entries[key] = array
                self._used += array.nbytes
            written[i] = True
            latest[key] = i
        ok = sum(written)
        self._count(puts=ok, put_bytes=sum(v.nbytes for (_, v), w in zip(views, written) if w),
                    dropped_puts=len(views) - ok)
        return written

    def read_many(self, keys: Sequence[bytes], consume: Callable[[int, memoryview], None]) -> list[bool]:
        served, nbytes = [], 0
        for i, key in enumerate(keys):
            with self._lock:
                array = self._entries.get(key)
                if array is not None:
                    self._entries.move_to_end(key)
            if array is None:
                served.append(False)
                continue
            # An evicted array stays valid while we hold it: eviction drops the dict's reference only.
            consume(i, memoryview(array))
            served.append(True)
            nbytes += array.nbytes
        hits = sum(served)
        self._count(hits=hits, misses=len(keys) - hits, get_bytes=nbytes)
        return served

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._entries for k in keys]

    def delete(self, key: bytes) -> bool:
        with self._lock:
            array = self._entries.pop(key, None)
            if array is not None:
                self._used -= array.nbytes
        return array is not None

    def _usage(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "bytes_used": self._used, "pinned": int(self.pinned)}

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._used = 0
