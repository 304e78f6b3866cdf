"""KVOffloadConnector's scheduler side inside vLLM's REAL scheduler, for the GLM-5.3-Flash-like stack.

The GLM spec stack comes from ``vllm_layouts.glm53_flash_like_config`` (vLLM's own planner): groups
0-2 KDA ``MambaSpec`` in align mode (STATE), group 3 MLA latent + kpool indexer (PAGED), group 4 the
kpool tail ring ``CircularBufferSpec`` (SKIP); block size 384.  On it we build what ``EngineCore``
builds: ``generate_scheduler_kv_cache_config``, ``resolve_kv_cache_block_sizes``, the request block
hasher and ``vllm.v1.core.sched.scheduler.Scheduler`` (so the real ``KVCacheManager`` /
``HybridKVCacheCoordinator`` / Mamba align manager) with ``kv_transfer_config`` =
KVOffloadConnector over an LMDB store.  Requests are driven like ``EngineCore.step``: ``schedule()``,
then ``update_from_output`` with a minimal ``ModelRunnerOutput`` (no worker: the model runner's
contribution here is the sampled token at the end of prefill and, for a step that carried a LoadJob,
the ``KVConnectorOutput`` the worker's ``get_transfer_results`` would report).

Loads are asynchronous (vLLM's protocol; see the connector's docstring): the lookup returns
``(tokens, True)``, the request is allocated and parked in ``WAITING_FOR_REMOTE_KVS`` with no tokens
scheduled, the LoadJob goes out in that same step's ``build_connector_meta``, and the worker reports
the request in ``finished_recving`` (plus ``failed_recving`` when the load failed) of that step's
output (``KVConnectorModelRunnerMixin.kv_connector_no_forward``: the model runner runs the connector
even when no token is scheduled).  The next ``schedule()`` promotes the request and runs it from the
loaded boundary, or, after a failure, from scratch (the connector's default ``load_failure_policy``,
"recompute", which it passes on to vLLM's ``kv_load_failure_policy``).

What the connector is given is recorded at the moment it is given: the connector's own
``build_connector_meta`` (the KVConnector API method the scheduler calls each step; the connector is
ours, no vLLM internals are patched) is wrapped to copy the step's
``kv_connector_block_state.boundary_state_offloads``, every live request's block table
(``kv_cache_manager.get_block_ids``), status and computed tokens before the connector runs; the
scheduler clears the block state from ``SchedulerOutput`` right after.

The token budget (400) is smaller than the prompt (3 blocks + 10 tokens), so prefill takes three steps
(384, 384, 394 tokens).  vLLM's default ``prefix_cache_retention_interval=0`` keeps only the replay
boundary's Mamba checkpoint (one hand-off per KDA group, at 1152); ``prefix_cache_retention_interval=384``
(``--prefix-cache-retention-interval``) keeps every boundary, so hand-offs happen at 384, 768 and 1152.

The worker is absent: the pages the save jobs name are written to the LMDB store by the test (any
bytes; the scheduler side checks presence only), then a fresh scheduler on the same store must hit.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
import torch

pytest.importorskip("vllm.distributed")

from support import vllm_layouts  # noqa: E402  (tests/ is on sys.path: conftest.py)

from kvoffload.connectors.plan import page_key, pages_for_load  # noqa: E402
from kvoffload.spec import GroupKind  # noqa: E402
from kvoffload.spec.vllm import group_name  # noqa: E402

BLOCK = 384
PROMPT_LEN = 3 * BLOCK + 10
TOKEN_BUDGET = 400  # < PROMPT_LEN: chunked prefill of 384 + 384 + 394 tokens
KDA_GROUPS = (0, 1, 2)
MLA_GROUP = 3
TAIL_GROUP = 4


class _HfConfigStub(dict):
    """The model config the connector digests into its keys (``PretrainedConfig.to_dict``)."""

    def to_dict(self) -> dict:
        return dict(self)


@dataclasses.dataclass
class _SchedulerModelConfigStub(vllm_layouts._ModelConfigStub):
    """``vllm_layouts``' planner stub plus the fields ``Scheduler``, ``StructuredOutputManager``,
    ``VllmConfig`` properties and the connector read (a real ``ModelConfig`` for glm5next cannot be
    built offline in the CPU build: see ``vllm_layouts``' docstring).  A text-only generative model."""

    model: str = "glm53-flash-like-stub"
    skip_tokenizer_init: bool = True
    is_encoder_decoder: bool = False
    uses_mrope: bool = False
    runner_type: str = "generate"
    is_diffusion: bool = False
    multimodal_config: object = None
    supports_multimodal_inputs: bool = False
    return_sampling_mask: bool = False
    quantization: object = None
    revision: object = None
    hf_config: _HfConfigStub = dataclasses.field(default_factory=lambda: _HfConfigStub(
        model_type="glm5next", num_hidden_layers=45, index_kpool=4))


def _glm_vllm_config(retention_interval: int, store_url: str, **extra_config):
    """(VllmConfig, worker KVCacheConfig) for the GLM stack, configured as ``vllm serve`` would be with
    ``--enable-prefix-caching --mamba-cache-mode align --max-num-batched-tokens 400
    --prefix-cache-retention-interval N --kv-transfer-config {KVOffloadConnector, kv_both,
    kv_connector_extra_config: {store, **extra_config}}`` (vLLM's own ``kv_load_failure_policy`` left at
    its default, "fail": the connector sets it from its ``load_failure_policy``)."""
    from vllm.config import KVTransferConfig

    captured = {}

    def before_plan(vllm_config):  # the retention knob set before vLLM's planner runs
        vllm_config.cache_config.prefix_cache_retention_interval = retention_interval
        captured["vllm_config"] = vllm_config

    worker_cfg = vllm_layouts.glm53_flash_like_config(before_plan=before_plan)
    vc = captured["vllm_config"]
    stub = vc.model_config
    object.__setattr__(vc, "model_config", _SchedulerModelConfigStub(
        max_model_len=stub.max_model_len, dtype=stub.dtype, use_mla=stub.use_mla))
    object.__setattr__(vc, "kv_transfer_config", KVTransferConfig(
        kv_connector="KVOffloadConnector", kv_connector_module_path="kvoffload.connectors.vllm",
        kv_role="kv_both", kv_connector_extra_config={"store": store_url, "model_revision": "stub-weights",
                                                      **extra_config}))
    vc.scheduler_config.max_num_batched_tokens = TOKEN_BUDGET
    assert vc.cache_config.enable_prefix_caching and vc.cache_config.mamba_cache_mode == "align"
    assert worker_cfg.prefix_cache_retention_interval == retention_interval
    return vc, worker_cfg


class _Engine:
    """The scheduler half of ``EngineCore`` (core.py: ``_initialize_kv_caches`` + ``__init__`` + ``step``)."""

    def __init__(self, vllm_config, worker_kv_cache_config):
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            get_request_block_hasher,
            init_none_hash,
            resolve_kv_cache_block_sizes,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        sched_cfg = generate_scheduler_kv_cache_config([worker_kv_cache_config])
        vllm_config.cache_config.num_gpu_blocks = sched_cfg.num_blocks
        block_size, hash_block_size = resolve_kv_cache_block_sizes(sched_cfg, vllm_config)
        assert block_size == hash_block_size == BLOCK
        self.scheduler = Scheduler(
            vllm_config=vllm_config, kv_cache_config=sched_cfg,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size, hash_block_size=hash_block_size)
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(hash_block_size, hash_fn)
        self.connector = self.scheduler.get_kv_connector()
        self.steps: list[dict] = []
        self.matched: dict[str, list[tuple[int, int]]] = defaultdict(list)  # req -> [(tokens, computed)]
        self.outputs: dict[str, list[tuple[list[int], object]]] = defaultdict(list)  # req -> [(tokens, finish)]
        self.unreported_saves: list[int] = []  # save jobs the simulated worker has not reported done
        self.awaiting: list[str] = []  # finished requests whose saves the scheduler waits for

        build = self.connector.build_connector_meta  # ours: its public KVConnector API method is wrapped
        manager = self.scheduler.kv_cache_manager

        def build_and_record(scheduler_output):
            state = scheduler_output.kv_connector_block_state
            offloads = {r: list(v) for r, v in state.boundary_state_offloads.items()} if state else {}
            # Every live request's table: one parked in WAITING_FOR_REMOTE_KVS has blocks (its LoadJob
            # goes out in this step) but no scheduled tokens.
            tables = {r: tuple(list(t) for t in manager.get_block_ids(r))
                      for r in set(self.scheduler.requests) | set(offloads)}
            computed = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
            cached = scheduler_output.scheduled_cached_reqs
            computed.update(zip(cached.req_ids, cached.num_computed_tokens))
            meta = build(scheduler_output)
            self.steps.append({"scheduled": dict(scheduler_output.num_scheduled_tokens), "computed": computed,
                               "status": {r: q.status for r, q in self.scheduler.requests.items()},
                               "offloads": offloads, "tables": tables, "meta": meta})
            return meta

        self.connector.build_connector_meta = build_and_record

        lookup = self.connector.get_num_new_matched_tokens

        def lookup_and_record(request, num_computed_tokens):
            result = lookup(request, num_computed_tokens)
            self.matched[request.request_id].append((result[0], num_computed_tokens))
            return result

        self.connector.get_num_new_matched_tokens = lookup_and_record

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 1):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        request = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                          block_hasher=self.block_hasher)
        self.scheduler.add_request(request)
        return request

    def step(self, finished_recving: set[str] | None = None, failed_recving: set[str] = frozenset(),
             report_saves: bool = True):
        """One ``EngineCore.step``.  The worker's transfer results for this step are given by the caller
        (a failed load is in both sets, as ``get_transfer_results`` reports it); by default every
        LoadJob of this step completes within it, and every SaveJob too (reported done, and the
        requests awaiting their saves as finished sending), unless `report_saves` is False: then the
        jobs stay in flight until a later step reports them."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        from kvoffload.connectors.vllm import StoredPages

        scheduler_output = self.scheduler.schedule()
        meta = scheduler_output.kv_connector_metadata
        if finished_recving is None:
            finished_recving = {job.req_id for job in meta.loads}
        self.unreported_saves += [job.job_id for job in meta.saves]
        self.awaiting += list(meta.await_saves)
        report, sent = None, set()
        if report_saves:
            report = StoredPages(done_jobs={job: 1 for job in self.unreported_saves}) if self.unreported_saves else None
            sent, self.unreported_saves, self.awaiting = set(self.awaiting), [], []
        req_ids = list(scheduler_output.num_scheduled_tokens)
        # Minimal runner output: one sampled token for a request whose prompt is now fully computed
        # (``_update_after_schedule`` already advanced num_computed_tokens), none mid-prefill.
        sampled = [[7] if self.scheduler.requests[r].num_computed_tokens >= self.scheduler.requests[r].num_tokens
                   else [] for r in req_ids]
        kv_output = None
        if finished_recving or failed_recving or report or sent:  # what KVOutputAggregator hands the scheduler
            kv_output = KVConnectorOutput(finished_recving=set(finished_recving) or None,
                                          failed_recving=set(failed_recving), finished_sending=sent or None,
                                          kv_connector_worker_meta=report)
        outputs = self.scheduler.update_from_output(scheduler_output, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
            kv_connector_output=kv_output))
        self.steps[-1]["kv_output"] = kv_output
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                self.outputs[out.request_id].append((list(out.new_token_ids), out.finish_reason))
        return scheduler_output

    def run(self, max_steps: int = 20) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")


def _prompt(seed: int) -> list[int]:
    return [(i * 7919 + seed * 104729) % 50000 + 1 for i in range(PROMPT_LEN)]


@pytest.fixture(scope="module")
def glm_runs(tmp_path_factory):
    """Both retention settings, each: a cold run that prefills and saves, then a fresh engine on the
    same store (after the saved pages were written to it) that must hit, load and finish the prompt.
    The connector's own `state_retention` is 'every' here, so it saves every STATE hand-off vLLM makes
    (its default keeps fewer: `test_default_state_retention_drops_inner_handoffs`)."""
    from kvoffload.store import shared_store

    runs = {}
    for retention in (0, BLOCK):
        store_url = f"lmdb://{tmp_path_factory.mktemp(f'store-r{retention}')}/store?capacity=256MiB"
        vc, worker_cfg = _glm_vllm_config(retention, store_url, state_retention="every")
        cold = _Engine(vc, worker_cfg)
        prompt = _prompt(retention)
        cold.add("cold", prompt)
        cold.run()
        # What the absent worker would have written: every saved page, under its store key.
        kinds = cold.connector.kinds
        saved = [page for step in cold.steps for job in step["meta"].saves for page in job.pages]
        store = shared_store(store_url)
        written = store.put_many([(page_key(key, group_name(g, kinds[g])), b"page") for key, g, _, _ in saved])
        assert all(written)
        warm = _Engine(vc, worker_cfg)
        warm.add("warm", prompt)
        # The load step: vLLM parks the request, the LoadJob goes out, the worker restores the pages
        # within the step and reports it in that step's output.
        warm.step(finished_recving={"warm"})
        warm.run()  # promoted by the next schedule(): runs from the loaded boundary
        runs[retention] = {"cold": cold, "warm": warm, "prompt": prompt, "store_url": store_url}
    return runs


@pytest.mark.parametrize("retention", [0, BLOCK])
def test_group_kinds_match_glm_stack(glm_runs, retention):
    kinds = glm_runs[retention]["cold"].connector.kinds
    assert kinds == [GroupKind.STATE] * 3 + [GroupKind.PAGED, GroupKind.SKIP]
    spec = glm_runs[retention]["cold"].scheduler.kv_cache_config.kv_cache_groups[TAIL_GROUP].kv_cache_spec
    assert type(spec).__name__ == "CircularBufferSpec"


@pytest.mark.parametrize("retention", [0, BLOCK])
def test_cold_prefill_is_chunked(glm_runs, retention):
    steps = [s for s in glm_runs[retention]["cold"].steps if "cold" in s["scheduled"]]
    assert [s["scheduled"]["cold"] for s in steps] == [384, 384, 394]  # max_tokens=1: done at prefill


@pytest.mark.parametrize("retention", [0, BLOCK])
def test_tail_ring_group_never_saved(glm_runs, retention):
    for step in glm_runs[retention]["cold"].steps:
        for job in step["meta"].saves:
            assert all(g != TAIL_GROUP for _, g, _, _ in job.pages), job


@pytest.mark.parametrize("retention", [0, BLOCK])
def test_state_pages_are_exactly_vllms_handoffs(glm_runs, retention):
    run = glm_runs[retention]
    engine = run["cold"]
    keys = engine.connector.chain.keys(run["prompt"])
    handed_off = defaultdict(set)  # group -> boundaries
    for step in engine.steps:
        state_pages = [p for job in step["meta"].saves if job.req_id == "cold"
                       for p in job.pages if p[1] in KDA_GROUPS]
        offers = step["offloads"].get("cold", [])
        expected = []
        for g, block_id, boundary in offers:
            assert g in KDA_GROUPS, offers  # only align-mode Mamba groups hand states off
            assert boundary % BLOCK == 0
            expected.append((keys[boundary // BLOCK - 1], g, boundary // BLOCK - 1, block_id))
            handed_off[g].add(boundary)
        assert sorted(state_pages) == sorted(expected)
        tables = step["tables"].get("cold")
        for key, g, index, block_id in state_pages:
            assert tables is not None
            assert block_id != 0  # vLLM's null block
            assert block_id in tables[g], (g, block_id, tables)
            for other in KDA_GROUPS:
                if other != g:
                    assert block_id not in tables[other], (g, other, block_id, tables)
    expected_boundaries = {3 * BLOCK} if retention == 0 else {BLOCK, 2 * BLOCK, 3 * BLOCK}
    assert {g: handed_off[g] for g in KDA_GROUPS} == {g: expected_boundaries for g in KDA_GROUPS}


@pytest.mark.parametrize("retention", [0, BLOCK])
def test_paged_pages_one_per_full_block_from_mla_group(glm_runs, retention):
    run = glm_runs[retention]
    engine = run["cold"]
    keys = engine.connector.chain.keys(run["prompt"])
    paged = []
    for step in engine.steps:
        for job in step["meta"].saves:
            for key, g, index, block_id in job.pages:
                if g not in KDA_GROUPS:
                    assert g == MLA_GROUP
                    assert key == keys[index]
                    assert block_id == step["tables"][job.req_id][MLA_GROUP][index]
                    paged.append(index)
    assert sorted(paged) == list(range(PROMPT_LEN // BLOCK))


def _load_targets(load) -> set[tuple[int, int]]:
    """(group, physical block) the LoadJob writes: each KDA group's checkpoint, the MLA pages."""
    targets = {(g, load.block_ids[g][load.end - 1]) for g in KDA_GROUPS}
    return targets | {(MLA_GROUP, b) for b in load.block_ids[MLA_GROUP][load.start:load.end]}


