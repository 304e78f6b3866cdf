"""kvoffload's numbers in vLLM's connector metrics: `KVOffloadStats` travels from workers to vLLM's
stats logger (the periodic "KV Transfer metrics" line), `KVOffloadPromMetrics` exports the same
counters on vLLM's Prometheus endpoint as `vllm:kvoffload_<name>_total`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from prometheus_client import Counter
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

COUNTERS = {
    "loaded_pages": "pages restored from the store",
    "loaded_bytes": "bytes restored from the store",
    "load_failures": "loads that failed (missing, corrupt or unreadable pages): blocks recomputed",
    "saved_pages": "pages written to the store",
    "saved_bytes": "bytes written to the store",
    "save_dropped": "pages the store could not take (full, failing disk)",
    "save_skipped_too_large": "pages never saved: larger than the store takes (capacity below one page)",
    "checksum_failures": "stored entries that failed verification (read as misses)",
    "prefetched_pages": "pages promoted from the slow tier into memory for queued requests (prefetch)",
    "prefetch_skipped": "prefetches not made: the prefetch byte budget was spent",
    "prefetch_cancelled": "prefetches ended early: their request was scheduled or left first",
    "load_microseconds": "time spent loading",
    "save_microseconds": "time spent saving",
}


@dataclass
class KVOffloadStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVOffloadStats:
        merged = dict(self.data)
        for key, value in other.data.items():
            merged[key] = merged.get(key, 0) + value
        return KVOffloadStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if k in COUNTERS}
        for kind, done in (("load", "loaded"), ("save", "saved")):
            nbytes, micros = self.data.get(f"{done}_bytes", 0), self.data.get(f"{kind}_microseconds", 0)
            if micros:
                out[f"{kind}_GBps"] = round(nbytes / micros / 1e3, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVOffloadPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # metric_types[Counter]: prometheus's Counter or a drop-in for it (vLLM's Ray wrappers); typed as the former
        self._counters: dict[str, Counter] = {
            name: cast(
                Counter, self._counter_cls(name=f"vllm:kvoffload_{name}", documentation=doc, labelnames=labelnames)
            )
            for name, doc in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            if name in self._counters and value:
                self._counters[name].labels(*labels).inc(value)
