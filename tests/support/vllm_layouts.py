"""Test support: real vLLM ``KVCacheConfig`` objects for a few model shapes.

Every config returned here is produced by vLLM's own planner, the same calls
``EngineCore._initialize_kv_caches`` (vllm/v1/engine/core.py) makes:

* ``vllm.v1.core.single_type_kv_cache_manager.register_all_kvcache_specs``
* ``vllm.v1.attention.backends.utils.get_supported_kv_cache_layouts`` /
  ``resolve_kv_cache_layout`` (layout chosen from the real backends' declared
  layouts and the specs)
* ``get_kv_cache_configs`` (grouping + packing; ``vllm.v1.core.kv_cache_planning``
  from vLLM 0.33, given the model-wide groups of ``get_global_kv_cache_groups``
  as the engine core passes them; ``vllm.v1.core.kv_cache_utils`` in 0.32)
* ``generate_scheduler_kv_cache_config``, ``resolve_kv_cache_block_sizes``,
  ``resolve_cache_hit_alignment_tokens`` (hash block size / hit alignment)

Layer specs are built with vLLM's own spec classes (``MLAAttentionSpec``,
``MambaSpec``, ``CircularBufferSpec``, ``FullAttentionSpec``) and vLLM's own
state shape/dtype calculators, with exactly the arguments the model layers'
``get_kv_cache_spec`` pass (see each builder).  No ``KVCacheTensor`` is ever
assembled by hand.  The block count is pinned with the real engine knob
``CacheConfig.num_gpu_blocks_override``.

``llama_config`` uses a real ``ModelConfig`` loaded from a throw-away local
``config.json`` (no weights, no tokenizer, no network).  The two hybrid builders
cannot do that: a real ``ModelConfig``/``VllmConfig`` for a hybrid architecture
resolves and imports the model class (``ModelRegistry.resolve_model_cls``),
and the glm5next model modules do not import in the CPU build (they pull in
torchvision / CUDA kernels); the hybrid block-size alignment
(``Platform._align_hybrid_block_size``) needs that model class too.  So they
build the real ``VllmConfig`` with real ``CacheConfig`` / ``SchedulerConfig`` /
``ParallelConfig`` and then set ``model_config`` to :class:`_ModelConfigStub`,
which carries only the fields the planner reads (``max_model_len``,
``original_max_model_len``, ``dtype``...).  The block-size / mamba-padding
alignment that ``Platform._align_hybrid_block_size`` would do is reproduced
in :func:`_align_hybrid_block_size` (same formula, same cache_config fields),
pinned to vLLM's own by ``test_copied_hybrid_alignment_matches_vllm``
(tests/spec/test_layout_vllm.py), which runs both on the same configs.

vLLM is imported lazily inside functions so this module imports without it.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import dataclass, replace
from typing import Any

DEFAULT_NUM_BLOCKS = 64


@dataclass
class _ModelConfigStub:
    """Smallest honest stand-in for ``vllm.config.ModelConfig`` (see module
    docstring for why a real one cannot be built for hybrid archs offline).
    Only attributes read by the KV-cache planner path are present."""

    max_model_len: int
    dtype: Any
    use_mla: bool = False
    is_hybrid: bool = True
    architecture: str = "stub"
    supports_kv_cache_grouping: bool = False  # vLLM 0.33+ grouping: no model of vLLM's declares its own

    @property
    def original_max_model_len(self) -> int:
        return self.max_model_len

    def get_sliding_window(self):
        return None


def _make_vllm_config(
    *,
    model_config: Any,
    block_size: int,
    num_blocks: int,
    max_model_len: int,
    mamba_cache_mode: str = "none",
    enable_prefix_caching: bool = True,
    stub: bool,
):
    from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig, VllmConfig

    cache_config = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        mamba_cache_mode=mamba_cache_mode,
        num_gpu_blocks_override=num_blocks,
    )
    scheduler_config = SchedulerConfig(
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
        disable_hybrid_kv_cache_manager=False,
        max_num_batched_tokens=max(2048, max_model_len),
    )
    parallel_config = ParallelConfig(tensor_parallel_size=1)
    kwargs = {} if stub else {"model_config": model_config}
    vllm_config = VllmConfig(
        **kwargs, cache_config=cache_config, scheduler_config=scheduler_config, parallel_config=parallel_config
    )
    if stub:
        # VllmConfig is a (pydantic) dataclass; bypass assignment validation.
        object.__setattr__(vllm_config, "model_config", model_config)
    # The CPU platform's post-init may rewrite these; pin what we asked for.
    cache_config = vllm_config.cache_config
    cache_config.block_size = block_size
    cache_config.enable_prefix_caching = enable_prefix_caching
    cache_config.mamba_cache_mode = mamba_cache_mode
    cache_config.num_gpu_blocks_override = num_blocks
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return vllm_config


def _align_hybrid_block_size(
    vllm_config, *, attn_page_size_1_token: int, mamba_page_size: int, kernel_block_alignment: int, use_mla: bool
) -> None:
    """Same arithmetic as ``Platform._align_hybrid_block_size``
    (vllm/platforms/interface.py): grow the attention block so its page is
    >= the mamba page, set ``mamba_block_size`` (align mode) and pad the mamba
    page to the attention page."""
    from vllm.utils.math_utils import cdiv

    cc = vllm_config.cache_config
    align = max(kernel_block_alignment, cc.block_size)
    if use_mla:
        align = max(align, 128)
    attn_block_size = align * cdiv(mamba_page_size, align * attn_page_size_1_token)
    if cc.block_size < attn_block_size:
        cc.block_size = attn_block_size
    if cc.mamba_cache_mode == "align":
        cc.mamba_block_size = cc.block_size
    attn_page = cc.block_size * attn_page_size_1_token
    assert attn_page >= mamba_page_size
    if attn_page != mamba_page_size:
        cc.mamba_page_size_padded = attn_page


def _kv_cache_configs(vllm_config, specs: list, available: list):
    """vLLM's grouping and packing, wherever the build keeps it (see the module docstring)."""
    try:
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        return get_kv_cache_configs(vllm_config, specs, available)
    return get_kv_cache_configs(vllm_config, specs, available, get_global_kv_cache_groups(vllm_config, specs))


