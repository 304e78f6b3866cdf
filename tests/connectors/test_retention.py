"""KDA checkpoint retention (`connectors.retention`): which boundaries each policy keeps, the hit
alignment, refused spellings, the hit rule under a policy (a hit ends only where a checkpoint is held),
the junction rule, and the bundled runner cold == warm under every policy with hits ending exactly at a
kept boundary."""

import pytest
import torch

from kvoffload.connectors.plan import hit_and_junction, hit_blocks, page, pages_for_save
from kvoffload.connectors.retention import DEFAULT, EVERY, StateRetention, as_retention
from kvoffload.errors import ConfigError
from kvoffload.spec import GroupKind, KeyChain
from kvoffload.spec.layout import KindsGroup, KindsLayout

POLICIES = ["every", "last", "last+junction", "last+every:3", "last+exp", "last+backexp"]


def _layout(block_size: int = 4, alignment: int = 4) -> KindsLayout:
    groups = (KindsGroup(0, GroupKind.STATE, "kda", 1), KindsGroup(1, GroupKind.PAGED, "mla", 1))
    return KindsLayout(block_size=block_size, hit_alignment=alignment,
                       kinds=(GroupKind.STATE, GroupKind.PAGED, GroupKind.SKIP), cacheable_groups=groups, tp_size=1)


@pytest.mark.parametrize("text, kept", [
    ("every", list(range(1, 21))),
    ("last", [20]),
    ("last+every:3", [3, 6, 9, 12, 15, 18, 20]),
    ("last+exp", [1, 2, 4, 8, 16, 20]),
    ("last+backexp", [4, 12, 16, 18, 19, 20]),  # 20 - 16, 20 - 8, 20 - 4, 20 - 2, 20 - 1
    ("exp+backexp", [1, 2, 4, 8, 12, 16, 18, 19]),
    ("every:5", [5, 10, 15, 20]),
])
def test_boundaries_of_each_policy(text, kept):
    """A prompt of 20 blocks + 1 token at an alignment of one block: its longest hit is 20 blocks."""
    assert StateRetention.parse(text).boundaries(_layout(), 4 * 20 + 1, 20) == kept


def test_last_is_the_longest_hit_not_the_last_full_block():
    """A prompt of exactly 20 blocks keeps one token to compute: its longest hit, hence `last`, is 19."""
    assert StateRetention.parse("last").boundaries(_layout(), 4 * 20, 20) == [19]
    assert StateRetention.parse("last").boundaries(_layout(), 4 * 20, 20, key_blocks=6) == [6]  # keys capped


def test_junction_keeps_the_divergence_boundary_only():
    retention = StateRetention.parse("last+junction")
    assert retention.boundaries(_layout(), 81, 20, junction=7) == [7, 20]
    assert retention.boundaries(_layout(), 81, 20, junction=0) == [20]
    assert StateRetention.parse("last").boundaries(_layout(), 81, 20, junction=7) == [20]


@pytest.mark.parametrize("text, kept", [
    ("every", list(range(2, 21, 2))),  # hit-able boundaries only (multiples of 2 blocks), 20 too
    ("last", [18]),  # 79 tokens aligned down to 72: 18 blocks
    ("last+every:3", [6, 12, 18]),  # every 3rd hit-able boundary: 3 * 2 blocks
    ("last+exp", [2, 4, 8, 16, 18]),  # hit-able boundaries 1, 2, 4, 8
    ("last+backexp", [2, 10, 14, 16, 18]),  # 9 steps - 8, 4, 2, 1
])
def test_only_hit_able_boundaries_are_kept(text, kept):
    """Alignment of 2 blocks (a kpool or cache_hit_alignment_tokens wider than the block): a checkpoint
    between two hit-able boundaries could never end a hit, so no policy keeps one."""
    layout = _layout(4, 8)
    retention = StateRetention.parse(text)
    assert retention.boundaries(layout, 80, 20) == kept
    assert retention.boundaries(layout, 80, 20, junction=7) == sorted(set(kept) | ({6} if retention.junction else set()))
    assert StateRetention.parse("junction").boundaries(layout, 80, 20, junction=7) == [6]  # aligned down


@pytest.mark.parametrize("text, message", [
    ("", "non-empty string"),
    ("   ", "non-empty string"),
    ("lats", "unknown rule 'lats'"),
    ("last+", "unknown rule ''"),
    ("last+exp:2", "unknown rule 'exp:2'"),
    ("Last", "unknown rule 'Last'"),
    ("every:0", "every:K needs a whole number K >= 1, got '0'"),
    ("every:-2", "every:K needs a whole number K >= 1"),
    ("every:two", "every:K needs a whole number K >= 1"),
    ("every:", "every:K needs a whole number K >= 1"),
    ("last+last", "rule 'last' given twice"),
    ("every+every:4", "rule 'every' given twice"),
])
def test_bad_spellings_are_refused(text, message):
    with pytest.raises(ConfigError, match=message) as raised:
        StateRetention.parse(text)
    assert isinstance(raised.value, ValueError)


