"""The aiter backend's wiring, checked without ROCm: a stand-in `aiter` package implements the entry
points the backend uses as aiter documents them, in torch: rms_norm; mla_decode_fwd over a page-size-1
cache addressed by kv_indptr/kv_indices (the current signature with page_size/nhead_kv, and the
2025 one without them); chunk_kimi_delta_attn (fla's chunk_kda surface); mhc_pre/mhc_post; and
fp8_mqa_logits. The tests prove that the backend dispatches exactly the shapes it claims, that what it
passes (padding to 576, head counts per call, one sequence per query, selected rows as kv_indices,
quantization scales) reproduces the reference, that a failing call falls back with one warning, and
that everything else falls back. aiter's real kernels are not run here (no ROCm GPU); see BENCHMARKS.md."""

import importlib
import logging
import sys
import types

import pytest
import torch

from glm_integration import kernels
from glm_integration.kernels import torch_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the fallback is Triton on a GPU, torch elsewhere
MODULES = ("aiter", "aiter.mla", "aiter.ops", "aiter.ops.triton", "aiter.ops.triton.kimi_delta_attn",
           "aiter.ops.triton.attention", "aiter.ops.triton.attention.fp8_mqa_logits")


def _mla_reference(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, sm_scale):
    for s in range(len(qo_indptr) - 1):
        rows = kv_buffer[kv_indices[kv_indptr[s]:kv_indptr[s + 1]].long(), 0, 0]  # [n, 576]
        for t in range(int(qo_indptr[s]), int(qo_indptr[s + 1])):
            scores = (q[t].float() @ rows.float().t()) * sm_scale  # [heads, n]
            o[t] = (scores.softmax(-1) @ rows[:, :512].float()).to(o.dtype)