@pytest.mark.parametrize("retention", [0, BLOCK])
def test_fresh_engine_hits_and_loads_into_each_groups_own_blocks(glm_runs, retention):
    from vllm.v1.request import RequestStatus

    run = glm_runs[retention]
    warm = run["warm"]
    end = PROMPT_LEN // BLOCK  # 3: the longest aligned prefix with a prompt token left to compute
    assert warm.matched["warm"] == [(end * BLOCK, 0)]  # asked once: no second lookup after the load
    step = warm.steps[0]
    # Asynchronous load: allocated and parked, nothing scheduled, the LoadJob in this very step.
    assert step["scheduled"] == {}
    assert step["status"]["warm"] == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = step["meta"].loads
    assert not step["meta"].saves
    keys = warm.connector.chain.keys(run["prompt"])
    assert (load.req_id, load.start, load.end, load.block_keys) == ("warm", 0, end, keys[:end])
    tables = step["tables"]["warm"]
    assert {g: load.block_ids[g] for g in range(len(tables))} == dict(enumerate(tables))
    checkpoints = []
    for g in KDA_GROUPS:
        block_id = load.block_ids[g][end - 1]
        assert block_id != 0 and block_id == tables[g][end - 1]
        assert all(block_id not in tables[o] for o in (*KDA_GROUPS, MLA_GROUP, TAIL_GROUP) if o != g)
        checkpoints.append(block_id)
    assert len(set(checkpoints)) == len(KDA_GROUPS)
    assert load.block_ids[MLA_GROUP][:end] == tables[MLA_GROUP][:end]
    assert 0 not in load.block_ids[MLA_GROUP][:end]
    # The pages the worker restores for this job (Offloader.load -> pages_for_load) and where they go.
    pages = pages_for_load(warm.connector.connector_scheduler.layout, load.block_keys, load.start, load.end)
    assert all(p.group.index != TAIL_GROUP for p in pages)
    assert sorted((p.group.index, p.index) for p in pages) == sorted(
        [(MLA_GROUP, i) for i in range(end)] + [(g, end - 1) for g in KDA_GROUPS])
    assert [job for s in warm.steps[1:] for job in s["meta"].loads] == []  # one LoadJob, once


