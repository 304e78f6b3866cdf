"""Which (group, block) pages to save and load, for a request under a layout. Pure functions: no I/O.

- PAGED groups: one page per full block (all the group's layers, used bytes only).
- STATE groups: one checkpoint per block boundary, stored with the block that ends there; saved only
  where the engine says it holds one (block-aligned chunking gives one at every boundary).
- SKIP groups: never.
A prefix of k blocks is a hit only when every PAGED page of blocks [0, k) and every STATE checkpoint
at boundary k are present, k * block_size is a multiple of the hit alignment (hence of index_kpool:
no open pool to restore), and at least one prompt token is left to compute.
Under tensor parallelism a page's key names its shard (`spec.keys.shard_key`): a group replicated on
several ranks is written by the first rank of each replica set and read by all, and a hit needs the
pages of every rank (`every_rank_keys`, the one place that spells those keys out).
Every page set an adapter moves is decided here, on a `LayoutView` (a worker's or the runner's
`CacheLayout`, or vLLM's rank-free scheduler `KindsLayout`): a hit (`hit_and_junction`), a load
(`pages_for_load`), a save (`plan_save`: PAGED pages from a start block, STATE checkpoints the engine
holds or hands off, a loaded range excluded, the retention policy applied), the keys a save in flight
or a held block stands for (`in_flight_keys`, `held_keys`), and a rank's own pages of pages planned
rank-free (`rank_free` -> `own_pages`). Adapters only say what the engine holds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Generic, NamedTuple, TypeVar

from ..spec import GroupKind, page_key, shard_key
from ..spec.layout import GroupView, LayoutView

# A request's block table: one for every group (the bundled runner), or one per group index (vLLM's
# hybrid allocator gives each group its own block IDs).
BlockTable = Sequence[int] | Mapping[int, Sequence[int]]
# A store's batched presence query (`Store.contains_many`): one answer per key, in order.
Contains = Callable[[list[bytes]], list[bool]]

G = TypeVar("G", bound=GroupView)

# Pages per store call in a background job (a host save or load, a prefetch): between two calls the job
# hands the GIL back (the engine's thread, waiting for it, runs its step) and a prefetch sees whether it
# was cancelled.
STORE_CALL_PAGES = 16


class Page(NamedTuple, Generic[G]):
    """A page to move: the one reference plan, offloader, jobs and transfers share. Its group is the
    layout's: a `CacheGroup` (byte placement: what a transfer needs) or, planned on vLLM's scheduler
    view, a `KindsGroup`. A tuple: a restore makes one per page on its critical path (half the cost of
    a frozen dataclass)."""

    key: bytes  # store key: page_key(block key, group name)
    group: G
    index: int  # type: ignore[assignment]  # block index within the request (tokens [i*B, (i+1)*B)); hides tuple.index
    block: int | None = None  # physical block in the cache; None until placed through a block table


# A Page from a (key, group, index, block) tuple, in C: `map` of it makes a restore's pages without a
# Python call each (`Page(...)` runs the tuple class's generated `__new__`).
_page_of = functools.partial(tuple.__new__, Page)


def physical_block(table: BlockTable, group: GroupView, index: int) -> int:
    """Where block `index` of a request lives for `group`, under `table`."""
    return table[group.index][index] if isinstance(table, Mapping) else table[index]


def store_key(layout: LayoutView, block_key: bytes, group: GroupView, rank: int | None = None) -> bytes:
    """The store key of one group's page of a block for `rank` (default: the layout's own TP rank; a
    scheduler's rank-free view names rank 0's): `page(...).key` without building the page."""
    rank = layout.tp_rank if rank is None else rank
    return page_key(shard_key(block_key, rank, layout.tp_size, group.tp_replicas), group.name)


def _store_keys(
    layout: LayoutView, block_keys: Sequence[bytes], pages: Iterable[tuple[int, GroupView]], rank: int
) -> list[bytes]:
    """`store_key` of pages, each a (block index, group), for `rank`: on one rank a block key is its own
    shard's (`shard_key`), so each is one remembered `page_key` (a restore's lookup and load derive
    hundreds on its critical path). The one place that writes this rule."""
    if layout.tp_size == 1:
        return [page_key(block_keys[i], g.name) for i, g in pages]
    return [store_key(layout, block_keys[i], g, rank) for i, g in pages]


def page(
    layout: LayoutView, block_key: bytes, group: G, index: int, rank: int | None = None, block: int | None = None
) -> Page[G]:
    """One group's page of a block, keyed for `rank` (see `store_key`), at physical `block` if given."""
    return Page(store_key(layout, block_key, group, rank), group, index, block)


def writes(layout: LayoutView, group: GroupView) -> bool:
    """Whether this rank stores `group`'s pages: one rank per set of replicas does."""
    return layout.tp_rank % group.tp_replicas == 0


def _groups(layout: LayoutView[G], kind: GroupKind) -> list[G]:
    return [g for g in layout.cacheable_groups if g.kind is kind]


