"""KVOffloadConnector's scheduler side on the engine's thread, step by step (fake scheduler outputs, no
engine): save jobs name exactly the blocks each scheduled request completed, whether vLLM lists it among
the new or the cached requests, and a step that completes no block asks vLLM for no block table (a
decode step is the common case: its cost is the connector's overhead)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.distributed")

from kvoffload.connectors.vllm_config import ConnectorConfig  # noqa: E402
from kvoffload.connectors.vllm_scheduler import _Scheduler  # noqa: E402
from kvoffload.spec import GroupKind, KeyChain  # noqa: E402
from kvoffload.spec.layout import KindsGroup, KindsLayout  # noqa: E402

BLOCK = 4


class _BlockState:
    """vLLM's connector block state: block tables on request, counted."""

    def __init__(self, tables):
        self.tables, self.asked, self.boundary_state_offloads = tables, [], {}

    def get_block_ids(self, req_id):
        self.asked.append(req_id)
        return self.tables[req_id]


def _output(block_state, new, cached, scheduled):
    """`new` / `cached`: req_id -> computed tokens; `scheduled`: req_id -> tokens this step."""
    return SimpleNamespace(
        kv_connector_block_state=block_state, num_scheduled_tokens=dict(scheduled),
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=n) for r, n in new.items()],
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached), num_computed_tokens=list(cached.values())))


def test_save_jobs_per_step_and_no_block_table_for_a_step_without_full_blocks():
    layout = KindsLayout(BLOCK, BLOCK, (GroupKind.PAGED, GroupKind.SKIP), (KindsGroup(0, GroupKind.PAGED, "kv"),))
    sched = _Scheduler(layout, KeyChain(b"fp", BLOCK), ConnectorConfig(store="memory://?capacity=1MiB"), 1, 1)
    prompts = {f"r{i}": list(range(100 * i, 100 * i + 3 * BLOCK + 1)) for i in range(3)}  # 3 full blocks + 1
    requests = {r: SimpleNamespace(request_id=r, prompt_token_ids=p) for r, p in prompts.items()}
    for request in requests.values():
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    tables = {r: [[10 * i + b for b in range(4)], []] for i, r in enumerate(prompts)}
    keys = {r: sched._requests[r].block_keys for r in prompts}

    # Step 1: r0 prefills 2 blocks (new), r1 its whole prompt (new), r2 one token short of a block.
    state = _BlockState(tables)
    meta = sched.build_connector_meta(_output(state, {"r0": 0, "r1": 0, "r2": 0}, {},
                                              {"r0": 2 * BLOCK, "r1": 3 * BLOCK + 1, "r2": BLOCK - 1}))
    assert {job.req_id: job.pages for job in meta.saves} == {
        "r0": [(keys["r0"][i], 0, i, tables["r0"][0][i]) for i in range(2)],
        "r1": [(keys["r1"][i], 0, i, tables["r1"][0][i]) for i in range(3)]}
    assert sorted(state.asked) == ["r0", "r1"]

    # Step 2: r0 and r2 go on as cached requests, r1 decodes.
    state = _BlockState(tables)
    meta = sched.build_connector_meta(_output(state, {}, {"r1": 3 * BLOCK + 1, "r0": 2 * BLOCK, "r2": BLOCK - 1},
                                              {"r1": 1, "r0": BLOCK + 1, "r2": 2 * BLOCK + 2}))
    assert {job.req_id: job.pages for job in meta.saves} == {
        "r0": [(keys["r0"][2], 0, 2, tables["r0"][0][2])],
        "r2": [(keys["r2"][i], 0, i, tables["r2"][0][i]) for i in range(3)]}
    assert sorted(state.asked) == ["r0", "r2"]

    # Steps 3+: everyone decodes; nothing to save, no block table asked for.
    for step in range(3):
        state = _BlockState(tables)
        computed = {r: 3 * BLOCK + 1 + step for r in prompts}
        meta = sched.build_connector_meta(_output(state, {}, computed, {r: 1 for r in prompts}))
        assert meta.saves == [] and state.asked == []


@pytest.mark.parametrize("retention, kept", [
    ("every", [1, 2, 3, 4, 5, 6]),
    ("last", [6]),
    ("last+exp", [1, 2, 4, 6]),
    ("last+junction", [3, 6]),  # vLLM's shared_prefix_boundary (3 blocks + 2 tokens) floors to 3
])
def test_save_job_keeps_only_the_retained_state_handoffs(retention, kept):
    """vLLM hands off a KDA checkpoint at every boundary (a retention interval of one block): the save
    job holds those the connector's state_retention keeps (`retention`), every PAGED page, and counts
    the hand-offs it dropped."""
    layout = KindsLayout(BLOCK, BLOCK, (GroupKind.STATE, GroupKind.PAGED, GroupKind.SKIP),
                         (KindsGroup(0, GroupKind.STATE, "kda"), KindsGroup(1, GroupKind.PAGED, "mla")))
    config = ConnectorConfig(store="memory://?capacity=1MiB", state_retention=retention)
    sched = _Scheduler(layout, KeyChain(b"fp", BLOCK), config, 1, 1)
    prompt = list(range(6 * BLOCK + 1))  # longest hit: 6 blocks
    request = SimpleNamespace(request_id="r", prompt_token_ids=prompt, shared_prefix_boundary=3 * BLOCK + 2)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    tables = {"r": [[20 + b for b in range(7)], [40 + b for b in range(7)]]}
    state = _BlockState(tables)
    state.boundary_state_offloads = {"r": [(0, 20 + k - 1, k * BLOCK) for k in range(1, 7)]}
    meta = sched.build_connector_meta(_output(state, {"r": 0}, {}, {"r": len(prompt)}))
    (job,) = meta.saves
    keys = sched._requests["r"].block_keys
    assert [p for p in job.pages if p[1] == 0] == [(keys[k - 1], 0, k - 1, 20 + k - 1) for k in kept]
    assert [p for p in job.pages if p[1] == 1] == [(keys[i], 1, i, 40 + i) for i in range(6)]
    assert sched.counters["checkpoints_not_retained"] == 6 - len(kept)