@pytest.mark.parametrize("retention", [0, BLOCK])
def test_loaded_request_runs_from_the_boundary_on_the_loaded_blocks(glm_runs, retention):
    """After ``finished_recving`` the next step schedules the request from the loaded boundary, on the
    very blocks the LoadJob wrote (vLLM copies the align-mode state out of them before that forward),
    and prefill completes."""
    from vllm.v1.engine import FinishReason

    warm = glm_runs[retention]["warm"]
    end = PROMPT_LEN // BLOCK
    load_step, run_step = warm.steps[0], warm.steps[1]
    assert load_step["kv_output"].finished_recving == {"warm"} and not load_step["kv_output"].failed_recving
    assert [s["scheduled"] for s in warm.steps if s["scheduled"]] == [{"warm": PROMPT_LEN - end * BLOCK}]
    assert run_step["scheduled"] == {"warm": PROMPT_LEN - end * BLOCK}
    assert run_step["computed"] == {"warm": end * BLOCK}
    (load,) = load_step["meta"].loads
    tables = run_step["tables"]["warm"]
    assert {(g, tables[g][end - 1]) for g in KDA_GROUPS} | {(MLA_GROUP, b) for b in tables[MLA_GROUP][:end]} \
        == _load_targets(load)
    assert warm.outputs["warm"] == [([7], FinishReason.LENGTH)]
    assert not warm.scheduler.has_requests()


