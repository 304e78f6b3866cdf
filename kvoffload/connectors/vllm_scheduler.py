"""`KVOffloadConnector`'s scheduler side (see `kvoffload.connectors.vllm` for the design): lookups on the
kinds-only view (`kvoffload.spec.vllm.scheduler_view`), load and save jobs, block pinning, the mirror of
the workers' memory tiers."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..spec import KeyChain, request_salt
from ..spec.layout import KindsLayout
from .plan import Page, hit_and_junction, hit_blocks, in_flight_keys, plan_save, rank_free
from .store_index import StoreIndex
from .vllm_config import ConnectorConfig
from .vllm_events import KVEvents, medium_for
from .vllm_messages import KVOffloadMetadata, LoadJob, PrefetchJob, SaveJob, StoredPages

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvoffload.connectors.vllm")


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
    junction: int = 0  # blocks: where the prompt diverges from a stored or held prefix (`retention`)
    request: Any = None  # vLLM's Request, kept only while KV events are enabled (its block hashes)


@dataclass
class _PinnedJob:
    blocks: list  # vLLM KVCacheBlocks referenced until every worker reports the job
    keys: list[bytes]  # rank-0 page keys in flight (present for lookups meanwhile)
    reports: int = 0


class _Scheduler:
    """The scheduler process's half: plans on `layout` (kinds only), keys requests with `chain`."""

    def __init__(self, layout: KindsLayout, chain: KeyChain, config: ConnectorConfig, tp_size: int, workers: int):
        """`config`: the connector's (its store, namespace, `max_saved_blocks`: a request's keys, hence
        its saves and hits, stop after so many prompt blocks; `prefetch_bytes`: queued requests' stored
        prefixes are promoted into the workers' memory tier; `state_retention`: the block boundaries
        whose STATE hand-offs are saved); `workers`: the engine's worker processes."""
        store_url, namespace, spec = config.store, config.namespace, config.spec
        max_blocks, prefetch, retention = config.max_blocks, config.prefetch_budget != 0, config.retention
        self.max_blocks, self.prefetch, self.retention = max_blocks, prefetch, retention
        self._arrived: list[Request] = []  # added since the last step (on_new_request), prefetch only
        self._prefetching: set[str] = set()  # requests with a prefetch sent to the workers, not yet ended
        self.layout, self.chain, self.tp_size, self.namespace = layout, chain, tp_size, namespace
        self.kinds = list(layout.kinds)
        self.block_size = layout.block_size
        self.counters: Counter[str] = Counter()
        self._requests: dict[str, _RequestState] = {}
        self._spec = spec
        self._index = StoreIndex(spec, store_url, workers, namespace)
        self._clear_workers = False
        self._resets = 0  # reset_cache generations
        self._uncleared = 0  # workers yet to report clearing for the latest one (no hits until then)
        self._block_pool = None  # vLLM binds it after construction
        self._next_job = 0
        self._pinned: dict[int, _PinnedJob] = {}
        self._in_flight: Counter[bytes] = Counter()
        self._await_saves: list[str] = []
        self._loads_ready: dict[str, _RequestState] = {}  # loads allocated since the last step's metadata
        self._workers = workers
        self._events: KVEvents | None = None  # enable_events: only when vLLM publishes KV events

    def enable_events(self, hash_block_size: int) -> None:
        """Record BlockStored / BlockRemoved events for vLLM's publisher (`vllm_events`)."""
        medium = medium_for(self._spec.scheme)
        self._events = KVEvents(self.layout, medium, hash_block_size, lambda keys: self._present(keys, lookup=False))

    def take_events(self) -> list:
        return self._events.take() if self._events is not None else []

    def _present(self, keys: list[bytes], lookup: bool = True) -> list[bool]:
        """`StoreIndex.present`, and for a `lookup` (a hit or a prefetch, a load to follow) also a page a
        save job in flight writes (the load runs after it, in order)."""
        found = self._index.present(keys, lookup)
        if lookup and self._in_flight:
            found = [there or key in self._in_flight for key, there in zip(keys, found)]
        return found

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self._block_pool = gpu_block_pool

    def has_pending_block_frees(self) -> bool:
        return bool(self._pinned)  # a save job's report will give blocks back: no need to preempt

    def _salted_chain(self, request: Request) -> KeyChain:
        lora = getattr(request, "lora_request", None)
        salt = request_salt(
            getattr(request, "cache_salt", None),
            lora.lora_name if lora is not None else None,
            [f.identifier for f in (getattr(request, "mm_features", None) or [])],
        )
        return self.chain if salt is None else self.chain.with_salt(salt)

    def _state(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            prompt = list(request.prompt_token_ids or [])
            keys = self._salted_chain(request).keys(prompt)[: self.max_blocks]  # prompt blocks only, capped
            state = _RequestState(keys, len(prompt))
            self._requests[request.request_id] = state
        if self._events is not None:
            state.request = request
        return state

    def on_new_request(self, request: Request) -> None:
        """vLLM added a request (it may wait in the queue for many steps): a prefetch candidate."""
        if self.prefetch:
            self._arrived.append(request)

    def _prefetch_meta(self, meta: KVOffloadMetadata, scheduled) -> None:
        """Requests that arrived and were not scheduled in this step wait in vLLM's queue: the workers
        promote their stored prefix into memory meanwhile (`prefetch`). A prefetch ends when its
        request is scheduled or its load goes out (the load takes over), or when it leaves."""
        meta.prefetch_done = [r for r in self._prefetching if r in scheduled or r not in self._requests]
        self._prefetching.difference_update(meta.prefetch_done)
        arrived, self._arrived = self._arrived, []
        for request in arrived:
            if request.request_id in scheduled or getattr(request, "is_finished", lambda: False)():
                continue
            state = self._state(request)
            if state.load_failed or self._uncleared > 0:
                continue
            try:
                end = hit_blocks(self.layout, state.block_keys, state.num_prompt_tokens, self._present)
            except Exception as exc:  # noqa: BLE001 - a broken store: no prefetch; its lookup will say more
                log.debug("KVOffloadConnector prefetch lookup failed: %s", exc)
                continue
            if end > 0:
                meta.prefetches.append(PrefetchJob(request.request_id, state.block_keys[:end], end))
                self._prefetching.add(request.request_id)
                self.counters["prefetches"] += 1

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        state = self._state(request)
        # vLLM's own junction (a prefix its cache holds without the Mamba state there), in blocks
        state.junction = max(state.junction, (getattr(request, "shared_prefix_boundary", 0) or 0) // self.block_size)
        have = num_computed_tokens // self.block_size
        if num_computed_tokens % self.block_size or state.load_failed or self._uncleared > 0:
            return 0, False
        try:  # every TP rank's pages (the layout knows tp_size and which groups ranks share)
            total, junction = hit_and_junction(
                self.layout, state.block_keys, state.num_prompt_tokens, self._present, have
            )
            state.junction = max(state.junction, junction)
        except Exception as exc:  # noqa: BLE001 - a broken store is a miss, never a failed engine
            log.error("KVOffloadConnector lookup failed: %s", exc, exc_info=True)
            total = have
        self.counters["lookups"] += 1
        if total <= have:
            return 0, False
        state.load_range = (have, total)
        if self._events is not None:
            self._events.held(request, state.block_keys, range(have, total))
        self.counters["hit_tokens"] += (total - have) * self.block_size
        return (total - have) * self.block_size, True  # asynchronous: see kvoffload.connectors.vllm

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or state.load_range is None:
            return
        if num_external_tokens <= 0:
            state.load_range = None
            return
        state.load_tables = {g: list(ids) for g, ids in enumerate(blocks.get_block_ids())}
        self._loads_ready[request.request_id] = state

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVOffloadMetadata:
        meta = KVOffloadMetadata()
        ready, self._loads_ready = self._loads_ready, {}
        for req_id, state in ready.items():
            if self._requests.get(req_id) is state and state.load_range is not None and state.load_tables is not None:
                start, end = state.load_range
                meta.loads.append(LoadJob(req_id, state.block_keys[:end], start, end, state.load_tables))
                state.load_range = state.load_tables = None
                state.saved_blocks = max(state.saved_blocks, end)  # those pages are in the store
                state.loaded = (start, end)
        block_state = scheduler_output.kv_connector_block_state
        handoffs = block_state.boundary_state_offloads if block_state is not None else {}
        computed = self._num_computed(scheduler_output)
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            saving = self._requests.get(req_id)
            if saving is None:
                continue
            pages = self._save_pages(
                req_id, saving, scheduled, computed.get(req_id, 0), block_state, handoffs.get(req_id, ())
            )
            if pages:
                job = SaveJob(req_id, rank_free(saving.block_keys, pages))
                if self._events is not None and saving.request is not None:
                    self._events.saved(saving.request, saving.block_keys, [p.index for p in pages])
                self._pin(job, in_flight_keys(self.layout, saving.block_keys, pages))
                saving.sent_saves = True
                meta.saves.append(job)
        meta.await_saves, self._await_saves = self._await_saves, []
        meta.idle = not scheduler_output.num_scheduled_tokens
        if self._arrived or self._prefetching:
            self._prefetch_meta(meta, {*scheduler_output.num_scheduled_tokens, *(j.req_id for j in meta.loads)})
        meta.clear_store, self._clear_workers = self._resets if self._clear_workers else 0, False
        return meta

    def reset_cache(self) -> bool:
        """Clear the store for `reset_prefix_cache(reset_connector=True)`. Keys are digests, so a store
        is cleared whole, and only if no other namespace ever claimed it (`Store.clear`); not while a
        save is in flight (it would land after the clear). This process clears a persistent store now;
        workers clear their own copy (a memory tier, values still to be written behind, which could
        land after this clear) before the next step's loads and saves, and no lookup hits until every
        worker has reported doing so. False, with the reason logged, when nothing was cleared."""
        if self._pinned:
            log.warning(
                "KVOffloadConnector: reset_cache refused: %d save job(s) still in flight; retry once "
                "the engine is idle",
                len(self._pinned),
            )
            return False
        if not self._index.clear():
            return False
        if self._events is not None:
            self._events.cleared()
        # Live requests' saved pages are gone: save them again. `loaded` stays, so a boundary a load
        # wrote into (possibly failing later) is still never saved.
        for state in self._requests.values():
            state.saved_blocks = 0
        self._resets += 1
        self._clear_workers, self._uncleared = True, self._workers
        return True

    def _pin(self, job: SaveJob, keys: list[bytes]) -> None:
        """Reference the job's blocks in vLLM's pool until the workers report it (see kvoffload.connectors.vllm);
        `keys` (every rank's, `plan.in_flight_keys`) count as present for lookups meanwhile."""
        self._next_job += 1
        job.job_id = self._next_job
        blocks: list = []  # vLLM's KVCacheBlock objects
        if self._block_pool is not None:
            blocks = [self._block_pool.blocks[block_id] for _, _, _, block_id in job.pages]
            self._block_pool.touch(blocks)
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
        if pinned.blocks and self._block_pool is not None:
            self._block_pool.free_blocks(pinned.blocks)
        in_flight = self._in_flight
        for key in pinned.keys:  # a job's keys are distinct
            if in_flight[key] > 1:
                in_flight[key] -= 1
            else:
                del in_flight[key]

    def _save_pages(self, req_id, state, scheduled, computed, block_state, handoffs) -> list[Page]:
        """The request's pages to save this step (`plan.plan_save`): PAGED pages of the blocks it completed,
        the STATE checkpoints vLLM hands off that the retention policy keeps. A step that completes no
        block (a decode step) does not even ask for its block table."""
        full = min((computed + scheduled) // self.block_size, len(state.block_keys))
        if full <= state.saved_blocks and not handoffs:
            return []
        tables = block_state.get_block_ids(req_id) if block_state is not None and full > state.saved_blocks else None
        save = plan_save(
            self.layout,
            state.block_keys,
            full if tables is not None else state.saved_blocks,
            table=None if tables is None else dict(enumerate(tables)),
            start=state.saved_blocks,
            handoffs=handoffs,
            loaded=range(*state.loaded),
            keep=self.retention.keeper(self.layout, state.num_prompt_tokens, len(state.block_keys), state.junction),
        )
        if tables is not None:
            state.saved_blocks = full
        if save.not_retained:
            self.counters["checkpoints_not_retained"] += save.not_retained
        return save.pages

    @staticmethod
    def _num_computed(scheduler_output) -> dict[str, int]:
        """Computed tokens of every scheduled request, indexed once a step (not scanned per request)."""
        cached = scheduler_output.scheduled_cached_reqs
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens))
        computed.update((new.req_id, new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs)
        return computed

    def update_connector_output(self, connector_output) -> None:
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(report, StoredPages):
            self._uncleared -= report.cleared.get(self._resets, 0)
            dropped = self._index.apply(report)
            for job_id, count in report.done_jobs.items():
                self._unpin(job_id, count)
            if self._events is not None:  # a page missing at a load is gone, whatever the store says
                self._events.removed(report.missing | self._index.gone(dropped - report.missing))
                if report.done_jobs:
                    self._events.check()
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
