"""GLM-5.3-Flash weights: the tensor layout a config implies, and loading an HF-format checkpoint into it.

Every name the runner sees is an HF text-model name (`layers.N....`, `embed_tokens.weight`, `norm.weight`)
plus `lm_head.weight`; the MTP layer (stored as `layers.<num_hidden_layers>.`) lives under `mtp.` so it can
never be mistaken for a decoder layer. Checkpoints come in several spellings: multimodal prefixes,
shards, and the release format that stores experts one by one, the KDA conv as three tensors and the
hyper-connections as `hc_attn_*`. All of them are normalised here, once, so nothing downstream guesses.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict

import torch

from .config import KDA, GlmConfig, ModelConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Checkpoint prefixes of the text tower, longest first.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
# What a multimodal checkpoint carries besides the text tower (matched after prefix stripping).
_VISION_PREFIXES = ("visual.", "vision_tower.", "vision_model.", "vision.", "multi_modal_projector.", "mm_projector.")
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
# Tensors an MTP layer may carry that duplicate the main model's (DeepSeek-style exports).
_MTP_OPTIONAL = ("embed_tokens.weight", "shared_head.head.weight")

# Release-format spellings -> HF text-model spellings (the renames HF's loader applies for glm5_next).
_RENAMES = (
    ("self_attn.f_a_proj.", "self_attn.forget_gate.f_a_proj."),
    ("self_attn.f_b_proj.", "self_attn.forget_gate.f_b_proj."),
    ("self_attn.dt_bias", "self_attn.forget_gate.dt_bias"),
    ("self_attn.A_log", "self_attn.forget_gate.A_log"),
    ("hc_attn_fn", "attn_hc.fn"),
    ("hc_attn_base", "attn_hc.base"),
    ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"),
    ("hc_ffn_base", "ffn_hc.base"),
    ("hc_ffn_scale", "ffn_hc.scale"),
)
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SPLIT_CONV = re.compile(r"^(.*\.self_attn)\.([qkv])_conv1d\.weight$")

# Kept in float32 whatever the model dtype (HF's `_keep_in_fp32_modules_strict` for this model).
FP32_SUFFIXES = ("e_score_correction_bias", "conv1d.weight", "dt_bias", "A_log")


# ---- layout -----------------------------------------------------------------------------------------


def _attention_shapes(c: GlmConfig, kind: str, with_indexer: bool) -> list[tuple[str, tuple[int, ...]]]:
    H = c.hidden_size
    if kind == KDA:
        qkv, dk, heads = c.linear_num_heads * c.linear_head_dim, c.linear_head_dim, c.linear_num_heads
        out = [
            ("q_proj.weight", (qkv, H)),
            ("k_proj.weight", (qkv, H)),
            ("v_proj.weight", (qkv, H)),
            ("conv1d.weight", (3 * qkv, 1, c.linear_conv_kernel_dim)),  # depthwise nn.Conv1d: [C, 1, K]
            ("forget_gate.dt_bias", (qkv,)),
            ("forget_gate.A_log", (heads,)),
            ("forget_gate.f_a_proj.weight", (dk, H)),
            ("forget_gate.f_b_proj.weight", (qkv, dk)),
            ("b_proj.weight", (heads, H)),
            ("g_a_proj.weight", (dk, H)),
            ("g_b_proj.weight", (qkv, dk)),
            ("o_norm.weight", (dk,)),  # one gated RMSNorm shared by all heads
            ("o_proj.weight", (H, qkv)),
        ]
        return [("self_attn." + n, s) for n, s in out]
    heads, qk = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    out = [
        ("q_a_proj.weight", (c.q_lora_rank, H)),
        ("q_a_layernorm.weight", (c.q_lora_rank,)),
        ("q_b_proj.weight", (heads * qk, c.q_lora_rank)),
        ("kv_a_proj_with_mqa.weight", (c.kv_lora_rank + c.qk_rope_head_dim, H)),
        ("kv_a_layernorm.weight", (c.kv_lora_rank,)),
        ("kv_b_proj.weight", (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)),  # [k_nope | v] per head
        ("o_proj.weight", (H, heads * c.v_head_dim)),
    ]
    if with_indexer:
        d = c.index_head_dim
        out += [
            ("indexer.index_kpool_compress_ape", (c.index_kpool, d)),
            ("indexer.index_kpool_compress_gate", (d, H)),
            ("indexer.wq_b.weight", (c.index_n_heads * d, c.q_lora_rank)),
            ("indexer.wk.weight", (d, H)),
            ("indexer.k_norm.weight", (d,)),  # a LayerNorm: weight and bias
            ("indexer.k_norm.bias", (d,)),
            ("indexer.weights_proj.weight", (c.index_n_heads, H)),
        ]
    return [("self_attn." + n, s) for n, s in out]


def _mlp_shapes(c: GlmConfig, mlp_type: str) -> list[tuple[str, tuple[int, ...]]]:
    H = c.hidden_size
    if mlp_type == "dense":
        I = c.intermediate_size  # noqa: E741
        out: list[tuple[str, tuple[int, ...]]] = [
            ("gate_proj.weight", (I, H)),
            ("up_proj.weight", (I, H)),
            ("down_proj.weight", (H, I)),
        ]
    else:
        E, I, S = c.n_routed_experts, c.moe_intermediate_size, c.moe_intermediate_size * c.n_shared_experts  # noqa: E741
        out = [
            ("experts.gate_up_proj", (E, 2 * I, H)),  # [gate | up] along dim 1
            ("experts.down_proj", (E, H, I)),
            ("gate.weight", (E, H)),
            ("gate.e_score_correction_bias", (E,)),
            ("shared_experts.gate_proj.weight", (S, H)),
            ("shared_experts.up_proj.weight", (S, H)),
            ("shared_experts.down_proj.weight", (H, S)),
        ]
    return [("mlp." + n, s) for n, s in out]


def _hc_shapes(c: GlmConfig, name: str) -> list[tuple[str, tuple[int, ...]]]:
    n = c.hc_mult
    return [(f"{name}.fn", ((2 + n) * n, n * c.hidden_size)), (f"{name}.base", ((2 + n) * n,)), (f"{name}.scale", (3,))]


def tensor_shapes(config: GlmConfig) -> OrderedDict[str, tuple[int, ...]]:
    """Every required tensor, in `Glm5NextTextModel.state_dict()` order, then `lm_head`, then `mtp.`."""
    c, H = config, config.hidden_size
    out: OrderedDict[str, tuple[int, ...]] = OrderedDict()
    out["embed_tokens.weight"] = (c.vocab_size, H)
    for i in range(c.num_hidden_layers):
        kind = c.layer_types[i]
        entries = _attention_shapes(c, kind, c.indexer_types[i] == "full")
        entries += _mlp_shapes(c, c.mlp_layer_types[i])
        entries += [("input_layernorm.weight", (H,)), ("post_attention_layernorm.weight", (H,))]
        entries += _hc_shapes(c, "attn_hc") + _hc_shapes(c, "ffn_hc")
        out.update((f"layers.{i}.{n}", s) for n, s in entries)
    out["norm.weight"] = (H,)
    out["lm_head.weight"] = (c.vocab_size, H)
    if c.num_nextn_predict_layers:
        # The MTP block is an indexed (MLA) layer without hyper-connections; its MLP takes the last layer's type.
        entries = [("enorm.weight", (H,)), ("hnorm.weight", (H,)), ("eh_proj.weight", (H, 2 * H))]
        entries += _attention_shapes(c, "indexed_attention", True) + _mlp_shapes(c, c.mlp_layer_types[-1])
        entries += [("input_layernorm.weight", (H,)), ("post_attention_layernorm.weight", (H,))]
        entries += [("shared_head.norm.weight", (H,))]
        out.update((f"mtp.{n}", s) for n, s in entries)
    return out


def tensor_dtype(config: GlmConfig, name: str) -> torch.dtype:
    return torch.float32 if name.endswith(FP32_SUFFIXES) else config.torch_dtype


# ---- loading ----------------------------------------------------------------------------------------


def _shard_files(directory: str) -> list[str]:
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
        with open(index, "rb") as f:
            try:
                contents = json.load(f)
            except ValueError as exc:
                raise ModelConfigError(f"{index}: not valid JSON ({exc})") from None
        weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
            raise ModelConfigError(f"{index}: no weight_map from tensor names to files")
        return sorted(set(weight_map.values()))
    if os.path.exists(os.path.join(directory, SINGLE_FILE)):
        return [SINGLE_FILE]
    raise FileNotFoundError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _read_raw(directory: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    raw: dict[str, torch.Tensor] = {}
    for file in _shard_files(directory):
        path = os.path.join(directory, file)
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if name in raw:
                        raise ModelConfigError(f"{directory}: tensor {name!r} appears in more than one shard")
                    raw[name] = f.get_tensor(name)
        except SafetensorError as exc:  # truncated, or not safetensors at all
            raise ModelConfigError(f"{path}: not a readable safetensors file ({exc})") from None
    return raw


def _text_name(name: str) -> str | None:
    """Strip the text-tower prefix; None for vision tensors and known-ignorable buffers."""
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    if name.startswith(_VISION_PREFIXES) or _IGNORED.search(name):
        return None
    return name


def _rename(name: str) -> str:
    for old, new in _RENAMES:
        if old in name and new not in name:
            name = name.replace(old, new)
    return name


def _fuse_release_format(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stack per-expert tensors into HF's [E, 2I, H] / [E, H, I] and join the split q/k/v conv weights."""
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    convs: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if m := _PER_EXPERT.match(name):
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
        elif m := _SPLIT_CONV.match(name):
            convs.setdefault(m.group(1), {})[m.group(2)] = t
        else:
            out[name] = t
    for prefix, per_proj in experts.items():
        stacked = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            by_index = per_proj.get(proj, {})
            if sorted(by_index) != list(range(len(by_index))) or not by_index:
                raise ModelConfigError(
                    f"{prefix}: per-expert {proj} tensors are incomplete (have {sorted(by_index)[:8]}...)"
                )
            stacked[proj] = torch.stack([by_index[e] for e in range(len(by_index))])
        out[prefix + ".gate_up_proj"] = torch.cat([stacked["gate_proj"], stacked["up_proj"]], dim=1)
        out[prefix + ".down_proj"] = stacked["down_proj"]
    for prefix, parts in convs.items():
        if sorted(parts) != ["k", "q", "v"]:
            raise ModelConfigError(f"{prefix}: split conv1d needs q, k and v, found {sorted(parts)}")
        w = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
        out[prefix + ".conv1d.weight"] = w.reshape(w.shape[0], 1, -1)
    return out