@pytest.mark.parametrize("retention", [0, BLOCK])
def test_loaded_blocks_are_never_saved(glm_runs, retention):
    """vLLM hands the loaded boundary's blocks off again once the request runs (``cache_blocks`` in
    ``_update_waiting_for_remote_kv`` offers every retained boundary).  The connector must not save
    them, in the load step or after: they are the blocks the load writes into, so after a failed load
    (page evicted or corrupt between lookup and load) the worker's wait_for_save would store those
    blocks' stale bytes as the checkpoint of this prefix."""
    warm = glm_runs[retention]["warm"]
    end = PROMPT_LEN // BLOCK
    (load,) = warm.steps[0]["meta"].loads
    assert warm.steps[0]["offloads"].get("warm", []) == []  # parked: nothing handed off in the load step
    reoffered = {(g, block_id) for g, block_id, boundary in warm.steps[1]["offloads"].get("warm", [])
                 if boundary == end * BLOCK}
    assert reoffered == {(g, load.block_ids[g][end - 1]) for g in KDA_GROUPS}
    for step in warm.steps:
        for job in step["meta"].saves:
            for key, g, index, block_id in job.pages:
                assert g != TAIL_GROUP
                assert (g, block_id) not in _load_targets(load), ("save of a loaded block", g, index, block_id)
                assert not load.start <= index < load.end, ("re-save of a loaded page", g, index, block_id)


