"""The `vllm` checkpoint format: the release names and config keys vLLM 0.33's own `glm5next` model
loads, holding exactly the values of the HF format.

vLLM's glm5next cannot be built on a CPU, so the names it expects are derived here from its source
(vllm/models/glm5next/common/{model,kda,attention}.py of the 0.33 wheel; line numbers below): the
modules' parameters, split back into the checkpoint tensors its `load_weights` fuses.
"""

import json
import os

import pytest
import torch

from glm_integration.checkpoint import (
    UNFORCED_BYTES,
    VLLM_ARCHITECTURE,
    checkpoint_bytes,
    main,
    release_tensors,
    vllm_config_dict,
    write_checkpoint,
)
from glm_integration.config import KDA, MLA, GlmConfig, ModelConfigError, preset
from glm_integration.weights import load_weights, tensor_shapes

SEED = 77
# Config keys vLLM's glm5next reads as attributes that transformers' Glm5NextTextConfig lacks:
# model.py:380 mhc, :411/:911 mla_use_nope, :256 topk_method, :312 scoring_func,
# attention.py:514 indexer_rope_interleave; deepseek_v2.py:138 moe_router_dtype (getattr);
# model.py:1285 num_nextn_predict_layers (MTP layers skipped by the main model).
VLLM_KEYS = {
    "mhc": True,
    "mla_use_nope": True,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "indexer_rope_interleave": True,
    "moe_router_dtype": "float32",
}
# Spelled the same in transformers 5.17 (which maps full_attention to deepseek_sparse_attention and has
# no indexed_attention) and 5.19 (full_attention -> indexed_attention); vLLM counts all as attention.
PORTABLE_LAYER_TYPES = {"linear_attention", "full_attention"}


def _vllm_layer(c: GlmConfig, p: str, kind: str, mlp_type: str, mhc: bool) -> dict[str, tuple[int, ...]]:
    """One Glm5NextDecoderLayer's checkpoint tensors under prefix `p`."""
    H, out = c.hidden_size, {}
    if kind == KDA:
        C, dk, nh = c.linear_num_heads * c.linear_head_dim, c.linear_head_dim, c.linear_num_heads
        K = c.linear_conv_kernel_dim
        # kda.py:239 in_proj_qkvbfg_a, fused from these six (model.py:872-877)
        for proj, rows in (("q", C), ("k", C), ("v", C), ("b", nh), ("f_a", dk), ("g_a", dk)):
            out[f"{p}self_attn.{proj}_proj.weight"] = (rows, H)
        out[f"{p}self_attn.f_b_proj.weight"] = (C, dk)  # kda.py:256
        out[f"{p}self_attn.dt_bias"] = (C,)  # kda.py:263
        for x in "qkv":  # kda.py:269-296: [C, K] linears unsqueezed to [C, 1, K]; the loader asserts equal shapes
            out[f"{p}self_attn.{x}_conv1d.weight"] = (C, 1, K)
        out[f"{p}self_attn.A_log"] = (nh,)  # kda.py:301, 1-D in checkpoints (kda.py:330)
        out[f"{p}self_attn.g_b_proj.weight"] = (C, dk)  # kda.py:306
        out[f"{p}self_attn.o_norm.weight"] = (dk,)  # kda.py:313
        out[f"{p}self_attn.o_proj.weight"] = (H, C)  # kda.py:314
    else:
        nope, rope, heads = c.qk_nope_head_dim, c.qk_rope_head_dim, c.num_attention_heads
        # attention.py:428 fused_qkv_a_proj <- q_a_proj, kv_a_proj_with_mqa (model.py:866-867)
        out[f"{p}self_attn.q_a_proj.weight"] = (c.q_lora_rank, H)
        out[f"{p}self_attn.kv_a_proj_with_mqa.weight"] = (c.kv_lora_rank + rope, H)
        out[f"{p}self_attn.q_a_layernorm.weight"] = (c.q_lora_rank,)  # attention.py:444
        out[f"{p}self_attn.q_b_proj.weight"] = (heads * (nope + rope), c.q_lora_rank)  # attention.py:445
        out[f"{p}self_attn.kv_a_layernorm.weight"] = (c.kv_lora_rank,)  # attention.py:460
        out[f"{p}self_attn.kv_b_proj.weight"] = (heads * (nope + c.v_head_dim), c.kv_lora_rank)  # :461
        out[f"{p}self_attn.o_proj.weight"] = (H, heads * c.v_head_dim)  # attention.py:468
        # Every MLA layer has an indexer when index_topk is set (attention.py:507, :519).
        d, q = f"{p}self_attn.indexer.", c.index_head_dim
        out[d + "index_kpool_compress_ape"] = (c.index_kpool, q)  # attention.py:219
        out[d + "index_kpool_compress_gate"] = (q, H)  # attention.py:224, no `.weight`
        out[d + "wq_b.weight"] = (c.index_n_heads * q, c.q_lora_rank)  # attention.py:229
        out[d + "wk.weight"] = (q, H)  # attention.py:238 wk_weights_proj <- wk, weights_proj
        out[d + "weights_proj.weight"] = (c.index_n_heads, H)
        out[d + "k_norm.weight"] = (q,)  # attention.py:246, a LayerNorm with bias
        out[d + "k_norm.bias"] = (q,)
    if mlp_type == "dense":  # model.py:185 gate_up_proj <- gate_proj, up_proj (model.py:862-863)
        I = c.intermediate_size  # noqa: E741
        out.update({f"{p}mlp.gate_proj.weight": (I, H), f"{p}mlp.up_proj.weight": (I, H),
                    f"{p}mlp.down_proj.weight": (H, I)})
    else:
        E, I = c.n_routed_experts, c.moe_intermediate_size  # noqa: E741
        S = I * c.n_shared_experts
        out[f"{p}mlp.gate.weight"] = (E, H)  # model.py:250
        out[f"{p}mlp.gate.e_score_correction_bias"] = (E,)  # model.py:256 (topk_method noaux_tc)
        for e in range(E):  # model.py:895 expert mapping: experts.{e}.{gate,up,down}_proj.
            for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                out[f"{p}mlp.experts.{e}.{proj}.weight"] = shape
        for proj, shape in (("gate_proj", (S, H)), ("up_proj", (S, H)), ("down_proj", (H, S))):  # model.py:288
            out[f"{p}mlp.shared_experts.{proj}.weight"] = shape
    out[f"{p}input_layernorm.weight"] = (H,)  # model.py:440
    out[f"{p}post_attention_layernorm.weight"] = (H,)  # model.py:449
    if mhc:  # model.py:453-480
        n = c.hc_mult
        for part in ("attn", "ffn"):
            out.update({f"{p}hc_{part}_fn": ((2 + n) * n, n * H), f"{p}hc_{part}_base": ((2 + n) * n,),
                        f"{p}hc_{part}_scale": (3,)})
    return out


