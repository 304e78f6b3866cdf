"""Triton kernels for the runner's hot ops, one program per independent slice of the work (a head, a
query, a token-expert pair), so NVIDIA and AMD GPUs run the same source. Importing this module
registers them as the `triton` backend; ops not here (norms, conv, pooling) keep the torch reference,
which runs on the GPU as ordinary torch ops.

Accumulation is fp32 throughout and every reduction runs in a fixed order inside one program (no
atomics, no split reductions), so a query's output depends only on its own inputs: a warm run that
computes fewer tokens of a chunk gets the same bits as the cold run. Against the torch reference the
results differ only by summation order (fp32) or by the reference's intermediate rounding to the model
dtype (bf16); the tolerances are in tests/test_triton_kernels.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import register


def _pow2(n: int, floor: int = 16) -> int:
    return max(triton.next_power_of_2(int(n)), floor)


# -- KDA: the gated delta rule ------------------------------------------------------------------------


@triton.jit
def _kda_recurrent_kernel(q, k, v, g, beta, s_in, out, s_out, T, H, DK, DV, scale, BK: tl.constexpr, BV: tl.constexpr):
    """One (head, value block): the state tile S[:, block] stays on chip for all T tokens."""
    h = tl.program_id(0)
    ok = tl.arange(0, BK)
    ov = tl.program_id(1) * BV + tl.arange(0, BV)
    mk, mv = ok < DK, ov < DV
    tile = h * DK * DV + ok[:, None] * DV + ov[None, :]
    mask2 = mk[:, None] & mv[None, :]
    s = tl.load(s_in + tile, mask=mask2, other=0.0)
    for t in range(T):
        row = t * H + h
        qt = tl.load(q + row * DK + ok, mask=mk, other=0.0).to(tl.float32)
        kt = tl.load(k + row * DK + ok, mask=mk, other=0.0).to(tl.float32)
        gt = tl.load(g + row * DK + ok, mask=mk, other=0.0).to(tl.float32)
        vt = tl.load(v + row * DV + ov, mask=mv, other=0.0).to(tl.float32)
        bt = tl.load(beta + row).to(tl.float32)
        qt = qt / tl.sqrt(tl.sum(qt * qt, 0) + 1e-6) * scale
        kt = kt / tl.sqrt(tl.sum(kt * kt, 0) + 1e-6)
        s = s * tl.exp(gt)[:, None]
        u = (vt - tl.sum(s * kt[:, None], 0)) * bt
        s = s + kt[:, None] * u[None, :]
        tl.store(out + row * DV + ov, tl.sum(s * qt[:, None], 0), mask=mv)
    tl.store(s_out + tile, s, mask=mask2)


@triton.jit
def _kda_chunked_kernel(
    q, k, v, g, beta, s_in, out, s_out, T, H, DK, DV, scale, L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr
):
    """One (head, value block), L tokens at a time in closed form: the chunk's pairwise decays
    exp(G_t - G_i) (never above 1, so no overflow for any decay), the unit-lower-triangular system for
    the chunk's updates solved by forward substitution, then one state update per chunk."""
    h = tl.program_id(0)
    ok = tl.arange(0, BK)
    ov = tl.program_id(1) * BV + tl.arange(0, BV)
    ol = tl.arange(0, L)
    mk, mv = ok < DK, ov < DV
    tile = h * DK * DV + ok[:, None] * DV + ov[None, :]
    mask2 = mk[:, None] & mv[None, :]
    s = tl.load(s_in + tile, mask=mask2, other=0.0)
    causal = ol[:, None] >= ol[None, :]
    for c0 in range(0, T, L):
        rows = (c0 + ol) * H + h
        mt = (c0 + ol) < T
        mtk = mt[:, None] & mk[None, :]
        qc = tl.load(q + rows[:, None] * DK + ok[None, :], mask=mtk, other=0.0).to(tl.float32)
        kc = tl.load(k + rows[:, None] * DK + ok[None, :], mask=mtk, other=0.0).to(tl.float32)
        gc = tl.load(g + rows[:, None] * DK + ok[None, :], mask=mtk, other=0.0).to(tl.float32)
        vc = tl.load(v + rows[:, None] * DV + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.0).to(tl.float32)
        bc = tl.load(beta + rows, mask=mt, other=0.0).to(tl.float32)
        qc = qc / tl.sqrt(tl.sum(qc * qc, 1) + 1e-6)[:, None] * scale
        kc = kc / tl.sqrt(tl.sum(kc * kc, 1) + 1e-6)[:, None]
        cum = tl.cumsum(gc, 0)  # G_t; padded rows add 0, so the last row holds the chunk's total
        decay = tl.exp(tl.where(causal[:, :, None], cum[:, None, :] - cum[None, :, :], float("-inf")))
        a = tl.sum(kc[:, None, :] * decay * kc[None, :, :], 2)  # A[t, i], i <= t
        b = tl.sum(qc[:, None, :] * decay * kc[None, :, :], 2)  # B[t, i], i <= t
        gamma = tl.exp(cum)
        rhs = bc[:, None] * (vc - tl.dot(gamma * kc, s, input_precision="ieee"))
        u = tl.zeros([L, BV], dtype=tl.float32)
        for t in tl.static_range(L):
            here = ol == t
            a_t = tl.sum(tl.where(here[:, None] & (ol[None, :] < t), a, 0.0), 0)
            r_t = tl.sum(tl.where(here[:, None], rhs, 0.0), 0)
            b_t = tl.sum(tl.where(here, bc, 0.0), 0)
            u_t = r_t - b_t * tl.sum(a_t[:, None] * u, 0)
            u = tl.where(here[:, None], u_t[None, :], u)
        o = tl.dot(gamma * qc, s, input_precision="ieee") + tl.dot(b, u, input_precision="ieee")
        tl.store(out + rows[:, None] * DV + ov[None, :], o, mask=mt[:, None] & mv[None, :])
        last = tl.sum(tl.where((ol == L - 1)[:, None], cum, 0.0), 0)
        s = tl.exp(last)[:, None] * s + tl.dot(tl.trans(tl.exp(last[None, :] - cum) * kc), u, input_precision="ieee")
    tl.store(s_out + tile, s, mask=mask2)


