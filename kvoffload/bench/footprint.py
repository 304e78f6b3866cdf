"""Bytes stored per cached token, by group, for the GLM-5.3-Flash presets at several tensor-parallel
sizes, against storing the whole packed block under every group key (the scheme of vLLM's
OffloadingConnector, where groups overlay one block as wide as the widest group's pages): the
amplification that layout-aware offload avoids. Pure arithmetic on layouts (nothing is allocated)."""

from __future__ import annotations

import time

from .common import machine

PRESETS = ("tiny", "pruned-4l", "full")
TP_SIZES = (1, 4, 8)


def _per_rank(config, tp: int):
    """One TP rank's cache: KDA heads are sharded across ranks; the MLA latent and indexer rows are
    replicated on every rank (MLA has one latent per token)."""
    heads = config.linear_num_heads
    if heads % tp:
        return None
    return config.replace(linear_num_heads=heads // tp)


def run(quick: bool = False, block_size: int = 64, progress=None) -> dict:
    from glm_integration.cache import PagedCache
    from glm_integration.config import preset

    rows = []
    for name in PRESETS[:2] if quick else PRESETS:
        for tp in TP_SIZES:
            config = _per_rank(preset(name), tp)
            if config is None:
                continue
            cache = PagedCache(config, block_size, 1, index_format="fp8", device="meta")
            layout = cache.layout
            cacheable = layout.cacheable_groups
            ours = layout.stored_bytes_per_block() / block_size
            # vLLM overlays its groups: a packed block is as wide as the widest group's pages.
            widest = max(sum(r.page_bytes * r.num_layers for r in g.regions) for g in layout.groups)
            whole = len(cacheable) * widest / block_size
            row = {"preset": name, "tp": tp, "block_size": block_size,
                   "stored_bytes_per_token_per_rank": ours,
                   "by_group": {g.name: g.used_bytes_per_block / block_size for g in cacheable},
                   "tail_ring_bytes_per_token": 0.0,
                   "whole_packed_block_per_group_key_bytes_per_token": whole,
                   "amplification_of_whole_block_scheme": round(whole / ours, 3),
                   "our_amplification": 1.0}
            rows.append(row)
            if progress:
                progress(f"[bench footprint] {name} TP{tp}: {ours:.0f} B/token per rank, whole-block scheme "
                         f"{row['amplification_of_whole_block_scheme']}x")
    return {"benchmark": "footprint", "quick": quick, "date": time.strftime("%Y-%m-%d"), "machine": machine(),
            "results": rows}