def _failing_engine(run, **extra_config):
    """A fresh engine on the run's store whose first step's LoadJob the worker reports as failed (a
    read error: the pages are still in the store)."""
    engine = _Engine(*_glm_vllm_config(0, run["store_url"], **extra_config))
    free = engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    engine.add("failing", run["prompt"])
    engine.step(finished_recving={"failing"}, failed_recving={"failing"})  # must not raise
    step = engine.steps[0]
    assert step["scheduled"] == {}
    (load,) = step["meta"].loads
    assert (load.req_id, load.start, load.end) == ("failing", 0, PROMPT_LEN // BLOCK)
    return engine, free


def test_failed_load_is_recomputed_not_fatal(glm_runs):
    """The connector's default ``load_failure_policy`` ("recompute", over vLLM's own default "fail"): a
    load reported in ``failed_recving`` (and ``finished_recving``) ends in a recompute from 0 (a fresh
    engine has no local prefix), not a crash; the connector offers no second load (the same read
    could fail forever), and the recomputed pages are saved again, as in a cold run."""
    from vllm.v1.engine import FinishReason

    run = glm_runs[0]
    engine, free = _failing_engine(run)
    assert engine.scheduler.recompute_kv_load_failures
    engine.run()
    assert engine.matched["failing"] == [(3 * BLOCK, 0), (0, 0)]
    assert [job for s in engine.steps[1:] for job in s["meta"].loads] == []
    assert [(s["computed"]["failing"], s["scheduled"]["failing"]) for s in engine.steps
            if "failing" in s["scheduled"]] == [(0, 384), (384, 384), (768, 394)]
    assert engine.outputs["failing"] == [([7], FinishReason.LENGTH)]
    assert not engine.scheduler.has_requests()
    assert engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free

    def saved(eng):
        return sorted((key, g, index) for s in eng.steps for job in s["meta"].saves
                      for key, g, index, _ in job.pages)

    assert saved(engine) == saved(run["cold"])


def test_failed_load_under_fail_policy_fails_the_request_not_the_engine(glm_runs):
    """``load_failure_policy="fail"`` (vLLM's own default): the request ends with an error instead of a
    recompute; the scheduler survives and frees its blocks."""
    from vllm.v1.engine import FinishReason

    engine, free = _failing_engine(glm_runs[0], load_failure_policy="fail")
    assert not engine.scheduler.recompute_kv_load_failures
    assert engine.outputs["failing"] == [([], FinishReason.ERROR)]
    assert not engine.scheduler.has_unfinished_requests()
    engine.run()  # the finished id reaches the (absent) worker; nothing is scheduled or loaded again
    assert [(s["scheduled"], s["meta"].loads) for s in engine.steps[1:]] == [({}, [])] * (len(engine.steps) - 1)
    assert engine.matched["failing"] == [(3 * BLOCK, 0)]
    assert engine.outputs["failing"] == [([], FinishReason.ERROR)]
    assert "failing" not in engine.scheduler.requests
    assert engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free


# -- start-up errors: clear, at construction, in either role --------------------------------------------

def _connector(tmp_path, role_name="SCHEDULER", prefix_caching=True, tp=1, **extra):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvoffload.connectors.vllm import KVOffloadConnector

    vllm_config, worker_cfg = _glm_vllm_config(0, f"lmdb://{tmp_path}/store?capacity=256MiB", **extra)
    vllm_config.cache_config.enable_prefix_caching = prefix_caching
    vllm_config.parallel_config.tensor_parallel_size = tp  # the MLA latent is then shared by the ranks
    return KVOffloadConnector(vllm_config, getattr(KVConnectorRole, role_name), worker_cfg)


def test_startup_errors_are_clear(tmp_path):
    """Configuration errors (kvoffload.errors.ConfigError: still ValueErrors, as vLLM expects)."""
    from kvoffload.errors import ConfigError

    with pytest.raises(ConfigError, match="needs prefix caching"):
        _connector(tmp_path, prefix_caching=False)
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config key"):
        _connector(tmp_path, colour="blue")
    with pytest.raises(ConfigError, match="load_failure_policy must be"):
        _connector(tmp_path, load_failure_policy="sometimes")
    with pytest.raises(ConfigError, match="must be absolute"):
        _connector(tmp_path, store="lmdb://relative/dir")
    with pytest.raises(ConfigError, match="admit= above 1 is not supported with tensor parallelism"):
        _connector(tmp_path, tp=2, store=f"tiered://?memory=64MiB&lmdb={tmp_path}/db&lmdb_capacity=64MiB&admit=2")
    with pytest.raises(ConfigError, match="weights .* set kv_connector_extra_config model_revision"):
        _connector(tmp_path, model_revision=None)  # the stub model is neither a directory nor in the hub cache


def test_unsupported_spec_is_named_at_startup(tmp_path, monkeypatch):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from kvoffload.spec import UnsupportedLayoutError

    vllm_config, worker_cfg = _glm_vllm_config(0, f"lmdb://{tmp_path}/store?capacity=256MiB")
    group = worker_cfg.kv_cache_groups[-1]
    group.kv_cache_spec = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=64,
                                            dtype=torch.bfloat16, sliding_window=128)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvoffload.connectors.vllm import KVOffloadConnector

    with pytest.raises(UnsupportedLayoutError, match="SlidingWindowSpec"):
        KVOffloadConnector(vllm_config, KVConnectorRole.SCHEDULER, worker_cfg)


def test_worker_layout_stores_only_used_bytes(tmp_path):
    """The worker's view of the GLM allocation: tail group skipped, no page padding stored."""
    from kvoffload.spec import from_vllm

    _, worker_cfg = _glm_vllm_config(0, f"lmdb://{tmp_path}/store?capacity=256MiB")
    layout = from_vllm(worker_cfg)
    assert [g.kind for g in layout.groups].count(GroupKind.SKIP) == 1
    stored = layout.stored_bytes_per_block()
    cacheable = [g for g in layout.groups if g.kind is not GroupKind.SKIP]
    assert stored == sum(g.used_bytes_per_block for g in cacheable)
    assert all(r.used_bytes <= r.page_bytes for g in cacheable for r in g.regions)
    kda = [g for g in cacheable if g.kind is GroupKind.STATE]
    assert all(g.used_bytes_per_block < sum(r.page_bytes * r.num_layers for r in g.regions) for g in kda)  # padding
    whole = len(cacheable) * layout.groups[0].regions[0].block_stride  # the whole packed block per group key
    assert stored / whole < 0.8


