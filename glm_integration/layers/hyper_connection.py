"""mHC: `hc_mult` residual streams, collapsed into one block input by `pre` weights, the block output
expanded back by `post` weights, and the streams mixed by a Sinkhorn-normalised (doubly stochastic)
matrix, all computed from the streams themselves."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class HyperConnection:
    def __init__(self, config, weights: dict[str, torch.Tensor], prefix: str):
        self.n, self.eps, self.iters = config.hc_mult, config.hc_eps, config.hc_sinkhorn_iters
        self.norm_eps = config.rms_norm_eps
        self.fn, self.base, self.scale = (weights[f"{prefix}.{n}"] for n in ("fn", "base", "scale"))

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D] -> (post [T, N], comb [T, N, N], collapsed block input [T, D])."""
        n = self.n
        flat = streams.reshape(streams.shape[0], -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        mixed = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        dtype = residual.dtype
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), residual)
