"""GLM-5.3-Flash forward pass over the paged cache: embeddings expanded to `hc_mult` streams, decoder
layers (KDA or MLA+DSA attention, dense MLP or MoE, each wrapped in mHC), the streams' mean, final
RMSNorm, LM head. One request's chunk at a time, so results never depend on batch composition."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import GlmConfig
from .kernels import ops
from .layers.attention import MLAttention
from .layers.chunk import Chunk
from .layers.feed_forward import DenseMLP, MoE
from .layers.hyper_connection import HyperConnection
from .layers.linear_attention import LinearAttention


class DecoderLayer:
    def __init__(self, config: GlmConfig, weights, index: int):
        prefix = f"layers.{index}"
        self.eps = config.rms_norm_eps
        self.kind = config.layer_types[index]
        self.attn: LinearAttention | MLAttention
        if self.kind == "linear_attention":
            self.attn = LinearAttention(config, weights, f"{prefix}.self_attn", index)
        else:
            shares = (config.indexer_types or ["full"] * config.num_hidden_layers)[index] == "shared"
            self.attn = MLAttention(config, weights, f"{prefix}.self_attn", index, indexer=not shares)
        sparse = config.mlp_layer_types[index] == "sparse"
        self.mlp = (MoE if sparse else DenseMLP)(config, weights, f"{prefix}.mlp")
        self.attn_norm = weights[f"{prefix}.input_layernorm.weight"]
        self.mlp_norm = weights[f"{prefix}.post_attention_layernorm.weight"]
        self.attn_hc = HyperConnection(config, weights, f"{prefix}.attn_hc")
        self.ffn_hc = HyperConnection(config, weights, f"{prefix}.ffn_hc")

    def __call__(self, streams, chunk: Chunk, cache, mask):
        post, comb, h = self.attn_hc.weights(streams)
        h = ops.rms_norm(h, self.attn_norm, self.eps)
        if isinstance(self.attn, LinearAttention):  # the layer kind is linear_attention
            h = self.attn(h, chunk, cache)
        else:
            h, mask = self.attn(h, chunk, cache, mask)
        streams = HyperConnection.merge(post, comb, h, streams)
        post, comb, h = self.ffn_hc.weights(streams)
        h = self.mlp(ops.rms_norm(h, self.mlp_norm, self.eps))
        return HyperConnection.merge(post, comb, h, streams), mask


class GlmModel:
    def __init__(self, config: GlmConfig, weights: dict[str, torch.Tensor]):
        self.config = config
        self.embed = weights["embed_tokens.weight"]
        self.norm = weights["norm.weight"]
        self.lm_head = weights["lm_head.weight"]
        self.layers = [DecoderLayer(config, weights, i) for i in range(config.num_hidden_layers)]

    @torch.no_grad()
    def forward(self, token_ids: list[int], chunk: Chunk, cache) -> torch.Tensor:
        """Compute positions [chunk.start, chunk.end) and write their cache; logits [T, vocab]."""
        if len(token_ids) != chunk.length:
            raise ValueError(f"chunk covers {chunk.length} positions but {len(token_ids)} tokens were given")
        x = F.embedding(torch.tensor(token_ids, dtype=torch.long, device=self.embed.device), self.embed)
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        mask = None
        for layer in self.layers:
            streams, mask = layer(streams, chunk, cache, mask)
        hidden = ops.rms_norm(streams.mean(dim=1), self.norm, self.config.rms_norm_eps)
        return F.linear(hidden, self.lm_head).float()