def test_save_sources_stay_pinned_until_the_workers_report_them(tmp_path):
    """Saves run in the background: every block a save job reads (PAGED blocks and the retired KDA
    boundary blocks vLLM hands off) keeps a reference, and a finished request keeps its blocks
    (`request_finished` -> True), until the save is reported; only then do they go back to the pool."""
    vc, worker_cfg = _glm_vllm_config(BLOCK, f"lmdb://{tmp_path}/store?capacity=256MiB")
    engine = _Engine(vc, worker_cfg)
    pool = engine.scheduler.kv_cache_manager.block_pool
    engine.add("r", _prompt(7))
    for _ in range(20):
        if "r" not in engine.scheduler.requests or engine.scheduler.requests["r"].is_finished():
            break
        engine.step(report_saves=False)
    jobs = [job for step in engine.steps for job in step["meta"].saves]
    sources = {block_id for job in jobs for _, _, _, block_id in job.pages}
    assert jobs and sources
    engine.step(report_saves=False)  # the request has finished: its await goes out, nothing is reported
    assert "r" in engine.scheduler.requests, "finished request freed before its saves were reported"
    assert engine.awaiting == ["r"]
    assert engine.connector.has_pending_block_frees()
    assert all(pool.blocks[b].ref_cnt > 0 for b in sources), "a save's source block went back to the pool"
    # A lookup meanwhile sees the pages of the saves in flight (the load would run after them).
    probe = engine.add("probe", _prompt(7))
    assert engine.connector.get_num_new_matched_tokens(probe, 0)[0] > 0
    engine.scheduler.finish_requests("probe", __import__("vllm.v1.request", fromlist=["x"]).RequestStatus.FINISHED_ABORTED)
    engine.step()  # the worker reports every job: unpinned, the request is sent and freed
    assert "r" not in engine.scheduler.requests
    assert not engine.connector.has_pending_block_frees()
    assert all(pool.blocks[b].ref_cnt == 0 for b in sources)
    assert not engine.connector.connector_scheduler._in_flight


def test_reset_cache_waits_for_saves_and_for_the_workers_to_clear(tmp_path):
    """`reset_prefix_cache(reset_connector=True)`: refused (False) while a save is in flight (it would
    land after the clear); then the store is cleared at once, and no lookup hits until every worker
    has reported clearing its own copy (told in the next step's metadata)."""
    from types import SimpleNamespace

    from kvoffload.connectors.vllm import StoredPages
    from kvoffload.store import shared_store

    vc, worker_cfg = _glm_vllm_config(BLOCK, f"lmdb://{tmp_path}/store?capacity=256MiB")
    engine = _Engine(vc, worker_cfg)
    engine.add("r", _prompt(7))
    for _ in range(20):
        if "r" not in engine.scheduler.requests or engine.scheduler.requests["r"].is_finished():
            break
        engine.step(report_saves=False)
    connector, scheduler = engine.connector, engine.connector.connector_scheduler
    assert connector.has_pending_block_frees()
    assert connector.reset_cache() is False
    engine.step()  # the saves are reported
    store = shared_store(scheduler._index.url)
    assert store.put(b"stale", b"x" * 100)
    assert connector.reset_cache() is True
    assert store.get(b"stale") is None
    scheduler._present = lambda keys, lookup=True: [True] * len(keys)  # say a late write landed after the clear
    probe = engine.add("probe", _prompt(8))
    assert connector.get_num_new_matched_tokens(probe, 0) == (0, False)
    engine.step()
    assert engine.steps[-1]["meta"].clear_store == 1
    scheduler.update_connector_output(SimpleNamespace(kv_connector_worker_meta=StoredPages(cleared={1: 1}),
                                                      failed_recving=None))
    assert connector.get_num_new_matched_tokens(engine.add("probe2", _prompt(9)), 0)[0] > 0


def _glm_kv_caches(worker_cfg):
    from vllm.v1.kv_cache_interface import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    return allocate_kv_cache(worker_cfg, torch.device("cpu"), KVCacheLayout[worker_cfg.kv_cache_layout])


def test_worker_layout_agrees_with_the_scheduler_view_at_register(tmp_path):
    """The facade delegates to one side per role; a worker's register_kv_caches builds the full layout and
    checks it against the scheduler's view (block size, hit alignment, groups) before any byte moves."""
    from kvoffload.spec.layout import KindsLayout

    worker = _connector(tmp_path, role_name="WORKER")
    assert worker.connector_scheduler is None and worker.connector_worker is not None
    scheduler = _connector(tmp_path)
    assert scheduler.connector_worker is None and scheduler.connector_scheduler is not None
    _, worker_cfg = _glm_vllm_config(0, f"lmdb://{tmp_path}/store?capacity=256MiB")
    worker.register_kv_caches(_glm_kv_caches(worker_cfg))
    try:
        layout = worker.connector_worker.layout
        assert KindsLayout.of(layout) == scheduler.connector_scheduler.layout == worker.view
        assert (layout.block_size, layout.hit_alignment, layout.index_kpool) == (BLOCK, BLOCK, 4)
        assert [g.name for g in scheduler.connector_scheduler.layout.cacheable_groups] == \
            ["g0-state", "g1-state", "g2-state", "g3-paged"]
    finally:
        worker.shutdown()


def test_disagreeing_worker_layout_fails_at_register(tmp_path, monkeypatch):
    """Either side made to disagree (the worker's layout, or the scheduler's view) is a start-up error
    naming what differs, raised before the store or the jobs thread exist."""
    from dataclasses import replace

    from kvoffload.connectors import vllm as facade
    from kvoffload.connectors import vllm_worker
    from kvoffload.spec import UnsupportedLayoutError

    _, worker_cfg = _glm_vllm_config(0, f"lmdb://{tmp_path}/store?capacity=256MiB")
    caches = _glm_kv_caches(worker_cfg)
    real_from_vllm = vllm_worker.from_vllm
    monkeypatch.setattr(vllm_worker, "from_vllm", lambda *a, **k: replace(real_from_vllm(*a, **k),
                                                                          hit_alignment=2 * BLOCK))
    worker = _connector(tmp_path, role_name="WORKER")
    with pytest.raises(UnsupportedLayoutError, match=r"disagree; hit_alignment: scheduler 384, worker 768"):
        worker.register_kv_caches(caches)
    assert worker.connector_worker.jobs is None and worker.connector_worker.offloader is None
    monkeypatch.undo()

    real_view = facade.scheduler_view

    def view_without_the_mla_group(kv_cache_config, **options):
        view = real_view(kv_cache_config, **options)
        return replace(view, cacheable_groups=view.cacheable_groups[:-1])

    monkeypatch.setattr(facade, "scheduler_view", view_without_the_mla_group)
    worker = _connector(tmp_path, role_name="WORKER")
    with pytest.raises(UnsupportedLayoutError, match="cacheable_groups: scheduler"):
        worker.register_kv_caches(caches)


