"""`KVOffloadConnector`: kvoffload behind vLLM's `--kv-transfer-config` (KV connector API v1 + HMA).

    --kv-transfer-config '{"kv_connector": "KVOffloadConnector",
                           "kv_connector_module_path": "kvoffload.connectors.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"store": "lmdb:///var/cache/kvoffload"}}'

The shape of vLLM's own OffloadingConnector: this facade validates the config, builds the key chain and
the scheduler's view of the cache (`kvoffload.spec.vllm.scheduler_view`), then delegates every API
method to `connector_scheduler` (`vllm_scheduler._Scheduler`) or `connector_worker`
(`vllm_worker._Worker`), whichever its role has; what they exchange is in `vllm_messages`.

Scheduler side: finds the longest prefix the store holds for every cacheable group (`plan`), tells vLLM
how many tokens the connector will provide, and turns each step into load and save jobs: PAGED pages of
blocks that became full this step, STATE checkpoints exactly where vLLM hands off an align-mode
boundary state (its `boundary_state_offloads`), SKIP groups never.
Worker side: views vLLM's backing allocation through the layout model (`from_vllm`; at
`register_kv_caches` it must agree with the scheduler's view: block size, hit alignment, groups, page
contents, or start-up fails) and moves pages with the same `Offloader` the bundled runner uses. Loads use vLLM's
asynchronous protocol (the request waits in WAITING_FOR_REMOTE_KVS while its pages are restored, then
runs): vLLM copies align-mode recurrent states between blocks before a forward, so a state must be in
place one step ahead; and a failed or corrupt load is reported as `failed_recving`, the one recompute
path vLLM has for hybrid models.
A request whose load failed is not offered a load again: it recomputes (and its pages are saved again).
`reset_prefix_cache(reset_connector=True)` clears the store where that is safe, else reports False
(`_Scheduler.reset_cache`).

Nothing waits for the store inside the engine step: the worker submits loads and saves to one background
thread (`jobs`) and reports them in a later step (a step with no token to compute waits up to 5 ms for
them, rather than spinning the engine loop against that thread). The scheduler pins every block a save job reads (a
reference on vLLM's block pool, as vLLM's own offloading does) until every worker reports the job done,
so neither a finished, preempted or aborted request nor a retired recurrent-state block can be reused
under a save; a finished request with saves also stays (`request_finished` returns True) until its saves
are reported through `finished_sending`, which keeps the engine stepping until they are durable. Pages of
a save in flight count as present for lookups: the load that follows runs after it, in order.

Prefetch (`tiered://` stores): a request that vLLM added (`on_new_request`) and did not schedule in that
step waits in its queue; the workers promote its stored prefix from the slow tier into their memory tier
meanwhile, on a thread of their own, within a byte budget (`prefetch`), so its load later reads memory.

Keys are kvoffload's own chained block keys (never vLLM's block hashes: those depend on a per-process
seed unless PYTHONHASHSEED is fixed), salted with the request's `cache_salt`, LoRA and multimodal ids.
Their context names each group's page content (`spec.vllm.key_context`: state shapes and dtypes, the KV
cache layout), so an engine never looks up pages written under another byte layout.
Under tensor parallelism each rank stores its own shards (KDA heads) under its own keys, while groups
every rank holds identically (MLA latent, indexer rows) are written once, by the first rank, under one
key all ranks read (`spec.keys.shard_key`); the scheduler's hit needs every rank's pages.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from ..errors import ConfigError
from ..spec import GroupKind, KeyChain
from ..spec.vllm import UnsupportedLayoutError, key_context, scheduler_view
from .vllm_config import EXTRA_CONFIG_KEYS, ConnectorConfig
from .vllm_identity import vllm_model_identity
from .vllm_messages import KVOffloadMetadata, LoadJob, SaveJob, StoredPages
from .vllm_metrics import KVOffloadPromMetrics, KVOffloadStats
from .vllm_scheduler import _Scheduler
from .vllm_worker import _Worker

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


def _log_through_vllm() -> None:
    """kvoffload's log lines in vLLM's log, in its format and at its level: Python drops the INFO lines of
    a logger nobody configured. An application that configured the `kvoffload` logger keeps its own; one
    that gave the root logger handlers gets the lines there (they propagate), not twice."""
    ours, theirs = logging.getLogger("kvoffload"), logging.getLogger("vllm")
    if ours.handlers or ours.level != logging.NOTSET or not theirs.handlers:
        return
    ours.setLevel(theirs.getEffectiveLevel())
    if not logging.getLogger().handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)


__all__ = ["KVOffloadConnector", "KVOffloadMetadata", "LoadJob", "SaveJob", "StoredPages", "EXTRA_CONFIG_KEYS"]


class KVOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_through_vllm()  # vLLM has configured its logging by now
        config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        if not vllm_config.cache_config.enable_prefix_caching:
            raise ConfigError("KVOffloadConnector needs prefix caching: start vLLM with --enable-prefix-caching")
        # A cache miss must not fail a request: vLLM reads this policy right after creating the connector.
        self._kv_transfer_config.kv_load_failure_policy = config.load_failure_policy
        self.store_url = config.store
        parallel = vllm_config.parallel_config
        self.tp_rank, self.tp_size = (
            getattr(parallel, "rank", 0) % max(parallel.tensor_parallel_size, 1),
            parallel.tensor_parallel_size,
        )
        model_id = config.model_id or str(vllm_config.model_config.model)
        # The whole model config and the weights' content (or model_revision): any change, no old keys.
        self.model_identity = vllm_model_identity(vllm_config, config.model_revision)
        # The scheduler's view (group kinds, physical block size, hit alignment, page contents, groups TP
        # ranks share); raises UnsupportedLayoutError for unknown specs. Workers check their full byte
        # layout against it in register_kv_caches. Keys follow the physical block, not vLLM's (possibly
        # finer) hash unit. Groups TP ranks hold identically (MLA latent, indexer) are stored once per TP
        # group, unless each rank's store is private to its process (memory://).
        share = not config.spec.process_local
        dcp_size = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
        self.view = scheduler_view(kv_cache_config, tp_size=self.tp_size, dcp_size=dcp_size, share_replicas=share)
        if config.spec.admit > 1 and any(g.tp_replicas > 1 for g in self.view.cacheable_groups):
            raise ConfigError(
                "KVOffloadConnector: tiered:// admit= above 1 is not supported with tensor parallelism "
                "on this model: TP ranks share some pages (written once, read by all), and a shared "
                "page waiting for admission is in the memory tier of the rank that wrote it only; "
                "leave admit at 1"
            )
        self.block_size = self.view.block_size
        self.kinds = list(self.view.kinds)
        if not any(kind is not GroupKind.SKIP for kind in self.kinds):
            raise UnsupportedLayoutError("KVOffloadConnector: no prefix-cacheable KV cache group")
        # The key chain's context is equal in the scheduler and every worker (what both see: model identity,
        # dtypes, block size, group kinds, layers and page contents, never byte offsets).
        context = key_context(
            self.view,
            kv_cache_config,
            model_id=f"{model_id}#{self.model_identity}",
            model_dtype=str(vllm_config.model_config.dtype),
            cache_dtype=str(vllm_config.cache_config.cache_dtype),
        )
        self.namespace = config.namespace
        self.chain = KeyChain(context, self.block_size, namespace=self.namespace)
        self.connector_scheduler: _Scheduler | None = None
        self.connector_worker: _Worker | None = None
        events_config = getattr(vllm_config, "kv_events_config", None)
        events = bool(events_config is not None and events_config.enable_kv_cache_events)
        if role == KVConnectorRole.SCHEDULER:
            workers = max(int(getattr(parallel, "world_size", 1) or 1), 1)
            self.connector_scheduler = _Scheduler(self.view, self.chain, config, self.tp_size, workers)
            if events:  # vLLM drains take_events every step
                self.connector_scheduler.enable_events(
                    getattr(kv_cache_config, "hash_block_size", None) or self.block_size
                )
        else:
            self.connector_worker = _Worker(
                kv_cache_config,
                self.view,
                config,
                f"{model_id}#{self.model_identity}",
                self.tp_rank,
                self.tp_size,
                dcp_size=dcp_size,
                share_replicas=share,
                report_evictions=events,
            )

    # ------------------------------------------------------------------ scheduler side
    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.bind_gpu_block_pool(gpu_block_pool)

    def has_pending_block_frees(self) -> bool:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.has_pending_block_frees()

    def on_new_request(self, request: Request) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks of a request with saves until the workers report them (finished_sending).
        A request still waiting for a load is held by vLLM itself until the load reports."""
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    def reset_cache(self) -> bool:
        """`reset_prefix_cache(reset_connector=True)`: forget this namespace's cached prefixes (see
        `_Scheduler.reset_cache`); False, with the reason logged, where that cannot be done."""
        return self.connector_scheduler.reset_cache() if self.connector_scheduler is not None else True

    def take_events(self):
        """BlockStored / BlockRemoved for the blocks the store holds (`vllm_events`); vLLM publishes them."""
        return self.connector_scheduler.take_events() if self.connector_scheduler is not None else ()

    def request_finished_all_groups(self, request: Request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Submit this step's loads; they finish in the background (reported by get_transfer_results)."""
        assert self.connector_worker is not None
        self.connector_worker.start_load_kv(self._get_connector_metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Loads and saves finished since the last step. A failed load is also 'finished' so the request
        leaves its wait state, and vLLM recomputes it; a finished request is 'sent' once its saves ran."""
        assert self.connector_worker is not None
        return self.connector_worker.get_transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request runs only after its load is reported

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # whole blocks are saved in wait_for_save (these hooks do not fire for indexer or KDA layers)

    def wait_for_save(self) -> None:
        """Submit this step's saves (after the forward that computed them); nothing waits here."""
        assert self.connector_worker is not None
        self.connector_worker.wait_for_save(self._get_connector_metadata())

    def build_connector_worker_meta(self) -> StoredPages | None:
        assert self.connector_worker is not None
        return self.connector_worker.build_connector_worker_meta()

    # ------------------------------------------------------------------ metrics, both roles
    def get_kv_connector_stats(self) -> KVOffloadStats | None:
        if self.connector_worker is None:  # the scheduler side moves no bytes
            return None
        return self.connector_worker.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVOffloadStats:
        return KVOffloadStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Finish the queued saves (bounded); the store is per process (shared_store) and closes with it."""
        if self.connector_worker is not None:
            self.connector_worker.shutdown()


VLLM_OFFLOADING = ("OffloadingConnector", "SimpleCPUOffloadConnector", "LMCacheMPConnector")


def __getattr__(name: str):
    """vLLM's `--kv-offloading-size` replaces the connector that `--kv-transfer-config` named with its own
    offloading connector but keeps our module path, so vLLM then asks this module for its class: say
    which option to drop, rather than a bare "not found"."""
    if name in VLLM_OFFLOADING:
        raise AttributeError(
            f"kvoffload: vLLM's --kv-offloading-size replaced KVOffloadConnector with its own {name}; "
            "use --kv-transfer-config alone for kvoffload, or --kv-offloading-size alone for vLLM's offloading"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
