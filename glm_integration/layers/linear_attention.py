"""KDA (Kimi delta attention) layers: a short causal conv over q/k/v, a per-key-channel forget gate,
and the gated delta rule. The state (conv window + fp32 recurrent S) lives in the page of the block
holding the latest computed token, so the page of every completed block is the checkpoint at its end
boundary (vLLM's mamba align mode), and a chunk never writes into an earlier (possibly shared) block."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import ops
from .chunk import Chunk


class LinearAttention:
    def __init__(self, config, weights, prefix: str, layer: int):
        self.layer, self.heads, self.dim = layer, config.linear_num_heads, config.linear_head_dim
        self.lower_bound, self.eps = config.linear_lower_bound, config.rms_norm_eps
        w = {name[len(prefix) + 1 :]: t for name, t in weights.items() if name.startswith(prefix + ".")}
        self.q, self.k, self.v = w["q_proj.weight"], w["k_proj.weight"], w["v_proj.weight"]
        self.conv = w["conv1d.weight"].reshape(w["conv1d.weight"].shape[0], -1)
        self.f_a, self.f_b = w["forget_gate.f_a_proj.weight"], w["forget_gate.f_b_proj.weight"]
        self.dt_bias, self.a_log = w["forget_gate.dt_bias"], w["forget_gate.A_log"]
        self.b, self.g_a, self.g_b = w["b_proj.weight"], w["g_a_proj.weight"], w["g_b_proj.weight"]
        self.o_norm, self.o = w["o_norm.weight"], w["o_proj.weight"]

    def _decay(self, x: torch.Tensor) -> torch.Tensor:
        raw = F.linear(F.linear(x, self.f_a), self.f_b).float() + self.dt_bias.float()
        raw = raw.view(x.shape[0], self.heads, self.dim)
        rate = self.a_log.float().exp().view(1, self.heads, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * raw)
        return -rate * F.softplus(raw, threshold=20.0)

    def __call__(self, x: torch.Tensor, chunk: Chunk, cache) -> torch.Tensor:
        conv_pages, state_pages = cache.conv_window(self.layer), cache.recurrent_state(self.layer)
        if chunk.start == 0:
            window = torch.zeros_like(conv_pages[0])
            state = torch.zeros_like(state_pages[0])
        else:
            src = chunk.block_of(chunk.start - 1)
            window, state = conv_pages[src], state_pages[src]
        mixed = torch.cat([F.linear(x, self.q), F.linear(x, self.k), F.linear(x, self.v)], dim=-1)
        mixed, window = ops.causal_conv(mixed, window, self.conv)
        shape = (x.shape[0], self.heads, self.dim)
        q, k, v = (t.reshape(shape) for t in mixed.split(self.heads * self.dim, dim=-1))
        g, beta = self._decay(x), torch.sigmoid(F.linear(x, self.b))
        kernel = ops.kda_recurrent if chunk.decode else ops.kda_chunked
        out, state = kernel(q, k, v, g, beta, state)
        dst = chunk.block_of(chunk.end - 1)
        conv_pages[dst] = window
        state_pages[dst] = state
        gate = F.linear(F.linear(x, self.g_a), self.g_b).view(shape)
        normed = ops.rms_norm(out.float(), self.o_norm.float(), self.eps) * torch.sigmoid(gate.float())
        return F.linear(normed.to(x.dtype).reshape(x.shape[0], -1), self.o)