def _pages(
    layout: LayoutView[G],
    block_keys: Sequence[bytes],
    blocks: Iterable[int],
    kind: GroupKind,
    rank: int | None = None,
    table: BlockTable | None = None,
) -> list[Page[G]]:
    """`page` of each of `kind`'s groups of each block, block by block, each group's block table column
    found once (a restore's pages are made on its critical path: thousands at block 64)."""
    rank = layout.tp_rank if rank is None else rank
    blocks = blocks if isinstance(blocks, range) else list(blocks)
    per_group = []  # one list per group (a comprehension each), interleaved block by block below
    for g in _groups(layout, kind):
        at = None if table is None else table[g.index] if isinstance(table, Mapping) else table
        places = repeat(None) if at is None else map(at.__getitem__, blocks)
        keys = _store_keys(layout, block_keys, zip(blocks, repeat(g)), rank)
        per_group.append(list(map(_page_of, zip(keys, repeat(g), blocks, places))))
    return per_group[0] if len(per_group) == 1 else [p for block in zip(*per_group) for p in block]


def every_rank_keys(
    layout: LayoutView, block_keys: Sequence[bytes], pages: Iterable[tuple[int, GroupView]]
) -> dict[bytes, int]:
    """The store keys of pages, each a (block index, group), on every TP rank (a key ranks share once)
    -> their block index. The one place that spells out every rank's keys of a block."""
    pages = list(pages)
    blocks = [i for i, _ in pages]
    keys: dict[bytes, int] = {}
    for rank in range(layout.tp_size):
        keys.update(zip(_store_keys(layout, block_keys, pages, rank), blocks))
    return keys


def held_keys(layout: LayoutView, block_keys: Sequence[bytes], index: int) -> list[bytes]:
    """Every rank's keys of block `index` that a hit through it needs: its PAGED pages and the STATE
    checkpoint at its end (a block is *held* when all are stored: `vllm_events`)."""
    return list(every_rank_keys(layout, block_keys, [(index, g) for g in layout.cacheable_groups]))


def in_flight_keys(layout: LayoutView, block_keys: Sequence[bytes], pages: Iterable[Page]) -> list[bytes]:
    """Every rank's keys of a save's `pages` (planned on any rank's view), each once: what lookups count
    as present while the save runs, since a rank's own load runs after its own saves, in order. A page
    ranks share (written by one rank, read by all) is not among them: it counts only once it is stored."""
    return list(every_rank_keys(layout, block_keys, [(p.index, p.group) for p in pages if p.group.tp_replicas == 1]))


def max_hit_blocks(layout: LayoutView, num_prompt_tokens: int) -> int:
    """The longest prefix that may come from a cache: aligned, and one prompt token left to compute."""
    step = layout.hit_alignment
    aligned = (num_prompt_tokens - 1) // step * step
    return aligned // layout.block_size


def hit_blocks(
    layout: LayoutView, block_keys: Sequence[bytes], num_prompt_tokens: int, contains: Contains, start: int = 0
) -> int:
    """How many leading blocks a store can restore on every TP rank (>= `start`, the blocks the engine
    already holds; returns `start` when the store adds nothing). See `hit_and_junction`."""
    return hit_and_junction(layout, block_keys, num_prompt_tokens, contains, start)[0]


