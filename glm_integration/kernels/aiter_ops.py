"""AMD aiter kernels (ROCm, e.g. MI300X/MI355X) for the runner, used only where their shape constraints
hold; every other call goes to the Triton backend (or, without Triton, the torch reference). Importing
this module imports aiter and registers the `aiter` backend; `--kernels aiter` is the only way in.

Every entry point is feature-detected by name and signature at import, so one source serves aiter
builds of 2025 and of 2026; a call that still fails at run time (a TypeError from a signature that
changed again, a RuntimeError from a build without the kernel for a shape) is answered by the fallback,
with one warning, and that entry point (for MLA: that head count) is not tried again.

Dispatched to aiter
  rms_norm                   `aiter.rms_norm(x, weight, eps)`: bf16/fp16 input, a weight of the same dtype,
                             last dimension <= 8192 (flattened to 2-D, as vLLM's ROCm path does).
  absorbed_decode_attention  `aiter.mla.mla_decode_fwd`: bf16, latent rank 512, heads in calls of
                             128, 64, 32, 16 or 8 (aiter's bf16 decode kernels; the largest that fits,
                             so 64 heads at TP1 read the rows once and TP8's 8 heads are served).
                             `page_size` / `nhead_kv` are passed only to builds whose signature has
                             them (older builds read them from the cache's shape). GLM-5.3's MLA has no
                             rope part: queries and the rows the mask selects are zero-padded to aiter's
                             576 = 512 + 64 (scores unchanged), the rows into one reused 576-wide buffer
                             whose pad columns are zeroed once; each query token is its own sequence,
                             its selected rows the kv_indices of a page-size-1 cache (as vLLM's ROCm
                             sparse-MLA backend drives it). Launched on the tensors' own device.
  kda_chunked                `aiter.ops.triton.kimi_delta_attn.chunk_kimi_delta_attn` (the fla
                             `chunk_kda` signature): log-space decay given, q/k l2-normed in the kernel,
                             fp32 state in and out, key dim <= 256.
  hc_pre, hc_post            `aiter.mhc_pre` / `aiter.mhc_post` (mHC): bf16 streams, 4 streams, hidden
                             size a multiple of 512.
  indexer_scores             `aiter.ops.triton.attention.fp8_mqa_logits.fp8_mqa_logits`: power-of-two
                             heads and head dim. The kernel takes fp8 queries and keys: each query head
                             and each pooled key is quantized with its own scale, folded exactly into
                             the head weights and key scales, so the scores differ from the reference
                             by fp8 rounding only (as DeepSeek-V3.2 serving computes them).
Not dispatched (no aiter kernel with these semantics, or layout constraints the runner does not meet):
  kda_recurrent (decode), causal conv, pool selection, MoE (`aiter.fused_moe` wants pre-shuffled expert
  weights and its own routing), prefill masked attention -> Triton.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import types

import torch
import torch.nn.functional as F

from . import register, torch_ref

log = logging.getLogger(__name__)

try:
    aiter = importlib.import_module("aiter")
except ImportError as exc:
    raise ImportError(f"aiter is not installed (it ships with ROCm builds, e.g. for MI300/MI355X): {exc}") from exc

_fallback: types.ModuleType
try:
    from . import triton_ops as _fallback
except ImportError:
    _fallback = torch_ref

MLA_RANK, MLA_ROPE_PAD, RMS_MAX_HIDDEN = 512, 64, 8192
MLA_HEADS = (128, 64, 32, 16, 8)  # aiter's bf16 MLA decode kernels (gfx942 and gfx950), largest first
_MLA_API = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens", "max_seqlen_q")
_KDA_API = ("beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel")
_MHC_PRE_API = (
    "residual",
    "fn",
    "hc_scale",
    "hc_base",
    "rms_eps",
    "hc_pre_eps",
    "hc_sinkhorn_eps",
    "hc_post_mult_value",
    "sinkhorn_repeat",
)
_MHC_POST_API = ("out", "x", "residual", "post_layer_mix", "comb_res_mix")
_LOGITS_API = ("Q", "KV", "kv_scales", "weights", "cu_starts", "cu_ends")
_CALL_ERRORS = (TypeError, RuntimeError)  # a signature that changed; a kernel this build lacks


def _params(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _entry(module: str, name: str, params: tuple[str, ...]):
    """aiter's `module.name` when present and taking every one of `params` by name, else None."""
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, RuntimeError):
        return None
    return fn if set(params) <= _params(fn) else None


