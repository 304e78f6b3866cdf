"""MLA (NoPE) with the DSA indexer over pooled keys (kpool).

Cache writes: each token's latent row (RMSNorm(W_kva x)) into its block's latent page; each pool of
`index_kpool` tokens, once complete, as one pooled key row (softmax(gate + ape)-weighted sum of the
pool's indexer keys) into its block's indexer page; the open pool's raw keys and gates into the
request's tail ring, from which the next chunk or decode step completes the pool.

Selection for query t: while the sequence fits in `index_topk` tokens, every token <= t (dense);
beyond it, the top `index_topk / kpool` complete visible pools by indexer score (stable tie-break:
lower pool index first) expanded to their tokens, plus the open tail [floor((t+1)/P)*P, t].
Attention is computed over a mask of all positions, so its sum never depends on selection order.
Prefill expands latents to keys and values; decode uses the absorbed form on the latent rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import ops
from .chunk import Chunk


class Indexer:
    def __init__(self, config, weights, prefix: str, layer: int):
        self.layer, self.heads, self.dim = layer, config.index_n_heads, config.index_head_dim
        self.kpool, self.topk = config.index_kpool, config.index_topk
        self.tail = config.index_kpool_always_select_tail
        w = {name[len(prefix) + 1 :]: t for name, t in weights.items() if name.startswith(prefix + ".")}
        self.wq_b, self.wk, self.weights_proj = w["wq_b.weight"], w["wk.weight"], w["weights_proj.weight"]
        self.k_norm_w, self.k_norm_b = w["k_norm.weight"], w["k_norm.bias"]
        self.ape, self.gate = w["index_kpool_compress_ape"], w["index_kpool_compress_gate"]

    def write(self, x: torch.Tensor, chunk: Chunk, cache) -> None:
        """Compress the pools this chunk completes; keep the open pool's raw rows in the ring."""
        p, d = self.kpool, self.dim
        keys = F.layer_norm(F.linear(x, self.wk), (d,), self.k_norm_w, self.k_norm_b, eps=1e-6)
        gates = F.linear(x, self.gate)
        ring = cache.ring(self.layer)[chunk.tail_block]
        open_start = chunk.start // p * p
        carried = torch.arange(open_start, chunk.start, device=chunk.device) % cache.ring_slots
        keys = torch.cat([ring[carried, :d].to(keys.dtype), keys])
        gates = torch.cat([ring[carried, d:].to(gates.dtype), gates])
        complete = (chunk.end // p * p - open_start) // p
        if complete > 0:
            pooled = ops.pool_keys(
                keys[: complete * p].view(complete, p, d), gates[: complete * p].view(complete, p, d), self.ape
            )
            rows = cache.index_rows(self.layer)
            first_pool = open_start // p
            for i, row in enumerate(cache.encode_index_rows(pooled)):
                pos = (first_pool + i) * p
                rows[chunk.block_of(pos), (pos % chunk.block_size) // p] = row
        rest = slice(complete * p, None)
        slots = torch.arange(open_start + complete * p, chunk.end, device=chunk.device) % cache.ring_slots
        ring[slots] = torch.cat([keys[rest], gates[rest]], dim=-1).float()

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, chunk: Chunk, cache) -> torch.Tensor:
        """[T, end] bool: which positions each query of the chunk attends."""
        dev = chunk.device
        positions = torch.arange(chunk.start, chunk.end, device=dev)
        keys = torch.arange(chunk.end, device=dev)
        causal = keys[None, :] <= positions[:, None]
        if chunk.end <= self.topk:
            return causal
        p = self.kpool
        pools = chunk.end // p
        rows = cache.index_rows(self.layer)
        starts = torch.arange(pools, device=dev) * p
        table = chunk.table()
        pooled = cache.decode_index_rows(rows[table[starts // chunk.block_size], (starts % chunk.block_size) // p])
        q = F.linear(q_resid, self.wq_b).view(x.shape[0], self.heads, self.dim)
        weights = F.linear(x, self.weights_proj).float() * self.heads**-0.5
        scores = ops.indexer_scores(q, weights, pooled, self.dim**-0.5)
        complete_visible = (positions[:, None] + 1) // p
        visible = torch.arange(pools, device=dev)[None, :] < complete_visible
        chosen = ops.select_pools(scores, visible, self.topk // p)
        mask = chosen.repeat_interleave(p, dim=1)
        mask = torch.cat(
            [mask, torch.zeros(mask.shape[0], chunk.end - mask.shape[1], dtype=torch.bool, device=dev)], dim=1
        )
        if self.tail:
            mask |= causal & (keys[None, :] >= complete_visible * p)
        return mask


class MLAttention:
    def __init__(self, config, weights, prefix: str, layer: int, indexer: bool):
        self.layer, self.heads = layer, config.num_attention_heads
        self.nope, self.v_dim, self.rank = config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
        self.scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
        self.eps = config.rms_norm_eps
        w = {name[len(prefix) + 1 :]: t for name, t in weights.items() if name.startswith(prefix + ".")}
        self.q_a, self.q_a_norm, self.q_b = w["q_a_proj.weight"], w["q_a_layernorm.weight"], w["q_b_proj.weight"]
        self.kv_a, self.kv_a_norm, self.kv_b = (
            w["kv_a_proj_with_mqa.weight"],
            w["kv_a_layernorm.weight"],
            w["kv_b_proj.weight"],
        )
        self.o = w["o_proj.weight"]
        kv_b = self.kv_b.view(self.heads, self.nope + self.v_dim, self.rank)
        self.w_uk, self.w_uv = kv_b[:, : self.nope], kv_b[:, self.nope :]  # [H, nope, R], [H, v, R]
        self.indexer = Indexer(config, weights, f"{prefix}.indexer", layer) if indexer else None

    def __call__(self, x: torch.Tensor, chunk: Chunk, cache, shared_mask: torch.Tensor | None):
        """Returns (output [T, hidden], the selection mask, for a following layer that shares it)."""
        t = x.shape[0]
        q_resid = ops.rms_norm(F.linear(x, self.q_a), self.q_a_norm, self.eps)
        q = F.linear(q_resid, self.q_b).view(t, self.heads, self.nope).transpose(0, 1)
        latent_new = ops.rms_norm(F.linear(x, self.kv_a)[:, : self.rank], self.kv_a_norm, self.eps)
        pages = cache.latent(self.layer)
        blocks, rows = chunk.row_blocks(chunk.start, chunk.end)
        pages[blocks, rows] = latent_new
        blocks, rows = chunk.row_blocks(0, chunk.end)
        latent = pages[blocks, rows]
        if self.indexer is not None:
            self.indexer.write(x, chunk, cache)
            mask = self.indexer.select(x, q_resid, chunk, cache)
        elif shared_mask is not None:
            mask = shared_mask
        else:
            raise ValueError(f"layer {self.layer} shares the top-k selection but no earlier layer computed one")
        if chunk.decode:
            q_latent = torch.einsum("htn,hnr->htr", q, self.w_uk)
            o_latent = ops.absorbed_decode_attention(q_latent, latent, mask, self.scale)
            out = torch.einsum("htr,hvr->htv", o_latent, self.w_uv)
        else:
            kv = F.linear(latent, self.kv_b).view(-1, self.heads, self.nope + self.v_dim).transpose(0, 1)
            out = ops.masked_attention(q, kv[..., : self.nope], kv[..., self.nope :], mask, self.scale)
        return F.linear(out.transpose(0, 1).reshape(t, -1), self.o), mask