class FakeAiter:
    """`mla`: "current" (page_size, nhead_kv keywords), "2025" (the wheel of 2025-11: neither), or
    "raises" (the 2025 parameter names, but a TypeError when called). `heads`: the head counts its MLA
    kernels serve (another raises RuntimeError, as a build without that kernel does)."""

    def __init__(self, mla="current", heads=(8, 16, 32, 64, 128), without=()):
        self.calls = {"rms_norm": 0, "mla": [], "kda": 0, "mhc_pre": 0, "mhc_post": 0, "logits": 0}
        self.heads, self.kv_buffers = heads, []
        self.modules = {name: types.ModuleType(name) for name in MODULES}
        root = self.modules["aiter"]
        root.rms_norm = self.rms_norm
        root.dtypes = types.SimpleNamespace(fp8=torch.float8_e4m3fn)
        root.mhc_pre, root.mhc_post = self.mhc_pre, self.mhc_post
        self.modules["aiter.mla"].mla_decode_fwd = {"current": self.mla_decode_fwd, "2025": self.mla_decode_fwd_2025,
                                                   "raises": self.mla_decode_fwd_raises}[mla]
        self.modules["aiter.ops.triton.kimi_delta_attn"].chunk_kimi_delta_attn = self.chunk_kimi_delta_attn
        self.modules["aiter.ops.triton.attention.fp8_mqa_logits"].fp8_mqa_logits = self.fp8_mqa_logits
        for module, name in without:
            delattr(self.modules[module], name)

    def rms_norm(self, x, weight, eps):
        assert x.dim() == 2 and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
        self.calls["rms_norm"] += 1
        return torch_ref.rms_norm(x, weight, eps)

    def _mla(self, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, sm_scale):
        assert kv_buffer.dim() == 4 and kv_buffer.shape[1:] == (1, 1, 576) and q.shape[-1] == 576
        assert o.shape == (q.shape[0], q.shape[1], 512) and max_seqlen_q == 1 and q.is_contiguous()
        assert kv_last_page_lens.eq(1).all()
        if q.shape[1] not in self.heads:
            raise RuntimeError(f"mla_decode_stage1_asm_fwd: cannot find a kernel for {q.shape[1]} heads")
        self.calls["mla"].append(q.shape[1])
        self.kv_buffers.append(kv_buffer)  # held: a later call cannot get the same memory by chance
        _mla_reference(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, sm_scale)

    def mla_decode_fwd(self, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                       page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0, num_kv_splits=None):
        assert page_size == 1 and nhead_kv == 1
        self._mla(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, sm_scale)

    def mla_decode_fwd_2025(self, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                            sm_scale=None, logit_cap=0.0, num_kv_splits=None, num_kv_splits_indptr=None):
        _, page_size, nhead_kv, _ = kv_buffer.shape  # read from the cache's shape
        assert page_size == 1 and nhead_kv == 1
        self._mla(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, sm_scale)

    def mla_decode_fwd_raises(self, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                              max_seqlen_q, **kwargs):
        self.calls["mla"].append(q.shape[1])
        raise TypeError("mla_decode_fwd() got an unexpected keyword argument 'sm_scale'")

    def chunk_kimi_delta_attn(self, q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                              output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                              chunk_size=None, cu_seqlens=None):
        """fla's chunk_kda: [B, T, H, K] inputs, g the log-space decay, state [N, H, K, V] fp32."""
        assert q.dim() == 4 and not use_gate_in_kernel and initial_state.dtype == torch.float32
        self.calls["kda"] += 1
        q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
        if use_qk_l2norm_in_kernel:
            q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
        s = initial_state.clone()
        o = torch.empty_like(v)
        for t in range(q.shape[1]):
            s = s * g[:, t].exp().unsqueeze(-1)
            u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", s, k[:, t]))
            s = s + k[:, t, :, :, None] * u[:, :, None, :]
            o[:, t] = torch.einsum("bhkv,bhk->bhv", s, q[:, t] * scale)
        return o.to(q.dtype), (s if output_final_state else None)

    def mhc_pre(self, residual, fn, hc_scale, hc_base, rms_eps=1e-6, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6,
                hc_post_mult_value=1.0, sinkhorn_repeat=20, norm_weight=None, norm_eps=1e-6):
        """DeepSeek's mHC pre block: (post_mix [m, hc, 1], comb_mix [m, hc, hc], layer_input [m, D] bf16)."""
        assert residual.dtype == torch.bfloat16 and fn.dtype == hc_scale.dtype == hc_base.dtype == torch.float32
        self.calls["mhc_pre"] += 1
        m, hc, d = residual.shape
        x = residual.reshape(m, -1).float()
        mixes = (x @ fn.t()) * torch.rsqrt(x.square().sum(-1, keepdim=True) / (hc * d) + rms_eps)
        pre = torch.sigmoid(mixes[:, :hc] * hc_scale[0] + hc_base[:hc]) + hc_pre_eps
        post = torch.sigmoid(mixes[:, hc:2 * hc] * hc_scale[1] + hc_base[hc:2 * hc]) * hc_post_mult_value
        cm = (mixes[:, 2 * hc:] * hc_scale[2] + hc_base[2 * hc:]).view(m, hc, hc).softmax(-1) + hc_sinkhorn_eps
        cm = cm / (cm.sum(-2, keepdim=True) + hc_sinkhorn_eps)
        for _ in range(sinkhorn_repeat - 1):
            cm = cm / (cm.sum(-1, keepdim=True) + hc_sinkhorn_eps)
            cm = cm / (cm.sum(-2, keepdim=True) + hc_sinkhorn_eps)
        return post.unsqueeze(-1), cm, (pre.unsqueeze(-1) * residual.float()).sum(1).bfloat16()

    def mhc_post(self, out, x, residual, post_layer_mix, comb_res_mix, store_nt=-1):
        assert post_layer_mix.shape == (*residual.shape[:2], 1) and comb_res_mix.dtype == torch.float32
        self.calls["mhc_post"] += 1
        out.copy_(x.float().unsqueeze(-2) * post_layer_mix + torch.bmm(comb_res_mix.mT, residual.float()))

    def fp8_mqa_logits(self, Q, KV, kv_scales, weights, cu_starts, cu_ends, clean_logits=True):
        assert Q.dtype == KV.dtype == torch.float8_e4m3fn and weights.dtype == kv_scales.dtype == torch.float32
        self.calls["logits"] += 1
        scores = torch.einsum("thd,nd->thn", Q.float(), KV.float()) * kv_scales
        logits = (scores.relu() * weights.unsqueeze(-1)).sum(1)
        window = torch.arange(KV.shape[0], device=KV.device)[None, :]
        inside = (window >= cu_starts[:, None].long()) & (window < cu_ends[:, None].long())
        return logits.masked_fill(~inside, float("-inf"))


