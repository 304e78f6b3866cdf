"""KV cache events (`kvoffload.connectors.vllm_events`) through vLLM's real Scheduler on the GLM spec stack:
the batches vLLM's publisher receives carry BlockStored for the blocks the store holds (vLLM's hashes,
chained by parent), BlockRemoved for pages a load found missing, pages evicted (from the scheduler's
mirror, or by LMDB in the worker) and on reset; nothing when events are off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.distributed")

from test_vllm_scheduler_glm import BLOCK, _Engine, _glm_vllm_config, _prompt  # noqa: E402

from kvoffload.connectors.plan import page_key  # noqa: E402
from kvoffload.spec import GroupKind  # noqa: E402
from kvoffload.spec.vllm import group_name  # noqa: E402


def _engine(tmp_path, events: bool, memory: str | None = None, capacity: str = "256MiB", worker: bool = False):
    """The GLM harness with the worker's writes simulated: into LMDB (of `capacity`), or (`memory`: a URL
    whose memory tier the scheduler mirrors, memory:// or tiered:// with admit > 1) reported to the
    scheduler's mirror as `StoredPages.added`, 100 bytes a page, with the jobs. `worker`: a real worker
    side on the LMDB store too (`engine.worker`), whose report joins the step's, as vLLM aggregates the
    workers' (it hears the store's evictions when events are enabled)."""
    from vllm.config.kv_events import KVEventsConfig

    from kvoffload.connectors.vllm import StoredPages
    from kvoffload.store import shared_store

    url = memory or f"lmdb://{tmp_path}/store?capacity={capacity}"
    # every boundary's checkpoint saved (not the default retention): the events of each held block are checked
    vc, worker_cfg = _glm_vllm_config(BLOCK, url, state_retention="every")
    if events:
        vc.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    engine = _Engine(vc, worker_cfg)
    engine.worker = None
    if worker:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kvoffload.connectors.vllm import KVOffloadConnector
        from test_vllm_scheduler_glm import _glm_kv_caches

        engine.worker = KVOffloadConnector(vc, KVConnectorRole.WORKER, worker_cfg)
        engine.worker.register_kv_caches(_glm_kv_caches(worker_cfg))  # reopens the store with its fingerprint
    kinds = engine.connector.kinds
    build = engine.connector.build_connector_meta  # our connector's KVConnector API method (recording too)
    written: list[bytes] = []

    def build_and_write(scheduler_output):  # the worker's part: the job's pages land in the store
        meta = build(scheduler_output)
        written.extend(page_key(key, group_name(g, kinds[g])) for job in meta.saves for key, g, _, _ in job.pages)
        if not memory:  # asked for at each use, as the scheduler does
            assert all(shared_store(url).put_many([(key, b"page") for key in written]))
            written.clear()
        return meta

    engine.connector.build_connector_meta = build_and_write
    scheduler = engine.connector.connector_scheduler
    update = scheduler.update_connector_output

    def update_with_added(output):  # a memory store's writes reach the scheduler in the workers' report
        if isinstance(getattr(output, "kv_connector_worker_meta", None), StoredPages):
            output.kv_connector_worker_meta.added.update((key, 100) for key in written)
            written.clear()
            if engine.worker is not None and (more := engine.worker.build_connector_worker_meta()) is not None:
                output.kv_connector_worker_meta = output.kv_connector_worker_meta.aggregate(more)
        update(output)

    scheduler.update_connector_output = update_with_added
    batches = []
    engine.scheduler.kv_event_publisher.publish = batches.append  # what vLLM's publisher is handed
    return engine, batches


def _ours(batches, kind):
    return [e for b in batches for e in b.events if type(e).__name__ == kind and e.medium == "STORAGE"]


def test_saved_blocks_are_published_with_vllms_hashes_and_removed(tmp_path):
    engine, batches = _engine(tmp_path, events=True)
    prompt = _prompt(3)
    request = engine.add("r", prompt)
    engine.run()
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as vllm_hash  # what vLLM's own events carry

    hashes = [vllm_hash(h) for h in request.block_hashes]
    kinds = engine.connector.kinds
    saved = {(g, index) for step in engine.steps for job in step["meta"].saves for _, g, index, _ in job.pages}
    needed = [g for g, k in enumerate(kinds) if k in (GroupKind.PAGED, GroupKind.STATE)]
    held = [i for i in range(len(prompt) // BLOCK) if all((g, i) in saved for g in needed)]
    assert held == [0, 1, 2]  # align mode hands a KDA checkpoint off at every boundary here
    stored = _ours(batches, "BlockStored")
    assert [e.block_hashes for e in stored] == [[hashes[i]] for i in held]  # once each
    for i, event in zip(held, stored):
        assert event.token_ids == prompt[i * BLOCK:(i + 1) * BLOCK]
        assert event.block_size == BLOCK and event.lora_id is None and event.group_idx is None
        assert event.parent_block_hash == (hashes[i - 1] if i else None)
    # A load that found one of block 1's pages missing: block 1 is no longer held.
    scheduler = engine.connector.connector_scheduler
    lost = page_key(engine.connector.chain.keys(prompt)[1], group_name(needed[0], kinds[needed[0]]))
    from kvoffload.connectors.vllm import StoredPages

    scheduler.update_connector_output(SimpleNamespace(kv_connector_worker_meta=StoredPages(missing={lost}),
                                                      failed_recving=None))
    removed = list(engine.connector.take_events())
    assert [(type(e).__name__, e.block_hashes, e.medium) for e in removed] == [
        ("BlockRemoved", [hashes[1]], "STORAGE")]
    # reset_cache: the blocks still announced are removed.
    assert engine.connector.reset_cache() is True
    removed = list(engine.connector.take_events())
    assert [(type(e).__name__, sorted(e.block_hashes)) for e in removed] == [
        ("BlockRemoved", sorted([hashes[0], hashes[2]]))]


def test_no_events_unless_vllm_publishes_them(tmp_path):
    engine, batches = _engine(tmp_path, events=False)
    engine.add("r", _prompt(3))
    engine.run()
    assert any(job.pages for step in engine.steps for job in step["meta"].saves)
    assert engine.connector.connector_scheduler._events is None
    assert list(engine.connector.take_events()) == []


def test_memory_mirror_evictions_are_published_as_removed(tmp_path):
    """A memory:// store (medium CPU): the scheduler's mirror evicts the oldest pages to stay within the
    capacity (10 pages of 100 bytes, a block needs 4): block 0 is removed when block 2 arrives."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as vllm_hash

    engine, batches = _engine(tmp_path, events=True, memory="memory://?capacity=1000")
    request = engine.add("r", _prompt(4))
    engine.run()
    hashes = [vllm_hash(h) for h in request.block_hashes]
    events = [(type(e).__name__, e.block_hashes, e.medium) for b in batches for e in b.events if e.medium == "CPU"]
    assert events == [("BlockStored", [hashes[0]], "CPU"), ("BlockStored", [hashes[1]], "CPU"),
                      ("BlockRemoved", [hashes[0]], "CPU"), ("BlockStored", [hashes[2]], "CPU")]


