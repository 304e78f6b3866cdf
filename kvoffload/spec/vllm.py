"""The layout model from vLLM's `KVCacheConfig` (vLLM 0.32 / 0.33).

Byte placement comes only from `kv_cache_config.kv_cache_tensors` (offset, layer stride, block stride:
they changed between vLLM versions, so nothing here hard-codes them). Spec classes map to kinds:
  not prefix-cacheable (CircularBufferSpec: the kpool tail ring; scratch; non-transferable) -> SKIP
  MambaSpec (KDA, GDN, Mamba in align/all mode)                                  -> STATE
  FullAttentionSpec, MLAAttentionSpec (latent, or DSA indexer with tokens_per_state) -> PAGED
Anything else is refused by name: guessing a layout is how pages end up in the wrong place.
"""

from __future__ import annotations

from .layout import CacheGroup, CacheLayout, GroupKind, Region, lcm


class UnsupportedLayoutError(ValueError):
    """A KV cache configuration kvoffload cannot offload correctly (said at start-up, never guessed)."""


def _layer_specs(group_spec) -> dict[str, object] | None:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if isinstance(group_spec, UniformTypeKVCacheSpecs):
        return dict(group_spec.kv_cache_specs)
    return None


def _kind(spec, group_index: int, transferable: bool) -> GroupKind:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    if not transferable or not spec.prefix_cacheable:
        return GroupKind.SKIP
    if type(spec) is MambaSpec:
        if spec.mamba_cache_mode not in ("align", "all"):
            raise UnsupportedLayoutError(
                f"cache group {group_index}: MambaSpec with mamba_cache_mode={spec.mamba_cache_mode!r} keeps "
                "no block-boundary checkpoints; enable prefix caching (vLLM then uses align mode)")
        return GroupKind.STATE
    if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
        return GroupKind.PAGED
    raise UnsupportedLayoutError(
        f"cache group {group_index}: unsupported KV cache spec type {type(spec).__name__} "
        f"({type(spec).__module__}); kvoffload supports FullAttentionSpec, MLAAttentionSpec, MambaSpec "
        "and non-prefix-cacheable groups (skipped)")


def _dtype(spec) -> str:
    if hasattr(spec, "dtypes"):
        return "+".join(str(d).removeprefix("torch.") for d in spec.dtypes)
    return str(spec.dtype).removeprefix("torch.")


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


def _regions(layer_names, specs_by_layer, tensor_of) -> tuple[Region, ...]:
    """The group's layers, tensor by tensor; each run of consecutive same-spec layers is one region."""
    members: dict[int, tuple[object, list[tuple[int, str]]]] = {}
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
            regions.append(Region(buffer=0, offset=tensor.offset + run[0][0] * tensor.layer_stride,
                                  layer_stride=tensor.layer_stride, block_stride=tensor.block_stride,
                                  layer_names=tuple(name for _, name in run), used_bytes=_used_bytes(spec),
                                  page_bytes=int(spec.page_size_bytes), dtype=_dtype(spec)))
    return tuple(regions)


def from_vllm(kv_cache_config, *, model_id: str = "", tp_rank: int = 0, tp_size: int = 1,
              extra: dict[str, str] | None = None) -> CacheLayout:
    """The layout of a worker's KV cache as vLLM planned it. Pass the WORKER's config (the scheduler's
    copy replaces uniform-type wrappers by one layer's spec and loses per-layer page sizes)."""
    tensors = list(kv_cache_config.kv_cache_tensors)
    if any(getattr(t, "host_resident", False) for t in tensors):
        raise UnsupportedLayoutError("host-resident KV cache tensors (HiSparse) are not supported by kvoffload")
    sizes = {t.size for t in tensors}
    if len(sizes) > 1:
        raise UnsupportedLayoutError(f"kv_cache_tensors disagree on the backing allocation size: {sorted(sizes)}")
    tensor_of = {name: (t, i) for t in tensors for i, name in enumerate(t.layers)}

    groups: list[CacheGroup] = []
    kpools: set[int] = set()
    for index, (group, kind) in enumerate(zip(kv_cache_config.kv_cache_groups, group_kinds(kv_cache_config))):
        group_spec = group.kv_cache_spec
        per_layer = _layer_specs(group_spec) or {name: group_spec for name in group.layer_names}
        tokens_per_state = 1
        for spec in per_layer.values():
            tps = getattr(spec, "tokens_per_state", 1)
            if isinstance(tps, int) and tps > 1:
                tokens_per_state = max(tokens_per_state, tps)
                if kind is GroupKind.PAGED:
                    kpools.add(tps)
        spec_types = sorted({type(s).__name__ for s in per_layer.values()})
        groups.append(CacheGroup(
            index=index, name=group_name(index, kind),
            kind=kind, block_size=int(group_spec.block_size),
            regions=_regions(group.layer_names, per_layer, tensor_of),
            tokens_per_state=tokens_per_state, spec_type="/".join(spec_types)))

    cacheable = [g for g in groups if g.cacheable]
    if not cacheable:
        raise UnsupportedLayoutError("no prefix-cacheable KV cache group: nothing to offload")
    if len(kpools) > 1:
        raise UnsupportedLayoutError(f"several pooling factors (tokens_per_state) in one model: {sorted(kpools)}")
    block_size = lcm(*(g.block_size for g in cacheable))
    index_kpool = kpools.pop() if kpools else 1
    hash_block_size = kv_cache_config.hash_block_size or block_size
    alignment = lcm(kv_cache_config.cache_hit_alignment_tokens or block_size, block_size, index_kpool)
    return CacheLayout(
        model_id=model_id, groups=tuple(groups), block_size=block_size, hash_block_size=hash_block_size,
        hit_alignment=alignment, num_blocks=int(kv_cache_config.num_blocks),
        buffer_sizes=(sizes.pop() if sizes else 0,), index_kpool=index_kpool, tp_rank=tp_rank, tp_size=tp_size,
        extra=tuple(sorted((extra or {}).items())))
