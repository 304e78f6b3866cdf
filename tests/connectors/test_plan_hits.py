"""`plan.hit_blocks` against the hit rule spelled out block by block (plan's docstring), on random
presence patterns: hybrid groups, a hit alignment of several blocks, TP ranks with a shared group."""

import random

import pytest

from kvoffload.connectors.plan import hit_blocks, max_hit_blocks, page
from kvoffload.spec import GroupKind, KeyChain
from kvoffload.spec.layout import KindsGroup, KindsLayout


def _layout(tp_size: int, hybrid: bool = True) -> KindsLayout:
    groups = (KindsGroup(0, GroupKind.STATE, "kda", 1), KindsGroup(1, GroupKind.PAGED, "mla", tp_size),
              KindsGroup(2, GroupKind.PAGED, "own", 1))
    if not hybrid:  # attention only (a llama): a boundary needs no checkpoint
        groups = groups[1:]
    return KindsLayout(block_size=4, hit_alignment=8, kinds=(GroupKind.STATE, GroupKind.PAGED, GroupKind.PAGED,
                                                           GroupKind.SKIP), cacheable_groups=groups, tp_size=tp_size)


def _reference(layout, keys, prompt_tokens, present, start):
    """The longest k >= start: k blocks aligned, a prompt token left, every rank's PAGED pages of blocks
    [start, k) and STATE checkpoint at block k - 1 present."""
    def there(i, kind):
        return all(page(layout, keys[i], g, i, rank).key in present for g in layout.cacheable_groups
                   if g.kind is kind for rank in range(layout.tp_size))

    best = start
    for k in range(start + 1, min(max_hit_blocks(layout, prompt_tokens), len(keys)) + 1):
        if not all(there(i, GroupKind.PAGED) for i in range(start, k)):
            break
        if k * layout.block_size % layout.hit_alignment == 0 and there(k - 1, GroupKind.STATE):
            best = k
    return best


@pytest.mark.parametrize("hybrid", [True, False])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_hit_blocks_follows_the_rule_on_random_patterns(tp_size, hybrid):
    layout = _layout(tp_size, hybrid)
    rng = random.Random(tp_size)
    keys = KeyChain(b"fp", layout.block_size).keys(list(range(4 * 24)))
    every = [page(layout, k, g, i, rank).key for i, k in enumerate(keys) for g in layout.cacheable_groups
             for rank in range(tp_size)]
    for trial in range(300):
        missing = rng.choice([0, 1, 2, 5])
        present = set(every) - set(rng.sample(every, missing))
        prompt_tokens = rng.choice([4 * 24, 4 * 24 + 1, 4 * 13 + 2])
        start = rng.choice([0, 0, 2, 5])
        calls = []

        def contains(query):
            calls.append(query)
            return [key in present for key in query]

        got = hit_blocks(layout, keys, prompt_tokens, contains, start)
        assert got == _reference(layout, keys, prompt_tokens, present, start), (trial, missing, start)
        # one batched presence query; a second (checkpoints below) only when the whole prefix is no hit
        limit = min(max_hit_blocks(layout, prompt_tokens), len(keys))
        top = limit * layout.block_size // layout.hit_alignment * layout.hit_alignment // layout.block_size
        assert len(calls) == 1 if got == top > start else len(calls) <= 2
        queried = [key for query in calls for key in query]
        assert len(queried) == len(set(queried))  # no key asked twice