def _plan(vllm_config, specs: dict, backends: list, before_plan=None):
    """Run the engine core's KV-cache planning sequence; return worker 0's
    KVCacheConfig. ``before_plan(vllm_config)``, if given, runs first (a test
    sets engine knobs there, or keeps the config)."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    if before_plan is not None:
        before_plan(vllm_config)
    register_all_kvcache_specs(vllm_config)
    supported = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    layout = resolve_kv_cache_layout(vllm_config, [supported], list(specs.values()))
    vllm_config.cache_config.kv_cache_layout = layout.name

    # Memory is irrelevant: num_gpu_blocks_override pins num_blocks.
    available = [1 << 44]
    kv_cache_configs = _kv_cache_configs(vllm_config, [specs], available)
    for cfg in kv_cache_configs:
        cfg.kv_cache_layout = vllm_config.cache_config.kv_cache_layout

    sched_cfg = generate_scheduler_kv_cache_config(kv_cache_configs)
    groups = sched_cfg.kv_cache_groups
    participating = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
    vllm_config.cache_config.block_size = min(participating or [g.kv_cache_spec.block_size for g in groups])
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(sched_cfg, vllm_config)
    alignment = resolve_cache_hit_alignment_tokens(sched_cfg, vllm_config, scheduler_block_size, hash_block_size)
    for cfg in (*kv_cache_configs, sched_cfg):
        cfg.hash_block_size = hash_block_size
        cfg.cache_hit_alignment_tokens = alignment
    return kv_cache_configs[0]


def glm53_flash_like_config(
    block_size: int | None = None,
    *,
    num_blocks: int = DEFAULT_NUM_BLOCKS,
    num_repeats: int = 2,
    kda_per_mla: int = 3,
    kv_lora_rank: int = 512,
    index_head_dim: int = 128,
    index_kpool: int = 4,
    kda_num_heads: int = 4,
    kda_head_dim: int = 128,
    kda_conv_kernel: int = 4,
    kda_prefill_backend: str = "flashkda",
    max_model_len: int = 4096,
    before_plan=None,
):
    """GLM-5.3-Flash-like stack, specs built as glm5next builds them.

    Layer pattern per repeat: ``kda_per_mla`` KDA layers then one MLA layer
    (defaults: 2 repeats -> layers 0-2,4-6 KDA; 3,7 MLA).  Per MLA layer i:

    * ``model.layers.{i}.self_attn.attn``: ``MLAAttentionSpec`` as
      ``MLAAttention.get_kv_cache_spec`` (num_kv_heads=1, max_tp_shards=1,
      head_size=kv_lora_rank(+rope 0)=512, bf16 -> 1024 B/token,
      cache_dtype_str="auto", is_index_group_leader=True).
    * ``model.layers.{i}.self_attn.indexer.k_cache``:
      ``DeepseekV32IndexerCache.get_kv_cache_spec`` (MLAAttentionSpec,
      num_kv_heads=1, max_tp_shards=1, head_size=128+128//128*4=132, uint8,
      cache_role=INDEXER) then ``replace(tokens_per_state=index_kpool)`` as
      ``Glm5NextIndexerCache`` does.
    * ``model.layers.{i}.self_attn.indexer.tail_cache``: ``CircularBufferSpec``
      exactly as ``Glm5NextTailCache.get_kv_cache_spec`` (ring =
      kpool*next_pow2(cdiv(kpool+num_spec, kpool)), num_kv_heads=2,
      head_size=128, head_size_v=0, bf16, dcp_sharded=False).

    KDA layer j: ``model.layers.{j}.self_attn``: ``MambaSpec`` as
    ``MambaBase.get_kv_cache_spec`` + ``Glm5NextLinearAttention`` override
    (shapes/dtypes from ``MambaStateShapeCalculator.kda_state_shape`` /
    ``MambaStateDtypeCalculator.kda_state_dtype``, mamba_type GDN_ATTN,
    align mode, prefill checkpoint block iff ``kda_prefill_backend ==
    "flashkda"``, which is what an H200 with head_dim 128 bf16 resolves to).

    ``block_size=None`` lets the hybrid alignment pick it (384 with defaults).
    ``before_plan(vllm_config)`` runs just before vLLM's planner (see :func:`_plan`).
    """
    import torch

    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.utils.math_utils import cdiv, next_power_of_2
    from vllm.v1.attention.backends.mla.indexer import Glm5NextIndexerBackend, KpoolTailBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import CircularBufferSpec, MambaSpec, MLAAttentionSpec, SparseCacheRole

    model_dtype = torch.bfloat16
    model_config = _ModelConfigStub(max_model_len=max_model_len, dtype=model_dtype, use_mla=True)
    vc = _make_vllm_config(
        model_config=model_config,
        block_size=block_size or 128,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        mamba_cache_mode="align",
        stub=True,
    )
    cc = vc.cache_config
    num_spec = vc.num_speculative_tokens  # 0: no speculative config

    kda_shapes = MambaStateShapeCalculator.kda_state_shape(
        1, kda_num_heads, kda_head_dim, conv_kernel_size=kda_conv_kernel, num_spec=num_spec
    )
    kda_dtypes = MambaStateDtypeCalculator.kda_state_dtype(
        model_dtype, cc.mamba_cache_dtype, cc.mamba_ssm_cache_dtype
    )
    mla_1tok = MLAAttentionSpec(
        block_size=1, num_kv_heads=1, head_size=kv_lora_rank, dtype=model_dtype, cache_dtype_str=cc.cache_dtype
    ).page_size_bytes
    mamba_page = MambaSpec(shapes=kda_shapes, dtypes=kda_dtypes, block_size=-1).page_size_bytes
    if block_size is None:
        _align_hybrid_block_size(
            vc, attn_page_size_1_token=mla_1tok, mamba_page_size=mamba_page, kernel_block_alignment=64, use_mla=True
        )
    else:
        cc.mamba_block_size = cc.block_size
        if cc.block_size * mla_1tok > mamba_page:
            cc.mamba_page_size_padded = cc.block_size * mla_1tok
    bs = cc.block_size

    def mla_spec():
        return MLAAttentionSpec(
            block_size=bs,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=kv_lora_rank,
            dtype=model_dtype,
            cache_dtype_str=cc.cache_dtype,
            is_index_group_leader=True,
        )

    def indexer_spec():
        head_dim = index_head_dim + index_head_dim // 128 * 4
        spec = MLAAttentionSpec(
            block_size=bs,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=head_dim,
            dtype=torch.uint8,
            cache_role=SparseCacheRole.INDEXER,
        )
        return replace(spec, tokens_per_state=index_kpool)

    def tail_spec():
        span = index_kpool + num_spec
        ring = index_kpool * next_power_of_2(cdiv(span, index_kpool))
        assert bs % ring == 0
        return CircularBufferSpec(
            block_size=ring,
            num_kv_heads=2,
            head_size=index_head_dim,
            head_size_v=0,
            dtype=torch.bfloat16,
            dcp_sharded=False,
        )

    def kda_spec():
        spec = MambaSpec(
            shapes=tuple(kda_shapes),
            dtypes=kda_dtypes,
            block_size=cc.mamba_block_size,
            page_size_padded=cc.mamba_page_size_padded,
            mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
            tp_replicated=False,
            mamba_cache_mode=cc.mamba_cache_mode,
            num_speculative_blocks=num_spec,
        )
        alignment = 16 if kda_prefill_backend == "flashkda" else None
        return replace(
            spec, num_prefill_checkpoint_blocks=int(alignment is not None), prefill_checkpoint_alignment=alignment
        )

    specs: dict = {}
    layer = 0
    for _ in range(num_repeats):
        for _ in range(kda_per_mla):
            specs[f"model.layers.{layer}.self_attn"] = kda_spec()
            layer += 1
        p = f"model.layers.{layer}.self_attn"
        specs[f"{p}.attn"] = mla_spec()
        specs[f"{p}.indexer.k_cache"] = indexer_spec()
        specs[f"{p}.indexer.tail_cache"] = tail_spec()
        layer += 1

    backends = [
        AttentionBackendEnum.FLASHMLA_SPARSE.get_class(),
        Glm5NextIndexerBackend,
        KpoolTailBackend,
        MambaAttentionBackendEnum.GDN_ATTN.get_class(),
    ]
    return _plan(vc, specs, backends, before_plan)


def qwen3_next_like_config(
    *,
    num_blocks: int = DEFAULT_NUM_BLOCKS,
    num_layers: int = 8,
    num_kv_heads: int = 2,
    head_size: int = 256,
    gdn_num_k_heads: int = 2,
    gdn_num_v_heads: int = 4,
    gdn_head_k_dim: int = 128,
    gdn_head_v_dim: int = 128,
    conv_kernel: int = 4,
    max_model_len: int = 4096,
    prefix_match_unit: int | None = None,
):
    """Qwen3-Next-like hybrid: every 4th layer (3, 7, ...) is full attention
    ``model.layers.{i}.self_attn.attn`` (``FullAttentionSpec`` bf16), the rest
    gated-delta-net ``model.layers.{i}.linear_attn`` (``MambaSpec`` from
    ``GatedDeltaNetAttention``/``MambaBase.get_kv_cache_spec``: shapes from
    ``gated_delta_net_state_shape``, dtypes from
    ``gated_delta_net_state_dtype``), align mode, prefix caching on."""
    import torch

    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    model_dtype = torch.bfloat16
    model_config = _ModelConfigStub(max_model_len=max_model_len, dtype=model_dtype)
    vc = _make_vllm_config(
        model_config=model_config,
        block_size=16,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        mamba_cache_mode="align",
        stub=True,
    )
    cc = vc.cache_config
    cc.prefix_match_unit = prefix_match_unit  # vLLM's hash_block_size: None = the GCD of the groups' blocks
    num_spec = vc.num_speculative_tokens
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, gdn_num_k_heads, gdn_num_v_heads, gdn_head_k_dim, gdn_head_v_dim, conv_kernel, num_spec
    )
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        model_dtype, cc.mamba_cache_dtype, cc.mamba_ssm_cache_dtype
    )
    attn_1tok = FullAttentionSpec(
        block_size=1, num_kv_heads=num_kv_heads, head_size=head_size, dtype=model_dtype
    ).page_size_bytes
    mamba_page = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
    # FlashAttention's smallest kernel block is 16.
    _align_hybrid_block_size(
        vc, attn_page_size_1_token=attn_1tok, mamba_page_size=mamba_page, kernel_block_alignment=16, use_mla=False
    )
    specs: dict = {}
    for i in range(num_layers):
        if i % 4 == 3:
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=cc.block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=model_dtype
            )
        else:
            specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                shapes=tuple(shapes),
                dtypes=dtypes,
                block_size=cc.mamba_block_size,
                page_size_padded=cc.mamba_page_size_padded,
                mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                mamba_cache_mode=cc.mamba_cache_mode,
                num_speculative_blocks=num_spec,
            )
    backends = [AttentionBackendEnum.FLASH_ATTN.get_class(), MambaAttentionBackendEnum.GDN_ATTN.get_class()]
    return _plan(vc, specs, backends)


@functools.lru_cache(maxsize=None)
def _llama_model_dir(num_layers: int, num_kv_heads: int, head_size: int) -> str:
    d = tempfile.mkdtemp(prefix="kvoffload_llama_cfg_")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4 * head_size * 2,
        "intermediate_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_size,
        "num_hidden_layers": num_layers,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def llama_config(
    *,
    num_blocks: int = DEFAULT_NUM_BLOCKS,
    num_layers: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 64,
    block_size: int = 16,
    max_model_len: int = 512,
):
    """Plain Llama, real ``ModelConfig`` (local config.json, float32):
    ``model.layers.{i}.self_attn.attn`` ``FullAttentionSpec`` float32, as
    ``Attention.get_kv_cache_spec`` builds it."""
    import torch

    from vllm.config import ModelConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_config = ModelConfig(
        model=_llama_model_dir(num_layers, num_kv_heads, head_size),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=max_model_len,
    )
    vc = _make_vllm_config(
        model_config=model_config,
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        stub=False,
    )
    specs = {
        f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
            block_size=vc.cache_config.block_size,
            num_kv_heads=model_config.get_num_kv_heads(vc.parallel_config),
            head_size=model_config.get_head_size(),
            dtype=torch.float32,
        )
        for i in range(num_layers)
    }
    return _plan(vc, specs, [AttentionBackendEnum.FLASH_ATTN.get_class()])


def describe(cfg) -> str:
    """Human-readable dump of a KVCacheConfig."""
    from vllm.v1.kv_cache_interface import MambaSpec, UniformTypeKVCacheSpecs

    def spec_line(s) -> str:
        parts = [type(s).__name__, f"block_size={s.block_size}", f"page_size_bytes={s.page_size_bytes}"]
        for attr in (
            "real_page_size_bytes",
            "unpadded_page_size_bytes",
            "tokens_per_state",
            "cache_role",
            "num_kv_heads",
            "head_size",
            "dtype",
            "dcp_sharded",
            "page_size_padded",
            "is_index_group_leader",
            "mamba_cache_mode",
            "num_prefill_checkpoint_blocks",
        ):
            try:
                value = getattr(s, attr)
            except AttributeError:
                continue
            except NotImplementedError:
                value = "<n/a>"
            parts.append(f"{attr}={getattr(value, 'value', value)}")
        parts.append(f"prefix_cacheable={s.prefix_cacheable}")
        if isinstance(s, MambaSpec):
            parts.append(f"shapes={s.shapes} dtypes={s.dtypes} mamba_type={s.mamba_type.name}")
        return " ".join(parts)

    out = [
        f"num_blocks={cfg.num_blocks} hash_block_size={cfg.hash_block_size} "
        f"cache_hit_alignment_tokens={cfg.cache_hit_alignment_tokens} "
        f"kv_cache_layout={cfg.kv_cache_layout}"
    ]
    for gi, g in enumerate(cfg.kv_cache_groups):
        out.append(f"  group {gi}: role={g.role.value} layers={g.layer_names}")
        out.append(f"    spec: {spec_line(g.kv_cache_spec)}")
        if isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs):
            for name, s in g.kv_cache_spec.kv_cache_specs.items():
                out.append(f"      {name}: {spec_line(s)}")
    for ti, t in enumerate(cfg.kv_cache_tensors):
        out.append(
            f"  tensor {ti}: size={t.size} offset={t.offset} "
            f"layer_stride={t.layer_stride} block_stride={t.block_stride} "
            f"layers={t.layers}"
        )
    return "\n".join(out)