def test_a_crafted_cache_salt_never_yields_another_requests_keys(tmp_path):
    """A base-model request whose client-chosen cache_salt spells a LoRA adapter or a multimodal input
    must not get that request's keys (the old '|'-joined salt let it poison the LoRA request's cache)."""
    from types import SimpleNamespace

    vc, worker_cfg = _glm_vllm_config(BLOCK, f"lmdb://{tmp_path}/store?capacity=256MiB")
    scheduler = _Engine(vc, worker_cfg).connector.connector_scheduler
    prompt = _prompt(3)

    def keys(cache_salt=None, lora=None, mm=()):
        request = SimpleNamespace(cache_salt=cache_salt, mm_features=[SimpleNamespace(identifier=i) for i in mm],
                                  lora_request=SimpleNamespace(lora_name=lora) if lora is not None else None)
        return scheduler._salted_chain(request).keys(prompt)

    assert keys("|lora:x") != keys(lora="x")
    assert keys("a|mm:h") != keys("a", mm=["h"])
    assert keys(lora="x") == keys(lora="x") and keys() == scheduler.chain.keys(prompt)


def test_max_saved_blocks_caps_what_one_request_writes(tmp_path):
    """kv_connector_extra_config max_saved_blocks=1: the save jobs of a 3-block prompt hold block 0's
    PAGED pages and its boundary checkpoints only; a fresh engine's lookup then offers that one block."""
    url = f"lmdb://{tmp_path}/store?capacity=256MiB"
    vc, worker_cfg = _glm_vllm_config(BLOCK, url, max_saved_blocks="1")
    engine = _Engine(vc, worker_cfg)
    engine.add("r", _prompt(7))
    for _ in range(20):
        if "r" not in engine.scheduler.requests or engine.scheduler.requests["r"].is_finished():
            break
        engine.step()
    saved = [page for step in engine.steps for job in step["meta"].saves for page in job.pages]
    assert saved and {index for _, _, index, _ in saved} == {0}
    assert {g for _, g, _, _ in saved} == {MLA_GROUP, *KDA_GROUPS}
    with pytest.raises(ValueError, match="max_saved_blocks must be a positive whole number"):
        _connector(tmp_path, max_saved_blocks="0")


def test_a_queued_request_is_prefetched_until_it_is_scheduled(tmp_path):
    """tiered:// store, one request at a time (max_num_seqs=1): a request vLLM queues behind a running
    one gets a PrefetchJob of its stored prefix in the step it arrived in, and its prefetch ends
    (`prefetch_done`) in the step that schedules it, beside its LoadJob of the same blocks. A request
    scheduled at once or with nothing stored gets none; a queued request that is aborted ends its own."""
    from vllm.v1.request import RequestStatus

    from kvoffload.store import shared_store

    url = f"tiered://?memory=64MiB&lmdb={tmp_path}/db&lmdb_capacity=256MiB&pinned=false"
    vc, worker_cfg = _glm_vllm_config(BLOCK, url)
    vc.scheduler_config.max_num_seqs = 1
    cold = _Engine(vc, worker_cfg)
    cold.add("cold", _prompt(7))
    cold.run()
    kinds = cold.connector.kinds
    saved = [page for step in cold.steps for job in step["meta"].saves for page in job.pages]
    assert all(shared_store(url).back.put_many([(page_key(key, group_name(g, kinds[g])), b"page")
                                                for key, g, _, _ in saved]))  # on disk only
    engine = _Engine(vc, worker_cfg)
    engine.add("first", _prompt(8), max_tokens=4)
    engine.step()
    assert not engine.steps[-1]["meta"].prefetches, "scheduled at once (and nothing stored): no prefetch"
    engine.add("queued", _prompt(7))
    engine.add("unknown", _prompt(9))
    engine.step()
    (job,) = engine.steps[-1]["meta"].prefetches
    assert job.req_id == "queued" and job.end == 3 and len(job.block_keys) == 3
    engine.add("gone", _prompt(7))
    engine.step()
    assert [j.req_id for j in engine.steps[-1]["meta"].prefetches] == ["gone"]
    engine.scheduler.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
    engine.step()
    assert engine.steps[-1]["meta"].prefetch_done == ["gone"]
    engine.run(max_steps=40)
    (load_step,) = [step["meta"] for step in engine.steps if any(j.req_id == "queued" for j in step["meta"].loads)]
    assert load_step.prefetch_done == ["queued"]
    assert [(j.start, j.end) for j in load_step.loads if j.req_id == "queued"] == [(0, job.end)]
    assert not engine.connector.connector_scheduler._prefetching
    assert sum(len(step["meta"].prefetches) for step in engine.steps) == 2


def test_prefetch_is_off_without_a_memory_tier_or_when_asked(tmp_path):
    from kvoffload.connectors.vllm_config import ConnectorConfig
    from kvoffload.errors import ConfigError

    tiered = f"tiered://?memory=64MiB&lmdb={tmp_path}/db&lmdb_capacity=256MiB"
    assert ConnectorConfig(store=tiered).prefetch_budget is None  # the worker's default: memory / 4
    assert ConnectorConfig(store=tiered, prefetch_bytes="0").prefetch_budget == 0
    assert ConnectorConfig(store=tiered, prefetch_bytes="1GiB").prefetch_budget == 1 << 30
    assert ConnectorConfig(store=f"lmdb://{tmp_path}/db?capacity=1GiB").prefetch_budget == 0
    with pytest.raises(ConfigError, match="prefetch_bytes"):
        ConnectorConfig(store=tiered, prefetch_bytes="lots")
    assert not _connector(tmp_path).connector_scheduler.prefetch  # lmdb:// alone: nothing to promote into


