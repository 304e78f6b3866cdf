"""`KVOffloadConnector`: kvoffload behind vLLM's `--kv-transfer-config` (KV connector API v1 + HMA).

    --kv-transfer-config '{"kv_connector": "KVOffloadConnector",
                           "kv_connector_module_path": "kvoffload.connectors.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"store": "lmdb:///var/cache/kvoffload"}}'

Scheduler side: finds the longest prefix the store holds for every cacheable group (`plan`), tells vLLM
how many tokens the connector will provide, and turns each step into load and save jobs: PAGED pages of
blocks that became full this step, STATE checkpoints exactly where vLLM hands off an align-mode
boundary state (its `boundary_state_offloads`), SKIP groups never.
Worker side: views vLLM's backing allocation through the layout model (`from_vllm`) and moves pages with
the same `Offloader` the bundled runner uses. Loads use vLLM's asynchronous protocol (the request waits
in WAITING_FOR_REMOTE_KVS while its pages are restored, then runs): vLLM copies align-mode recurrent
states between blocks before a forward, so a state must be in place one step ahead; and a failed or
corrupt load is reported as `failed_recving`, the one recompute path vLLM has for hybrid models.
A request whose load failed is not offered a load again: it recomputes (and its pages are saved again).

Nothing waits for the store inside the engine step: the worker submits loads and saves to one background
thread (`jobs`) and reports them in a later step. The scheduler pins every block a save job reads (a
reference on vLLM's block pool, as vLLM's own offloading does) until every worker reports the job done,
so neither a finished, preempted or aborted request nor a retired recurrent-state block can be reused
under a save; a finished request with saves also stays (`request_finished` returns True) until its saves
are reported through `finished_sending`, which keeps the engine stepping until they are durable. Pages of
a save in flight count as present for lookups: the load that follows runs after it, in order.

Keys are kvoffload's own chained block keys (never vLLM's block hashes: those depend on a per-process
seed unless PYTHONHASHSEED is fixed), salted with the request's `cache_salt`, LoRA and multimodal ids.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from ..spec import GroupKind, KeyChain, page_key
from ..spec.vllm import UnsupportedLayoutError, from_vllm, group_kinds, group_name
from ..store import parse_url, shared_store
from .jobs import Jobs
from .offloader import Offloader
from .plan import Page, hit_blocks
from .transfer import make_transfer
from .vllm_metrics import COUNTERS, KVOffloadPromMetrics, KVOffloadStats

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

EXTRA_CONFIG_KEYS = {
    "store": "store URL (memory://, lmdb:///abs/dir, tiered://...); default lmdb under ~/.cache/kvoffload",
    "namespace": "key namespace: deployments that must not share cached prefixes use different ones",
    "model_id": "identity of the weights in the layout fingerprint (default: the served model name)",
    "load_failure_policy": "'recompute' (default: a failed load is a cache miss) or 'fail' (vLLM's own default)",
}


@dataclass
class LoadJob:
    req_id: str
    block_keys: list[bytes]
    start: int
    end: int
    block_ids: dict[int, list[int]]  # group index -> the request's block table


@dataclass
class SaveJob:
    req_id: str
    pages: list[tuple[bytes, int, int, int]]  # (block key, group index, block index, physical block id)
    job_id: int = 0  # the scheduler's: reported back when the job is done, to unpin its blocks


@dataclass
class KVOffloadMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    await_saves: list[str] = field(default_factory=list)  # finished requests to report via finished_sending


@dataclass
class StoredPages(KVConnectorWorkerMetadata):
    """Worker -> scheduler, every step: pages written (key -> bytes), pages a load did not find, and
    save jobs done (job id -> number of workers reporting it). The scheduler mirrors a memory:// store
    with it, since that store lives in the worker process, and unpins a job's blocks once every worker
    has reported it."""

    added: dict[bytes, int] = field(default_factory=dict)
    missing: set[bytes] = field(default_factory=set)
    done_jobs: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: StoredPages) -> StoredPages:
        done = dict(self.done_jobs)
        for job, count in other.done_jobs.items():
            done[job] = done.get(job, 0) + count
        return StoredPages({**self.added, **other.added}, self.missing | other.missing, done)


class _MirrorIndex:
    """The scheduler's view of a worker's memory tier: the same byte capacity and LRU order, fed by
    `StoredPages`. A page it still believes present but the worker evicted fails its load and is
    recomputed, never served wrong."""

    def __init__(self, capacity: int):
        from collections import OrderedDict

        self.capacity, self.used, self.sizes = capacity, 0, OrderedDict()

    def update(self, report: StoredPages) -> None:
        for key in report.missing:
            self.used -= self.sizes.pop(key, 0)
        for key, size in report.added.items():
            self.used -= self.sizes.pop(key, 0)
            self.sizes[key] = size
            self.used += size
            while self.used > self.capacity and self.sizes:
                self.used -= self.sizes.popitem(last=False)[1]

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        found = [k in self.sizes for k in keys]
        for key, there in zip(keys, found):
            if there:
                self.sizes.move_to_end(key)
        return found


@dataclass
class _RequestState:
    block_keys: list[bytes]
    num_prompt_tokens: int
    saved_blocks: int = 0  # PAGED pages of blocks [0, saved_blocks) handed to a save job
    load_range: tuple[int, int] | None = None  # (start, end) blocks the connector promised
    load_tables: dict[int, list[int]] | None = None  # their block tables, once allocated
    loaded: tuple[int, int] = (0, 0)  # (start, end) blocks a load job restored (or tried to)
    load_failed: bool = False  # a load for it failed: no more loads, it recomputes
    sent_saves: bool = False  # a save job for it went to the workers


@dataclass
class _PinnedJob:
    blocks: list  # vLLM KVCacheBlocks referenced until every worker reports the job
    keys: list[bytes]  # rank-0 page keys in flight (present for lookups meanwhile)
    reports: int = 0


def rank_keys(keys: list[bytes], rank: int, size: int) -> list[bytes]:
    """Each TP rank stores its own shard under its own keys."""
    return keys if size == 1 else [page_key(k, f"tp{rank}/{size}") for k in keys]


def _default_store() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return f"lmdb://{os.path.join(base, 'kvoffload', 'vllm-store')}?capacity=16GiB"


class KVOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"KVOffloadConnector: unknown kv_connector_extra_config key(s) {unknown}; "
                             f"known: {sorted(EXTRA_CONFIG_KEYS)}")
        if not vllm_config.cache_config.enable_prefix_caching:
            raise ValueError("KVOffloadConnector needs prefix caching: start vLLM with --enable-prefix-caching")
        policy = extra.get("load_failure_policy", "recompute")
        if policy not in ("recompute", "fail"):
            raise ValueError(f"KVOffloadConnector: load_failure_policy must be 'recompute' or 'fail', got {policy!r}")
        # A cache miss must not fail a request: vLLM reads this policy right after creating the connector.
        self._kv_transfer_config.kv_load_failure_policy = policy
        self.store_url = extra.get("store") or _default_store()
        parse_url(self.store_url)  # a bad URL fails at start-up, in both roles
        parallel = vllm_config.parallel_config
        self.tp_rank, self.tp_size = getattr(parallel, "rank", 0) % max(parallel.tensor_parallel_size, 1), \
            parallel.tensor_parallel_size
        model_id = extra.get("model_id") or str(vllm_config.model_config.model)
        self.kinds = group_kinds(kv_cache_config)  # raises UnsupportedLayoutError for unknown specs
        if not any(kind is not GroupKind.SKIP for kind in self.kinds):
            raise UnsupportedLayoutError("KVOffloadConnector: no prefix-cacheable KV cache group")
        self.block_size = kv_cache_config.hash_block_size or vllm_config.cache_config.block_size
        # The key chain's context must be equal in the scheduler and every worker: derive it from what
        # both see (model identity, dtypes, block size, group kinds and layers), not from byte offsets.
        identity = repr((model_id, str(vllm_config.model_config.dtype), vllm_config.cache_config.cache_dtype,
                         self.block_size, [(k.value, tuple(g.layer_names))
                                           for k, g in zip(self.kinds, kv_cache_config.kv_cache_groups)]))
        self.chain = KeyChain(identity.encode(), self.block_size, namespace=extra.get("namespace", "vllm"))
        self.counters: Counter[str] = Counter()
        if role == KVConnectorRole.SCHEDULER:
            self._requests: dict[str, _RequestState] = {}
            self._plan_layout = _KindsLayout(self.kinds, kv_cache_config, self.block_size)
            self._mirror = _mirror_for(self.store_url)
            self._store_presence = self._mirror.contains_many if self._mirror else shared_store(self.store_url).contains_many
            self._block_pool = None  # vLLM binds it after construction
            self._next_job = 0
            self._pinned: dict[int, _PinnedJob] = {}
            self._in_flight: Counter[bytes] = Counter()
            self._await_saves: list[str] = []
            self._workers = max(int(getattr(parallel, "world_size", 1) or 1), 1)
        else:
            self.offloader: Offloader | None = None
            self.jobs: Jobs | None = None
            self._saving: Counter[str] = Counter()  # request -> save jobs submitted and not done
            self._awaited: set[str] = set()  # finished requests the scheduler waits on
            self._model_id = model_id
            self._report = StoredPages()

    # ------------------------------------------------------------------ scheduler side
    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self._block_pool = gpu_block_pool

    def _presence(self, keys: list[bytes]) -> list[bool]:
        """Stored, or written by a save job in flight (the load of them runs after it, in order)."""
        stored = self._store_presence(keys)
        return [there or key in self._in_flight for key, there in zip(keys, stored)]

    def has_pending_block_frees(self) -> bool:
        return bool(self._pinned)  # a save job's report will give blocks back: no need to preempt

    def _salted_chain(self, request: Request) -> KeyChain:
        salt = [getattr(request, "cache_salt", None) or ""]
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            salt.append(f"lora:{lora.lora_name}")
        salt += [f"mm:{f.identifier}" for f in (getattr(request, "mm_features", None) or [])]
        return self.chain.with_salt("|".join(salt)) if any(salt) else self.chain

    def _state(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            prompt = list(request.prompt_token_ids or [])
            state = _RequestState(self._salted_chain(request).keys(prompt), len(prompt))
            self._requests[request.request_id] = state
        return state

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        state = self._state(request)
        have = num_computed_tokens // self.block_size
        if num_computed_tokens % self.block_size or state.load_failed:
            return 0, False
        try:  # rank 0's pages stand for all ranks' (a rank that misses fails its load: recomputed)
            total = hit_blocks(self._plan_layout, rank_keys(state.block_keys, 0, self.tp_size),
                               state.num_prompt_tokens, self._presence, have)
        except Exception as exc:  # noqa: BLE001 - a broken store is a miss, never a failed engine
            log.error("KVOffloadConnector lookup failed: %s", exc)
            total = have
        self.counters["lookups"] += 1
        if total <= have:
            return 0, False
        state.load_range = (have, total)
        self.counters["hit_tokens"] += (total - have) * self.block_size
        return (total - have) * self.block_size, True  # asynchronous: see the module docstring

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or state.load_range is None:
            return
        if num_external_tokens <= 0:
            state.load_range = None
            return
        state.load_tables = {g: list(ids) for g, ids in enumerate(blocks.get_block_ids())}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVOffloadMetadata()
        for req_id, state in self._requests.items():
            if state.load_range is not None and state.load_tables is not None:
                start, end = state.load_range
                meta.loads.append(LoadJob(req_id, state.block_keys[:end], start, end, state.load_tables))
                state.load_range = state.load_tables = None
                state.saved_blocks = max(state.saved_blocks, end)  # those pages are in the store
                state.loaded = (start, end)
        block_state = scheduler_output.kv_connector_block_state
        handoffs = block_state.boundary_state_offloads if block_state is not None else {}
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            job = self._save_job(req_id, state, scheduled, scheduler_output, block_state,
                                 handoffs.get(req_id, []))
            if job.pages:
                self._pin(job)
                state.sent_saves = True
                meta.saves.append(job)
        meta.await_saves, self._await_saves = self._await_saves, []
        return meta

    def _pin(self, job: SaveJob) -> None:
        """Reference the job's blocks in vLLM's pool until the workers report it (see the docstring)."""
        self._next_job += 1
        job.job_id = self._next_job
        blocks = []
        if self._block_pool is not None:
            blocks = [self._block_pool.blocks[block_id] for _, _, _, block_id in job.pages]
            self._block_pool.touch(blocks)
        keys = [page_key(rank_keys([key], 0, self.tp_size)[0], group_name(g, self.kinds[g]))
                for key, g, _, _ in job.pages]
        self._in_flight.update(keys)
        self._pinned[job.job_id] = _PinnedJob(blocks, keys)

    def _unpin(self, job_id: int, reports: int) -> None:
        pinned = self._pinned.get(job_id)
        if pinned is None:
            return
        pinned.reports += reports
        if pinned.reports < self._workers:
            return
        del self._pinned[job_id]
        if pinned.blocks:
            self._block_pool.free_blocks(pinned.blocks)
        self._in_flight.subtract(pinned.keys)
        for key in pinned.keys:
            if self._in_flight[key] <= 0:
                del self._in_flight[key]

    def _save_job(self, req_id, state, scheduled, scheduler_output, block_state, handoffs) -> SaveJob:
        computed = self._num_computed(req_id, scheduler_output)
        full = min((computed + scheduled) // self.block_size, len(state.block_keys))
        pages: list[tuple[bytes, int, int, int]] = []
        tables = block_state.get_block_ids(req_id) if block_state is not None else None
        if tables is not None and full > state.saved_blocks:
            for g, kind in enumerate(self.kinds):
                if kind is GroupKind.PAGED:
                    pages += [(state.block_keys[i], g, i, tables[g][i]) for i in range(state.saved_blocks, full)]
            state.saved_blocks = full
        for group_id, block_id, boundary in handoffs:  # STATE: exactly the blocks vLLM hands off
            index = boundary // self.block_size - 1
            if (self.kinds[group_id] is GroupKind.STATE and boundary % self.block_size == 0
                    and 0 <= index < len(state.block_keys)
                    # vLLM offers a loaded boundary again, the very block the load writes into: saving
                    # it after a failed load would store stale bytes as this prefix's checkpoint.
                    and not state.loaded[0] <= index < state.loaded[1]):
                pages.append((state.block_keys[index], group_id, index, block_id))
        return SaveJob(req_id, pages)

    @staticmethod
    def _num_computed(req_id: str, scheduler_output) -> int:
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id == req_id:
                return new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid == req_id:
                return cached.num_computed_tokens[i]
        return 0

    def update_connector_output(self, connector_output) -> None:
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(report, StoredPages):
            if self._mirror is not None:
                self._mirror.update(report)
            for job_id, count in report.done_jobs.items():
                self._unpin(job_id, count)
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            state = self._requests.get(req_id)
            if state is not None:
                # Offering the same load again could fail the same way forever (a read error, a page
                # only one TP rank lost); vLLM recomputes from scratch, so save those pages again.
                state.load_failed = True
                state.saved_blocks = min(state.saved_blocks, state.loaded[0])
                state.loaded = (0, 0)

    def request_finished(self, request: Request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks of a request with saves until the workers report them (finished_sending).
        A request still waiting for a load is held by vLLM itself until the load reports."""
        state = self._requests.pop(request.request_id, None)
        from vllm.v1.request import RequestStatus

        waiting_for_load = getattr(request, "status", None) == RequestStatus.WAITING_FOR_REMOTE_KVS
        if state is None or not state.sent_saves or waiting_for_load:
            return False, None
        self._await_saves.append(request.request_id)
        return True, None

    def request_finished_all_groups(self, request: Request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:  # the worker's own tensor-parallel rank, once vLLM's process groups exist
            from vllm.distributed import get_tensor_model_parallel_rank

            self.tp_rank = get_tensor_model_parallel_rank()
        except Exception:  # noqa: BLE001 - not initialised (single process): keep the config's rank
            pass
        layout = from_vllm(self._kv_cache_config, model_id=self._model_id, tp_rank=self.tp_rank,
                           tp_size=self.tp_size)
        any_cache = next(iter(kv_caches.values()))
        any_cache = any_cache[0] if isinstance(any_cache, (list, tuple)) else any_cache
        raw = torch.empty(0, dtype=torch.uint8, device=any_cache.device).set_(any_cache.untyped_storage())
        transfer = make_transfer(raw)
        self.offloader = Offloader(shared_store(self.store_url, fingerprint=layout.fingerprint), layout, transfer)
        self.jobs = Jobs(self.offloader, name=f"kvoffload-tp{self.tp_rank}")
        self.layout = layout
        log.info("KVOffloadConnector: %s, %d bytes stored per block", self.store_url,
                 layout.stored_bytes_per_block())

    def _rank_keys(self, keys: list[bytes]) -> list[bytes]:
        return rank_keys(keys, self.tp_rank, self.tp_size)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Submit this step's loads; they finish in the background (reported by get_transfer_results)."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVOffloadMetadata) or self.jobs is None:
            return
        for job in meta.loads:
            self.jobs.submit_load(job.req_id, self._rank_keys(job.block_keys), job.start, job.end, job.block_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Loads and saves finished since the last step. A failed load is also 'finished' so the request
        leaves its wait state, and vLLM recomputes it; a finished request is 'sent' once its saves ran."""
        done, failed = set(), set()
        for result in self.jobs.poll() if self.jobs is not None else ():
            if result.kind == "load":
                done.add(result.job_id)
                if not result.ok:
                    failed.add(result.job_id)
                    self._report.missing.update(result.missing)
                    log.warning("KVOffloadConnector: load for %s failed; vLLM recomputes its prefix", result.job_id)
                continue
            job_id, req_id = result.job_id
            self._saving[req_id] -= 1
            if self._saving[req_id] <= 0:
                del self._saving[req_id]
            self._report.done_jobs[job_id] = self._report.done_jobs.get(job_id, 0) + 1
            for page in result.written:
                self._report.added[page.key] = page.group.used_bytes_per_block
        sent = {req_id for req_id in self._awaited if req_id not in self._saving}
        self._awaited -= sent
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=done, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request runs only after its load is reported

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # whole blocks are saved in wait_for_save (these hooks do not fire for indexer or KDA layers)

    def wait_for_save(self) -> None:
        """Submit this step's saves (after the forward that computed them); nothing waits here."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVOffloadMetadata) or self.jobs is None:
            return
        groups = self.offloader.layout.groups
        for job in meta.saves:
            keys = self._rank_keys([key for key, _, _, _ in job.pages])
            pages = [(Page(page_key(k, groups[g].name), groups[g], index), block)
                     for k, (_, g, index, block) in zip(keys, job.pages)]
            self._saving[job.req_id] += 1
            self.jobs.submit_save((job.job_id, job.req_id), pages)
        self._awaited.update(meta.await_saves)

    def build_connector_worker_meta(self) -> StoredPages | None:
        report, self._report = self._report, StoredPages()
        return report if report.added or report.missing or report.done_jobs else None

    # ------------------------------------------------------------------ metrics
    def get_kv_connector_stats(self) -> KVOffloadStats | None:
        if getattr(self, "offloader", None) is None:  # the scheduler side moves no bytes
            return None
        now = dict(self.offloader.counters)
        now["checksum_failures"] = int(self.offloader.store.stats().get("checksum_failures", 0))
        last = getattr(self, "_last_counters", {})
        self._last_counters = now
        delta = {k: now.get(k, 0) - last.get(k, 0) for k in COUNTERS}
        return KVOffloadStats(data=delta) if any(delta.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVOffloadStats:
        return KVOffloadStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Finish the queued saves (bounded); the store is per process (shared_store) and closes with it."""
        if getattr(self, "jobs", None) is not None:
            self.jobs.close()


class _KindsLayout:
    """What `plan` needs on the scheduler side (group kinds, block size, alignment) without byte
    placement, which only workers know."""

    def __init__(self, kinds, kv_cache_config, block_size: int):
        from ..spec.layout import lcm

        self.block_size = block_size
        kpool = max([k for k in _pool_sizes(kv_cache_config)] or [1])
        self.hit_alignment = lcm(kv_cache_config.cache_hit_alignment_tokens or block_size, block_size, kpool)
        self.cacheable_groups = tuple(_KindOnly(i, k) for i, k in enumerate(kinds) if k is not GroupKind.SKIP)


@dataclass(frozen=True)
class _KindOnly:
    index: int
    kind: GroupKind

    @property
    def name(self) -> str:
        return group_name(self.index, self.kind)


def _pool_sizes(kv_cache_config):
    from vllm.v1.kv_cache_interface import iter_layer_specs

    for group in kv_cache_config.kv_cache_groups:
        for spec in iter_layer_specs(group.kv_cache_spec):
            tps = getattr(spec, "tokens_per_state", 1)
            if isinstance(tps, int) and tps > 1:
                yield tps


def _mirror_for(url: str) -> _MirrorIndex | None:
    """LMDB (alone or behind memory) is read directly by the scheduler process; a memory tier lives in
    the worker process, so the scheduler mirrors it from the workers' reports."""
    from ..store import DEFAULT_MEMORY_CAPACITY, parse_size

    parsed = parse_url(url)
    if parsed.scheme != "memory":
        return None
    return _MirrorIndex(parse_size(parsed.options.get("capacity", DEFAULT_MEMORY_CAPACITY)))
