"""The dense SwiGLU MLP of the first layers and the MoE of the others: sigmoid router scores plus a
correction bias choose experts (grouped top-k), the chosen scores are renormalised and scaled, and a
shared expert is always added. Gate and up projections are clamped (SwiGLU limit)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import ops


class DenseMLP:
    def __init__(self, config, weights, prefix: str):
        self.limit = config.swiglu_limit
        self.gate, self.up, self.down = (weights[f"{prefix}.{n}_proj.weight"] for n in ("gate", "up", "down"))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.linear(x, self.gate).clamp(max=self.limit)
        up = F.linear(x, self.up).clamp(-self.limit, self.limit)
        return F.linear(F.silu(gate) * up, self.down)


class MoE:
    def __init__(self, config, weights, prefix: str):
        self.top_k, self.groups, self.topk_groups = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm_topk, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.limit = config.swiglu_limit
        self.router = weights[f"{prefix}.gate.weight"]
        self.bias = weights[f"{prefix}.gate.e_score_correction_bias"]
        self.gate_up = weights[f"{prefix}.experts.gate_up_proj"]
        self.down = weights[f"{prefix}.experts.down_proj"]
        self.shared = DenseMLP(config, weights, f"{prefix}.shared_experts")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.router.float()).sigmoid()
        choice = scores + self.bias.float()
        experts = choice.shape[-1]
        grouped = choice.view(-1, self.groups, experts // self.groups)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_groups, dim=-1).indices, 1)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(-1, experts).bool()
        indices = choice.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(1, indices)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, indices

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = self.route(x)
        routed = ops.moe_experts(x, weights, indices, self.gate_up, self.down, self.limit)
        return routed + self.shared(x)