@pytest.mark.parametrize("admit", [2, 1])
def test_tiered_admission_hits_pages_waiting_in_the_workers_memory(tmp_path, admit):
    """tiered:// with admit=2: a saved page waits in the worker's memory tier for its second use, so the
    scheduler mirrors that tier from the workers' reports (`StoredPages.added`; its capacity and policy)
    and a lookup hits it there (the load is that second use). Once the mirror has evicted it, it is a miss
    unless it is on disk. admit=1 has no mirror: the disk tier answers alone, as before."""
    from types import SimpleNamespace

    from kvoffload.connectors.vllm import StoredPages
    from kvoffload.store import shared_store

    url = f"tiered://?memory=64KiB&lmdb={tmp_path}/db&lmdb_capacity=64MiB&admit={admit}"
    engine = _Engine(*_glm_vllm_config(BLOCK, url, state_retention="every"))  # every hand-off saved
    engine.add("cold", _prompt(1))
    engine.run()
    connector, scheduler = engine.connector, engine.connector.connector_scheduler
    saved = [page_key(key, group_name(g, connector.kinds[g]))
             for step in engine.steps for job in step["meta"].saves for key, g, _, _ in job.pages]
    assert len(saved) == 12  # 3 blocks: 3 KDA checkpoints and the MLA page each

    def report(**fields):  # the workers' aggregated report of a step
        scheduler.update_connector_output(SimpleNamespace(kv_connector_worker_meta=StoredPages(**fields),
                                                          failed_recving=None))

    def lookup(req_id):
        return connector.get_num_new_matched_tokens(engine.add(req_id, _prompt(1)), 0)

    report(added={key: 1000 for key in saved})  # in the worker's memory tier, not on disk
    assert lookup("warm") == ((3 * BLOCK, True) if admit == 2 else (0, False))
    report(added={b"other%d" % i: 1000 for i in range(100)})  # past the memory tier's 64 KiB: the oldest go
    mirror = scheduler._index.mirror
    assert (mirror is None) is (admit == 1)
    if mirror is not None:  # bounded by the tier's capacity
        assert mirror.used <= mirror.capacity == 64 << 10 and len(mirror.sizes) == (64 << 10) // 1000
    assert lookup("evicted") == (0, False)
    assert all(shared_store(url).back.put_many([(key, b"page") for key in saved]))  # on disk (admitted)
    assert lookup("on-disk") == (3 * BLOCK, True)


def test_register_refuses_tensors_the_layout_misplaces(tmp_path):
    """vLLM's real tensors (allocated by vLLM's own allocator for the GLM-5.3-Flash groups) pass the
    register-time check; a layer tensor swapped for another layer's, given another block stride, or living in
    another allocation is refused at start-up with its name, never copied as if it were the page."""
    from kvoffload.spec import UnsupportedLayoutError
    from kvoffload.spec.vllm import check_tensors, from_vllm

    _, worker_cfg = _glm_vllm_config(0, f"lmdb://{tmp_path}/store?capacity=256MiB")
    caches = _glm_kv_caches(worker_cfg)
    layout = from_vllm(worker_cfg, model_id="glm", kv_caches=caches)
    check_tensors(layout, caches)
    mla = next(g for g in layout.groups if g.kind.name == "PAGED").regions[0].layer_names[0]
    t = caches[mla]
    moved = dict(caches)
    # Another group's tensor (groups share memory: vLLM aliases layer i of every group) at another offset.
    other = next(c for c in caches.values() if c.dim() == 4 and c.dtype == torch.int8
                 and c.storage_offset() != t.storage_offset() * t.element_size())
    moved[mla] = other
    with pytest.raises(UnsupportedLayoutError, match=f"{mla}: block 0 bytes"):
        check_tensors(layout, moved)
    restrided = dict(caches)
    restrided[mla] = t.as_strided(t.shape, (t.stride(0) - 256, *t.stride()[1:]), t.storage_offset())
    with pytest.raises(UnsupportedLayoutError, match=f"{mla}: shape"):
        check_tensors(layout, restrided)
    elsewhere = dict(caches)
    elsewhere[mla] = t.clone()
    with pytest.raises(UnsupportedLayoutError, match="2 allocations"):
        check_tensors(layout, elsewhere)


def test_default_state_retention_drops_inner_handoffs(tmp_path):
    """The connector's default state_retention ('last+junction') in vLLM's real scheduler, with every
    boundary handed off (retention interval 384): the save jobs hold the KDA checkpoints of the longest
    hit's boundary only (1152), every MLA page, and the dropped hand-offs are counted; a fresh engine on
    the stored pages then hits there."""
    from kvoffload.store import shared_store

    url = f"lmdb://{tmp_path}/store?capacity=256MiB"
    vc, worker_cfg = _glm_vllm_config(BLOCK, url)
    cold = _Engine(vc, worker_cfg)
    prompt = _prompt(11)
    cold.add("cold", prompt)
    cold.run()
    offered = {(g, boundary) for step in cold.steps for g, _, boundary in step["offloads"].get("cold", [])}
    assert offered == {(g, k * BLOCK) for g in KDA_GROUPS for k in (1, 2, 3)}
    saved = [page for step in cold.steps for job in step["meta"].saves for page in job.pages]
    assert sorted((g, index) for _, g, index, _ in saved if g in KDA_GROUPS) == [(g, 2) for g in KDA_GROUPS]
    assert sorted(index for _, g, index, _ in saved if g == MLA_GROUP) == [0, 1, 2]
    assert cold.connector.connector_scheduler.counters["checkpoints_not_retained"] == 2 * len(KDA_GROUPS)
    kinds = cold.connector.kinds
    assert all(shared_store(url).put_many([(page_key(key, group_name(g, kinds[g])), b"page") for key, g, _, _ in saved]))
    warm = _Engine(vc, worker_cfg)
    warm.add("warm", prompt)
    warm.step(finished_recving={"warm"})
    assert warm.matched["warm"] == [(3 * BLOCK, 0)]