def test_a_policy_keeping_nothing_or_a_non_string_is_refused():
    with pytest.raises(ConfigError, match="keeps no checkpoint"):
        StateRetention()
    with pytest.raises(ConfigError, match="non-empty string"):
        StateRetention.parse(4)


@pytest.mark.parametrize("text, canonical", [
    ("every", "every"), ("every:1", "every"), ("last+every", "every"), ("exp+last", "last+exp"),
    ("last + every:4", "last+every:4"), ("backexp+junction+last+exp", "last+junction+exp+backexp"),
])
def test_canonical_spelling_round_trips(text, canonical):
    retention = StateRetention.parse(text)
    assert str(retention) == canonical and StateRetention.parse(canonical) == retention


def test_as_retention():
    assert as_retention(None) == DEFAULT and as_retention("every") == EVERY and as_retention(EVERY) is EVERY


@pytest.mark.parametrize("text", POLICIES)
@pytest.mark.parametrize("alignment", [4, 8])
def test_a_hit_ends_exactly_at_the_longest_kept_boundary(text, alignment):
    """Save a 12-block prompt's pages under the policy; a prompt sharing its first m blocks then hits
    at the longest boundary the policy kept within both (never at one it dropped)."""
    layout, retention = _layout(4, alignment), StateRetention.parse(text)
    chain = KeyChain(b"fp", layout.block_size)
    saved = list(range(1000, 1000 + 4 * 12 + 2))
    keys = chain.keys(saved)
    checkpoints = retention.state_blocks(layout, len(saved), range(12))
    store = {p.key for p in pages_for_save(layout, keys, 12, checkpoints)}
    kept = set(retention.boundaries(layout, len(saved), 12))
    assert {i + 1 for i in checkpoints} == kept
    for m in range(13):
        prompt = saved[:4 * m] + list(range(7, 7 + 9))  # diverges after m blocks
        limit = min(m, (len(prompt) - 1) // alignment * alignment // 4)
        got = hit_blocks(layout, chain.keys(prompt), len(prompt), lambda q: [k in store for k in q])
        assert got == max((k for k in kept if k <= limit), default=0), (m, got)


def test_junction_is_where_stored_pages_run_past_the_hit():
    """A prompt stored under `last` leaves its inner boundaries without checkpoints; a second prompt that
    shares 5 of its blocks misses (no checkpoint there) but learns the junction, 5; saved with
    `last+junction` it keeps that checkpoint, so a third prompt sharing the 5 blocks hits there."""
    layout, chain = _layout(), KeyChain(b"fp", 4)
    last, junction = StateRetention.parse("last"), StateRetention.parse("last+junction")
    store: set[bytes] = set()

    def contains(query):
        return [k in store for k in query]

    def save(prompt, retention, junction_blocks=0):
        keys, full = chain.keys(prompt), len(prompt) // 4
        checkpoints = retention.state_blocks(layout, len(prompt), range(full), junction=junction_blocks)
        store.update(p.key for p in pages_for_save(layout, keys, full, checkpoints))

    first = list(range(100, 100 + 4 * 9 + 1))
    save(first, last)
    second = first[:20] + list(range(3, 3 + 11))
    assert hit_and_junction(layout, chain.keys(second), len(second), contains) == (0, 5)
    save(second, junction, 5)
    assert page(layout, chain.keys(second)[4], layout.cacheable_groups[0], 4).key in store
    third = first[:20] + list(range(400, 410))
    assert hit_and_junction(layout, chain.keys(third), len(third), contains) == (5, 0)


# ---------------------------------------------------------------------------- the bundled runner

BLOCK = 16
COLD_BLOCKS = 7  # the cold prompt: 7 full blocks + 5 tokens (longest hit 7 blocks)
SHARED_BLOCKS = 5  # the later prompts share its first 5 blocks, then diverge
# policy -> (boundaries the cold run keeps, blocks the second prompt hits, blocks the third one hits)
EXPECTED = {
    "every": ({1, 2, 3, 4, 5, 6, 7}, 5, 5),
    "last": ({7}, 0, 0),
    "last+junction": ({7}, 0, 5),  # the second prompt found the junction at 5 and kept it
    "last+every:3": ({3, 6, 7}, 3, 3),
    "last+exp": ({1, 2, 4, 7}, 4, 4),
    "last+backexp": ({3, 5, 6, 7}, 5, 5),
}


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def runner_prompts(tiny_model):
    """The cold prompt, two prompts sharing its first blocks, and each one's greedy tokens computed
    alone on a fresh engine with no store (the reference)."""
    from glm_integration.cache import PagedCache
    from glm_integration.engine import Engine

    config, model, model_id = tiny_model
    cold = _tokens(COLD_BLOCKS * BLOCK + 5, 1)
    prompts = [cold, cold[:SHARED_BLOCKS * BLOCK] + _tokens(20, 2), cold[:SHARED_BLOCKS * BLOCK] + _tokens(27, 3)]
    reference = [Engine(model, PagedCache(config, BLOCK, 32, model_id=model_id)).generate([p], 6)[0].output
                 for p in prompts]
    return prompts, reference


@pytest.mark.parametrize("text", list(EXPECTED))
def test_runner_warm_runs_equal_cold_and_hit_at_a_kept_boundary(tiny_model, runner_prompts, text):
    """Each prompt on a fresh engine (no local prefix cache) over one store with the connector under the
    policy: greedy tokens equal the reference, the store holds checkpoints exactly at the kept
    boundaries, and each hit (tokens the connector loaded) ends at the kept boundary the table names."""
    from glm_integration.cache import PagedCache
    from glm_integration.engine import Engine
    from kvoffload import open_store
    from kvoffload.connectors.runner import RunnerConnector

    config, model, model_id = tiny_model
    prompts, reference = runner_prompts
    kept, second_hit, third_hit = EXPECTED[text]
    with open_store("memory://?capacity=256MiB") as store:
        loaded, connectors = [], []
        for prompt, expected in zip(prompts, reference):
            engine = Engine(model, PagedCache(config, BLOCK, 32, model_id=model_id))
            connectors.append(RunnerConnector(store, engine, state_retention=text))
            (request,) = engine.generate([prompt], 6)
            assert request.output == expected, (text, len(loaded))
            assert request.cached_tokens == 0
            loaded.append(request.loaded_tokens)
            if not loaded[1:]:  # after the cold run: its checkpoints, exactly at the kept boundaries
                layout, keys = engine.cache.layout, request.keys
                state = [g for g in layout.cacheable_groups if g.kind is GroupKind.STATE]
                assert len(state) >= 2  # the tiny model's KDA groups
                for k in range(1, COLD_BLOCKS + 1):
                    there = store.contains_many([page(layout, keys[k - 1], g, k - 1).key for g in state])
                    assert there == [k in kept] * len(state), (text, k)
        assert loaded == [0, second_hit * BLOCK, third_hit * BLOCK]
        assert connectors[0].retention == StateRetention.parse(text)


def test_trace_replay_saves_checkpoints_under_the_policy(tmp_path):
    """`bench trace`'s replay: a retention row per disk set-up and policy, and under `last` the replay
    writes only the PAGED pages plus one checkpoint per request's longest hit, fewer bytes than under
    `every` (a small seeded workload; GLM-5.3-Flash's page sizes at a quarter of vLLM's block)."""
    from kvoffload.tools.bench import trace

    retention_rows = [p for p in trace.POLICIES if len(p) > 7]
    assert {(p[1], str(p[7])) for p in retention_rows} == {
        (d, r) for d in trace.DISK_CAPACITIES for r in trace.RETENTIONS}
    layout = trace.glm_layout(1088)
    requests = trace.workload(3, chats=3, agents=1, documents=2, system_tokens=3000)
    chain = KeyChain(layout.fingerprint, layout.block_size, namespace="test")
    keys = [chain.keys(r.tokens) for r in requests]
    rows = {}
    for name in ("every", "last"):
        replay = trace._Replay(layout, trace.DISK_CAPACITIES[0], 1, "lru", str(tmp_path / name), 1.0,
                               retention=StateRetention.parse(name))
        for request, request_keys in zip(requests, keys):
            replay.request(request_keys, len(request.tokens), request.arrival)
        rows[name] = replay.result(name)
    state_bytes = sum(-(-g.used_bytes_per_block // trace.SCALE) * trace.SCALE
                      for g in layout.cacheable_groups if g.kind is GroupKind.STATE)
    every, last = rows["every"], rows["last"]
    assert (every["state_retention"], last["state_retention"]) == ("every", "last")
    assert 0 < last["memory_written_bytes"] < every["memory_written_bytes"]
    assert (every["memory_written_bytes"] - last["memory_written_bytes"]) % state_bytes == 0  # whole checkpoints
    assert last["hit_tokens"] > 0
