"""Tensor parallelism: a group every rank holds identically (the MLA latent and the DSA indexer rows,
replicated on all ranks) is stored once per TP group under a key all ranks share; a group each rank
holds its own shard of (KDA heads) keeps one key per rank; a hit needs the shared pages and every
rank's own. Checked on vLLM's GLM-5.3-Flash-like spec stack at TP 2/4/8 through the connector's worker
side, and on the bundled runner's cache sharded the same way."""

from __future__ import annotations

import pytest
import torch

from kvoffload.connectors.offloader import Offloader
from kvoffload.connectors.plan import hit_blocks, page, pages_for_save
from kvoffload.connectors.transfer import make_transfer
from kvoffload.spec import GroupKind, KeyChain, shard_key
from kvoffload.store import open_store

BLOCKS = 3


def _fill(raws, layouts, seed=0):
    """Random bytes per rank, then a replicated group's pages made equal to rank 0's (what TP gives)."""
    g = torch.Generator().manual_seed(seed)
    for raw in raws:
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    for group in layouts[0].cacheable_groups:
        for rank, raw in enumerate(raws):
            first = rank - rank % group.tp_replicas
            for region in group.regions:
                for layer in range(region.num_layers):
                    for block in range(layouts[0].num_blocks):
                        at = region.page_offset(layer, block)
                        raw[at:at + region.used_bytes] = raws[first][at:at + region.used_bytes]


def _pages_bytes(raw, layout, table):
    """Every cacheable group's used bytes of blocks `table` (the state only at the last)."""
    out = []
    for group in layout.cacheable_groups:
        blocks = table if group.kind is GroupKind.PAGED else table[-1:]
        for region in group.regions:
            for layer in range(region.num_layers):
                for block in blocks:
                    at = region.page_offset(layer, block)
                    out.append(raw[at:at + region.used_bytes].clone())
    return out