def _load(monkeypatch, fake):
    for name, module in fake.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "glm_integration.kernels.aiter_ops", raising=False)
    return importlib.import_module("glm_integration.kernels.aiter_ops")


@pytest.fixture
def load(monkeypatch):
    def loader(**options):
        fake = FakeAiter(**options)
        return _load(monkeypatch, fake), fake

    yield loader
    sys.modules.pop("glm_integration.kernels.aiter_ops", None)
    kernels._backends.pop("aiter", None)  # the stand-in must not outlive the test


@pytest.fixture
def aiter_ops(load):
    return load()


def _decode_inputs(heads, seed=0, rows=300, tokens=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, tokens, 512, generator=g).bfloat16()
    latent = torch.randn(rows, 512, generator=g).bfloat16()
    mask = torch.rand(tokens, rows, generator=g) < 0.2
    mask[:, 0] = True
    return q.to(DEVICE), latent.to(DEVICE), mask.to(DEVICE)


def _close_to_reference(ops, q, latent, mask):
    ours = ops.absorbed_decode_attention(q, latent, mask, 512 ** -0.5)
    reference = torch_ref.absorbed_decode_attention(q, latent, mask, 512 ** -0.5)
    assert ours.shape == reference.shape and (ours.float() - reference.float()).abs().max() < 3e-2


def test_mla_decode_dispatch_matches_reference(aiter_ops):
    ops, fake = aiter_ops
    _close_to_reference(ops, *_decode_inputs(32))
    assert fake.calls["mla"] == [32]


@pytest.mark.parametrize("heads,calls", [(8, [8]), (64, [64]), (128, [128]), (16, [16]), (24, [16, 8]),
                                         (96, [64, 32]), (256, [128, 128])])
def test_mla_decode_uses_the_largest_head_counts(aiter_ops, heads, calls):
    """64 heads at TP1 read the rows once (not four times); TP8's 8 heads are served."""
    ops, fake = aiter_ops
    _close_to_reference(ops, *_decode_inputs(heads, rows=120))
    assert fake.calls["mla"] == calls


def test_mla_decode_with_the_2025_signature(load):
    """aiter builds without page_size/nhead_kv keywords: called without them, same result."""
    ops, fake = load(mla="2025")
    _close_to_reference(ops, *_decode_inputs(16))
    assert fake.calls["mla"] == [16]


def test_mla_decode_type_error_falls_back_with_one_warning(load, caplog):
    ops, fake = load(mla="raises")
    with caplog.at_level(logging.WARNING, logger="glm_integration.kernels.aiter_ops"):
        _close_to_reference(ops, *_decode_inputs(16))
        _close_to_reference(ops, *_decode_inputs(16, seed=1))
    assert fake.calls["mla"] == [16]  # not tried again
    assert len([r for r in caplog.records if "aiter mla failed" in r.getMessage()]) == 1


def test_mla_decode_missing_kernel_drops_that_head_count(load, caplog):
    """A build without the 64-head kernel (RuntimeError): that call falls back, later ones use 32 + 32."""
    ops, fake = load(heads=(16, 32, 128))
    with caplog.at_level(logging.WARNING, logger="glm_integration.kernels.aiter_ops"):
        _close_to_reference(ops, *_decode_inputs(64))
        _close_to_reference(ops, *_decode_inputs(64, seed=1))
    assert fake.calls["mla"] == [32, 32]
    assert len([r for r in caplog.records if "mla_heads=64" in r.getMessage()]) == 1


