"""The layout model from vLLM's `KVCacheConfig` (vLLM 0.32 to 0.34): the one place that bridges what
differs between vLLM builds (spec names and fields, the backing allocation), by feature, never by version.

Byte placement comes only from `kv_cache_config.kv_cache_tensors` (offset, layer stride, block stride:
they changed between vLLM versions, so nothing here hard-codes them), placed in the one buffer pages
are copied in and out of (`backing_buffer`: vLLM 0.34's extensible KV cache maps each layer on its own).
Spec classes map to kinds:
  not prefix-cacheable (the kpool tail ring: CircularBufferSpec, spelled KpoolTailSpec in some builds;
  scratch; non-transferable; the flag is `prefix_cacheable` or `participates_in_prefix_caching`) -> SKIP
  MambaSpec (KDA, GDN, Mamba in align/all mode)                                  -> STATE
  FullAttentionSpec, MLAAttentionSpec (latent, or DSA indexer with tokens_per_state) -> PAGED
Anything else is refused by name: guessing a layout is how pages end up in the wrong place.
Under tensor parallelism a group whose specs say its bytes are the same on several ranks
(`AttentionSpec.max_tp_shards`: ranks beyond it hold replicas, as MLA latents and indexer rows do;
`MambaSpec.tp_replicated`) is stored once per set of replicas (`CacheGroup.tp_replicas`), when the
store is shared by the ranks' processes.

What a page's bytes mean is more than its size: vLLM's conv-state layout (VLLM_SSM_CONV_STATE_LAYOUT,
SD or DS) transposes a mamba state inside the same page, and the KV cache layout (LBHNC, LBNHC...)
orders an attention page's heads and tokens. `page_content` names it from the spec (state shapes and
dtypes, head geometry) and the resolved `kv_cache_config.kv_cache_layout`; it is in the key context
(`key_context`, same in the scheduler and every worker) and in the layout fingerprint, which the
worker also binds to the dim order of the tensors vLLM really hands it. A store written under one
byte layout is therefore never read under another.

One derivation, two views: `scheduler_view` (kinds, page content, block size, hit alignment: what the
scheduler plans with; it has no byte placement) and `from_vllm` (the worker's full byte layout) take
them from the same helpers, and `check_agreement` (run by each worker at start-up) refuses a worker
layout that disagrees with the scheduler's view.
"""

from __future__ import annotations

import enum
import math
from typing import Any

from ..errors import LayoutError
from .keys import _framed
from .layout import CacheGroup, CacheLayout, GroupKind, KindsGroup, KindsLayout, Region, lcm

# The kpool tail ring's spec, by the names vLLM builds give it: never prefix-cached.
_TAIL_SPECS = ("CircularBufferSpec", "KpoolTailSpec")
# The spellings of a spec's "this group takes part in prefix caching" flag.
_CACHEABLE_FLAGS = ("prefix_cacheable", "participates_in_prefix_caching")
# Spec fields that say what a page's bytes mean (read where present): state shapes and dtypes in their
# order (SD vs DS conv state), head geometry, quantisation, pooling.
_CONTENT_FIELDS = (
    "shapes",
    "dtypes",
    "dtype",
    "num_kv_heads",
    "num_head_slots",
    "head_size",
    "head_size_v",
    "kv_quant_mode",
    "state_content_bytes",
    "tokens_per_state",
    "cache_dtype_str",
    "cache_role",
    "mamba_type",
    "kv_head_major_slots",
    "state_alignment",
)
# Content fields newer vLLM builds added, at the value that means the bytes of builds without them (left
# out of the page content there, so those pages keep their keys): vLLM 0.34's grouping of packed head
# slots by KV head (H2ND) and byte alignment of each Mamba state within its page.
_NEUTRAL_CONTENT = {"kv_head_major_slots": False, "state_alignment": 1}


class UnsupportedLayoutError(LayoutError):
    """A KV cache configuration kvoffload cannot offload correctly (said at start-up, never guessed)."""


def _layer_specs(group_spec) -> dict[str, object] | None:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if isinstance(group_spec, UniformTypeKVCacheSpecs):
        return dict(group_spec.kv_cache_specs)
    return None


def _prefix_cacheable(spec) -> bool:
    """False when the spec is a tail ring or says so by either spelling of the flag."""
    if any(cls.__name__ in _TAIL_SPECS for cls in type(spec).__mro__):
        return False
    return all(bool(getattr(spec, flag)) for flag in _CACHEABLE_FLAGS if hasattr(spec, flag))