def vllm_expected(c: GlmConfig, mhc: bool = True) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape that vLLM's Glm5NextForCausalLM loads (every parameter, nothing else),
    plus the MTP layer its Glm5NextMTP loads when the config has one."""
    H, out = c.hidden_size, {}
    out["model.embed_tokens.weight"] = (c.vocab_size, H)  # model.py:725
    out["model.norm.weight"] = (H,)  # model.py:757
    out["lm_head.weight"] = (c.vocab_size, H)  # model.py:1061
    for i in range(c.num_hidden_layers):
        out.update(_vllm_layer(c, f"model.layers.{i}.", c.layer_types[i], c.mlp_layer_types[i], mhc))
    if c.num_nextn_predict_layers:
        # The main model skips `model.layers.<num_hidden_layers>.` (model.py:921-924). Glm5NextMTP reads
        # enorm/hnorm/eh_proj/shared_head there (mtp.py:52-62, 266) and the rest as its mtp_block
        # (mtp.py:284): an MLA layer (model.py:381) with the last layer's MLP type (model.py:421) and no
        # hyper-connections (model.py:453); its lm_head is the main model's (deferred, mtp.py:62).
        p = f"model.layers.{c.num_hidden_layers}."
        out.update({p + "enorm.weight": (H,), p + "hnorm.weight": (H,), p + "eh_proj.weight": (H, 2 * H),
                    p + "shared_head.norm.weight": (H,)})
        out.update(_vllm_layer(c, p, MLA, c.mlp_layer_types[-1], mhc=False))
    return out


def _release_shapes(cfg: GlmConfig) -> dict[str, tuple[int, ...]]:
    """The names and shapes the writer produces, on meta tensors (no memory)."""
    out = {}
    for name, shape in tensor_shapes(cfg).items():
        out.update((n, tuple(t.shape)) for n, t in release_tensors(cfg, name, torch.empty(shape, device="meta")))
    return out


def _files(directory):
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    hf, vllm = tmp_path_factory.mktemp("hf"), tmp_path_factory.mktemp("vllm")
    write_checkpoint(preset("tiny"), SEED, str(hf))
    summary = write_checkpoint(preset("tiny"), SEED, str(vllm), format="vllm")
    return str(hf), str(vllm), summary


def test_release_format_loads_to_the_hf_tensors(dirs):
    hf, vllm, _ = dirs
    a, b = load_weights(hf), load_weights(vllm)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].contiguous().view(torch.uint8).equal(b[name].contiguous().view(torch.uint8)), name
    assert GlmConfig.from_pretrained(vllm) == preset("tiny")


def test_release_names_and_shapes_are_what_vllm_loads(dirs):
    from safetensors import safe_open

    _, vllm, summary = dirs
    with safe_open(os.path.join(vllm, "model.safetensors"), framework="pt") as f:
        written = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    expected = vllm_expected(preset("tiny"))
    assert written == expected
    assert summary["tensors"] == len(expected)
    # Same at the real widths (meta tensors): the vLLM preset and a full-width layer schedule.
    for name in ("vllm-4l", "pruned-4l"):
        cfg = preset(name)
        assert _release_shapes(cfg) == vllm_expected(cfg), name


def test_config_json_has_what_vllm_reads(dirs):
    _, vllm, _ = dirs
    d = json.load(open(os.path.join(vllm, "config.json")))
    assert d["architectures"] == [VLLM_ARCHITECTURE] == ["Glm5NextForCausalLM"]  # vLLM registry.py:127
    assert d["model_type"] == "glm5_next_text"
    assert {k: d[k] for k in VLLM_KEYS} == VLLM_KEYS
    assert d["num_nextn_predict_layers"] == 0 and d["qk_rope_head_dim"] == 0
    assert set(d["layer_types"]) <= PORTABLE_LAYER_TYPES and "indexed_attention" not in d["layer_types"]
    cfg = preset("tiny")
    assert [t == "full_attention" for t in d["layer_types"]] == [t == MLA for t in cfg.layer_types]
    assert d["index_kpool_always_select_tail"] is True  # model.py:161
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoConfig.from_pretrained(vllm)  # transformers keeps the keys it does not define
    assert type(hf).__name__ == "Glm5NextTextConfig"
    assert all(getattr(hf, k) == v for k, v in VLLM_KEYS.items())
    assert [t == "linear_attention" for t in hf.layer_types] == [t == KDA for t in cfg.layer_types]


def test_same_seed_same_bytes(dirs, tmp_path):
    _, vllm, _ = dirs
    write_checkpoint(preset("tiny"), SEED, str(tmp_path / "again"), format="vllm")
    assert _files(vllm) == _files(tmp_path / "again")
    argv = ["--preset", "tiny", "--format", "vllm", "--seed", str(SEED + 1), "--out", str(tmp_path / "other")]
    assert main(argv) == 0
    other = _files(tmp_path / "other")
    assert other["config.json"] == _files(vllm)["config.json"]
    assert other["model.safetensors"] != _files(vllm)["model.safetensors"]


def test_without_mhc_and_what_vllm_cannot_load(tmp_path):
    cfg = preset("tiny")
    write_checkpoint(cfg, SEED, str(tmp_path), format="vllm", mhc=False)
    d = json.load(open(tmp_path / "config.json"))
    assert d["mhc"] is False
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        written = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    assert written == vllm_expected(cfg, mhc=False)
    with pytest.raises(ModelConfigError, match="missing"):  # the runner needs the hyper-connections
        load_weights(str(tmp_path))
    with pytest.raises(ValueError, match="only for format 'vllm'"):
        write_checkpoint(cfg, SEED, str(tmp_path), mhc=False)
    with pytest.raises(ValueError, match="format must be"):
        write_checkpoint(cfg, SEED, str(tmp_path), format="release")
    shared = cfg.replace(indexer_types=("full", "full", "full", "full", "shared"))
    with pytest.raises(ModelConfigError, match="indexer_types"):
        vllm_config_dict(shared)
    with pytest.raises(SystemExit):
        main(["--preset", "tiny", "--no-mhc", "--seed", "0", "--out", str(tmp_path / "x")])


def test_vllm_4l_preset():
    full, cfg = preset("full"), preset("vllm-4l")
    assert cfg.layer_types == full.layer_types[:4] == (KDA, KDA, KDA, MLA)
    assert cfg.mlp_layer_types == ("dense", "dense", "dense", "sparse")
    widths = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
              "index_n_heads", "index_head_dim", "index_topk", "index_kpool", "linear_num_heads", "linear_head_dim",
              "linear_conv_kernel_dim", "hc_mult", "dtype")
    assert all(getattr(cfg, w) == getattr(full, w) for w in widths)
    assert (cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_nextn_predict_layers) == (8, 256, 0)
    assert 1 << 30 <= checkpoint_bytes(cfg) <= UNFORCED_BYTES  # ~1.2 GiB: the CLI writes it without --force
    assert checkpoint_bytes(preset("pruned-4l")) > UNFORCED_BYTES
    d = vllm_config_dict(cfg)
    assert d["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
