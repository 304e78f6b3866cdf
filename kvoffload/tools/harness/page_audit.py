"""Byte-for-byte audit of the pages KVOffloadConnector moves inside a running vLLM engine (in-process:
scheduler and worker in the caller's process). An `Offloader` observer: every saved page's digest is
kept; every restored page is read back from the engine's cache (GPU or CPU) once its load is done and
compared with the bytes its store holds and, when this process saved it, with what was saved. Used by
the engine driver's `audit` command (tests, benchmarks); costs a copy per page, so never in production."""

from __future__ import annotations

import threading
from collections import Counter

import xxhash


def _digest(data) -> bytes:
    return xxhash.xxh3_128_digest(memoryview(data).cast("B"))


class PageAudit:
    def __init__(self, offloader):
        self.offloader = offloader
        self.saved_digests: dict[bytes, bytes] = {}
        self.saved_counts: Counter[str] = Counter()  # group name -> pages saved
        self.loaded_counts: Counter[str] = Counter()  # group name -> pages restored and read back
        self.equal_to_store = self.equal_to_saved = 0
        self.mismatches: list[str] = []
        self._lock = threading.Lock()  # saves and loads run on the job thread, `summary` on the engine's

    @classmethod
    def install(cls) -> PageAudit:
        """Attach to this process's KVOffloadConnector worker (vLLM's KV transfer group)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from ...connectors.vllm import KVOffloadConnector

        connector = get_kv_transfer_group()
        if not isinstance(connector, KVOffloadConnector) or connector.connector_worker is None:
            raise RuntimeError(
                f"page audit: this process's KV connector is not a KVOffloadConnector worker "
                f"({type(connector).__name__})"
            )
        offloader = connector.connector_worker.offloader
        if offloader is None:
            raise RuntimeError("page audit: the connector's worker has no KV caches registered yet")
        audit = cls(offloader)
        offloader.observer = audit
        return audit

    def saved(self, page, data) -> None:
        with self._lock:
            self.saved_digests[page.key] = _digest(data)
            self.saved_counts[page.group.name] += 1

    def loaded(self, page) -> None:
        restored = _digest(self.offloader.transfer.gather(page.group, page.block))
        stored = self.offloader.store.get(page.key)
        with self._lock:
            self.loaded_counts[page.group.name] += 1
            if stored is not None and _digest(stored) == restored:
                self.equal_to_store += 1
            else:
                self.mismatches.append(f"{page.group.name} block {page.block}: restored bytes differ from the store's")
            if page.key in self.saved_digests:
                if self.saved_digests[page.key] == restored:
                    self.equal_to_saved += 1
                else:
                    self.mismatches.append(f"{page.group.name} block {page.block}: restored bytes differ from saved")

    def summary(self) -> dict:
        layout = self.offloader.layout
        with self._lock:
            return {
                "saved_pages": dict(self.saved_counts),
                "loaded_pages": dict(self.loaded_counts),
                "equal_to_store": self.equal_to_store,
                "equal_to_saved": self.equal_to_saved,
                "mismatches": list(self.mismatches[:20]),
                "block_size": layout.block_size,
                "stored_bytes_per_block": layout.stored_bytes_per_block(),
                "groups": [
                    {
                        "name": g.name,
                        "kind": g.kind.value,
                        "spec": g.spec_type,
                        "used_bytes_per_block": g.used_bytes_per_block,
                    }
                    for g in layout.groups
                ],
            }
