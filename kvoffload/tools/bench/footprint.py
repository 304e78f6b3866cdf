"""Bytes stored per cached token, by group, for the GLM-5.3-Flash presets at several tensor-parallel
sizes, at the runner's block (64) and at the block vLLM gives the model (the attention block grows
until its page holds a KDA state); per rank and per TP group, before and after storing the replicated
groups (MLA latent, indexer rows) once per TP group; against storing the whole packed block under every
group key (the scheme of vLLM's OffloadingConnector, where groups overlay one block as wide as the
widest group's pages). Pure arithmetic on layouts (nothing is allocated)."""

from __future__ import annotations

import math
import time

from .common import machine

PRESETS = ("tiny", "pruned-4l", "full")
TP_SIZES = (1, 2, 4, 8)
RUNNER_BLOCK = 64
VLLM_MLA_BLOCK_ALIGN = 128  # vLLM aligns an MLA model's hybrid block to 128 tokens


def _per_rank(config, tp: int):
    """One TP rank's cache: KDA heads are sharded across ranks; the MLA latent and indexer rows are
    replicated on every rank (MLA has one latent per token)."""
    heads = config.linear_num_heads
    if heads % tp:
        return None
    return config.replace(linear_num_heads=heads // tp)


def vllm_block_size(config) -> int:
    """The block vLLM picks for a hybrid MLA + KDA model (its hybrid block-size alignment): the
    smallest multiple of 128 tokens whose MLA page (one latent row per token) holds one layer's KDA
    state, so both kinds share one page size. 4352 / 2176 / 1152 tokens for GLM-5.3-Flash at TP 1/2/4."""
    from glm_integration.cache import PagedCache

    cache = PagedCache(config, RUNNER_BLOCK, 1, device="meta")
    latent_per_token = cache.latent_bytes // RUNNER_BLOCK
    align = VLLM_MLA_BLOCK_ALIGN
    return align * math.ceil(cache.kda_bytes / (align * latent_per_token))


def _row(name: str, config, tp: int, block_size: int, source: str) -> dict:
    from glm_integration.cache import PagedCache

    layout = PagedCache(config, block_size, 1, index_format="fp8", device="meta", tp_size=tp).layout
    cacheable = layout.cacheable_groups
    per_rank = layout.stored_bytes_per_block() / block_size
    per_group_after = sum(g.used_bytes_per_block * tp // g.tp_replicas for g in cacheable) / block_size
    # vLLM overlays its groups: a packed block is as wide as the widest group's pages.
    widest = max(sum(r.page_bytes * r.num_layers for r in g.regions) for g in layout.groups)
    whole = len(cacheable) * widest / block_size
    return {
        "preset": name,
        "tp": tp,
        "block_size": block_size,
        "block_source": source,
        "stored_bytes_per_token_per_rank": per_rank,
        "by_group": {g.name: g.used_bytes_per_block / block_size for g in cacheable},
        "replicated_groups": [g.name for g in cacheable if g.tp_replicas > 1],
        "per_tp_group_bytes_per_token_before": per_rank * tp,  # every rank its own copy of everything
        "per_tp_group_bytes_per_token_after": per_group_after,  # replicated groups once per TP group
        "tp_group_saving": round(1 - per_group_after / (per_rank * tp), 4),
        "tail_ring_bytes_per_token": 0.0,
        "whole_packed_block_per_group_key_bytes_per_token": whole,
        "amplification_of_whole_block_scheme": round(whole / per_rank, 3),
        "our_amplification": 1.0,
    }


def run(quick: bool = False, block_size: int = RUNNER_BLOCK, progress=None) -> dict:
    from glm_integration.config import preset

    rows = []
    for name in PRESETS[:2] if quick else PRESETS:
        for tp in TP_SIZES:
            config = _per_rank(preset(name), tp)
            if config is None:
                continue
            for size, source in ((block_size, "runner"), (vllm_block_size(config), "vllm")):
                row = _row(name, config, tp, size, source)
                rows.append(row)
                if progress:
                    progress(
                        f"[bench footprint] {name} TP{tp} block {size} ({source}): "
                        f"{row['stored_bytes_per_token_per_rank']:.0f} B/token per rank; per TP group "
                        f"{row['per_tp_group_bytes_per_token_before']:.0f} -> "
                        f"{row['per_tp_group_bytes_per_token_after']:.0f}; whole-block scheme "
                        f"{row['amplification_of_whole_block_scheme']}x"
                    )
    return {
        "benchmark": "footprint",
        "quick": quick,
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "results": rows,
    }