def test_mla_decode_pads_no_copy_of_the_cache_per_call(aiter_ops):
    """Rows are written into one 576-wide buffer reused by every call, and only the rows the queries
    select (not the whole latent cache, padded afresh each call)."""
    ops, fake = aiter_ops
    for seed in range(3):
        q, latent, mask = _decode_inputs(16, seed=seed, rows=400)
        _close_to_reference(ops, q, latent, mask)
        assert fake.kv_buffers[-1].shape[0] == int(mask.any(0).sum()) < latent.shape[0]
    storages = {kv.untyped_storage().data_ptr() for kv in fake.kv_buffers}
    assert len(storages) == 1
    assert fake.kv_buffers[0][:, 0, 0, 512:].eq(0).all()


def test_aiter_runs_on_the_tensors_own_device(aiter_ops):
    """aiter's wrappers launch Triton kernels on the current device: each call is made inside the
    tensors' device (cuda:1 for tensors on cuda:1, whatever the default is)."""
    ops, _ = aiter_ops
    scope = ops._on(torch.device("cuda", 1))
    assert isinstance(scope, torch.cuda.device) and scope.idx == 1
    with ops._on(torch.device("cpu")):
        pass


@pytest.mark.parametrize("heads,rank,dtype", [(12, 512, torch.bfloat16), (16, 256, torch.bfloat16),
                                              (16, 512, torch.float32)])
def test_mla_decode_shapes_outside_the_kernel_fall_back(aiter_ops, heads, rank, dtype):
    ops, fake = aiter_ops
    q, latent = torch.randn(heads, 1, rank).to(DEVICE, dtype), torch.randn(40, rank).to(DEVICE, dtype)
    mask = torch.ones(1, 40, dtype=torch.bool, device=DEVICE)
    out = ops.absorbed_decode_attention(q, latent, mask, 0.1)
    assert fake.calls["mla"] == []
    assert torch.allclose(out.float(), torch_ref.absorbed_decode_attention(q, latent, mask, 0.1).float(), atol=3e-2)


