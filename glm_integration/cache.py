"""The runner's paged KV cache: one block-outermost packed buffer shaped like vLLM's GLM-5.3-Flash cache.

Every block holds, side by side (the runner does not alias groups the way vLLM's allocator may):
  mla      PAGED  per MLA layer the latent rows of the block's tokens, then per MLA layer the DSA
                  indexer's pooled key rows (one per `index_kpool` tokens: exact fp32, or vLLM's
                  132-byte fp8 row: 128 e4m3 values + an fp32 scale);
  kda<g>   STATE  per KDA layer of the group: the conv window [3*H*Dk, K-1] (model dtype) and the
                  recurrent state S [H, Dk, Dv] (fp32) after the block's last computed token;
  tail     SKIP   per MLA layer the kpool ring: raw indexer key + gate of the open pool (fp32).
It describes itself as a `kvoffload.spec.CacheLayout`, the same model the vLLM adapter builds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvoffload.spec import CacheGroup, CacheLayout, GroupKind, Region
from kvoffload.spec.layout import lcm

from .config import GlmConfig

INDEX_FORMATS = ("fp32", "fp8")
FP8_MAX = 448.0


def torch_dtype(config: GlmConfig) -> torch.dtype:
    name = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", "float32")).removeprefix("torch.")
    return getattr(torch, name)


def _align(n: int, to: int = 16) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class _Page:
    offset: int  # within the block
    nbytes: int


class PagedCache:
    """The packed buffer, typed views onto each layer's pages, and the layout description."""

    def __init__(
        self,
        config: GlmConfig,
        block_size: int,
        num_blocks: int,
        *,
        index_format: str = "fp32",
        model_id: str = "",
        device: str | torch.device = "cpu",
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        kpool = config.index_kpool
        if block_size % kpool:
            raise ValueError(f"block size {block_size} must be a multiple of index_kpool {kpool}")
        if index_format not in INDEX_FORMATS:
            raise ValueError(f"index_format must be one of {INDEX_FORMATS}, got {index_format!r}")
        self.config, self.block_size, self.num_blocks = config, block_size, num_blocks
        # One tensor-parallel rank's cache when tp_size > 1: `config` carries this rank's KDA heads; the
        # MLA latent and indexer rows are the same on every rank (one latent per token), so they are
        # stored once per TP group (CacheGroup.tp_replicas).
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.index_format, self.kpool = index_format, kpool
        self.dtype = torch_dtype(config)
        self.mla_layers, self.kda_layers = list(config.mla_layers), list(config.kda_layers)
        size = torch.empty(0, dtype=self.dtype).element_size()
        d_idx, heads, dk = config.index_head_dim, config.linear_num_heads, config.linear_head_dim
        self.conv_dim, self.ring_slots = 3 * heads * dk, kpool

        self.latent_bytes = block_size * config.kv_lora_rank * size
        self.index_row_bytes = d_idx * 4 if index_format == "fp32" else d_idx + 4
        self.index_bytes = (block_size // kpool) * self.index_row_bytes
        self.conv_bytes = self.conv_dim * (config.linear_conv_kernel_dim - 1) * size
        self.kda_bytes = self.conv_bytes + heads * dk * dk * 4
        self.ring_bytes = self.ring_slots * 2 * d_idx * 4

        # KDA layers form groups of (at most) as many layers as the MLA group has, as vLLM groups them.
        per_group = max(len(self.mla_layers), 1)
        self.kda_groups = [self.kda_layers[i : i + per_group] for i in range(0, len(self.kda_layers), per_group)]

        cursor = 0
        self._latent: dict[int, _Page] = {}  # layer -> its page in a block; likewise below
        self._index: dict[int, _Page] = {}
        self._kda: dict[int, _Page] = {}
        self._ring: dict[int, _Page] = {}
        for table, layers, nbytes in (
            (self._latent, self.mla_layers, self.latent_bytes),
            (self._index, self.mla_layers, self.index_bytes),
            (self._kda, self.kda_layers, self.kda_bytes),
            (self._ring, self.mla_layers, self.ring_bytes),
        ):
            for layer in layers:
                table[layer] = _Page(cursor, nbytes)
                cursor += _align(nbytes)
        self.block_stride = _align(cursor, 64)
        self.buffer = torch.zeros(num_blocks * self.block_stride, dtype=torch.uint8, device=device)
        self.layout = self._describe(model_id)

    # -- typed views: [num_blocks, ...] over the packed buffer ---------------------------------------
    def _view(self, page: _Page, dtype: torch.dtype, shape: tuple[int, ...], extra_offset: int = 0) -> torch.Tensor:
        size = torch.empty(0, dtype=dtype).element_size()
        typed = self.buffer.view(dtype)
        strides, acc = [], 1
        for dim in reversed(shape):
            strides.append(acc)
            acc *= dim
        return typed.as_strided(
            (self.num_blocks, *shape),
            (self.block_stride // size, *reversed(strides)),
            (page.offset + extra_offset) // size,
        )

    def latent(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, kv_lora_rank] latent rows of one MLA layer."""
        return self._view(self._latent[layer], self.dtype, (self.block_size, self.config.kv_lora_rank))

    def index_rows(self, layer: int) -> torch.Tensor:
        """[num_blocks, pools_per_block, row]: fp32 keys, or uint8 fp8 rows of 132 bytes."""
        if self.index_format == "fp32":
            return self._view(
                self._index[layer], torch.float32, (self.block_size // self.kpool, self.config.index_head_dim)
            )
        return self._view(self._index[layer], torch.uint8, (self.block_size // self.kpool, self.index_row_bytes))

    def conv_window(self, layer: int) -> torch.Tensor:
        k = self.config.linear_conv_kernel_dim
        return self._view(self._kda[layer], self.dtype, (self.conv_dim, k - 1))

    def recurrent_state(self, layer: int) -> torch.Tensor:
        h, d = self.config.linear_num_heads, self.config.linear_head_dim
        return self._view(self._kda[layer], torch.float32, (h, d, d), extra_offset=self.conv_bytes)

    def ring(self, layer: int) -> torch.Tensor:
        """[num_blocks, ring_slots, 2 * index_head_dim]: raw key then gate score of each open-pool token."""
        return self._view(self._ring[layer], torch.float32, (self.ring_slots, 2 * self.config.index_head_dim))

    # -- indexer row formats -------------------------------------------------------------------------
    def encode_index_rows(self, pooled: torch.Tensor) -> torch.Tensor:
        if self.index_format == "fp32":
            return pooled.float()
        scale = pooled.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
        values = (pooled.float() / scale).to(torch.float8_e4m3fn).view(torch.uint8)
        return torch.cat([values, scale.view(torch.uint8).reshape(-1, 4)], dim=-1)

    def decode_index_rows(self, rows: torch.Tensor) -> torch.Tensor:
        if self.index_format == "fp32":
            return rows
        d = self.config.index_head_dim
        values = rows[..., :d].contiguous().view(torch.float8_e4m3fn).float()
        return values * rows[..., d:].contiguous().view(torch.float32)

    # -- layout model --------------------------------------------------------------------------------
    def _region(self, table: dict[int, _Page], layers: list[int], role: str, dtype: str) -> Region:
        pages = [table[layer] for layer in layers]
        stride = pages[1].offset - pages[0].offset if len(pages) > 1 else _align(pages[0].nbytes)
        assert all(b.offset - a.offset == stride for a, b in zip(pages, pages[1:])), "pages must be evenly spaced"
        return Region(
            buffer=0,
            offset=pages[0].offset,
            layer_stride=stride,
            block_stride=self.block_stride,
            layer_names=tuple(f"layers.{layer}.{role}" for layer in layers),
            used_bytes=pages[0].nbytes,
            page_bytes=_align(pages[0].nbytes),
            dtype=dtype,
        )

    def _describe(self, model_id: str) -> CacheLayout:
        dt = str(self.dtype).removeprefix("torch.")
        groups: list[CacheGroup] = []
        if self.mla_layers:
            index_dtype = "float32" if self.index_format == "fp32" else "float8_e4m3fn+float32"
            groups.append(
                CacheGroup(
                    len(groups),
                    "mla",
                    GroupKind.PAGED,
                    self.block_size,
                    (
                        self._region(self._latent, self.mla_layers, "self_attn.latent", dt),
                        self._region(self._index, self.mla_layers, "self_attn.indexer.k_cache", index_dtype),
                    ),
                    tokens_per_state=self.kpool,
                    spec_type="MLA latent + DSA indexer",
                    tp_replicas=self.tp_size,
                )
            )
        for g, layers in enumerate(self.kda_groups):
            groups.append(
                CacheGroup(
                    len(groups),
                    f"kda{g}",
                    GroupKind.STATE,
                    self.block_size,
                    (self._region(self._kda, layers, "self_attn.kda_state", f"{dt}+float32"),),
                    spec_type="KDA state",
                )
            )
        if self.mla_layers:
            groups.append(
                CacheGroup(
                    len(groups),
                    "tail",
                    GroupKind.SKIP,
                    self.ring_slots,
                    (self._region(self._ring, self.mla_layers, "self_attn.indexer.tail_ring", "float32"),),
                    spec_type="kpool tail ring",
                )
            )
        return CacheLayout(
            model_id=model_id,
            groups=tuple(groups),
            block_size=self.block_size,
            hash_block_size=self.block_size,
            hit_alignment=lcm(self.block_size, self.kpool),
            num_blocks=self.num_blocks,
            buffer_sizes=(self.buffer.numel(),),
            index_kpool=self.kpool,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            extra=(("dtype", dt), ("index_format", self.index_format)),
        )