def hit_and_junction(
    layout: LayoutView, block_keys: Sequence[bytes], num_prompt_tokens: int, contains: Contains, start: int = 0
) -> tuple[int, int]:
    """`hit_blocks`, and the junction: where the leading run of blocks whose PAGED pages are all stored
    ends (aligned down), when that is past the hit, else 0. There a stored prefix lacks the checkpoint
    this prompt would need: another request stored those blocks and diverged later, so the boundary is
    a proven shared prefix (`retention`'s `junction` rule keeps its checkpoint).

    One batched presence query asks for every PAGED page and the checkpoint at the last aligned
    boundary (the whole prefix restored: the common hit); only when that checkpoint is missing does a
    second query ask for the checkpoints of the boundaries below, up to where the PAGED run ends. A
    long prefix's lookup derives a checkpoint key per boundary only then (a key is a hash: thousands
    of them are a restart's first restore's largest host cost)."""
    limit = min(max_hit_blocks(layout, num_prompt_tokens), len(block_keys))
    if limit <= start:
        return start, 0
    step = layout.hit_alignment // layout.block_size  # blocks per aligned boundary
    state_groups = _groups(layout, GroupKind.STATE)

    def checkpoint_keys(ends: Iterable[int]) -> dict[bytes, int]:  # every rank's, of the boundaries -> block index
        return every_rank_keys(layout, block_keys, [(end - 1, g) for end in ends for g in state_groups])

    def held(ends: list[int], keys: dict[bytes, int], answers: Sequence[bool]) -> set[int]:
        """The boundaries among `ends` whose checkpoints (`keys`, present per `answers`) are all stored
        (all of them where the layout has no STATE group)."""
        return set(ends) - {index + 1 for index, there in zip(keys.values(), answers) if not there}

    paged_groups = _groups(layout, GroupKind.PAGED)
    paged = every_rank_keys(layout, block_keys, [(i, g) for i in range(start, limit) for g in paged_groups])
    top = limit // step * step  # the last aligned boundary: the whole prefix, if it is there
    tops = [top] if top > start else []
    first = checkpoint_keys(tops)
    answers = contains([*paged, *first])
    run = min((index for index, there in zip(paged.values(), answers) if not there), default=limit)
    if run >= top and top in held(tops, first, answers[len(paged) :]):
        best = top
    else:  # not the whole prefix: the checkpoints of the boundaries below, up to the run's end
        ends = [end for end in range(run // step * step, start, -step) if end != top]
        below = checkpoint_keys(ends)
        best = max(held(ends, below, contains(list(below)) if below else []), default=start)
    junction = run // step * step
    return best, junction if junction > best else 0


def pages_for_load(
    layout: LayoutView[G], block_keys: Sequence[bytes], start: int, end: int, table: BlockTable | None = None
) -> list[Page[G]]:
    """Pages to restore blocks [start, end): their PAGED pages and the STATE checkpoint at `end`
    (placed at their physical blocks under `table`, if given)."""
    if end <= start:
        return []
    return _pages(layout, block_keys, range(start, end), GroupKind.PAGED, table=table) + _pages(
        layout, block_keys, [end - 1], GroupKind.STATE, table=table
    )


class Handoff(NamedTuple):
    """A STATE group's checkpoint an engine holds in a block of its own (vLLM's `boundary_state_offloads`
    entries, in their order): the state of the prefix [0, boundary) tokens."""

    group: int  # group index
    block: int  # the physical block holding it
    boundary: int  # tokens


@dataclass(frozen=True, slots=True)
class SavePlan(Generic[G]):
    pages: list[Page[G]]
    not_retained: int = 0  # checkpoints held but left out by the retention policy (`keep`)


def plan_save(
    layout: LayoutView[G],
    block_keys: Sequence[bytes],
    full_blocks: int,
    state_blocks: Iterable[int] = (),
    table: BlockTable | None = None,
    *,
    start: int = 0,
    handoffs: Iterable[Handoff] = (),
    loaded: range = range(0),
    keep: Callable[[int], bool] | None = None,
) -> SavePlan[G]:
    """What a save writes, the one place that decides it (`pages_for_save` is its page list):
    - PAGED: the pages of the full computed blocks [start, full_blocks) (within the keys), under `table`;
    - STATE: the checkpoint after each block of `state_blocks` below `full_blocks` (every STATE group,
      under `table`) and each of `handoffs` that ends on a block boundary within the keys (at its own
      block); never one inside the `loaded` blocks: vLLM offers a loaded boundary again, the very block
      the load writes into, and saving it after a failed load would store stale bytes as this prefix's
      checkpoint; and only those `keep(boundary in blocks)` retains (`retention.StateRetention.keeper`;
      all without `keep`), the others counted in `not_retained`;
    - of a replicated group, only on the rank that writes it (`writes`)."""
    end = min(full_blocks, len(block_keys))
    pages = _pages(layout, block_keys, range(start, end), GroupKind.PAGED, table=table)
    stateful = {g.index: g for g in _groups(layout, GroupKind.STATE)}
    held = [
        (g, i, None if table is None else physical_block(table, g, i))
        for i in sorted(set(state_blocks) & set(range(end)))
        for g in stateful.values()
    ]
    for group_id, block_id, boundary in handoffs:
        index = boundary // layout.block_size - 1
        if group_id in stateful and boundary % layout.block_size == 0 and 0 <= index < len(block_keys):
            held.append((stateful[group_id], index, block_id))
    not_retained = 0
    for g, i, block in held:
        if i in loaded:
            continue
        if keep is not None and not keep(i + 1):
            not_retained += 1
            continue
        pages.append(page(layout, block_keys[i], g, i, block=block))
    return SavePlan([p for p in pages if writes(layout, p.group)], not_retained)


def pages_for_save(
    layout: LayoutView[G],
    block_keys: Sequence[bytes],
    full_blocks: int,
    state_blocks: Iterable[int],
    table: BlockTable | None = None,
) -> list[Page[G]]:
    """PAGED pages of every full computed block; STATE pages only where a boundary checkpoint exists;
    of a replicated group only on the rank that writes it (placed under `table`, if given): `plan_save`."""
    return plan_save(layout, block_keys, full_blocks, state_blocks, table).pages


# A page planned on a rank-free view, for every rank to key as its own: (block key, group index, block
# index, physical block); compact on vLLM's pickled scheduler -> worker channel.
PlacedPage = tuple[bytes, int, int, int]


def rank_free(block_keys: Sequence[bytes], pages: Iterable[Page]) -> list[PlacedPage]:
    """Placed pages (`Page.block` set) as each rank keys them again (`own_pages`)."""
    return [(block_keys[p.index], p.group.index, p.index, p.block) for p in pages if p.block is not None]


def own_pages(layout: LayoutView[G], placed: Iterable[PlacedPage]) -> list[Page[G]]:
    """This rank's pages of pages planned rank-free (`rank_free`): keyed for the layout's TP rank, of a
    replicated group only where this rank writes it."""
    groups = {g.index: g for g in layout.cacheable_groups if writes(layout, g)}
    return [page(layout, key, groups[g], index, block=block) for key, g, index, block in placed if g in groups]