def _kind(spec, group_index: int, transferable: bool) -> GroupKind:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    if not transferable or not _prefix_cacheable(spec):
        return GroupKind.SKIP
    if type(spec) is MambaSpec:
        if spec.mamba_cache_mode not in ("align", "all"):
            raise UnsupportedLayoutError(
                f"cache group {group_index}: MambaSpec with mamba_cache_mode={spec.mamba_cache_mode!r} keeps "
                "no block-boundary checkpoints; enable prefix caching (vLLM then uses align mode)"
            )
        return GroupKind.STATE
    if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
        return GroupKind.PAGED
    raise UnsupportedLayoutError(
        f"cache group {group_index}: unsupported KV cache spec type {type(spec).__name__} "
        f"({type(spec).__module__}); kvoffload supports FullAttentionSpec, MLAAttentionSpec, MambaSpec "
        "and non-prefix-cacheable groups (skipped)"
    )


def _dtype(spec) -> str:
    if hasattr(spec, "dtypes"):
        return "+".join(str(d).removeprefix("torch.") for d in spec.dtypes)
    return str(spec.dtype).removeprefix("torch.")


def _canon(value) -> str:
    """A process-independent spelling of a spec field (dtypes without 'torch.', enums by name)."""
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_canon(v) for v in value) + ")"
    if isinstance(value, enum.Enum):
        return value.name
    if type(value).__module__ == "torch":
        return str(value).removeprefix("torch.")
    return repr(value)


def _page_order(kv_cache_layout: str | None) -> str:
    """The order of heads (H), tokens (N) and content (C) inside an attention page under vLLM's resolved
    KV cache layout ('HNC' for LBHNC); the layout's name where vLLM has no such enum."""
    if not kv_cache_layout:
        return "unknown"
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        return "".join("LBHNC"[axis] for axis in KVCacheLayout[kv_cache_layout].value if axis >= 2)
    except (ImportError, KeyError):
        return str(kv_cache_layout)


def page_content(spec, kv_cache_layout: str | None) -> str:
    """What one layer's page means beyond its size: the spec type and its content fields, and for
    attention pages the in-page order of the KV cache layout. Same-size layouts differ here."""
    parts = [type(spec).__name__]
    for name in _CONTENT_FIELDS:
        try:
            value = getattr(spec, name)
        except (AttributeError, NotImplementedError):
            continue
        if name in _NEUTRAL_CONTENT and value == _NEUTRAL_CONTENT[name]:
            continue
        parts.append(f"{name}={_canon(value)}")
    if not hasattr(spec, "shapes"):  # an attention page: heads and tokens in the KV cache layout's order
        parts.append(f"order={_page_order(kv_cache_layout)}")
    return " ".join(parts)


def group_content(group, kv_cache_config) -> str:
    """A group's page content as the scheduler sees it (one layer's spec, see `_scheduler_specs`)."""
    return page_content(_scheduler_specs(group)[0], getattr(kv_cache_config, "kv_cache_layout", None))


def tensor_order(tensor) -> str:
    """A worker tensor's element type, shape past the block dim and physical dim order (dims by falling
    stride; size-1 dims carry no order), e.g. 'bfloat16(4,64,256):0123'; lists describe each member."""
    if isinstance(tensor, (list, tuple)):
        return "[" + ";".join(tensor_order(t) for t in tensor) + "]"
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    dims = sorted((d for d in range(len(shape)) if d == 0 or shape[d] > 1), key=lambda d: (-strides[d], d))
    return f"{_canon(tensor.dtype)}{_canon(shape[1:])}:{''.join(map(str, dims))}"


def _used_bytes(spec) -> int:
    """Bytes of real content at the start of each page: packing pads pages, padding is not data."""
    return int(spec.real_page_size_bytes)


def group_name(index: int, kind: GroupKind) -> str:
    """Names depend only on what the scheduler and every worker both see (index and kind), because
    page keys include them."""
    return f"g{index}-{kind.value}"


def group_kinds(kv_cache_config) -> list[GroupKind]:
    """The kind of every group, from the specs alone (enough for the scheduler side, whose config
    replaces uniform-type wrappers by one layer's spec)."""
    kinds = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        per_layer = _layer_specs(group.kv_cache_spec) or {"": group.kv_cache_spec}
        found = {_kind(spec, index, getattr(group, "enable_kv_transfer", True)) for spec in per_layer.values()}
        if len(found) != 1:
            raise UnsupportedLayoutError(f"cache group {index} mixes cache kinds {sorted(k.value for k in found)}")
        kinds.append(found.pop())
    return kinds


