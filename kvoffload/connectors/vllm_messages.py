"""What `KVOffloadConnector`'s scheduler side and worker side exchange (see `kvoffload.connectors.vllm`):
the step's jobs (scheduler -> workers) and the workers' reports (workers -> scheduler)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


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
    # (block key, group index, block index, physical block id): plain tuples, compact on vLLM's pickled
    # scheduler -> worker channel; each worker turns them into its own rank's `plan.Page`s on arrival.
    pages: list[tuple[bytes, int, int, int]]
    job_id: int = 0  # the scheduler's: reported back when the job is done, to unpin its blocks


@dataclass
class PrefetchJob:
    """A queued request's stored prefix, blocks [0, end): promote it into the workers' memory tier."""

    req_id: str
    block_keys: list[bytes]
    end: int


@dataclass
class KVOffloadMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    prefetches: list[PrefetchJob] = field(default_factory=list)
    prefetch_done: list[str] = field(default_factory=list)  # scheduled or gone: their prefetch ends
    saves: list[SaveJob] = field(default_factory=list)
    await_saves: list[str] = field(default_factory=list)  # finished requests to report via finished_sending
    clear_store: int = 0  # a reset's generation (reset_cache; 0: none): workers clear their own copy
    idle: bool = False  # no token scheduled in this step: a worker may wait briefly for its jobs


@dataclass
class StoredPages(KVConnectorWorkerMetadata):
    """Worker -> scheduler, every step: pages written (key -> bytes), pages a load did not find, and
    save jobs done (job id -> number of workers reporting it), workers that cleared their store, and
    (only while KV events are enabled) pages the store evicted. The scheduler mirrors a memory store
    with it, since that store lives in the worker process, unpins a job's blocks once every worker has
    reported it, serves no hit after a reset until every worker has cleared its own copy, and reports
    evicted pages' blocks as removed."""

    added: dict[bytes, int] = field(default_factory=dict)
    missing: set[bytes] = field(default_factory=set)
    done_jobs: dict[int, int] = field(default_factory=dict)
    cleared: dict[int, int] = field(default_factory=dict)  # reset generation -> workers that cleared for it
    evicted: set[bytes] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> StoredPages:
        if not isinstance(other, StoredPages):  # every worker of an engine runs this connector
            raise TypeError(f"StoredPages cannot aggregate {type(other).__name__}")
        done = dict(self.done_jobs)
        for job, count in other.done_jobs.items():
            done[job] = done.get(job, 0) + count
        cleared = dict(self.cleared)
        for generation, count in other.cleared.items():
            cleared[generation] = cleared.get(generation, 0) + count
        return StoredPages(
            {**self.added, **other.added}, self.missing | other.missing, done, cleared, self.evicted | other.evicted
        )
