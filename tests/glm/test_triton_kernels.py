"""The Triton backend against the torch reference, op by op, at the tiny preset's shapes and at the
real model's head shapes (pruned-4l / full: KDA 128x128 heads, MLA latent rank 512, 128-wide indexer).

Pool selection must equal the reference exactly (same pools, ties to the lower index).
Tolerances (max abs error, inputs ~N(0, 1)): fp32 inputs 2e-4 for the KDA recurrence (different
summation order, chunked closed form vs token-by-token), 1e-4 elsewhere; bf16 inputs 3e-2 (the
reference rounds intermediates to bf16, the kernels keep fp32 until the output). Runs where a GPU and
Triton are present, skips otherwise."""

import pytest
import torch

from glm_integration.kernels import torch_ref as reference

triton = pytest.importorskip("triton", reason="the Triton backend needs triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton backend needs a GPU")
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops():
    from glm_integration.kernels import triton_ops

    return triton_ops


def _rand(*shape, dtype=torch.float32, scale=1.0, seed=[0]):
    seed[0] += 1
    g = torch.Generator(device="cuda").manual_seed(seed[0])
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


def _close(ours, theirs, tol, what):
    err = (ours.float() - theirs.float()).abs().max().item()
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,dim", [(1, 4, 32), (37, 4, 32), (70, 2, 128)])
@pytest.mark.parametrize("op", ["kda_chunked", "kda_recurrent"])
def test_kda(ops, op, tokens, heads, dim, dtype):
    q, k, v = (_rand(tokens, heads, dim, dtype=dtype) for _ in range(3))
    g = -_rand(tokens, heads, dim).abs() * 0.5  # log decay <= 0, some strong
    g[tokens // 2] = -30.0  # a near-total forget: the chunked form must stay finite
    beta = torch.sigmoid(_rand(tokens, heads))
    state = _rand(heads, dim, dim) * 0.1
    out, new_state = getattr(ops, op)(q, k, v, g, beta, state)
    ref_out, ref_state = reference.kda_recurrent(q, k, v, g, beta, state)  # the defining recurrence
    tol = TOL[dtype] * 2
    _close(out, ref_out, tol, f"{op} output")
    _close(new_state, ref_state, tol, f"{op} state")
    assert out.dtype == torch.float32 and new_state.dtype == torch.float32
    if op == "kda_chunked":
        _close(out, reference.kda_chunked(q, k, v, g, beta, state)[0], tol, "vs the torch chunked form")


def _selection(tokens, keys, density):
    mask = torch.rand(tokens, keys, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)) < density
    mask[:, 0] = True
    return mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,tokens,keys,dim,vdim", [(4, 16, 16, 32, 32), (8, 33, 300, 256, 256), (2, 1, 2100, 64, 48)])
def test_sparse_masked_attention(ops, heads, tokens, keys, dim, vdim, dtype):
    q, k = _rand(heads, tokens, dim, dtype=dtype), _rand(heads, keys, dim, dtype=dtype)
    v = _rand(heads, keys, vdim, dtype=dtype)
    mask = _selection(tokens, keys, 0.3)
    _close(ops.masked_attention(q, k, v, mask, dim ** -0.5), reference.masked_attention(q, k, v, mask, dim ** -0.5),
           TOL[dtype], "masked attention")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,tokens,keys,rank", [(4, 1, 40, 32), (16, 1, 2500, 512), (8, 3, 700, 512)])
def test_sparse_absorbed_decode_attention(ops, heads, tokens, keys, rank, dtype):
    q, latent = _rand(heads, tokens, rank, dtype=dtype), _rand(keys, rank, dtype=dtype)
    mask = _selection(tokens, keys, 0.1)
    _close(ops.absorbed_decode_attention(q, latent, mask, rank ** -0.5),
           reference.absorbed_decode_attention(q, latent, mask, rank ** -0.5), TOL[dtype], "absorbed decode")


def test_sparse_attention_result_does_not_depend_on_other_queries(ops):
    """A warm run computes fewer queries of a chunk than the cold run: each query's bits must not move."""
    q, k, v = _rand(4, 20, 64), _rand(4, 90, 64), _rand(4, 90, 64)
    mask = _selection(20, 90, 0.4)
    whole = ops.masked_attention(q, k, v, mask, 0.125)
    part = ops.masked_attention(q[:, 12:], k, v, mask[12:], 0.125)
    assert torch.equal(whole[:, 12:], part)


@pytest.mark.parametrize("tokens,heads,pools", [(5, 4, 9), (64, 32, 513)])
def test_indexer_scores_and_pooled_top_k(ops, tokens, heads, pools):
    q, w, pooled = _rand(tokens, heads, 128), _rand(tokens, heads) * heads ** -0.5, _rand(pools, 128)
    ours, theirs = ops.indexer_scores(q, w, pooled, 128 ** -0.5), reference.indexer_scores(q, w, pooled, 128 ** -0.5)
    _close(ours, theirs, 1e-4 * max(1.0, theirs.abs().max().item()), "indexer scores")
    visible = torch.arange(pools, device="cuda")[None, :] < torch.arange(1, tokens + 1, device="cuda")[:, None] * 4
    k = min(8, pools)
    chosen = ops.select_pools(ours, visible, k)
    assert torch.equal(chosen, reference.select_pools(ours, visible, k))  # same scores: the same pools
    # from the reference's own scores, the same pools away from near-ties
    top = theirs.masked_fill(~visible, float("-inf")).sort(dim=-1, descending=True).values
    clear = (top[:, k - 1] - top[:, k]).abs() > 1e-3
    assert torch.equal(chosen[clear], reference.select_pools(theirs, visible, k)[clear])


@pytest.mark.parametrize("tokens,pools,k", [(5, 9, 4), (7, 40, 8), (3, 2100, 512), (4, 10, 20)])
def test_select_pools_is_the_stable_top_k(ops, tokens, pools, k):
    g = torch.Generator(device="cuda").manual_seed(pools)
    weights = torch.randn(tokens, 4, 1, device="cuda", generator=g)
    scores = (weights * torch.relu(torch.randn(tokens, 4, pools, device="cuda", generator=g))).sum(1)
    scores[:, ::3] = 0.0
    scores[:, 1::7] = -0.0  # signed zeros tie with zeros, as in the reference's sort
    visible = torch.rand(tokens, pools, device="cuda", generator=g) < 0.7
    assert torch.equal(ops.select_pools(scores, visible, k), reference.select_pools(scores, visible, k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,dim,experts,inter,top", [(7, 128, 8, 64, 2), (19, 512, 16, 256, 8)])
def test_moe_experts(ops, tokens, dim, experts, inter, top, dtype):
    x = _rand(tokens, dim, dtype=dtype)
    gate_up, down = _rand(experts, 2 * inter, dim, dtype=dtype, scale=dim ** -0.5), _rand(experts, dim, inter, dtype=dtype,
                                                                                           scale=inter ** -0.5)
    indices = torch.stack([torch.randperm(experts, device="cuda")[:top] for _ in range(tokens)])
    weights = torch.softmax(_rand(tokens, top), -1)
    ours = ops.moe_experts(x, weights, indices, gate_up, down, 7.0)
    theirs = reference.moe_experts(x, weights, indices, gate_up, down, 7.0)
    assert ours.dtype == dtype
    _close(ours, theirs, TOL[dtype] * max(1.0, theirs.abs().max().item()), "moe")


def test_backend_selection():
    from glm_integration.kernels import active_backend, backend_for, use_backend

    assert backend_for("cuda") == "triton" and backend_for("cpu") == "torch"
    before = active_backend()
    use_backend("triton")
    use_backend(before)