def _scheduler_specs(group) -> list:
    """The specs the scheduler process sees for a group: its copy of the config replaces a
    uniform-type wrapper by one (the first) layer's spec (`generate_scheduler_kv_cache_config`)."""
    per_layer = _layer_specs(group.kv_cache_spec)
    return [next(iter(per_layer.values()))] if per_layer else [group.kv_cache_spec]


def _pool_sizes(specs) -> set[int]:
    """Pooling factors (`tokens_per_state` > 1: e.g. the DSA indexer's kpool) among `specs`."""
    pools = set()
    for spec in specs:
        tps = getattr(spec, "tokens_per_state", 1)
        if isinstance(tps, int) and tps > 1:
            pools.add(tps)
    return pools


def _index_kpool(kinds: list[GroupKind], specs_per_group: list[list]) -> int:
    """The pooling factor of the PAGED groups (1 without pooling): a hit must not leave an open pool."""
    pools = set().union(*(_pool_sizes(specs) for kind, specs in zip(kinds, specs_per_group) if kind is GroupKind.PAGED))
    if len(pools) > 1:
        raise UnsupportedLayoutError(f"several pooling factors (tokens_per_state) in one model: {sorted(pools)}")
    return pools.pop() if pools else 1


def _hit_alignment(kv_cache_config, block_size: int, index_kpool: int) -> int:
    """A hit ends on vLLM's cache-hit alignment, on a whole block and on a whole pool."""
    return lcm(kv_cache_config.cache_hit_alignment_tokens or block_size, block_size, index_kpool)