def test_tiered_memory_evictions_are_removed_unless_on_disk(tmp_path):
    """tiered:// with admit=2 (medium STORAGE): the scheduler mirrors the workers' memory tier, as for
    memory:// above; a page that tier evicts is gone unless the disk tier holds it."""
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as vllm_hash

    from kvoffload.connectors.vllm import StoredPages
    from kvoffload.store import shared_store

    url = f"tiered://?memory=1000&lmdb={tmp_path}/db&lmdb_capacity=1MiB&admit=2"
    engine, batches = _engine(tmp_path, events=True, memory=url)
    request = engine.add("r", _prompt(4))
    engine.run()
    hashes = [vllm_hash(h) for h in request.block_hashes]
    events = [(type(e).__name__, e.block_hashes) for b in batches for e in b.events if e.medium == "STORAGE"]
    assert events == [("BlockStored", [hashes[0]]), ("BlockStored", [hashes[1]]), ("BlockRemoved", [hashes[0]]),
                      ("BlockStored", [hashes[2]])]
    kinds = engine.connector.kinds
    block_1 = [page_key(key, group_name(g, kinds[g])) for step in engine.steps for job in step["meta"].saves
               for key, g, index, _ in job.pages if index == 1]
    assert all(shared_store(url).back.put_many([(key, b"page") for key in block_1]))  # admitted: on disk
    scheduler = engine.connector.connector_scheduler
    scheduler.update_connector_output(SimpleNamespace(  # 10 more pages: the mirror lets blocks 1 and 2 go
        kv_connector_worker_meta=StoredPages(added={b"other%d" % i: 100 for i in range(10)}), failed_recving=None))
    assert [(type(e).__name__, e.block_hashes) for e in engine.connector.take_events()] == [
        ("BlockRemoved", [hashes[2]])]


