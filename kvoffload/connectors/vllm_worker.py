"""`KVOffloadConnector`'s worker side (see `kvoffload.connectors.vllm` for the design): views vLLM's
backing allocation through the full layout (`kvoffload.spec.vllm.from_vllm`), checked against the
scheduler's kinds view at start-up, and runs loads and saves as background jobs."""

from __future__ import annotations

import logging
import threading
from collections import Counter

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from ..spec.layout import CacheLayout, KindsLayout
from ..spec.vllm import backing_buffer, check_agreement, check_tensors, from_vllm
from ..store import shared_store
from .jobs import Jobs, LoadDone
from .offloader import Offloader
from .plan import own_pages, pages_for_load
from .prefetch import Prefetcher
from .store_index import mirrored_tier
from .transfer import make_transfer
from .vllm_config import ConnectorConfig
from .vllm_messages import KVOffloadMetadata, StoredPages
from .vllm_metrics import COUNTERS, KVOffloadStats

log = logging.getLogger("kvoffload.connectors.vllm")
IDLE_WAIT_S = 0.005  # at most this long per step with nothing to compute, waiting for a job's result

MAX_EVICTED = 1 << 16  # evicted keys held for one report (more in one step: their removal goes unreported)


class _Worker:
    """A worker process's half: `view` is what the scheduler plans with (checked against this
    worker's layout in `register_kv_caches`)."""

    def __init__(
        self,
        kv_cache_config,
        view: KindsLayout,
        config: ConnectorConfig,
        model_id: str,
        tp_rank: int,
        tp_size: int,
        *,
        dcp_size: int = 1,
        share_replicas: bool = True,
        report_evictions: bool = False,
    ):
        """`config`: the connector's (its store and namespace; `prefetch_bytes`: what its prefetch may hold
        for queued requests); `report_evictions`: KV events are enabled; report the keys the store evicts
        (`StoredPages.evicted`)."""
        self.kv_cache_config, self.view, self.store_url = kv_cache_config, view, config.store
        self.namespace, self._prefetch_budget = config.namespace, config.prefetch_budget
        # written keys go to the scheduler only where it mirrors a memory tier living in this process
        self._report_written = mirrored_tier(config.spec) is not None
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._dcp_size, self._share_replicas = dcp_size, share_replicas
        self.offloader: Offloader | None = None
        self.jobs: Jobs | None = None
        self.prefetcher: Prefetcher | None = None
        self.layout: CacheLayout | None = None
        self._saving: Counter[str] = Counter()  # request -> save jobs submitted and not done
        self._awaited: set[str] = set()  # finished requests the scheduler waits on
        self._model_id = model_id
        self._report = StoredPages()
        self._idle_step = False  # this step scheduled no token (KVOffloadMetadata.idle)
        self._last_counters: dict[str, int] = {}
        self._report_evictions = report_evictions
        self._evicted: dict[bytes, None] = {}  # filled by the threads that write the store
        self._evicted_lock = threading.Lock()
        self._stats_due = False  # a job was reported since the last stats: its counters may have moved

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:  # the worker's own tensor-parallel rank, once vLLM's process groups exist
            from vllm.distributed import get_tensor_model_parallel_rank

            self.tp_rank = get_tensor_model_parallel_rank()
        except Exception:  # noqa: BLE001 - not initialised (single process): keep the config's rank
            pass
        # One buffer and the config placed in it, however vLLM allocated the cache (`backing_buffer`).
        raw, kv_cache_config = backing_buffer(self.kv_cache_config, kv_caches)
        if kv_cache_config is not self.kv_cache_config:
            log.info("KVOffloadConnector: vLLM's KV cache is in one segment per layer; pages move through one view")
        layout = from_vllm(
            kv_cache_config,
            model_id=self._model_id,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            dcp_size=self._dcp_size,
            share_replicas=self._share_replicas,
            kv_caches=kv_caches,
        )  # the tensors' dim orders: fingerprint
        check_agreement(self.view, layout)  # UnsupportedLayoutError at start-up, never wrong pages later
        check_tensors(layout, kv_caches, raw)  # the real (CUDA) tensors lie where the config says
        transfer = make_transfer(raw)
        store = shared_store(self.store_url, fingerprint=layout.fingerprint)
        store.claim(self.namespace)
        if self._report_evictions:
            store.watch_evictions(self._on_evicted)
        self.offloader = Offloader(store, layout, transfer)
        self.jobs = Jobs(self.offloader, name=f"kvoffload-tp{self.tp_rank}")
        front = store.memory_front  # prefetch fills a memory tier in front of a slower one
        budget = front.capacity // 4 if self._prefetch_budget is None and front is not None else self._prefetch_budget
        if budget and front is not None:
            self.prefetcher = Prefetcher(store, budget, name=f"kvoffload-prefetch-tp{self.tp_rank}")
        self.layout = layout
        log.info(
            "KVOffloadConnector: %s, %d bytes stored per block, transfer warm start %.0f ms",
            self.store_url,
            layout.stored_bytes_per_block(),
            1e3 * self.offloader.warm_up_s,
        )

    def start_load_kv(self, meta) -> None:
        """Submit this step's loads; they finish in the background (reported by get_transfer_results)."""
        self._idle_step = False
        offloader, layout = self.offloader, self.layout
        if not isinstance(meta, KVOffloadMetadata) or self.jobs is None or offloader is None or layout is None:
            return  # not registered yet (register_kv_caches makes all three)
        self._idle_step = meta.idle
        if meta.clear_store:  # before this step's loads and saves; no save is in flight (see reset_cache)
            if self.prefetcher is not None and not self.prefetcher.cancel_all():
                log.warning(
                    "KVOffloadConnector: worker %d: a prefetch still runs while its store is cleared", self.tp_rank
                )
            self._report.added.clear()
            if not offloader.store.clear(self.namespace):
                log.warning("KVOffloadConnector: worker %d could not clear its store", self.tp_rank)
            self._report.cleared[meta.clear_store] = 1
        if self.prefetcher is not None:  # before the loads: a request's load takes over from its prefetch
            self.prefetcher.done(meta.prefetch_done)
            for job in meta.prefetches:
                self.prefetcher.submit(job.req_id, pages_for_load(layout, job.block_keys, 0, job.end))
        for load in meta.loads:
            self.jobs.submit_load(load.req_id, load.block_keys, load.start, load.end, load.block_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Loads and saves finished since the last step. A failed load is also 'finished' so the request
        leaves its wait state, and vLLM recomputes it; a finished request is 'sent' once its saves ran."""
        if self._idle_step and self.jobs is not None and self.jobs.pending:
            # Nothing to compute this step (requests wait for loads): sleep briefly for a result instead
            # of letting the engine loop spin against the (niced) job thread on a busy machine.
            self.jobs.wait_results(IDLE_WAIT_S)
        results = self.jobs.poll() if self.jobs is not None else ()
        if not results and not self._awaited:  # most steps: nothing finished, nobody waits
            return KVConnectorTransferResults()
        self._stats_due = self._stats_due or bool(results)
        done, failed = set(), set()
        for result in results:
            if isinstance(result, LoadDone):
                done.add(result.req_id)
                if not result.ok:
                    failed.add(result.req_id)
                    self._report.missing.update(result.missing)
                    log.warning("KVOffloadConnector: load for %s failed; vLLM recomputes its prefix", result.req_id)
                continue
            self._saving[result.req_id] -= 1
            if self._saving[result.req_id] <= 0:
                del self._saving[result.req_id]
            self._report.done_jobs[result.job_id] = self._report.done_jobs.get(result.job_id, 0) + 1
            if self._report_written:
                for written in result.written:
                    self._report.added[written.key] = written.group.used_bytes_per_block
        sent = {req_id for req_id in self._awaited if req_id not in self._saving}
        self._awaited -= sent
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=done, failed_recving=failed)

    def wait_for_save(self, meta) -> None:
        """Submit this step's saves (after the forward that computed them); nothing waits here."""
        if not isinstance(meta, KVOffloadMetadata) or self.jobs is None or self.offloader is None:
            return
        for job in meta.saves:  # this rank's keys; a replicated group's pages only on its writing rank
            self._saving[job.req_id] += 1
            self.jobs.submit_save(job.job_id, job.req_id, own_pages(self.offloader.layout, job.pages))
        self._awaited.update(meta.await_saves)

    def _on_evicted(self, keys: list[bytes]) -> None:
        """The store's eviction listener (a save job's or a write-behind thread): kept for the next report."""
        with self._evicted_lock:
            room = MAX_EVICTED - len(self._evicted)
            self._evicted.update(dict.fromkeys(keys[: max(room, 0)]))

    def build_connector_worker_meta(self) -> StoredPages | None:
        report = self._report
        if self._report_evictions:
            with self._evicted_lock:
                evicted, self._evicted = self._evicted, {}
            report.evicted.update(evicted)
        if not (report.added or report.missing or report.done_jobs or report.cleared or report.evicted):
            return None
        self._report = StoredPages()
        return report

    def get_kv_connector_stats(self) -> KVOffloadStats | None:
        """The counters' change since the last report. They move only inside jobs (the store's checksum
        failures too: a load's reads), and a job's counts precede its result, so they are read only on
        a step that polled a result, never on the idle ones."""
        if self.offloader is None or not self._stats_due:
            return None
        self._stats_due = False
        now = dict(self.offloader.counters)
        if self.prefetcher is not None:
            now.update(self.prefetcher.counters)
        now["checksum_failures"] = self.offloader.store.counter("checksum_failures")  # stats(): I/O per step
        last, self._last_counters = self._last_counters, now
        delta = {k: now.get(k, 0) - last.get(k, 0) for k in COUNTERS}
        return KVOffloadStats(data=delta) if any(delta.values()) else None

    def shutdown(self) -> None:
        """Finish the queued saves (bounded); the store is per process (shared_store) and closes with it."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.jobs is not None:
            self.jobs.close()