_entries = {
    "mla": _entry("aiter.mla", "mla_decode_fwd", _MLA_API),
    "kda": _entry("aiter.ops.triton.kimi_delta_attn", "chunk_kimi_delta_attn", _KDA_API),
    "mhc_pre": _entry("aiter", "mhc_pre", _MHC_PRE_API),
    "mhc_post": _entry("aiter", "mhc_post", _MHC_POST_API),
    "logits": _entry("aiter.ops.triton.attention.fp8_mqa_logits", "fp8_mqa_logits", _LOGITS_API),
}
_mla_keywords = {k: 1 for k in ("page_size", "nhead_kv") if k in _params(_entries["mla"])}
_mla_heads = list(MLA_HEADS)


def _give_up(what: str, exc: Exception) -> None:
    """One warning per entry point (or MLA head count) that failed; it is not called again."""
    if what.startswith("mla_heads="):
        _mla_heads.remove(int(what.split("=")[1]))
    else:
        _entries[what] = None
    log.warning(
        "aiter %s failed (%s: %s); using the %s kernels for it from now on",
        what,
        type(exc).__name__,
        exc,
        getattr(_fallback, "__name__", "fallback").rsplit(".", 1)[-1],
    )


def _on(device: torch.device):
    """aiter's Python wrappers launch Triton kernels and size splits on the current device: make it the
    tensors' own."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _other(name: str):
    return getattr(_fallback, name, getattr(torch_ref, name))


def rms_norm(x, weight, eps):
    if (
        weight is not None
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and 0 < x.shape[-1] <= RMS_MAX_HIDDEN
        and x.numel()
    ):
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        with _on(x.device):
            return aiter.rms_norm(flat, weight.contiguous(), eps).view(x.shape)
    return _other("rms_norm")(x, weight, eps)


def mla_head_calls(heads: int) -> list[int] | None:
    """Heads per aiter call, largest kernels first; None when the available ones cannot cover `heads`."""
    calls, left = [], heads
    while left:
        size = next((h for h in _mla_heads if h <= left), None)
        if size is None:
            return None
        calls.append(size)
        left -= size
    return calls


class _PaddedRows:
    """The 576-wide rows aiter reads, in one buffer per (device, dtype) reused by every call: its 64 pad
    columns are zeroed when it is made, and a call writes only the rank part of the rows it selects."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}

    def fill(self, latent: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        key, n = (latent.device, latent.dtype), positions.numel()
        buf = self.buffers.get(key)
        if buf is None or buf.shape[0] < n:
            rows = max(n, 2 * buf.shape[0] if buf is not None else 256)
            buf = self.buffers[key] = torch.zeros(
                rows, MLA_RANK + MLA_ROPE_PAD, dtype=latent.dtype, device=latent.device
            )
        torch.index_select(latent, 0, positions, out=buf[:n, :MLA_RANK])
        return buf[:n].view(n, 1, 1, MLA_RANK + MLA_ROPE_PAD)


padded_rows = _PaddedRows()


def absorbed_decode_attention(q_latent, latent, mask, scale):
    heads, tokens, rank = q_latent.shape
    calls = mla_head_calls(heads)
    if not (
        _entries["mla"] is not None
        and calls
        and q_latent.dtype == latent.dtype == torch.bfloat16
        and rank == MLA_RANK
        and tokens > 0
    ):
        return _other("absorbed_decode_attention")(q_latent, latent, mask, scale)
    device = q_latent.device
    used = mask.any(0)  # the rows any query selects: only these are copied, compacted
    slot = used.cumsum(0) - 1
    selected = mask.nonzero()  # (query, position) pairs, query-major, positions ascending
    kv_indices = slot[selected[:, 1]].to(torch.int32)
    kv_indptr = torch.zeros(tokens + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = mask.sum(-1).cumsum(0)
    qo_indptr = torch.arange(tokens + 1, dtype=torch.int32, device=device)
    last_page_lens = torch.ones(tokens, dtype=torch.int32, device=device)
    kv = padded_rows.fill(latent, used.nonzero().squeeze(1))
    out = torch.empty(tokens, heads, MLA_RANK, dtype=q_latent.dtype, device=device)
    h = 0
    for size in calls:
        q = F.pad(q_latent[h : h + size].transpose(0, 1), (0, MLA_ROPE_PAD)).contiguous()
        o = torch.empty(tokens, size, MLA_RANK, dtype=q_latent.dtype, device=device)
        try:
            with _on(device):
                _entries["mla"](
                    q, kv, o, qo_indptr, kv_indptr, kv_indices, last_page_lens, 1, sm_scale=scale, **_mla_keywords
                )
        except _CALL_ERRORS as exc:
            _give_up("mla" if isinstance(exc, TypeError) else f"mla_heads={size}", exc)
            return _other("absorbed_decode_attention")(q_latent, latent, mask, scale)
        out[:, h : h + size] = o
        h += size
    return out.transpose(0, 1)


def kda_chunked(q, k, v, g, beta, state, chunk: int = 64):
    if (
        _entries["kda"] is not None
        and q.shape[0] > 0
        and q.shape[-1] <= 256
        and q.dim() == 3
        and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
    ):
        try:
            with _on(q.device):
                out, final = _entries["kda"](
                    q[None],
                    k[None],
                    v[None],
                    g[None],
                    beta.float()[None],
                    scale=q.shape[-1] ** -0.5,
                    initial_state=state.float()[None],
                    output_final_state=True,
                    use_qk_l2norm_in_kernel=True,
                )
            return out[0].float(), final[0]
        except _CALL_ERRORS as exc:
            _give_up("kda", exc)
    return _other("kda_chunked")(q, k, v, g, beta, state, chunk)


def _mhc_shapes(streams: torch.Tensor) -> bool:
    return streams.dtype == torch.bfloat16 and streams.shape[1] == 4 and streams.shape[-1] % 512 == 0


def hc_pre(streams, fn, base, scale, eps, norm_eps, iters):
    if _entries["mhc_pre"] is not None and _mhc_shapes(streams) and streams.shape[0] > 0:
        try:
            with _on(streams.device):
                post, comb, collapsed = _entries["mhc_pre"](
                    streams.contiguous(),
                    fn.float().contiguous(),
                    scale.float().contiguous(),
                    base.float().contiguous(),
                    rms_eps=norm_eps,
                    hc_pre_eps=eps,
                    hc_sinkhorn_eps=eps,
                    hc_post_mult_value=2.0,
                    sinkhorn_repeat=iters,
                )
            return post.view(streams.shape[0], streams.shape[1]), comb, collapsed
        except _CALL_ERRORS as exc:
            _give_up("mhc_pre", exc)
    return _other("hc_pre")(streams, fn, base, scale, eps, norm_eps, iters)


def hc_post(post, comb, block_out, residual):
    if (
        _entries["mhc_post"] is not None
        and _mhc_shapes(residual)
        and block_out.dtype == residual.dtype
        and residual.shape[0] > 0
    ):
        out = torch.empty_like(residual, memory_format=torch.contiguous_format)
        try:
            with _on(residual.device):
                _entries["mhc_post"](
                    out,
                    block_out.contiguous(),
                    residual.contiguous(),
                    post.float().unsqueeze(-1).contiguous(),
                    comb.float().contiguous(),
                )
            return out
        except _CALL_ERRORS as exc:
            _give_up("mhc_post", exc)
    return _other("hc_post")(post, comb, block_out, residual)


def _fp8():
    return getattr(getattr(aiter, "dtypes", None), "fp8", torch.float8_e4m3fn)  # e4m3fnuz on gfx942


def _quantized(x: torch.Tensor, fp8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (fp8 values, fp32 scale per row [...]): x == values * scale up to fp8 rounding."""
    x = x.float()
    s = x.abs().amax(-1).clamp(min=1e-12) / torch.finfo(fp8).max
    return (x / s.unsqueeze(-1)).to(fp8), s


def indexer_scores(q, weights, pooled, scale):
    t, heads, dim = q.shape
    n = pooled.shape[0]
    if (
        _entries["logits"] is not None
        and t > 0
        and n > 0
        and scale > 0
        and heads & (heads - 1) == 0
        and dim & (dim - 1) == 0
    ):
        fp8 = _fp8()
        q8, q_scale = _quantized(q, fp8)
        k8, k_scale = _quantized(pooled, fp8)
        # relu(a * b) = a * relu(b) for a > 0: the query scales join the head weights, the rest the key scales
        w = (weights.float() * q_scale).contiguous()
        starts = torch.zeros(t, dtype=torch.int32, device=q.device)
        ends = torch.full((t,), n, dtype=torch.int32, device=q.device)
        try:
            with _on(q.device):
                return _entries["logits"](q8, k8, (k_scale * scale).contiguous(), w, starts, ends)
        except _CALL_ERRORS as exc:
            _give_up("logits", exc)
    return _other("indexer_scores")(q, weights, pooled, scale)


_OURS = ("rms_norm", "absorbed_decode_attention", "kda_chunked", "hc_pre", "hc_post", "indexer_scores")
for _name in torch_ref.OPS:
    register("aiter", _name, globals()[_name] if _name in _OURS else _other(_name))
