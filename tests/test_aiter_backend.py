"""The aiter backend's wiring, checked without ROCm: a stand-in `aiter` module implements the two
entry points as their documentation defines them (rms_norm; mla_decode_fwd over a page-size-1 cache
addressed by kv_indptr/kv_indices) in torch. The tests prove that the backend dispatches exactly the
shapes it claims, that what it passes (padding to 576, 16-head groups, one sequence per query,
selected rows as kv_indices) reproduces the reference, and that everything else falls back.
aiter's real kernels are not run here (no ROCm GPU); see BENCHMARKS.md."""

import importlib
import sys
import types

import pytest
import torch

from glm_integration import kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the fallback is Triton on a GPU, torch elsewhere
from glm_integration.kernels import torch_ref


class FakeAiter:
    def __init__(self):
        self.calls = {"rms_norm": 0, "mla_decode_fwd": 0}
        self.module = types.ModuleType("aiter")
        self.module.rms_norm = self.rms_norm
        self.mla = types.ModuleType("aiter.mla")
        self.mla.mla_decode_fwd = self.mla_decode_fwd
        self.module.mla = self.mla

    def rms_norm(self, x, weight, eps):
        assert x.dim() == 2 and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
        self.calls["rms_norm"] += 1
        return torch_ref.rms_norm(x, weight, eps)

    def mla_decode_fwd(self, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                       page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0, num_kv_splits=None):
        assert kv_buffer.dim() == 4 and kv_buffer.shape[1:] == (1, 1, 576) and q.shape[-1] == 576
        assert q.shape[1] in (16, 128) and o.shape == (q.shape[0], q.shape[1], 512) and max_seqlen_q == 1
        assert page_size == 1 and nhead_kv == 1 and kv_last_page_lens.eq(1).all()
        self.calls["mla_decode_fwd"] += 1
        for s in range(len(qo_indptr) - 1):
            rows = kv_buffer[kv_indices[kv_indptr[s]:kv_indptr[s + 1]].long(), 0, 0]  # [n, 576]
            for t in range(int(qo_indptr[s]), int(qo_indptr[s + 1])):
                scores = (q[t].float() @ rows.float().t()) * sm_scale  # [heads, n]
                o[t] = (scores.softmax(-1) @ rows[:, :512].float()).to(o.dtype)


@pytest.fixture
def aiter_ops(monkeypatch):
    fake = FakeAiter()
    monkeypatch.setitem(sys.modules, "aiter", fake.module)
    monkeypatch.setitem(sys.modules, "aiter.mla", fake.mla)
    monkeypatch.delitem(sys.modules, "glm_integration.kernels.aiter_ops", raising=False)
    module = importlib.import_module("glm_integration.kernels.aiter_ops")
    yield module, fake
    sys.modules.pop("glm_integration.kernels.aiter_ops", None)
    kernels._backends.pop("aiter", None)  # the stand-in must not outlive the test


def test_mla_decode_dispatch_matches_reference(aiter_ops):
    ops, fake = aiter_ops
    g = torch.Generator().manual_seed(0)
    q = torch.randn(32, 2, 512, generator=g).bfloat16()
    latent = torch.randn(300, 512, generator=g).bfloat16()
    mask = torch.rand(2, 300, generator=g) < 0.2
    mask[:, 0] = True
    ours = ops.absorbed_decode_attention(q, latent, mask, 512 ** -0.5)
    assert fake.calls["mla_decode_fwd"] == 2  # 32 heads, 16 at a time
    reference = torch_ref.absorbed_decode_attention(q, latent, mask, 512 ** -0.5)
    assert ours.shape == reference.shape and (ours.float() - reference.float()).abs().max() < 3e-2


@pytest.mark.parametrize("heads,rank,dtype", [(12, 512, torch.bfloat16), (16, 256, torch.bfloat16),
                                              (16, 512, torch.float32)])
def test_mla_decode_shapes_outside_the_kernel_fall_back(aiter_ops, heads, rank, dtype):
    ops, fake = aiter_ops
    q, latent = torch.randn(heads, 1, rank).to(DEVICE, dtype), torch.randn(40, rank).to(DEVICE, dtype)
    mask = torch.ones(1, 40, dtype=torch.bool, device=DEVICE)
    out = ops.absorbed_decode_attention(q, latent, mask, 0.1)
    assert fake.calls["mla_decode_fwd"] == 0
    assert torch.allclose(out.float(), torch_ref.absorbed_decode_attention(q, latent, mask, 0.1).float(), atol=3e-2)


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
