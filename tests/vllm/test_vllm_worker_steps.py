"""KVOffloadConnector's worker side step by step (vLLM's Llama KV cache spec, an LMDB store, no engine):
what it reports each step, and that a step in which no job finished costs no store access and no new
report object (these hooks run on the engine's thread every step)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.distributed")

from support import vllm_layouts  # noqa: E402

from kvoffload.connectors.vllm_config import ConnectorConfig  # noqa: E402
from kvoffload.connectors.vllm_messages import KVOffloadMetadata, SaveJob  # noqa: E402
from kvoffload.connectors.vllm_worker import _Worker  # noqa: E402
from kvoffload.spec import GroupKind, KeyChain  # noqa: E402
from kvoffload.spec.vllm import scheduler_view  # noqa: E402


@pytest.mark.parametrize("tier", ["lmdb", "memory"])
def test_idle_steps_report_nothing_and_touch_no_store(tmp_path, monkeypatch, tier):
    """Also: written keys are reported only for a store the scheduler mirrors (memory:// lives in the
    worker process); the scheduler asks LMDB itself."""
    from vllm.v1.kv_cache_interface import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    cfg = vllm_layouts.llama_config(num_blocks=40)
    view = scheduler_view(cfg)
    url = {"lmdb": f"lmdb://{tmp_path}/store?capacity=64MiB", "memory": "memory://?capacity=64MiB"}[tier]
    worker = _Worker(cfg, view, ConnectorConfig(store=url), "m", 0, 1)
    worker.register_kv_caches(allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout[cfg.kv_cache_layout]))
    store = worker.offloader.store
    touched = []
    for name in ("stats", "counter"):
        def spy(*args, __real=getattr(store, name), __name=name, **kwargs):
            touched.append(__name)
            return __real(*args, **kwargs)

        monkeypatch.setattr(store, name, spy)

    def step(meta=KVOffloadMetadata(), finished=()):
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        worker.jobs.drain(timeout=60)
        results = worker.get_transfer_results(set(finished))
        return results, worker.get_kv_connector_stats(), worker.build_connector_worker_meta()

    results, stats, report = step()
    assert (results.finished_sending, results.finished_recving, stats, report) == (set(), set(), None, None)
    assert touched == []

    (group,) = [g for g in view.cacheable_groups if g.kind is GroupKind.PAGED]
    keys = KeyChain(b"fp", view.block_size).keys(list(range(3 * view.block_size)))
    job = SaveJob("r", [(key, group.index, i, 1 + i) for i, key in enumerate(keys)], job_id=7)
    results, stats, report = step(KVOffloadMetadata(saves=[job], await_saves=["r"]))
    assert results.finished_sending == {"r"} and report.done_jobs == {7: 1}
    assert len(report.added) == (3 if tier == "memory" else 0)
    assert stats.data["saved_pages"] == 3 and stats.data["checksum_failures"] == 0
    assert touched == ["counter"]

    for _ in range(3):  # idle again: nothing read, nothing reported
        assert step()[1:] == (None, None)
    assert touched == ["counter"]
    worker.shutdown()