def _check_store_once_per_tp_group(store, layouts, keys, tp):
    """Shared pages once, each rank's own pages once per rank; then the hit rule over all ranks."""
    layout0 = layouts[0]
    shared = [g for g in layout0.cacheable_groups if g.tp_replicas == tp]
    own = [g for g in layout0.cacheable_groups if g.tp_replicas == 1]
    assert shared and own
    for g in shared:  # one key for every rank, present; no per-rank copy
        assert {page(lay, keys[0], g, 0).key for lay in layouts} == {page(layout0, keys[0], g, 0).key}
        assert all(store.contains_many([page(layout0, k, g, i).key for i, k in enumerate(keys)]))
        assert not any(store.contains_many([shard_key(k, 1, tp) for k in keys]))
    for g in own:  # one key per rank, each present
        rank_keys = {page(lay, keys[-1], g, BLOCKS - 1).key for lay in layouts}
        assert len(rank_keys) == tp and all(store.contains_many(sorted(rank_keys)))
    prompt = BLOCKS * layout0.block_size + 1
    assert hit_blocks(layout0, keys, prompt, store.contains_many) == BLOCKS
    # A hit needs every rank's own checkpoint, and the shared pages.
    state = next(g for g in own if g.kind is GroupKind.STATE)
    store.delete(page(layouts[-1], keys[-1], state, BLOCKS - 1).key)
    assert hit_blocks(layout0, keys, prompt, store.contains_many) == 0


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_vllm_glm_stack_stores_replicated_groups_once_per_tp_group(tmp_path, tp):
    pytest.importorskip("vllm.distributed")
    from support import vllm_layouts

    from kvoffload.connectors.vllm_messages import KVOffloadMetadata, LoadJob, SaveJob
    from kvoffload.connectors.vllm_config import ConnectorConfig
    from kvoffload.connectors.vllm_worker import _Worker
    from kvoffload.spec.vllm import check_agreement, from_vllm, scheduler_view
    from kvoffload.store import shared_store
    from vllm.v1.kv_cache_interface import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    cfg = vllm_layouts.glm53_flash_like_config(kda_num_heads=8 // tp)
    view = scheduler_view(cfg, tp_size=tp)
    assert [g.tp_replicas for g in view.cacheable_groups] == [1, 1, 1, tp]  # KDA x3 per rank, MLA + indexer shared
    private = scheduler_view(cfg, tp_size=tp, share_replicas=False)
    assert {g.tp_replicas for g in private.cacheable_groups} == {1}  # memory://: each rank's store is its own
    layouts = [from_vllm(cfg, model_id="m", tp_rank=r, tp_size=tp) for r in range(tp)]
    for layout in layouts:
        check_agreement(view, layout)
    assert len({layout.fingerprint for layout in layouts}) == 1

    url = f"lmdb://{tmp_path}/store?capacity=256MiB"
    keys = KeyChain(b"tp-test", view.block_size).keys(list(range(BLOCKS * view.block_size + 5)))
    table = {g: [1 + i for i in range(BLOCKS)] for g in range(len(view.kinds))}
    pages = [(keys[i], g.index, i, table[g.index][i]) for g in view.cacheable_groups
             for i in (range(BLOCKS) if g.kind is GroupKind.PAGED else [BLOCKS - 1])]

    def workers():
        out = []
        for rank in range(tp):
            worker = _Worker(cfg, view, ConnectorConfig(store=url), "m", rank, tp)
            caches = allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout[cfg.kv_cache_layout])
            worker.register_kv_caches(caches)
            any_cache = next(iter(caches.values()))
            out.append((worker, torch.empty(0, dtype=torch.uint8).set_(any_cache.untyped_storage())))
        return out

    savers = workers()
    _fill([raw for _, raw in savers], layouts)
    before = [_pages_bytes(raw, layouts[r], table[0]) for r, (_, raw) in enumerate(savers)]
    meta = KVOffloadMetadata(saves=[SaveJob("r", pages, job_id=1)])
    for worker, _ in savers:
        worker.wait_for_save(meta)
        assert worker.jobs.drain(timeout=60)
        done = worker.get_transfer_results(set())
        assert worker.build_connector_worker_meta().done_jobs == {1: 1}, done
    store = shared_store(url)
    _check_store_once_per_tp_group(store, layouts, keys, tp)

    # Put the deleted checkpoint back (save again from that rank), then load into fresh caches.
    savers[-1][0].wait_for_save(meta)
    assert savers[-1][0].jobs.drain(timeout=60)
    for worker, _ in savers:
        worker.shutdown()
    loaders = workers()
    load = KVOffloadMetadata(loads=[LoadJob("r", keys, 0, BLOCKS, table)])
    for rank, (worker, raw) in enumerate(loaders):
        raw.zero_()
        worker.start_load_kv(load)
        assert worker.jobs.drain(timeout=60)
        results = worker.get_transfer_results(set())
        assert results.finished_recving == {"r"} and not results.failed_recving
        after = _pages_bytes(raw, layouts[rank], table[0])
        assert all(torch.equal(a, b) for a, b in zip(before[rank], after)), f"rank {rank}: pages differ"
        worker.shutdown()


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_runner_cache_sharded_like_vllm_stores_the_mla_group_once(tmp_path, tp):
    from glm_integration.cache import PagedCache
    from glm_integration.config import preset

    config = preset("tiny")
    config = config.replace(linear_num_heads=tp * max(1, config.linear_num_heads // tp))
    per_rank = config.replace(linear_num_heads=config.linear_num_heads // tp)
    caches = [PagedCache(per_rank, 16, BLOCKS + 1, tp_rank=r, tp_size=tp) for r in range(tp)]
    layouts = [c.layout for c in caches]
    assert {g.name: g.tp_replicas for g in layouts[0].cacheable_groups}["mla"] == tp
    assert {g.tp_replicas for g in layouts[0].cacheable_groups if g.kind is GroupKind.STATE} == {1}
    assert len({layout.fingerprint for layout in layouts}) == 1
    keys = KeyChain(layouts[0].fingerprint, 16).keys(list(range(BLOCKS * 16 + 3)))
    table = list(range(BLOCKS))
    _fill([c.buffer for c in caches], layouts)
    before = [_pages_bytes(c.buffer, c.layout, table) for c in caches]
    with open_store(f"lmdb://{tmp_path}/store?capacity=64MiB", fingerprint=layouts[0].fingerprint) as store:
        for cache in caches:
            assert len(pages_for_save(cache.layout, keys, BLOCKS, [BLOCKS - 1])) == (
                (BLOCKS if cache.tp_rank == 0 else 0) + len(cache.kda_groups))
            Offloader(store, cache.layout, make_transfer(cache.buffer)).save(keys, BLOCKS, [BLOCKS - 1], table)
        _check_store_once_per_tp_group(store, layouts, keys, tp)
        Offloader(store, layouts[-1], make_transfer(caches[-1].buffer)).save(keys, BLOCKS, [BLOCKS - 1], table)
        for rank, cache in enumerate(caches):
            cache.buffer.zero_()
            assert Offloader(store, cache.layout, make_transfer(cache.buffer)).load(keys, 0, BLOCKS, table)
            after = _pages_bytes(cache.buffer, cache.layout, table)
            assert all(torch.equal(a, b) for a, b in zip(before[rank], after)), f"rank {rank}: pages differ"