def _kda_inputs(t=70, heads=3, dk=32, dv=16, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(t, heads, dk, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(t, heads, dv, generator=g).to(dtype)
    decay = -torch.rand(t, heads, dk, generator=g).to(dtype) * 0.3
    beta = torch.rand(t, heads, generator=g).to(dtype)
    state = torch.randn(heads, dk, dv, generator=g) * 0.1
    return tuple(t.to(DEVICE) for t in (q, k, v, decay, beta, state))


def test_kda_chunked_dispatch_matches_reference(aiter_ops):
    ops, fake = aiter_ops
    inputs = _kda_inputs()
    out, state = ops.kda_chunked(*inputs)
    ref_out, ref_state = torch_ref.kda_chunked(*inputs)
    assert fake.calls["kda"] == 1
    assert out.dtype == ref_out.dtype == torch.float32 and state.shape == ref_state.shape
    assert (out - ref_out).abs().max() < 3e-2 and (state - ref_state).abs().max() < 1e-3


def test_kda_without_the_kernel_falls_back(load):
    ops, fake = load(without=[("aiter.ops.triton.kimi_delta_attn", "chunk_kimi_delta_attn")])
    inputs = _kda_inputs(dtype=torch.float32)
    out, state = ops.kda_chunked(*inputs)
    assert fake.calls["kda"] == 0 and torch.allclose(out, torch_ref.kda_chunked(*inputs)[0], atol=1e-4)


def _mhc_inputs(t=5, n=4, d=512):
    g = torch.Generator().manual_seed(4)
    streams = torch.randn(t, n, d, generator=g).bfloat16()
    fn = torch.randn(n * (n + 2), n * d, generator=g) * 0.02
    base, scale = torch.randn(n * (n + 2), generator=g) * 0.1, torch.rand(3, generator=g) + 0.5
    return tuple(t.to(DEVICE) for t in (streams, fn, base, scale))


def test_mhc_dispatch_matches_reference(aiter_ops):
    ops, fake = aiter_ops
    streams, fn, base, scale = _mhc_inputs()
    post, comb, collapsed = ops.hc_pre(streams, fn, base, scale, 1e-6, 1e-5, 20)
    ref_post, ref_comb, ref_collapsed = torch_ref.hc_pre(streams, fn, base, scale, 1e-6, 1e-5, 20)
    assert fake.calls["mhc_pre"] == 1
    assert post.shape == ref_post.shape and comb.shape == ref_comb.shape and collapsed.dtype == ref_collapsed.dtype
    assert (post - ref_post).abs().max() < 1e-4 and (comb - ref_comb).abs().max() < 1e-4
    assert (collapsed.float() - ref_collapsed.float()).abs().max() < 3e-2
    block_out = torch.randn(5, 512).bfloat16().to(DEVICE)
    merged = ops.hc_post(ref_post, ref_comb, block_out, streams)
    assert fake.calls["mhc_post"] == 1
    reference = torch_ref.hc_post(ref_post, ref_comb, block_out, streams)
    assert merged.shape == reference.shape and (merged.float() - reference.float()).abs().max() < 5e-2


def test_mhc_outside_the_kernel_falls_back(aiter_ops):
    ops, fake = aiter_ops
    for streams, fn, base, scale in (_mhc_inputs(d=384), _mhc_inputs(n=2), [t.float() for t in _mhc_inputs()]):
        out = ops.hc_pre(streams, fn, base, scale, 1e-6, 1e-5, 20)
        assert all(torch.equal(a, b) for a, b in zip(out, torch_ref.hc_pre(streams, fn, base, scale, 1e-6, 1e-5, 20)))
    assert fake.calls["mhc_pre"] == 0


def test_indexer_logits_dispatch_matches_reference(aiter_ops):
    ops, fake = aiter_ops
    g = torch.Generator().manual_seed(5)
    q = torch.randn(6, 4, 128, generator=g).bfloat16().to(DEVICE)
    weights = (torch.randn(6, 4, generator=g) * 0.5).to(DEVICE)
    pooled = torch.randn(50, 128, generator=g).to(DEVICE)
    ours = ops.indexer_scores(q, weights, pooled, 128 ** -0.5)
    reference = torch_ref.indexer_scores(q, weights, pooled, 128 ** -0.5)
    assert fake.calls["logits"] == 1 and ours.shape == reference.shape
    assert (ours - reference).abs().max() < 0.05 * reference.abs().max()  # fp8 rounding of q and keys only


def test_indexer_logits_outside_the_kernel_fall_back(aiter_ops):
    ops, fake = aiter_ops
    q, weights, pooled = (torch.randn(*shape, device=DEVICE) for shape in ((2, 3, 128), (2, 3), (7, 128)))  # 3 heads
    reference = torch_ref.indexer_scores(q, weights, pooled, 0.1)
    assert torch.allclose(ops.indexer_scores(q, weights, pooled, 0.1), reference, atol=1e-4)
    assert fake.calls["logits"] == 0


def test_rms_norm_dispatch_and_fallback(aiter_ops):
    ops, fake = aiter_ops
    x, w = torch.randn(3, 5, 64).bfloat16().to(DEVICE), torch.randn(64).bfloat16().to(DEVICE)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), torch_ref.rms_norm(x, w, 1e-6))
    assert fake.calls["rms_norm"] == 1
    ops.rms_norm(x.float(), w.float(), 1e-6)  # fp32: not aiter's
    ops.rms_norm(x, None, 1e-6)  # no weight: not aiter's
    assert fake.calls["rms_norm"] == 1


def test_every_op_is_registered_and_backend_selectable(aiter_ops):
    from glm_integration.kernels import _backends, active_backend, use_backend

    assert set(_backends["aiter"]) == set(torch_ref.OPS)
    before = active_backend()
    use_backend("aiter")
    use_backend(before)


def test_without_aiter_the_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter", None)  # import fails
    monkeypatch.delitem(sys.modules, "glm_integration.kernels.aiter_ops", raising=False)
    monkeypatch.delitem(kernels._backends, "aiter", raising=False)
    with pytest.raises(ValueError, match="aiter is not installed"):
        kernels.use_backend("aiter")