@pytest.mark.parametrize("events", [True, False])
def test_lmdb_evictions_are_published_as_removed(tmp_path, events):
    """LMDB evicts in the process that writes it: the worker hears it (`Store.watch_evictions`), reports the
    keys (`StoredPages.evicted`) and the scheduler removes the blocks they broke. A 64 KiB store holds 14
    pages of 4 bytes (a block has 4: 3 KDA checkpoints, 1 MLA page): the second prompt's 12 pages evict
    the first prompt's oldest. With events off no worker collects evicted keys."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as vllm_hash

    from kvoffload.store import shared_store

    engine, batches = _engine(tmp_path, events=events, capacity="64KiB", worker=True)
    try:
        first = engine.add("a", _prompt(1))
        engine.run()
        engine.add("b", _prompt(2))
        engine.run()
        kinds = engine.connector.kinds
        pages = [(page_key(key, group_name(g, kinds[g])), index) for step in engine.steps
                 for job in step["meta"].saves if job.req_id == "a" for key, g, index, _ in job.pages]
        store = shared_store(f"lmdb://{tmp_path}/store?capacity=64KiB")
        assert store.stats()["evictions"] > 0
        there = dict(zip([key for key, _ in pages], store.contains_many([key for key, _ in pages])))
        broken = {vllm_hash(first.block_hashes[index]) for key, index in pages if not there[key]}
        assert broken  # blocks of "a" with an evicted page
        removed = [h for e in _ours(batches, "BlockRemoved") for h in e.block_hashes]
        if not events:
            assert removed == [] and store._on_evict is None  # nobody listens
            return
        assert sorted(removed) == sorted(broken)  # once each, and only those
        stored = [h for e in _ours(batches, "BlockStored") for h in e.block_hashes]
        assert len(stored) == 6 and {vllm_hash(h) for h in first.block_hashes[:3]} <= set(stored)
    finally:
        engine.worker.shutdown()


def test_a_physical_block_carries_each_of_vllms_finer_hashes(tmp_path):
    """vLLM's hash unit finer than the physical block (`prefix_match_unit`): a block's event carries its
    hash units' hashes in order, `block_size` is the unit, the parent is the unit hash just before it."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as vllm_hash

    from kvoffload.connectors.vllm_events import KVEvents

    engine, _ = _engine(tmp_path, events=True)
    view, prompt = engine.connector.view, _prompt(5)
    unit = BLOCK // 4
    request = SimpleNamespace(block_hashes=[bytes([i]) * 32 for i in range(len(prompt) // unit)],
                              prompt_token_ids=prompt, lora_request=SimpleNamespace(adapter_id=3, name="ad"))
    events = KVEvents(view, "CPU", unit, lambda keys: [True] * len(keys))
    keys = engine.connector.chain.keys(prompt)
    events.saved(request, keys, [1, 0])
    events.check()
    stored = events.take()
    assert [e.block_hashes for e in stored] == [[vllm_hash(h) for h in request.block_hashes[i * 4:(i + 1) * 4]]
                                                for i in (0, 1)]
    assert [e.parent_block_hash for e in stored] == [None, vllm_hash(request.block_hashes[3])]
    assert [e.token_ids for e in stored] == [prompt[:BLOCK], prompt[BLOCK:2 * BLOCK]]
    assert {(e.block_size, e.lora_id, e.lora_name, e.medium) for e in stored} == {(unit, 3, "ad", "CPU")}
    events.saved(request, keys, [0, 1])  # saved again: announced once
    events.check()
    assert events.take() == []
