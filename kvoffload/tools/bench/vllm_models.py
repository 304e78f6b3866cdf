"""Small random-weight models for the real vLLM CPU engine (seeded, written locally: no hub access,
no tokenizer files; prompts are token ids). Used by the vLLM benchmarks and the vLLM tests; the tests'
own hybrid model is in tests/support/vllm_harness.py."""

from __future__ import annotations

import json
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


def write_llama(dir: str, sizes: dict, *, vocab: int, seed: int = 0, device: str = "cpu") -> str:
    """A bf16 ``LlamaForCausalLM`` checkpoint of `sizes` (`llama_sizes`) with seeded random weights, written
    tensor by tensor (one safetensors file per layer, and their index): an 8B-parameter model needs neither
    a float32 copy nor minutes of initialisation, and `device` (a GPU) draws the numbers. Returns ``dir``."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    hidden, layers = sizes["hidden_size"], sizes["num_hidden_layers"]
    q, kv = sizes["num_attention_heads"] * sizes["head_dim"], sizes["num_key_value_heads"] * sizes["head_dim"]
    ffn = sizes["intermediate_size"]
    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.bfloat16, device=device)
        return out.normal_(0.0, 0.02, generator=generator).cpu()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    os.makedirs(dir, exist_ok=True)
    LlamaConfig(vocab_size=vocab, tie_word_embeddings=False, **sizes).save_pretrained(dir)
    weight_map: dict[str, str] = {}

    def write(tensors: dict, name: str) -> None:
        save_file(tensors, f"{dir}/{name}")
        weight_map.update(dict.fromkeys(tensors, name))

    outer = {"model.embed_tokens.weight": normal(vocab, hidden), "model.norm.weight": ones(hidden)}
    write({**outer, "lm_head.weight": normal(vocab, hidden)}, "model-outer.safetensors")
    shapes = {
        "self_attn.q_proj": (q, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, q),
        "mlp.gate_proj": (ffn, hidden),
        "mlp.up_proj": (ffn, hidden),
        "mlp.down_proj": (hidden, ffn),
    }
    for i in range(layers):
        at = f"model.layers.{i}."
        tensors = {f"{at}{name}.weight": normal(*shape) for name, shape in shapes.items()}
        tensors[f"{at}input_layernorm.weight"] = ones(hidden)
        tensors[f"{at}post_attention_layernorm.weight"] = ones(hidden)
        write(tensors, f"model-layer{i:03d}.safetensors")
    with open(f"{dir}/model.safetensors.index.json", "w") as index:  # which file holds each tensor
        json.dump({"metadata": {}, "weight_map": weight_map}, index)
    return dir
