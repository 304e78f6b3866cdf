"""The layout model: WHAT of a paged KV cache is cached, and exactly where its bytes are.

A cache is a set of groups sharing one block table each. A group is
  PAGED  per-block pages addressed by token position (full attention, MLA latent, DSA indexer pools);
  STATE  a recurrent checkpoint valid at a block boundary (KDA / Mamba: conv window + recurrent S);
  SKIP   never cached (the kpool tail ring, scratch, anything not prefix-cacheable).
Each group's pages live in one or more `Region`s of the backing buffers: the page of layer `l` in
block `b` starts at `offset + l * layer_stride + b * block_stride`, and only its first `used_bytes`
are data (the rest is padding that packing added, which is never copied or stored).
`KindsLayout` is the same cache without byte placement (vLLM's scheduler process plans with it); `plan`
takes either through `LayoutView`, the protocol both satisfy.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol, TypeAlias, TypeVar

# Bump when the meaning of stored page bytes changes for the same layout.
PAGE_FORMAT_VERSION = 1


class GroupKind(enum.StrEnum):
    PAGED = "paged"
    STATE = "state"
    SKIP = "skip"


@dataclass(frozen=True)
class Region:
    """A run of same-shaped layer pages of one group inside one backing buffer."""

    buffer: int  # index of the backing buffer (allocation) holding these pages
    offset: int  # byte offset of the first layer's block-0 page
    layer_stride: int
    block_stride: int
    layer_names: tuple[str, ...]
    used_bytes: int  # bytes of data per page (per layer, per block)
    page_bytes: int  # bytes allocated per page, padding included
    dtype: str  # element type of the page content, for the fingerprint and for humans
    # What the page's bytes mean beyond their size (e.g. shapes, dtypes and dim order of its states, the
    # worker tensors' dim order): two same-size layouts must not read each other's pages.
    content: str = ""

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def page_offset(self, layer: int, block: int) -> int:
        """Byte offset of the page of `layer` (index within this region) in `block`."""
        return self.offset + layer * self.layer_stride + block * self.block_stride

    def end(self, num_blocks: int) -> int:
        """One past the last byte this region may touch, for bounds checks."""
        last_layer = max(self.num_layers - 1, 0)
        return self.page_offset(last_layer, num_blocks - 1) + self.page_bytes

    def geometry(self) -> dict:
        """What the stored bytes depend on; offsets and strides do not (they change with num_blocks)."""
        return {"layers": self.num_layers, "used_bytes": self.used_bytes, "dtype": self.dtype, "content": self.content}


@dataclass(frozen=True)
class CacheGroup:
    index: int
    name: str
    kind: GroupKind
    block_size: int  # tokens per block of this group
    regions: tuple[Region, ...]
    tokens_per_state: int = 1  # tokens pooled into one stored row (index_kpool for the DSA indexer)
    spec_type: str = ""  # the engine's spec class, for messages and `inspect`
    content: str = ""  # the page meaning the scheduler also sees (it is in the key context); see Region.content
    # Consecutive tensor-parallel ranks holding identical bytes of this group (1: every rank its own
    # shard, e.g. KDA heads; tp_size: replicated on all, e.g. the MLA latent). See `spec.keys.shard_key`.
    tp_replicas: int = 1

    @property
    def cacheable(self) -> bool:
        return self.kind is not GroupKind.SKIP

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(name for r in self.regions for name in r.layer_names)

    @cached_property
    def used_bytes_per_block(self) -> int:
        """Bytes one block of this group really holds, summed over its layers."""
        return sum(r.used_bytes * r.num_layers for r in self.regions)

    def page_spans(self, block: int) -> list[tuple[int, int]]:
        """(offset, length) of every layer's used bytes in physical `block`: a page is their concatenation."""
        return [(r.page_offset(layer, block), r.used_bytes) for r in self.regions for layer in range(r.num_layers)]

    def geometry(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind.value,
            "block_size": self.block_size,
            "tokens_per_state": self.tokens_per_state,
            "content": self.content,
            "regions": [r.geometry() for r in self.regions],
        }


