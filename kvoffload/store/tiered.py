"""Memory in front of disk. Writes go to both (write-through: a page is durable once on disk);
reads try memory first and promote a disk hit into memory, so hot prefixes stay in host RAM."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .base import Store
from .buffers import Buffer, byte_view


class TieredStore(Store):
    def __init__(self, front: Store, back: Store, url: str | None = None):
        super().__init__()
        self.front, self.back = front, back
        self.capacity = back.capacity
        self.url = url or f"tiered://({front.url} | {back.url})"

    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        items = list(items)
        durable = self.back.put_many(items)
        self.front.put_many([(k, v) for k, v in items if self._fits_front(v)])
        self._count(puts=sum(durable), put_bytes=sum(byte_view(v).nbytes for (_, v), ok in zip(items, durable) if ok),
                    dropped_puts=len(items) - sum(durable))
        return durable

    def _fits_front(self, value: Buffer) -> bool:
        return byte_view(value).nbytes <= self.front.capacity

    def read_many(self, keys: Sequence[bytes], consume: Callable[[int, memoryview], None]) -> list[bool]:
        nbytes = 0

        def counted(i: int, view: memoryview) -> None:
            nonlocal nbytes
            consume(i, view)
            nbytes += view.nbytes

        served = self.front.read_many(keys, counted)
        missing = [i for i, ok in enumerate(served) if not ok]
        promote: list[tuple[bytes, bytes]] = []

        def from_back(j: int, view: memoryview) -> None:
            i = missing[j]
            counted(i, view)
            served[i] = True
            if view.nbytes <= self.front.capacity:
                promote.append((keys[i], bytes(view)))

        disk_hits = sum(self.back.read_many([keys[i] for i in missing], from_back)) if missing else 0
        if promote:
            self.front.put_many(promote)
        hits = sum(served)
        self._count(hits=hits, misses=len(keys) - hits, get_bytes=nbytes, memory_hits=hits - disk_hits, disk_hits=disk_hits,
                    promotions=len(promote))
        return served

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        front = self.front.contains_many(keys)
        missing = [k for k, ok in zip(keys, front) if not ok]
        back = iter(self.back.contains_many(missing)) if missing else iter(())
        return [ok or next(back) for ok in front]

    def delete(self, key: bytes) -> bool:
        in_front = self.front.delete(key)
        return self.back.delete(key) or in_front

    def _usage(self) -> dict[str, int]:
        usage = {}
        for name, tier in (("memory", self.front), ("disk", self.back)):
            for k, v in tier.stats().items():
                if k != "url":
                    usage[f"{name}_{k}"] = v
        usage["entries"] = usage.get("disk_entries", 0)
        usage["bytes_used"] = usage.get("disk_bytes_used", 0)
        usage["evictions"] = usage.get("disk_evictions", 0)  # entries gone from the store as a whole
        usage["checksum_failures"] = usage.get("disk_checksum_failures", 0)
        return usage

    def close(self) -> None:
        self.front.close()
        self.back.close()
