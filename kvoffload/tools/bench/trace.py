"""Cache policies on a trace: which blocks are worth storing, measured on a workload, not guessed.

A seeded synthetic workload (`workload`): multi-turn chat sessions that grow their prefix behind one
shared system prompt, agent loops that re-send a long context with a growing scratchpad, and one-off long
documents, with Poisson arrivals. Blocks and page sizes are GLM-5.3-Flash's at the block vLLM gives it
(4352 tokens at TP1: a 50 MB MLA page and a 148 MB KDA checkpoint per block). The trace is replayed in
arrival order against real stores (`tiered://` memory in front of LMDB, a new store per policy): every
request looks up its longest stored prefix (`plan.hit_blocks`), reads it (a disk hit is promoted into
memory; a memory hit counts towards admission), then saves the pages of the blocks it computed, with a
checkpoint at the block boundaries its KDA checkpoint retention policy keeps (`connectors.retention`;
vLLM hands one off at every boundary with a retention interval of one block, and the connector keeps
those the policy names): at every boundary in the baseline rows, fewer in the retention rows.

Stored values are the model's page sizes divided by SCALE, and so are the tier capacities: hit rates,
evictions and admission decisions are the model's; bytes are reported at model size. The time to first
token saved is modelled per request: the prefill of its hit tokens (PREFILL_TOKENS_PER_S, an assumption:
change it with your own measurement) minus the time to move the hit bytes from memory over the link
(LINK_GBPS, measured on the H200 machine by `bench datapath`) and from disk (a raw sequential read on this
machine, measured in the same run, page cache dropped for the file). Baselines in the same run: no
offload, memory only, and store-everything LRU (`admit=1`), each tier set-up with a roomy disk and with
one under pressure. The memory tier's eviction policy is LRU, and S3-FIFO (`evict=s3fifo`) beside it; the
disk's is LRU, and S3-FIFO (`lmdb_evict=s3fifo`) for the disk under pressure.

Queueing and prefetch: one modelled engine serves requests one at a time in arrival order (prefill of
the tokens it did not hit, plus moving the hit bytes); a request arriving while it is busy waits, and
its time to first token (`ttft_s_mean`) includes the wait. A prefetch policy promotes, during that wait,
the disk-only pages of the request's stored prefix into memory, as many as the wait at disk speed
allows (the vLLM connector's prefetch), so its load reads them from memory.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from ...connectors.plan import hit_and_junction, hit_blocks, pages_for_load, pages_for_save
from ...connectors.retention import EVERY, StateRetention
from ...spec import KeyChain
from ...store import Store, open_store
from ...store.tiered import TieredStore
from .common import machine

SCALE = 8192  # stored bytes = model bytes / SCALE (capacities too)
PREFILL_TOKENS_PER_S = 8000.0  # assumption: GLM-5.3-Flash prefill on one H200; see the module docstring
LINK_GBPS = 52.5  # host -> device through the memory tier, H200 machine (BENCHMARKS.md, bench datapath)
MEMORY_CAPACITY = 64 << 30  # model bytes of host memory for KV (one GPU's share)
DISK_CAPACITIES = (1 << 40, 256 << 30)  # model bytes of local disk for KV: roomy, then under pressure
# (name, disk capacity or None: memory only, admit, memory eviction[, per-request cap, prefetch, disk
# eviction, KDA checkpoint retention]); "no offload" stores nothing
CAP_BLOCKS = 8  # the per-request cap tried (vLLM connector: max_saved_blocks)
RETENTIONS = ("last", "last+junction", "last+every:4", "last+exp", "last+backexp", "last+exp+backexp")  # beside `every`
PolicyRow = tuple[str, int | None, int | None, str, *tuple[Any, ...]]  # _Replay's arguments (a tail may be left out)
POLICIES: tuple[PolicyRow, ...] = (
    ("no offload", None, None, "lru"),
    ("memory only, LRU", None, 1, "lru"),
    ("memory only, S3-FIFO", None, 1, "s3fifo"),
    *(
        (
            f"memory + disk {d >> 30} GiB, {'store everything' if a == 1 else f'admit={a}'}"
            f"{', S3-FIFO memory' if e == 's3fifo' else ''}",
            d,
            a,
            e,
        )
        for d in DISK_CAPACITIES
        for a in (1, 2, 3)
        for e in ("lru", "s3fifo")
        if e == "lru" or a < 3
    ),
    *(
        (f"memory + disk {d >> 30} GiB, store everything, cap {CAP_BLOCKS} blocks", d, 1, "lru", CAP_BLOCKS)
        for d in DISK_CAPACITIES
    ),
    *((f"memory + disk {d >> 30} GiB, store everything, prefetch", d, 1, "lru", None, True) for d in DISK_CAPACITIES),
    (
        f"memory + disk {DISK_CAPACITIES[-1] >> 30} GiB, store everything, S3-FIFO disk",
        DISK_CAPACITIES[-1],
        1,
        "lru",
        None,
        False,
        "s3fifo",
    ),
    *(
        (
            f"memory + disk {d >> 30} GiB, store everything, checkpoints {r}",
            d,
            1,
            "lru",
            None,
            False,
            "lru",
            StateRetention.parse(r),
        )
        for d in DISK_CAPACITIES
        for r in RETENTIONS
    ),
)


@dataclass(frozen=True)
class Request:
    arrival: float  # seconds from the start of the trace
    kind: str  # chat, agent, document
    tokens: np.ndarray


def _segment(rng: np.random.Generator, n: int | np.integer) -> np.ndarray:
    return rng.integers(3, 150_000, int(n), dtype=np.int64)


def workload(
    seed: int = 0,
    *,
    chats: int = 160,
    agents: int = 32,
    documents: int = 120,
    system_tokens: int = 6000,
    duration_s: float = 4 * 3600.0,
) -> list[Request]:
    """The trace, sorted by arrival. Session starts are uniform over `duration_s`; turns follow each
    other after exponential think times (chat 60 s, agent 10 s), except that a session sometimes comes
    back much later (a user after lunch, an agent resumed: 20% / 10% of turns, 40 / 30 min on average),
    when its prefix may have left host memory."""
    rng = np.random.default_rng(seed)

    def pause(short: float, long_share: float, long: float) -> float:
        return rng.exponential(long if rng.random() < long_share else short)

    system = _segment(rng, system_tokens)
    out: list[Request] = []
    for _ in range(chats):
        at, history = rng.uniform(0, duration_s), system
        for _ in range(int(rng.integers(3, 13))):
            prompt = np.concatenate([history, _segment(rng, rng.integers(200, 2000))])
            out.append(Request(at, "chat", prompt))
            history = np.concatenate([prompt, _segment(rng, rng.integers(200, 1500))])  # the reply
            at += pause(60.0, 0.2, 2400.0)
    for _ in range(agents):
        at = rng.uniform(0, duration_s)
        context = np.concatenate([system, _segment(rng, rng.integers(20_000, 60_000))])
        for _ in range(int(rng.integers(5, 21))):
            context = np.concatenate([context, _segment(rng, rng.integers(1000, 5000))])  # a tool result
            out.append(Request(at, "agent", context))
            at += pause(10.0, 0.1, 1800.0)
    for _ in range(documents):
        out.append(
            Request(
                rng.uniform(0, duration_s),
                "document",
                np.concatenate([_segment(rng, rng.integers(20_000, 100_000)), _segment(rng, 100)]),
            )
        )
    return sorted(out, key=lambda r: r.arrival)


def glm_layout(block_size: int | None = None):
    """GLM-5.3-Flash's cache layout (TP1) at vLLM's block size (or `block_size`)."""
    from glm_integration.cache import PagedCache
    from glm_integration.config import preset

    from .footprint import vllm_block_size

    config = preset("full")
    return PagedCache(config, block_size or vllm_block_size(config), 1, index_format="fp8", device="meta").layout


def _raw_disk_read_gbps(tmp: str, nbytes: int) -> float:
    from .datapath import _raw_read, _raw_write

    _raw_write(tmp, nbytes)
    seconds = _raw_read(tmp, nbytes)
    os.unlink(os.path.join(tmp, "raw.bin"))
    return nbytes / seconds / 1e9


class _Replay:
    """One policy's run over the trace: a fresh store, counters at model size."""

    def __init__(
        self,
        layout,
        disk: int | None,
        admit: int | None,
        evict: str,
        directory: str,
        disk_gbps: float,
        cap: int | None = None,
        prefetch: bool = False,
        disk_evict: str = "lru",
        retention: StateRetention = EVERY,
    ):
        self.cap = cap  # a request's keys stop after this many blocks: nothing beyond is saved or hit
        self.retention = retention  # the block boundaries whose KDA checkpoint is saved
        self.prefetch, self.disk_gbps, self.free_at = prefetch, disk_gbps, 0.0
        self.layout, self.admit, self.disk, self.evict, self.disk_evict = layout, admit, disk, evict, disk_evict
        self.size = {g.name: -(-g.used_bytes_per_block // SCALE) for g in layout.cacheable_groups}
        self.payload = bytes(max(self.size.values()))
        self.totals = dict.fromkeys(
            ("prompt_tokens", "hit_tokens", "memory_read_bytes", "disk_read_bytes", "memory_written_bytes"), 0
        )
        # (hit tokens, memory bytes, disk bytes, queue wait s, time to first token s)
        self.per_request: list[tuple[int, int, int, float, float]] = []
        self.store: Store | None = None  # None: no offload
        self.front: Store | None = None  # the memory tier: the store itself, or the tiered store's front
        self.tiered: TieredStore | None = None  # the store, when it has a disk tier
        if admit is not None and disk is None:
            self.store = self.front = open_store(
                f"memory://?capacity={MEMORY_CAPACITY // SCALE}&pinned=false&evict={evict}"
            )
        elif admit is not None and disk is not None:
            tiered = open_store(
                f"tiered://?memory={MEMORY_CAPACITY // SCALE}&lmdb={directory}"
                f"&lmdb_capacity={disk // SCALE}&pinned=false&admit={admit}&evict={evict}"
                f"&lmdb_evict={disk_evict}"
            )
            if not isinstance(tiered, TieredStore):
                raise TypeError(f"a tiered:// URL opened a {type(tiered).__name__}")
            self.store, self.front, self.tiered = tiered, tiered.front, tiered

    def _model_bytes(self, pages) -> int:
        """Model bytes as the stores count them: stored bytes times SCALE (over by < SCALE per page)."""
        return sum(self.size[p.group.name] for p in pages) * SCALE

    def request(self, all_keys: list[bytes], num_tokens: int, arrival: float) -> None:
        """One request arriving at `arrival`: it waits while the modelled engine is busy (one request
        at a time: its prefill of what it did not hit, plus moving what it hit), prefetching meanwhile
        (a prefetch policy), then looks up, reads and saves."""
        self.totals["prompt_tokens"] += num_tokens
        start = max(arrival, self.free_at)
        store, front = self.store, self.front
        if store is None or front is None:  # both or neither
            self._served(arrival, start, num_tokens, 0, 0, 0)
            return
        keys = all_keys[: self.cap]
        if self.prefetch and start > arrival:
            self._prefetch(store, front, keys, num_tokens, start - arrival)
        hit, junction = hit_and_junction(self.layout, keys, num_tokens, store.contains_many)
        memory = disk = 0
        if hit:
            pages = pages_for_load(self.layout, keys, 0, hit)
            in_memory = front.contains_many([p.key for p in pages])
            memory = self._model_bytes(p for p, there in zip(pages, in_memory) if there)
            disk = self._model_bytes(pages) - memory
            served = store.read_many([p.key for p in pages], lambda i, view: None)
            assert all(served), "a page present a moment ago was not served"
        self._served(arrival, start, num_tokens, hit * self.layout.block_size, memory, disk)
        self.totals["hit_tokens"] += hit * self.layout.block_size
        self.totals["memory_read_bytes"] += memory
        self.totals["disk_read_bytes"] += disk
        full = len(keys)
        checkpoints = self.retention.state_blocks(self.layout, num_tokens, range(full), full, junction)
        save = [p for p in pages_for_save(self.layout, keys, full, checkpoints) if p.index >= hit]
        todo = [p for p, there in zip(save, store.contains_many([p.key for p in save])) if not there]
        stored = store.put_many([(p.key, memoryview(self.payload)[: self.size[p.group.name]]) for p in todo])
        self.totals["memory_written_bytes"] += self._model_bytes(p for p, ok in zip(todo, stored) if ok)
        if self.tiered is not None:
            self.tiered.flush()  # the trace's think times are longer than any write-behind delay

    def _served(self, arrival: float, start: float, num_tokens: int, hit_tokens: int, memory: int, disk: int) -> None:
        move = memory / (LINK_GBPS * 1e9) + disk / (self.disk_gbps * 1e9)
        self.free_at = start + (num_tokens - hit_tokens) / PREFILL_TOKENS_PER_S + move
        self.per_request.append((hit_tokens, memory, disk, start - arrival, self.free_at - arrival))

    def _prefetch(self, store: Store, front: Store, keys: list[bytes], num_tokens: int, wait: float) -> None:
        """What the connector's prefetch does for a queued request: the stored prefix's pages that only
        the disk holds, promoted into memory in order, as far as the wait at disk speed (and the
        prefetch budget, a quarter of memory) allows."""
        end = hit_blocks(self.layout, keys, num_tokens, store.contains_many)
        pages = pages_for_load(self.layout, keys, 0, end)
        budget = min(wait * self.disk_gbps * 1e9, MEMORY_CAPACITY / 4)
        chosen = []
        for p, there in zip(pages, front.contains_many([p.key for p in pages])):
            cost = self.size[p.group.name] * SCALE
            if there:
                continue
            if cost > budget:
                break
            budget -= cost
            chosen.append(p.key)
        store.prefetch(chosen)

    def result(self, name: str) -> dict:
        saved = [
            hit / PREFILL_TOKENS_PER_S - memory / (LINK_GBPS * 1e9) - disk / (self.disk_gbps * 1e9)
            for hit, memory, disk, _, _ in self.per_request
        ]
        waits = [wait for *_, wait, _ in self.per_request]
        stats = self.store.stats() if self.store is not None else {}
        row = {
            "policy": name,
            "admit": self.admit,
            "disk_capacity": self.disk,
            "evict": self.evict,
            "disk_evict": self.disk_evict if self.disk else None,
            "max_saved_blocks": self.cap,
            "prefetch": self.prefetch,
            "state_retention": str(self.retention),
            **self.totals,
            "hit_rate_tokens": round(self.totals["hit_tokens"] / self.totals["prompt_tokens"], 4),
            "disk_written_bytes": int(stats.get("behind_written_bytes", 0)) * SCALE,
            # a request's pages beyond behind_bytes (half the memory tier) stay in memory only
            "disk_dropped_bytes": int(stats.get("behind_dropped_bytes", 0)) * SCALE,
            "disk_evictions": int(stats.get("disk_evictions", 0)) if self.disk else 0,
            "memory_evictions": int(stats.get("memory_evictions" if self.disk else "evictions", 0)),
            "prefetched_bytes": int(stats.get("prefetched_bytes", 0)) * SCALE,
            "queued_requests": sum(1 for wait in waits if wait > 0),
            "queue_wait_s_mean": round(sum(waits) / len(waits), 3),
            "ttft_s_mean": round(sum(ttft for *_, ttft in self.per_request) / len(self.per_request), 3),
            "ttft_saved_s_total": round(sum(saved), 2),
            "ttft_saved_s_mean": round(sum(saved) / len(saved), 3),
        }
        if self.store is not None:
            self.store.close()
        return row


def run(quick: bool = False, progress=None, seed: int = 0) -> dict:
    say = progress or (lambda message: None)
    sizes = dict(chats=6, agents=2, documents=6, system_tokens=3000) if quick else {}
    trace = workload(seed, **sizes)
    layout = glm_layout(1088 if quick else None)  # quick: a quarter of vLLM's block, same page sizes per token
    chain = KeyChain(layout.fingerprint, layout.block_size, namespace="trace")
    kinds = {kind: sum(1 for r in trace if r.kind == kind) for kind in ("chat", "agent", "document")}
    say(
        f"[bench trace] {len(trace)} requests ({kinds}), {sum(len(r.tokens) for r in trace):,} prompt tokens, "
        f"block {layout.block_size}, {layout.stored_bytes_per_block() / 1e6:.0f} MB stored per block"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvoffload-trace-") as tmp:
        disk_gbps = _raw_disk_read_gbps(tmp, (64 << 20) if quick else (1 << 30))
        say(f"[bench trace] raw sequential disk read here: {disk_gbps:.2f} GB/s")
        # once: every policy replays the same keys (keys() takes the token array as it is: np.asarray)
        keys = [chain.keys(cast(Sequence[int], request.tokens)) for request in trace]
        for n, (name, disk, admit, evict, *extra) in enumerate(POLICIES):
            replay = _Replay(layout, disk, admit, evict, os.path.join(tmp, f"store-{n}"), disk_gbps, *extra)
            started = time.perf_counter()
            for i, request in enumerate(trace):
                replay.request(keys[i], len(request.tokens), request.arrival)
                if (i + 1) % 100 == 0:
                    say(f"[bench trace] {name}: {i + 1}/{len(trace)} requests")
            rows.append(replay.result(name))
            row = rows[-1]
            say(
                f"[bench trace] {name}: hit rate {row['hit_rate_tokens']:.1%}, disk written "
                f"{row['disk_written_bytes'] / 1e12:.2f} TB, TTFT saved {row['ttft_saved_s_mean']:.2f} s per request, "
                f"TTFT {row['ttft_s_mean']:.2f} s with queueing "
                f"({time.perf_counter() - started:.0f} s)"
            )
    return {
        "benchmark": "trace",
        "quick": quick,
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "seed": seed,
        "requests": len(trace),
        "by_kind": kinds,
        "block_size": layout.block_size,
        "stored_bytes_per_block": layout.stored_bytes_per_block(),
        "scale": SCALE,
        "memory_capacity": MEMORY_CAPACITY,
        "prefill_tokens_per_s": PREFILL_TOKENS_PER_S,
        "link_GBps": LINK_GBPS,
        "disk_read_GBps_measured": round(disk_gbps, 3),
        "results": rows,
    }