def _few(names, n=5) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def load_weights(directory: str, config: GlmConfig | None = None) -> dict[str, torch.Tensor]:
    """Load an HF-format GLM-5.3-Flash checkpoint with names normalised and checked against `config`.

    `config` defaults to the directory's config.json. Vision tensors are dropped; the MTP layer
    (`layers.<num_hidden_layers>.`) is returned under `mtp.`. Missing, unexpected or misshapen tensors
    raise ModelConfigError (a ValueError) naming a few of them.
    """
    if config is None:
        if not os.path.exists(os.path.join(directory, "config.json")):
            raise FileNotFoundError(f"{directory}: no config.json; pass config= to load_weights")
        config = GlmConfig.from_pretrained(directory)
    raw = _read_raw(directory)
    if fp8 := [n for n in raw if n.endswith(("weight_scale_inv", "weight_scale", "input_scale"))]:
        raise ModelConfigError(
            f"{directory}: quantised checkpoint (e.g. {_few(fp8, 2)}); load the BF16 release instead"
        )

    text: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        short = _text_name(name)
        if short is not None:
            text[_rename(short)] = t
    text = _fuse_release_format(text)

    n_layers = config.num_hidden_layers
    out: dict[str, torch.Tensor] = {}
    beyond = []
    for name, t in text.items():
        if m := _LAYER.match(name):
            idx = int(m.group(1))
            if idx == n_layers:
                name = "mtp." + m.group(2)
            elif idx > n_layers:
                beyond.append(name)
                continue
        out[name] = t
    if beyond:
        raise ModelConfigError(
            f"{directory}: tensors for layers past the MTP layer (index {n_layers}): {_few(beyond)}; "
            f"does num_hidden_layers={n_layers} match this checkpoint?"
        )

    expected = tensor_shapes(config)
    missing = [n for n in expected if n not in out]
    if missing:
        raise ModelConfigError(f"{directory}: {len(missing)} required tensors missing: {_few(missing)}")
    unexpected = [
        n
        for n in out
        if n not in expected
        and not (n.startswith("mtp.") and (not config.num_nextn_predict_layers or n[4:] in _MTP_OPTIONAL))
    ]
    if unexpected:
        raise ModelConfigError(f"{directory}: {len(unexpected)} unexpected tensors: {_few(unexpected)}")
    wrong = [f"{n} {tuple(out[n].shape)} != {shape}" for n, shape in expected.items() if tuple(out[n].shape) != shape]
    if config.num_nextn_predict_layers:
        wrong += [
            f"mtp.{n} {tuple(out['mtp.' + n].shape)} != {(config.vocab_size, config.hidden_size)}"
            for n in _MTP_OPTIONAL
            if "mtp." + n in out and tuple(out["mtp." + n].shape) != (config.vocab_size, config.hidden_size)
        ]
    if wrong:
        raise ModelConfigError(f"{directory}: {len(wrong)} tensors have the wrong shape: {'; '.join(wrong[:5])}")
    return out
