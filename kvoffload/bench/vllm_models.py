"""Small random-weight models for the real vLLM CPU engine (seeded, written locally: no hub access,
no tokenizer files; prompts are token ids). Shared by the vLLM benchmarks and the vLLM tests."""

from __future__ import annotations

import os
from typing import Any


def _save_model(model_cls, config, out_dir: str, dtype, seed: int) -> str:
    import torch

    os.makedirs(out_dir, exist_ok=True)
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = model_cls(config).to(dtype)
        model.save_pretrained(out_dir)
    return out_dir


def tiny_llama(dir: str, *, seed: int = 0, **overrides: Any) -> str:
    """A float32 ``LlamaForCausalLM``: 2 layers, hidden 128, head_dim 32 (the CPU attention backend's
    smallest head size), vocab 512, unless `overrides` say otherwise. Returns ``dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # CPU attention: head >= 32
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.1,  # larger than default: well-separated logits, robust greedy argmax
    )
    cfg.update(overrides)
    return _save_model(LlamaForCausalLM, LlamaConfig(**cfg), dir, torch.float32, seed)


def tiny_qwen3_next(dir: str, *, seed: int = 0, **overrides: Any) -> str:
    """A bf16 hybrid ``Qwen3NextForCausalLM``: layer 0 gated-delta-net linear attention (a mamba-spec
    group), layer 1 full attention, both MoE (4 experts, top-2, shared expert). CPU constraints: bf16
    and ``linear_key_head_dim == linear_value_head_dim == 128``. 4 KV heads of 128 make the attention
    page big enough that vLLM aligns the attention block to 64 tokens. Run with ``dtype="bfloat16"``."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=2048,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=1, linear_num_value_heads=1,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=0.1,
    )
    cfg.update(overrides)
    return _save_model(Qwen3NextForCausalLM, Qwen3NextConfig(**cfg), dir, torch.bfloat16, seed)
