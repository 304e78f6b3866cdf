"""AMD aiter kernels (ROCm, e.g. MI355X) for the runner, used only where their shape constraints hold;
every other call goes to the Triton backend (or, without Triton, the torch reference). Importing this
module imports aiter and registers the `aiter` backend; `--kernels aiter` is the only way in.

Dispatched to aiter
  rms_norm                   `aiter.rms_norm(x, weight, eps)`: bf16/fp16 input, a weight of the same dtype,
                             last dimension <= 8192 (flattened to 2-D, as vLLM's ROCm path does).
  absorbed_decode_attention  `aiter.mla.mla_decode_fwd`: bf16, latent rank 512, heads a multiple of 16
                             (run 16 at a time). GLM-5.3's MLA has no rope part, so queries and latent
                             rows are zero-padded to aiter's 576 = 512 + 64 (scores unchanged); each query
                             token is its own sequence and its selected rows are the kv_indices of a
                             page-size-1 cache (the way vLLM's ROCm sparse-MLA backend drives it).
Not dispatched (no aiter kernel with these semantics, or layout constraints the runner does not meet):
  KDA (no gated-delta kernel), indexer scores and pool selection, MoE (`aiter.fused_moe` wants
  pre-shuffled expert weights and its own routing), prefill masked attention -> Triton.
"""

from __future__ import annotations

import importlib
import inspect

import torch
import torch.nn.functional as F

from . import register, torch_ref

try:
    aiter = importlib.import_module("aiter")
except ImportError as exc:
    raise ImportError(f"aiter is not installed (it ships with ROCm builds, e.g. for MI300/MI355X): {exc}") from exc

try:
    from . import triton_ops as _fallback
except ImportError:
    _fallback = torch_ref

MLA_RANK, MLA_ROPE_PAD, HEAD_GROUP, RMS_MAX_HIDDEN = 512, 64, 16, 8192
_NEW_MLA_API = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens", "max_seqlen_q")


def _mla_decode():
    """aiter's MLA decode entry point when it has the (qo_indptr, ..., max_seqlen_q) signature, else None."""
    try:
        fn = importlib.import_module("aiter.mla").mla_decode_fwd
        params = inspect.signature(fn).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    return fn if all(name in params for name in _NEW_MLA_API) else None


_MLA_DECODE = _mla_decode()


def _other(name: str):
    return getattr(_fallback, name, getattr(torch_ref, name))


def rms_norm(x, weight, eps):
    if (weight is not None and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and 0 < x.shape[-1] <= RMS_MAX_HIDDEN and x.numel()):
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        return aiter.rms_norm(flat, weight.contiguous(), eps).view(x.shape)
    return _other("rms_norm")(x, weight, eps)


def absorbed_decode_attention(q_latent, latent, mask, scale):
    heads, tokens, rank = q_latent.shape
    if not (_MLA_DECODE is not None and q_latent.dtype == latent.dtype == torch.bfloat16 and rank == MLA_RANK
            and heads % HEAD_GROUP == 0 and tokens > 0):
        return _other("absorbed_decode_attention")(q_latent, latent, mask, scale)
    device = q_latent.device
    selected = mask.nonzero()  # (query, position) pairs, query-major, positions ascending
    kv_indices = selected[:, 1].to(torch.int32).contiguous()
    kv_indptr = torch.zeros(tokens + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = mask.sum(-1).cumsum(0)
    qo_indptr = torch.arange(tokens + 1, dtype=torch.int32, device=device)
    last_page_lens = torch.ones(tokens, dtype=torch.int32, device=device)
    kv = F.pad(latent, (0, MLA_ROPE_PAD)).view(-1, 1, 1, MLA_RANK + MLA_ROPE_PAD)
    out = torch.empty(tokens, heads, MLA_RANK, dtype=q_latent.dtype, device=device)
    for h in range(0, heads, HEAD_GROUP):
        q = F.pad(q_latent[h:h + HEAD_GROUP].transpose(0, 1), (0, MLA_ROPE_PAD)).contiguous()
        o = torch.empty(tokens, HEAD_GROUP, MLA_RANK, dtype=q_latent.dtype, device=device)
        _MLA_DECODE(q, kv, o, qo_indptr, kv_indptr, kv_indices, last_page_lens, 1, page_size=1, nhead_kv=1,
                    sm_scale=scale)
        out[:, h:h + HEAD_GROUP] = o
    return out.transpose(0, 1)


for _name in torch_ref.OPS:
    register("aiter", _name, globals().get(_name) if _name in ("rms_norm", "absorbed_decode_attention")
             else _other(_name))