def _kda(kernel, q, k, v, g, beta, state, **extra):
    t, h, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    s_in = state.float().contiguous()
    out = torch.empty((t, h, dv), dtype=torch.float32, device=q.device)
    s_out = torch.empty_like(s_in)
    bv = min(_pow2(dv), 32)
    kernel[(h, triton.cdiv(dv, bv))](
        q, k, v, g, beta, s_in, out, s_out, t, h, dk, dv, dk**-0.5, BK=_pow2(dk), BV=bv, **extra
    )
    return out, s_out


def kda_recurrent(q, k, v, g, beta, state):
    return _kda(_kda_recurrent_kernel, q, k, v, g, beta, state)


def kda_chunked(q, k, v, g, beta, state, chunk: int = 16):
    return _kda(_kda_chunked_kernel, q, k, v, g, beta, state, L=16, num_warps=8)


# -- sparse MLA attention over selected key indices -----------------------------------------------


@triton.jit
def _sparse_attention_kernel(
    q,
    k,
    v,
    idx,
    counts,
    out,
    scale,
    sq_h,
    sq_t,
    sk_h,
    sk_s,
    sv_h,
    sv_s,
    so_h,
    so_t,
    si_t,
    D,
    DV,
    BD: tl.constexpr,
    BDV: tl.constexpr,
    BN: tl.constexpr,
):
    """One (query, head): online softmax over the query's selected keys in ascending position order."""
    t, h = tl.program_id(0), tl.program_id(1)
    od, ov = tl.arange(0, BD), tl.arange(0, BDV)
    md, mv = od < D, ov < DV
    qv = tl.load(q + h * sq_h + t * sq_t + od, mask=md, other=0.0).to(tl.float32)
    m = tl.max(tl.full([BN], float("-inf"), tl.float32), 0)
    total = tl.sum(tl.zeros([BN], tl.float32), 0)
    acc = tl.zeros([BDV], tl.float32)
    n = tl.load(counts + t)
    for n0 in range(0, n, BN):
        on = n0 + tl.arange(0, BN)
        mn = on < n
        pos = tl.load(idx + t * si_t + on, mask=mn, other=0).to(tl.int64)
        keys = tl.load(k + h * sk_h + pos[:, None] * sk_s + od[None, :], mask=mn[:, None] & md[None, :], other=0.0)
        score = tl.where(mn, tl.sum(keys.to(tl.float32) * qv[None, :], 1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(score, 0))
        p = tl.exp(score - m_new)
        alpha = tl.exp(m - m_new)
        vals = tl.load(v + h * sv_h + pos[:, None] * sv_s + ov[None, :], mask=mn[:, None] & mv[None, :], other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * vals.to(tl.float32), 0)
        total = total * alpha + tl.sum(p, 0)
        m = m_new
    tl.store(out + h * so_h + t * so_t + ov, (acc / total).to(out.dtype.element_ty), mask=mv)


def _selected(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query the selected key positions, ascending (padded), and how many there are."""
    s = mask.shape[-1]
    positions = torch.arange(s, device=mask.device, dtype=torch.int32).expand_as(mask)
    ordered = torch.where(mask, positions, s).sort(dim=-1).values
    counts = mask.sum(-1, dtype=torch.int32)
    width = max(int(counts.max()), 1) if counts.numel() else 1
    return ordered[:, :width].contiguous(), counts.contiguous()


def _sparse_attention(q, k, v, sk_h, sv_h, mask, scale):
    heads, t, d = q.shape
    dv = v.shape[-1]
    idx, counts = _selected(mask)
    out = torch.empty((heads, t, dv), dtype=q.dtype, device=q.device)
    _sparse_attention_kernel[(t, heads)](
        q,
        k,
        v,
        idx,
        counts,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        sk_h,
        k.stride(-2),
        sv_h,
        v.stride(-2),
        out.stride(0),
        out.stride(1),
        idx.stride(0),
        d,
        dv,
        BD=_pow2(d),
        BDV=_pow2(dv),
        BN=16,
    )
    return out


def masked_attention(q, k, v, mask, scale):
    k, v = k.contiguous(), v.contiguous()
    return _sparse_attention(q.contiguous(), k, v, k.stride(0), v.stride(0), mask, scale)


def absorbed_decode_attention(q_latent, latent, mask, scale):
    latent = latent.contiguous()  # keys and values are the same latent rows, shared by every head
    return _sparse_attention(q_latent.contiguous(), latent, latent, 0, 0, mask, scale)


# -- DSA indexer scores over pooled keys -------------------------------------------------------------


@triton.jit
def _indexer_scores_kernel(q, w, pooled, out, N, H, D, scale, BN: tl.constexpr, BD: tl.constexpr):
    """One (query, pool block): sum over heads of w[t, h] * relu(q[t, h] . pooled[n] * scale)."""
    t = tl.program_id(0)
    on = tl.program_id(1) * BN + tl.arange(0, BN)
    od = tl.arange(0, BD)
    mn, md = on < N, od < D
    keys = tl.load(pooled + on[:, None] * D + od[None, :], mask=mn[:, None] & md[None, :], other=0.0).to(tl.float32)
    acc = tl.zeros([BN], tl.float32)
    for h in range(H):
        qv = tl.load(q + (t * H + h) * D + od, mask=md, other=0.0).to(tl.float32)
        acc += tl.maximum(tl.sum(keys * qv[None, :], 1) * scale, 0.0) * tl.load(w + t * H + h).to(tl.float32)
    tl.store(out + t * N + on, acc, mask=mn)


def indexer_scores(q, weights, pooled, scale):
    t, h, d = q.shape
    n = pooled.shape[0]
    out = torch.empty((t, n), dtype=torch.float32, device=q.device)
    if n:
        bn = 32
        _indexer_scores_kernel[(t, triton.cdiv(n, bn))](
            q.contiguous(), weights.contiguous(), pooled.contiguous(), out, n, h, d, scale, BN=bn, BD=_pow2(d)
        )
    return out


@triton.jit
def _order_keys(scores, visible, on, mask):
    """int64 keys whose order is the scores' order; invisible pools get 0, below every visible one."""
    bits = tl.load(scores + on, mask=mask, other=0.0).to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    bits = tl.where(bits == 0x80000000, 0, bits)  # -0.0 ties with 0.0, as in the reference's sort
    key = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000) + 1
    seen = tl.load(visible + on, mask=mask, other=0) != 0
    return tl.where(seen & mask, key, 0)


@triton.jit
def _select_pools_kernel(scores, visible, out, N, K, BN: tl.constexpr):
    """One row: the K best visible pools, ties to the lower index. A bisection over the 32-bit order
    keys finds the K-th best key T; every key above T is chosen, then keys equal to T in index order."""
    t = tl.program_id(0).to(tl.int64)
    row_s, row_v, row_o = scores + t * N, visible + t * N, out + t * N
    lo = tl.sum(tl.zeros([BN], tl.int64), 0) + 1  # count(key >= lo) >= K holds for lo = 1 when enough are visible
    hi = lo + 0xFFFFFFFF + 1
    for _ in range(33):
        mid = (lo + hi) // 2
        count = tl.sum(tl.zeros([BN], tl.int64), 0)
        for n0 in range(0, N, BN):
            on = n0 + tl.arange(0, BN)
            count += tl.sum((_order_keys(row_s, row_v, on, on < N) >= mid).to(tl.int64), 0)
        big = count >= K
        lo = tl.where(big, mid, lo)
        hi = tl.where(big, hi, mid)
    above = tl.sum(tl.zeros([BN], tl.int64), 0)
    for n0 in range(0, N, BN):
        on = n0 + tl.arange(0, BN)
        above += tl.sum((_order_keys(row_s, row_v, on, on < N) > lo).to(tl.int64), 0)
    room = K - above  # how many pools tied at the threshold still fit
    taken = tl.sum(tl.zeros([BN], tl.int64), 0)
    for n0 in range(0, N, BN):
        on = n0 + tl.arange(0, BN)
        key = _order_keys(row_s, row_v, on, on < N)
        tied = (key == lo).to(tl.int64)
        rank = taken + tl.cumsum(tied, 0)  # 1-based position among the tied, in index order
        chosen = (key > lo) | ((key == lo) & (rank <= room))
        tl.store(row_o + on, (chosen & (key > 0)).to(tl.int8), mask=on < N)
        taken += tl.sum(tied, 0)


def select_pools(scores, visible, k):
    t, n = scores.shape
    out = torch.zeros((t, n), dtype=torch.int8, device=scores.device)
    if t and n:
        _select_pools_kernel[(t,)](
            scores.float().contiguous(), visible.to(torch.int8).contiguous(), out, n, min(k, n), BN=min(_pow2(n), 1024)
        )
    return out.bool()


# -- MoE: routed experts, token by token ---------------------------------------------------------------


@triton.jit
def _moe_up_kernel(x, idx, gate_up, hidden, K, D, NI, limit, BI: tl.constexpr, BD: tl.constexpr):
    """One (token-expert pair, intermediate block): clamped SwiGLU of the expert's gate and up rows."""
    pair = tl.program_id(0)
    t = pair // K
    e = tl.load(idx + pair).to(tl.int64)
    oi = tl.program_id(1) * BI + tl.arange(0, BI)
    mi = oi < NI
    gate = tl.zeros([BI], tl.float32)
    up = tl.zeros([BI], tl.float32)
    base = gate_up + e * 2 * NI * D
    for d0 in range(0, D, BD):
        od = d0 + tl.arange(0, BD)
        md = od < D
        xv = tl.load(x + t * D + od, mask=md, other=0.0).to(tl.float32)
        m2 = mi[:, None] & md[None, :]
        gate_rows = tl.load(base + oi[:, None] * D + od[None, :], mask=m2, other=0.0).to(tl.float32)
        up_rows = tl.load(base + (NI + oi[:, None]) * D + od[None, :], mask=m2, other=0.0).to(tl.float32)
        gate += tl.sum(gate_rows * xv[None, :], 1)
        up += tl.sum(up_rows * xv[None, :], 1)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    tl.store(hidden + pair * NI + oi, gate * tl.sigmoid(gate) * up, mask=mi)


@triton.jit
def _moe_down_kernel(hidden, idx, weights, down, out, K, D, NI, BD: tl.constexpr, BI: tl.constexpr):
    """One (token, output block): the token's experts summed in rank order."""
    t = tl.program_id(0)
    od = tl.program_id(1) * BD + tl.arange(0, BD)
    md = od < D
    acc = tl.zeros([BD], tl.float32)
    for j in range(K):
        e = tl.load(idx + t * K + j).to(tl.int64)
        part = tl.zeros([BD], tl.float32)
        for i0 in range(0, NI, BI):
            oi = i0 + tl.arange(0, BI)
            mi = oi < NI
            hv = tl.load(hidden + (t * K + j) * NI + oi, mask=mi, other=0.0)
            wd = tl.load(down + e * D * NI + od[:, None] * NI + oi[None, :], mask=md[:, None] & mi[None, :], other=0.0)
            part += tl.sum(wd.to(tl.float32) * hv[None, :], 1)
        acc += part * tl.load(weights + t * K + j).to(tl.float32)
    tl.store(out + t * D + od, acc.to(out.dtype.element_ty), mask=md)


def moe_experts(x, weights, indices, gate_up, down, limit):
    t, d = x.shape
    kk = indices.shape[1]
    inter = down.shape[-1]
    x, indices, weights = x.contiguous(), indices.contiguous(), weights.float().contiguous()
    hidden = torch.empty((t * kk, inter), dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    if t:
        bi, bd = min(_pow2(inter), 64), min(_pow2(d), 128)
        _moe_up_kernel[(t * kk, triton.cdiv(inter, bi))](
            x, indices, gate_up.contiguous(), hidden, kk, d, inter, float(limit), BI=bi, BD=bd
        )
        _moe_down_kernel[(t, triton.cdiv(d, bd))](
            hidden, indices, weights, down.contiguous(), out, kk, d, inter, BD=bd, BI=bi
        )
    return out


for _name in (
    "kda_recurrent",
    "kda_chunked",
    "masked_attention",
    "absorbed_decode_attention",
    "indexer_scores",
    "select_pools",
    "moe_experts",
):
    register("triton", _name, globals()[_name])
