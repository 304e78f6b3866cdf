"""mHC: `hc_mult` residual streams, collapsed into one block input by `pre` weights, the block output
expanded back by `post` weights, and the streams mixed by a Sinkhorn-normalised (doubly stochastic)
matrix, all computed from the streams themselves (kernels: ops.hc_pre, ops.hc_post)."""

from __future__ import annotations

import torch

from ..kernels import ops


class HyperConnection:
    def __init__(self, config, weights: dict[str, torch.Tensor], prefix: str):
        self.n, self.eps, self.iters = config.hc_mult, config.hc_eps, config.hc_sinkhorn_iters
        self.norm_eps = config.rms_norm_eps
        self.fn, self.base, self.scale = (weights[f"{prefix}.{n}"] for n in ("fn", "base", "scale"))

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D] -> (post [T, N], comb [T, N, N], collapsed block input [T, D])."""
        return ops.hc_pre(streams, self.fn, self.base, self.scale, self.eps, self.norm_eps, self.iters)

    @staticmethod
    def merge(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return ops.hc_post(post, comb, block_out, residual)