def _spec_replicas(spec, tp_size: int, dcp_size: int) -> int:
    """Consecutive TP ranks holding the same bytes of a layer, from what the spec declares."""
    if getattr(spec, "tp_replicated", False) is True:
        return tp_size
    shards = getattr(spec, "max_tp_shards", None)
    if not isinstance(shards, int) or shards <= 0 or (getattr(spec, "dcp_sharded", False) and dcp_size > 1):
        return 1  # unknown, or each rank holds other tokens (decode context parallelism)
    return max(1, tp_size // shards)


def _group_replicas(specs, tp_size: int, dcp_size: int, share: bool) -> int:
    """Replicas of a whole group (every layer's bytes the same on them); 1 when not `share`d (the
    store is private to each rank's process, e.g. memory://)."""
    if not share:
        return 1
    return math.gcd(tp_size, *(_spec_replicas(spec, tp_size, dcp_size) for spec in specs))


def physical_block_size(kv_cache_config, kinds: list[GroupKind] | None = None) -> int:
    """Tokens per block of the prefix cache: the LCM of the cacheable groups' physical blocks. Keys,
    pages and block tables are all per physical block; vLLM's `hash_block_size` (its
    `prefix_match_unit`, possibly finer) only says where vLLM's own hits may land, and every group's
    block is a multiple of it, so a hit on whole physical blocks is also on its grid."""
    kinds = group_kinds(kv_cache_config) if kinds is None else kinds
    sizes = [
        int(g.kv_cache_spec.block_size)
        for g, k in zip(kv_cache_config.kv_cache_groups, kinds)
        if k is not GroupKind.SKIP
    ]
    if not sizes:
        raise UnsupportedLayoutError("no prefix-cacheable KV cache group: nothing to offload")
    return lcm(*sizes)


def scheduler_view(kv_cache_config, *, tp_size: int = 1, dcp_size: int = 1, share_replicas: bool = True) -> KindsLayout:
    """The scheduler's view: group kinds, page contents, the physical block (the key chain's block), the
    hit alignment, which groups TP ranks share. The same from the scheduler's copy of the config as from
    a worker's (`_scheduler_specs`)."""
    kinds = group_kinds(kv_cache_config)  # raises UnsupportedLayoutError for unknown specs
    block_size = physical_block_size(kv_cache_config, kinds)
    specs = [_scheduler_specs(g) for g in kv_cache_config.kv_cache_groups]
    kpool = _index_kpool(kinds, specs)
    groups = tuple(
        KindsGroup(i, k, group_name(i, k), _group_replicas(specs[i], tp_size, dcp_size, share_replicas))
        for i, k in enumerate(kinds)
        if k is not GroupKind.SKIP
    )
    return KindsLayout(
        block_size,
        _hit_alignment(kv_cache_config, block_size, kpool),
        tuple(kinds),
        groups,
        tuple(group_content(g, kv_cache_config) for g in kv_cache_config.kv_cache_groups),
        tp_size,
    )


def key_context(view: KindsLayout, kv_cache_config, *, model_id: str, model_dtype: str, cache_dtype: str) -> bytes:
    """The key chain's context: model identity, dtypes, block size and every group's kind, layers and
    page content, each part framed. Built from what the scheduler and every worker both see (never
    from byte offsets), so both derive the same keys; a store written under another byte layout (SD vs
    DS conv state, another KV cache layout) has other keys, and offers no hits."""
    groups = [
        _framed(kind.value.encode(), _framed(*(name.encode() for name in group.layer_names)), content.encode())
        for kind, content, group in zip(view.kinds, view.contents, kv_cache_config.kv_cache_groups)
    ]
    return _framed(
        b"vllm", model_id.encode(), model_dtype.encode(), cache_dtype.encode(), str(view.block_size).encode(), *groups
    )


def check_agreement(view: KindsLayout, layout: CacheLayout) -> None:
    """Refuse a worker layout that disagrees with the scheduler's view (block size, hit alignment,
    group kinds, cacheable groups, page contents): the scheduler would promise hits and name pages the
    worker stores differently."""
    worker = KindsLayout.of(layout)
    diffs = [
        f"{name}: scheduler {getattr(view, name)!r}, worker {getattr(worker, name)!r}"
        for name in ("block_size", "hit_alignment", "kinds", "cacheable_groups", "contents", "tp_size")
        if getattr(view, name) != getattr(worker, name)
    ]
    if diffs:
        raise UnsupportedLayoutError(
            "the scheduler's and the worker's views of the KV cache disagree; " + "; ".join(diffs)
        )


def _regions(layer_names, specs_by_layer, tensor_of, kv_cache_layout, kv_caches) -> tuple[Region, ...]:
    """The group's layers, tensor by tensor; each run of consecutive same-spec layers is one region. Its
    content is the spec's page content and, where the worker's tensors are given, their dim orders."""
    members: dict[int, tuple[Any, list[tuple[int, str]]]] = {}  # id -> (vLLM's KVCacheTensor, its layers)
    for name in layer_names:
        if name not in tensor_of:
            raise UnsupportedLayoutError(f"layer {name!r} has no entry in kv_cache_config.kv_cache_tensors")
        tensor, index = tensor_of[name]
        members.setdefault(id(tensor), (tensor, []))[1].append((index, name))
    regions: list[Region] = []
    for tensor, layers in members.values():
        layers.sort()
        runs: list[list[tuple[int, str]]] = []
        for index, name in layers:
            last = runs[-1][-1] if runs else None
            if last and index == last[0] + 1 and specs_by_layer[name] == specs_by_layer[last[1]]:
                runs[-1].append((index, name))
            else:
                runs.append([(index, name)])
        for run in runs:
            spec = specs_by_layer[run[0][1]]
            content = page_content(spec, kv_cache_layout)
            if kv_caches is not None:
                orders = sorted({tensor_order(kv_caches[name]) for _, name in run if name in kv_caches})
                content += " tensors=" + "|".join(orders)
            regions.append(
                Region(
                    buffer=0,
                    offset=tensor.offset + run[0][0] * tensor.layer_stride,
                    layer_stride=tensor.layer_stride,
                    block_stride=tensor.block_stride,
                    layer_names=tuple(name for _, name in run),
                    used_bytes=_used_bytes(spec),
                    page_bytes=int(spec.page_size_bytes),
                    dtype=_dtype(spec),
                    content=content,
                )
            )
    return tuple(regions)


def from_vllm(
    kv_cache_config,
    *,
    model_id: str = "",
    tp_rank: int = 0,
    tp_size: int = 1,
    dcp_size: int = 1,
    share_replicas: bool = True,
    extra: dict[str, str] | None = None,
    kv_caches: dict | None = None,
) -> CacheLayout:
    """The layout of a worker's KV cache as vLLM planned it. Pass the WORKER's config (the scheduler's
    copy replaces uniform-type wrappers by one layer's spec and loses per-layer page sizes), and the
    tensors vLLM registers (`kv_caches`) where known: their dim orders go into the fingerprint."""
    tensors = list(kv_cache_config.kv_cache_tensors)
    _refuse_host_resident(tensors)
    sizes = {t.size for t in tensors}
    if len(sizes) > 1:
        raise UnsupportedLayoutError(f"kv_cache_tensors disagree on the backing allocation size: {sorted(sizes)}")
    tensor_of = {name: (t, i) for t in tensors for i, name in enumerate(t.layers)}
    kv_cache_layout = getattr(kv_cache_config, "kv_cache_layout", None)

    groups: list[CacheGroup] = []
    kinds = group_kinds(kv_cache_config)
    specs_per_group = []
    for index, (group, kind) in enumerate(zip(kv_cache_config.kv_cache_groups, kinds)):
        group_spec = group.kv_cache_spec
        per_layer = _layer_specs(group_spec) or {name: group_spec for name in group.layer_names}
        specs_per_group.append(list(per_layer.values()))
        tokens_per_state = max(_pool_sizes(per_layer.values()) or {1})
        spec_types = sorted({type(s).__name__ for s in per_layer.values()})
        groups.append(
            CacheGroup(
                index=index,
                name=group_name(index, kind),
                kind=kind,
                block_size=int(group_spec.block_size),
                regions=_regions(group.layer_names, per_layer, tensor_of, kv_cache_layout, kv_caches),
                tokens_per_state=tokens_per_state,
                spec_type="/".join(spec_types),
                content=group_content(group, kv_cache_config),
                tp_replicas=_group_replicas(per_layer.values(), tp_size, dcp_size, share_replicas),
            )
        )

    cacheable = [g for g in groups if g.cacheable]
    if not cacheable:
        raise UnsupportedLayoutError("no prefix-cacheable KV cache group: nothing to offload")
    index_kpool = _index_kpool(kinds, specs_per_group)
    block_size = physical_block_size(kv_cache_config, kinds)
    alignment = _hit_alignment(kv_cache_config, block_size, index_kpool)
    return CacheLayout(
        model_id=model_id,
        groups=tuple(groups),
        block_size=block_size,
        # kvoffload's keys are per physical block whatever vLLM's hash unit (its prefix_match_unit): the
        # fingerprint must not change with it, or equal keys would name entries another run cannot read.
        hash_block_size=block_size,
        hit_alignment=alignment,
        num_blocks=int(kv_cache_config.num_blocks),
        buffer_sizes=(sizes.pop() if sizes else 0,),
        index_kpool=index_kpool,
        tp_rank=tp_rank,
        tp_size=tp_size,
        extra=tuple(sorted((extra or {}).items())),
    )


def _refuse_host_resident(tensors) -> None:
    if any(getattr(t, "host_resident", False) for t in tensors):
        raise UnsupportedLayoutError("host-resident KV cache tensors (HiSparse) are not supported by kvoffload")


def _members(tensor) -> list:
    return [m for t in tensor for m in _members(t)] if isinstance(tensor, (list, tuple)) else [tensor]


def _several_allocations(count: int) -> UnsupportedLayoutError:
    return UnsupportedLayoutError(
        f"vLLM's KV cache tensors live in {count} allocations; kvoffload copies pages from one backing allocation"
    )


def backing_buffer(kv_cache_config, kv_caches: dict) -> tuple[Any, Any]:
    """The one byte buffer (a flat uint8 tensor) a worker's pages are copied in and out of, and
    `kv_cache_config` placed in it. Where every tensor vLLM registers views one allocation (vLLM 0.32,
    0.33, CPU builds, 0.34 without its extensible KV cache), that allocation is the buffer and the config
    is returned as is. vLLM 0.34's extensible KV cache (its default on CUDA) reserves one address range
    and maps each layer's region of a layer-outermost layout as a segment of its own: each layer's tensor
    views its own storage, and the connector's `kv_cache_tensors` are one per layer, placed in it. Those
    are placed again in one uint8 view spanning the segments (vLLM's `uint8_tensor_from_ptr`), each at
    its storage's distance from the first, once every page of each is seen inside its own storage (no
    byte between segments is ever touched); consecutive equally spaced layers become one tensor again,
    so the regions (and the layout fingerprint) are those of the same cache allocated in one piece."""
    import copy
    from dataclasses import replace

    import torch

    _refuse_host_resident(kv_cache_config.kv_cache_tensors)  # they live outside the device allocation
    storages: dict[int, Any] = {}
    storage_of: dict[str, set[int]] = {}
    devices = set()
    for name, tensor in kv_caches.items():
        for member in _members(tensor):
            storage = member.untyped_storage()
            storages.setdefault(storage.data_ptr(), storage)
            storage_of.setdefault(name, set()).add(storage.data_ptr())
            devices.add(member.device)
    if not storages:
        raise UnsupportedLayoutError("vLLM registered no KV cache tensors")
    (device, *others) = devices
    if len(storages) == 1:
        return torch.empty(0, dtype=torch.uint8, device=device).set_(next(iter(storages.values()))), kv_cache_config
    try:
        from vllm.utils.extensible_tensor import uint8_tensor_from_ptr  # vLLM 0.34+: the extensible KV cache
    except ImportError:
        raise _several_allocations(len(storages)) from None
    if others or device.type != "cuda":
        raise _several_allocations(len(storages))
    base = min(storages)
    end = max(ptr + storage.nbytes() for ptr, storage in storages.items())
    placed: list[Any] = []
    for t in kv_cache_config.kv_cache_tensors:
        ptrs = set().union(*(storage_of.get(name, {-1}) for name in t.layers))
        ptr = ptrs.pop() if len(ptrs) == 1 else -1
        if ptr not in storages:
            raise UnsupportedLayoutError(f"layers {t.layers[:3]}: not in one registered KV cache allocation")
        reach = t.offset + (len(t.layers) - 1) * t.layer_stride + kv_cache_config.num_blocks * t.block_stride
        if reach > storages[ptr].nbytes():
            raise UnsupportedLayoutError(
                f"layers {t.layers[:3]}: pages reach byte {reach} of an allocation of {storages[ptr].nbytes()}"
            )
        t = replace(t, offset=ptr - base + t.offset, size=end - base)
        last = placed[-1] if placed else None
        step = t.offset - (last.offset + (len(last.layers) - 1) * last.layer_stride) if last else 0
        if (
            last is not None
            and step > 0
            and t.block_stride == last.block_stride
            and (len(last.layers) == 1 or last.layer_stride == step)
            and (len(t.layers) == 1 or t.layer_stride == step)
        ):
            placed[-1] = replace(last, layers=[*last.layers, *t.layers], layer_stride=step)
        else:
            placed.append(t)
    rebased = copy.copy(kv_cache_config)
    rebased.kv_cache_tensors = placed
    index = device.index if device.index is not None else torch.cuda.current_device()
    return uint8_tensor_from_ptr(base, end - base, index), rebased


def check_tensors(layout: CacheLayout, kv_caches: dict, buffer=None) -> None:
    """Refuse a layout the tensors vLLM really registered contradict: every tensor must live in the one
    backing allocation the transfer copies from (`buffer`, from `backing_buffer`, where given), have a
    dim of `num_blocks` blocks at the layout's block stride, and keep every byte of a block inside the
    bytes stored for that layer's page. Derived from `kv_cache_config` alone, the layout could otherwise
    miss an attention backend's real placement (a K/V split outside the block, another stride order) and
    store pages that are not the KV."""
    members = {name: _members(t) for name, t in kv_caches.items()}
    if buffer is None:
        bases = {m.untyped_storage().data_ptr() for ms in members.values() for m in ms}
        if len(bases) > 1:
            raise _several_allocations(len(bases))
        base = next(iter(bases), 0)
    else:
        base = buffer.data_ptr()
    problems = []
    for group in layout.groups:
        for region in group.regions:
            for layer, name in enumerate(region.layer_names):
                page = region.page_offset(layer, 0)
                for t in members.get(name, ()):
                    size = t.element_size()
                    start = t.data_ptr() - base
                    dims = [
                        d
                        for d in range(t.dim())
                        if t.shape[d] == layout.num_blocks and t.stride(d) * size == region.block_stride
                    ]
                    if not dims:
                        problems.append(
                            f"{name}: shape {tuple(t.shape)} strides {tuple(t.stride())} has no dim of "
                            f"{layout.num_blocks} blocks {region.block_stride} bytes apart"
                        )
                        continue
                    extent = size + sum(
                        (t.shape[d] - 1) * t.stride(d) * size for d in range(t.dim()) if d != dims[0] and t.shape[d] > 0
                    )
                    if not (page <= start and start + extent <= page + region.used_bytes):
                        problems.append(
                            f"{name}: block 0 bytes [{start}, {start + extent}) outside its stored page "
                            f"[{page}, {page + region.used_bytes}) ({group.name})"
                        )
    if problems:
        raise UnsupportedLayoutError(
            "vLLM's KV cache tensors disagree with the layout derived from its config: "
            + "; ".join(problems[:6])
            + (f" ... and {len(problems) - 6} more" if len(problems) > 6 else "")
        )
