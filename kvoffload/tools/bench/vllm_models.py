"""Small random-weight models for the real vLLM CPU engine (seeded, written locally: no hub access,
no tokenizer files; prompts are token ids). Used by the vLLM benchmarks and the vLLM tests; the tests'
own hybrid model is in tests/support/vllm_harness.py."""

from __future__ import annotations

import os
from typing import Any


def llama_sizes(
    *, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int, positions: int
) -> dict[str, int]:
    """A `LlamaConfig`'s sizes under its own names and in its order, from short ones: so each model here
    (the benchmark profiles, `prefetch`, `tiny_llama`) is one line."""
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=positions,
    )


def kv_bytes_per_token(sizes: dict, element_bytes: int) -> int:
    """The K and V of every layer for one token, in a model of `sizes` (`llama_sizes`)."""
    return sizes["num_hidden_layers"] * 2 * sizes["num_key_value_heads"] * sizes["head_dim"] * element_bytes


def save_model(model_cls, config, out_dir: str, dtype, seed: int) -> str:
    """`model_cls(config)` with seeded random weights, in `dtype`, saved to `out_dir` (returned)."""
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

    cfg: dict[str, Any] = dict(
        vocab_size=512,
        # head_dim 32: the CPU attention backend takes no smaller head
        **llama_sizes(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32, positions=2048),
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.1,  # larger than default: well-separated logits, robust greedy argmax
    )
    cfg.update(overrides)
    return save_model(LlamaForCausalLM, LlamaConfig(**cfg), dir, torch.float32, seed)
