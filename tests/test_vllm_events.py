"""KV cache events (`kvoffload.connectors.vllm_events`) through vLLM's real Scheduler on the GLM spec stack:
the batches vLLM's publisher receives carry BlockStored for the blocks the store holds (vLLM's hashes,
chained by parent), BlockRemoved for pages a load found missing and on reset; nothing when events are off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from test_vllm_scheduler_glm import BLOCK, _Engine, _glm_vllm_config, _prompt  # noqa: E402

from kvoffload.connectors.plan import page_key  # noqa: E402
from kvoffload.spec import GroupKind  # noqa: E402
from kvoffload.spec.vllm import group_name  # noqa: E402


def _engine(tmp_path, events: bool, memory: str | None = None):
    """The GLM harness with the worker's writes simulated: into LMDB, or (`memory`: a memory:// URL)
    reported to the scheduler's mirror as `StoredPages.added`, 100 bytes a page, with the jobs."""
    from vllm.config.kv_events import KVEventsConfig

    from kvoffload.connectors.vllm import StoredPages
    from kvoffload.store import shared_store

    vc, worker_cfg = _glm_vllm_config(BLOCK, memory or f"lmdb://{tmp_path}/store?capacity=256MiB")
    if events:
        vc.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    engine = _Engine(vc, worker_cfg)
    kinds = engine.connector.kinds
    store = None if memory else shared_store(f"lmdb://{tmp_path}/store?capacity=256MiB")
    build = engine.scheduler._build_kv_connector_meta
    written: list[bytes] = []

    def build_and_write(connector, scheduler_output):  # the worker's part: the job's pages land in the store
        meta = build(connector, scheduler_output)
        written.extend(page_key(key, group_name(g, kinds[g])) for job in meta.saves for key, g, _, _ in job.pages)
        if store is not None:
            assert all(store.put_many([(key, b"page") for key in written]))
            written.clear()
        return meta

    engine.scheduler._build_kv_connector_meta = build_and_write
    scheduler = engine.connector.connector_scheduler
    update = scheduler.update_connector_output

    def update_with_added(output):  # a memory store's writes reach the scheduler in the workers' report
        if isinstance(getattr(output, "kv_connector_worker_meta", None), StoredPages):
            output.kv_connector_worker_meta.added.update((key, 100) for key in written)
            written.clear()
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
