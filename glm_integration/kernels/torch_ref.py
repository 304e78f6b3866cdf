"""Reference kernels in plain PyTorch (CPU or any device). Every other backend is checked against these.
All reductions run in a fixed order and in fp32 where the model keeps fp32 (recurrent state, router,
softmax), so equal inputs give bit-equal outputs on a fixed thread count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

OPS = (
    "rms_norm",
    "causal_conv",
    "kda_chunked",
    "kda_recurrent",
    "masked_attention",
    "absorbed_decode_attention",
    "indexer_scores",
    "pool_keys",
    "select_pools",
    "moe_experts",
    "hc_pre",
    "hc_post",
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(dtype) if weight is None else weight * h.to(dtype)


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over x [T, C] continuing from `window` [C, K-1] (the previous K-1
    inputs); returns (y [T, C], the new window)."""
    k = weight.shape[-1]
    ext = torch.cat([window.to(x.dtype), x.transpose(0, 1)], dim=1)  # [C, K-1+T]
    y = F.conv1d(ext.unsqueeze(0).to(weight.dtype), weight.view(weight.shape[0], 1, k), groups=weight.shape[0])
    return F.silu(y[0]).transpose(0, 1).to(x.dtype), ext[:, ext.shape[1] - (k - 1) :].clone()


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def kda_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """Kimi delta attention over T tokens in closed form per chunk.
    q, k [T, H, Dk], v [T, H, Dv], g [T, H, Dk] (log decay <= 0), beta [T, H], state [H, Dk, Dv] fp32.
    Per token: S <- diag(exp g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q (q, k l2-normed,
    q scaled by Dk^-1/2). Within a chunk the u's solve one unit-lower-triangular system."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    q = _l2norm(q) * q.shape[-1] ** -0.5
    k = _l2norm(k)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    s = state.float()
    for start in range(0, q.shape[0], chunk):
        sl = slice(start, start + chunk)
        out[sl], s = _kda_chunk(
            q[sl].transpose(0, 1),
            k[sl].transpose(0, 1),
            v[sl].transpose(0, 1),
            g[sl].transpose(0, 1),
            beta[sl].transpose(0, 1),
            s,
        )
    return out, s


def _kda_chunk(q, k, v, g, beta, s):
    # shapes per head: q, k, g [H, L, Dk]; v [H, L, Dv]; beta [H, L]; s [H, Dk, Dv]
    L = q.shape[1]
    cum = g.cumsum(dim=1)  # G_t
    diff = cum.unsqueeze(2) - cum.unsqueeze(1)  # [H, t, i, Dk] = G_t - G_i
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(causal[None, :, :, None], diff, torch.full_like(diff, float("-inf"))).exp()
    a = torch.einsum("hic,htic,htc->hti", k, decay, k)  # A[t,i] = sum_c k_i k_t exp(G_t - G_i)
    b = torch.einsum("hic,htic,htc->hti", k, decay, q)  # B[t,i] = sum_c k_i q_t exp(G_t - G_i)
    strict = torch.ones(L, L, dtype=torch.bool, device=q.device).tril(-1)
    lhs = torch.eye(L, device=q.device) + beta.unsqueeze(-1) * a * strict
    gamma = cum.exp()
    rhs = beta.unsqueeze(-1) * (v - torch.einsum("htc,hcv->htv", gamma * k, s))
    u = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)
    out = torch.einsum("htc,hcv->htv", gamma * q, s) + torch.einsum("hti,hiv->htv", b * causal, u)
    last = cum[:, -1:, :]  # G_L
    s = gamma[:, -1, :, None] * s + torch.einsum("hic,hiv->hcv", (last - cum).exp() * k, u)
    return out.transpose(0, 1), s


def kda_recurrent(q, k, v, g, beta, state):
    """The same recurrence token by token (decode)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    q = _l2norm(q) * q.shape[-1] ** -0.5
    k = _l2norm(k)
    s = state.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[0]):
        s = s * g[t].exp().unsqueeze(-1)
        u = (v[t] - (s * k[t].unsqueeze(-1)).sum(-2)) * beta[t].unsqueeze(-1)
        s = s + k[t].unsqueeze(-1) * u.unsqueeze(-2)
        out[t] = (s * q[t].unsqueeze(-1)).sum(-2)
    return out, s


def masked_attention(q, k, v, mask, scale):
    """q [H, T, D], k [H, S, D], v [H, S, Dv], mask [T, S] bool (True = attend). Masked positions
    contribute exact zeros, so the sum over a selection does not depend on the selection's order."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


def absorbed_decode_attention(q_latent, latent, mask, scale):
    """MLA decode in the absorbed form: q_latent [H, T, R] (= W_UK^T q), latent rows [S, R];
    returns o_latent [H, T, R], to be mapped by W_UV."""
    scores = torch.matmul(q_latent, latent.t()) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q_latent.dtype)
    return torch.matmul(probs, latent)


def pool_keys(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Compress complete pools: keys, gates [N, P, D] -> [N, D], softmax over the pool per channel."""
    probs = (gates.float() + ape.float()).softmax(dim=1).to(keys.dtype)
    return (probs * keys).sum(dim=1)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, pooled: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D], weights [T, H] (already scaled by H^-1/2), pooled [N, D] -> scores [T, N]."""
    s = torch.relu(torch.matmul(q.float(), pooled.float().t()) * scale)  # [T, H, N]
    return torch.matmul(weights.float().unsqueeze(1), s).squeeze(1)


def select_pools(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k visible pools per row with a stable tie-break (lower pool index wins); [T, N] -> bool mask."""
    n = scores.shape[-1]
    masked = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, : min(k, n)]
    chosen = torch.zeros_like(visible)
    chosen.scatter_(1, order, True)
    return chosen & visible


def moe_experts(x, weights, indices, gate_up, down, limit):
    """x [T, D]; weights/indices [T, K]; gate_up [E, 2I, D]; down [E, D, I]. Each token sums its experts
    in rank order, independent of which other tokens share the batch."""
    out = torch.zeros_like(x)
    for slot in range(indices.shape[1]):
        for e in indices[:, slot].unique().tolist():
            rows = (indices[:, slot] == e).nonzero().squeeze(1)
            gate, up = F.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
            h = F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
            out[rows] += F.linear(h, down[e]) * weights[rows, slot, None].to(x.dtype)
    return out


def hc_pre(streams, fn, base, scale, eps: float, norm_eps: float, iters: int):
    """mHC before a block: streams [T, N, D] -> (post [T, N], comb [T, N, N], the block input [T, D]).
    `fn` [N(N+2), N D] maps the RMS-normed streams to the pre, post and comb logits; `base` [N(N+2)]
    and `scale` [3] bias and scale them; comb is Sinkhorn-normalised in `iters` rounds."""
    n = streams.shape[1]
    flat = streams.reshape(streams.shape[0], -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixed = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hc_post(post, comb, block_out, residual):
    """mHC after a block: the block output [T, D] spread over the streams by `post`, plus the streams
    [T, N, D] mixed by comb^T."""
    dtype = residual.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), residual
    )