@dataclass(frozen=True)
class CacheLayout:
    """A whole cache: its groups, block geometry, and the identity of what its pages mean."""

    model_id: str
    groups: tuple[CacheGroup, ...]
    block_size: int  # tokens per block of the prefix cache (the scheduler's block)
    hash_block_size: int  # tokens per block hash
    hit_alignment: int  # a prefix hit is a multiple of this many tokens
    num_blocks: int
    buffer_sizes: tuple[int, ...]
    index_kpool: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    extra: tuple[tuple[str, str], ...] = field(default=())  # e.g. (("kv_cache_dtype", "fp8"),)

    def __post_init__(self) -> None:
        if self.hit_alignment % self.index_kpool:
            raise ValueError(
                f"hit alignment {self.hit_alignment} is not a multiple of index_kpool "
                f"{self.index_kpool}: a hit boundary would leave an open pool behind"
            )
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        for group in self.groups:
            if group.tp_replicas < 1 or self.tp_size % group.tp_replicas:
                raise ValueError(
                    f"group {group.name}: tp_replicas {group.tp_replicas} does not divide tp_size {self.tp_size}"
                )
            for region in group.regions:
                if region.used_bytes > region.page_bytes:
                    raise ValueError(
                        f"group {group.name}: used bytes {region.used_bytes} exceed the page ({region.page_bytes})"
                    )
                if self.num_blocks and region.end(self.num_blocks) > self.buffer_sizes[region.buffer]:
                    raise ValueError(
                        f"group {group.name}: pages run past the end of buffer {region.buffer} "
                        f"({region.end(self.num_blocks)} > {self.buffer_sizes[region.buffer]})"
                    )

    @cached_property
    def cacheable_groups(self) -> tuple[CacheGroup, ...]:
        return tuple(g for g in self.groups if g.cacheable)

    def group(self, name: str) -> CacheGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no cache group named {name!r} (have {', '.join(g.name for g in self.groups)})")

    def stored_bytes_per_block(self) -> int:
        """What offload stores per full block: the used bytes of the cacheable groups, nothing else."""
        return sum(g.used_bytes_per_block for g in self.cacheable_groups)

    def fingerprint_fields(self) -> dict:
        return {
            "page_format": PAGE_FORMAT_VERSION,
            "model_id": self.model_id,
            "block_size": self.block_size,
            "hash_block_size": self.hash_block_size,
            "index_kpool": self.index_kpool,
            "tp_size": self.tp_size,  # not the rank: keys name a rank's own shards (`shard_key`)
            "groups": [g.geometry() for g in self.groups],
            "extra": [list(kv) for kv in self.extra],
        }

    @property
    def fingerprint(self) -> bytes:
        """16 bytes naming what a stored page means; any change in geometry, dtype, byte layout (state
        shapes, dim order), model, TP size or kpool gives another fingerprint, so pages of one layout are
        never served to another. Every rank of a TP group has the same one (a replicated page written by
        one rank is read by all)."""
        canonical = json.dumps(self.fingerprint_fields(), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(canonical.encode(), digest_size=16, person=b"kvoffload-layout").digest()


@dataclass(frozen=True)
class KindsGroup:
    """A cache group without byte placement: what the scheduler side plans with."""

    index: int
    kind: GroupKind
    name: str
    tp_replicas: int = 1


# What `plan` reads of a cache group (index, name, kind, tp_replicas): a worker's or the scheduler's.
GroupView: TypeAlias = CacheGroup | KindsGroup


G_co = TypeVar("G_co", bound=GroupView, covariant=True)


class LayoutView(Protocol[G_co]):
    """What `plan` reads of a layout: a `CacheLayout` (a worker's, the bundled runner's, with byte
    placement) or a `KindsLayout` (vLLM's scheduler, without), both engine-neutral."""

    @property
    def block_size(self) -> int: ...
    @property
    def hit_alignment(self) -> int: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def cacheable_groups(self) -> Sequence[G_co]: ...


@dataclass(frozen=True)
class KindsLayout:
    """What `plan` needs on the scheduler side (group kinds, block size, alignment) without byte
    placement, which only workers know (`spec.vllm.scheduler_view` builds it from vLLM's config)."""

    block_size: int
    hit_alignment: int
    kinds: tuple[GroupKind, ...]  # every group, SKIP included (keys and save jobs index groups by position)
    cacheable_groups: tuple[KindsGroup, ...]
    contents: tuple[str, ...] = ()  # every group's page content (`spec.vllm.group_content`), in the key context
    tp_size: int = 1  # the scheduler plans for every rank: a hit needs each rank's pages

    @property
    def tp_rank(self) -> int:
        """The view is rank-free: keys it names without a rank are rank 0's (`plan.store_key`)."""
        return 0

    @classmethod
    def of(cls, layout: CacheLayout) -> KindsLayout:
        """The same view of a worker's full layout."""
        return cls(
            layout.block_size,
            layout.hit_alignment,
            tuple(g.kind for g in layout.groups),
            tuple(KindsGroup(g.index, g.kind, g.name, g.tp_replicas) for g in layout.cacheable_groups),
            tuple(g.content for g in layout.groups),
            layout.tp_size,
        )


def lcm(*values: int) -> int:
    return math.lcm(*[v for v in values if v])
