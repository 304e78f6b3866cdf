"""The tiny random GLM-5.3-Flash checkpoint is a faithful HF checkpoint, reproducible, and tie-free enough
for greedy decoding; `load_weights` normalises every checkpoint spelling to the same text weights."""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.models.glm5_next import Glm5NextTextConfig, Glm5NextTextModel  # noqa: E402

from glm_integration.checkpoint import init_tensor, main, write_checkpoint  # noqa: E402
from glm_integration.config import GlmConfig, preset  # noqa: E402
from glm_integration.weights import load_weights, tensor_shapes  # noqa: E402

SEED = 1234


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    write_checkpoint(preset("tiny"), SEED, str(out))
    return str(out)


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    transformers.utils.logging.set_verbosity_error()
    model, info = Glm5NextTextModel.from_pretrained(tiny_dir, output_loading_info=True)
    return model.eval(), info


def _files(directory):
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


def test_hf_loads_every_tensor_and_runs(hf_model, tiny_dir):
    model, info = hf_model
    assert not info["missing_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    # The text model has no head; lm_head.weight is the only key it has no slot for.
    assert info["unexpected_keys"] == {"lm_head.weight"}
    written = load_file(os.path.join(tiny_dir, "model.safetensors"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, written[name]), name
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model(input_ids=ids).last_hidden_state
    assert hidden.shape == (1, 40, 128)
    assert torch.isfinite(hidden).all()
    assert 0.1 < hidden.std().item() < 10


def test_same_seed_same_bytes_other_seed_differs(tiny_dir, tmp_path):
    write_checkpoint(preset("tiny"), SEED, str(tmp_path / "again"))
    assert _files(tiny_dir) == _files(tmp_path / "again")
    assert main(["--preset", "tiny", "--seed", str(SEED + 1), "--out", str(tmp_path / "other")]) == 0
    other = _files(tmp_path / "other")
    assert other["config.json"] == _files(tiny_dir)["config.json"]
    assert other["model.safetensors"] != _files(tiny_dir)["model.safetensors"]
    assert main(["--preset", "pruned-4l", "--seed", "0", "--out", str(tmp_path / "big")]) == 2


def test_hf_constant_params_are_randomised(tiny_dir):
    weights = load_file(os.path.join(tiny_dir, "model.safetensors"))
    suffixes = (
        "index_kpool_compress_ape",
        "index_kpool_compress_gate",
        "e_score_correction_bias",
        "forget_gate.A_log",
        "forget_gate.dt_bias",
        "attn_hc.base",
        "attn_hc.scale",
        "ffn_hc.base",
        "ffn_hc.scale",
    )
    for suffix in suffixes:
        found = [t for n, t in weights.items() if n.endswith(suffix)]
        assert found, suffix
        for t in found:
            assert t.std() > 0.01, suffix
            assert t.unique().numel() > 0.99 * t.numel(), suffix  # (fp32 draws may collide once in a while)


def test_load_weights_roundtrip_and_sharded_multimodal_copy(tiny_dir, tmp_path):
    written = load_file(os.path.join(tiny_dir, "model.safetensors"))
    loaded = load_weights(tiny_dir)
    assert loaded.keys() == written.keys()
    assert all(torch.equal(loaded[n], written[n]) for n in written)

    # Same weights as a multimodal, sharded release: prefixes, vision tensors and an MTP layer.
    cfg = preset("tiny")
    names = sorted(written)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    prefixed = lambda n: n if n == "lm_head.weight" else "model.language_model." + n  # noqa: E731
    weight_map = {}
    for file, part in shards.items():
        tensors = {prefixed(n): written[n] for n in part}
        if file.startswith("model-00002"):
            tensors["model.visual.x.weight"] = torch.ones(3, 3)
            tensors["model.language_model.layers.5.enorm.weight"] = torch.full((128,), 2.0)
        save_file(tensors, str(tmp_path / file))
        weight_map.update((n, file) for n in tensors)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm5_next", "text_config": cfg.to_hf_dict()}))

    sharded = load_weights(str(tmp_path))
    assert sharded.keys() == written.keys() | {"mtp.enorm.weight"}
    assert all(torch.equal(sharded[n], written[n]) for n in written)
    assert torch.equal(sharded["mtp.enorm.weight"], torch.full((128,), 2.0))


def test_load_weights_release_format_and_errors(tiny_dir, tmp_path):
    """Per-expert MoE tensors, split q/k/v convs and `hc_attn_*` names load to the HF layout."""
    cfg = preset("tiny")
    written = load_file(os.path.join(tiny_dir, "model.safetensors"))
    release = {}
    for name, t in written.items():
        if name.endswith("experts.gate_up_proj"):
            base = name.rsplit(".", 1)[0]
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                release[f"{base}.{e}.gate_proj.weight"] = gate[e].clone()
                release[f"{base}.{e}.up_proj.weight"] = up[e].clone()
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                release[f"{name.rsplit('.', 1)[0]}.{e}.down_proj.weight"] = t[e].clone()
        elif name.endswith("conv1d.weight"):
            for letter, part in zip("qkv", t.chunk(3, dim=0)):
                release[name.replace("conv1d", f"{letter}_conv1d")] = part.squeeze(1).clone()
        else:
            release[name.replace("forget_gate.", "").replace("attn_hc.", "hc_attn_").replace("ffn_hc.", "hc_ffn_")] = t
    save_file({"model." + n: t for n, t in release.items()}, str(tmp_path / "model.safetensors"))
    loaded = load_weights(str(tmp_path), config=cfg)
    assert loaded.keys() == written.keys()
    assert all(torch.equal(loaded[n], written[n]) for n in written)

    with pytest.raises(ValueError, match="wrong shape"):
        load_weights(tiny_dir, config=cfg.replace(moe_intermediate_size=32))
    save_file({n: t for n, t in written.items() if n != "lm_head.weight"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing: .*lm_head.weight"):
        load_weights(str(tmp_path), config=cfg)


def test_sharded_bf16_checkpoint_with_mtp(tmp_path):
    """The path pruned-4l/full take (bf16, MTP layer, shards), on a tiny config."""
    cfg = preset("tiny").replace(dtype="bfloat16", num_nextn_predict_layers=1)
    summary = write_checkpoint(cfg, SEED, str(tmp_path), max_shard_bytes=1 << 20)
    assert len(summary["files"]) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    loaded = load_weights(str(tmp_path))
    assert {n: tuple(t.shape) for n, t in loaded.items()} == dict(tensor_shapes(cfg))
    assert loaded["mtp.eh_proj.weight"].dtype == torch.bfloat16
    assert loaded["layers.0.self_attn.conv1d.weight"].dtype == torch.float32  # HF keeps these in fp32
    assert loaded["layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    # Rewriting in place as one file leaves no stale shard behind.
    write_checkpoint(cfg, SEED, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    assert all(torch.equal(t, loaded[n]) for n, t in load_weights(str(tmp_path)).items())


@pytest.mark.parametrize("name", ["tiny", "pruned-4l", "full"])
def test_config_roundtrip_and_hf_layout(name):
    cfg = preset(name)
    d = cfg.to_hf_dict()
    assert GlmConfig.from_hf_dict(d) == cfg
    assert GlmConfig.from_hf_dict({"text_config": d, "vision_config": {}}) == cfg
    hf = Glm5NextTextConfig(**d)
    assert list(hf.layer_types) == list(cfg.layer_types)
    assert list(hf.mlp_layer_types) == list(cfg.mlp_layer_types)
    assert list(hf.indexer_types) == list(cfg.indexer_types)
    # The layout we write is exactly the HF model's state dict (checked without allocating: meta device).
    with torch.device("meta"):
        model = Glm5NextTextModel(hf)
    ours = {n: s for n, s in tensor_shapes(cfg).items() if n != "lm_head.weight" and not n.startswith("mtp.")}
    assert list(ours.items()) == [(n, tuple(t.shape)) for n, t in model.state_dict().items()]
    assert any(n.startswith("mtp.") for n in tensor_shapes(cfg)) == (cfg.num_nextn_predict_layers == 1)


def test_config_defaults_and_validation():
    full = preset("full")
    assert full.kda_layers == tuple(i for i in range(45) if i % 4 != 3)
    assert full.mla_layers == tuple(range(3, 45, 4))
    assert (full.index_kpool, full.index_n_heads, full.dtype, full.num_nextn_predict_layers) == (4, 32, "bfloat16", 1)
    assert preset("pruned-4l").layer_types == full.layer_types[:4]
    assert preset("tiny").mla_layers == (2, 4)
    cfg = GlmConfig.from_hf_dict({"num_hidden_layers": 8, "index_topk_pattern": "FSFFFSFS",
                                  "linear_attn_config": {"num_heads": 8, "head_dim": 64, "gate_lower_bound": None}})
    assert cfg.indexer_types[:3] == ("full", "shared", "full") and cfg.linear_num_heads == 8
    assert cfg.linear_lower_bound == -5.0  # safe_gate defaults on
    with pytest.raises(ValueError, match="qk_rope_head_dim must be 0"):
        GlmConfig.from_hf_dict({"qk_rope_head_dim": 64})
    with pytest.raises(ValueError, match="multiple of index_kpool"):
        GlmConfig.from_hf_dict({"index_topk": 2048, "index_kpool": 3})


def test_pruned_layers_equal_full_layers():
    full, pruned = preset("full"), preset("pruned-4l")
    for name in ("layers.0.self_attn.forget_gate.A_log", "layers.3.self_attn.indexer.index_kpool_compress_ape",
                 "mtp.enorm.weight"):
        shape = tensor_shapes(pruned)[name]
        assert torch.equal(init_tensor(full, 7, name, shape), init_tensor(pruned, 7, name, shape))


def test_greedy_margin(hf_model, tiny_dir):
    """Top-1/top-2 logit gap at the last position of prompts of length 1..64 (8 random prompts each).

    The model is causal, so position n-1 of a 64-token prompt is the last position of its length-n
    prefix: one batched forward covers all lengths (checked on two prefixes)."""
    model, _ = hf_model
    lm_head = load_file(os.path.join(tiny_dir, "model.safetensors"))["lm_head.weight"]
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        hidden = model(input_ids=ids).last_hidden_state
        for n in (1, 37):
            prefix = model(input_ids=ids[:1, :n]).last_hidden_state[0, -1]
            assert torch.allclose(prefix, hidden[0, n - 1], atol=1e-4)
    top2 = (hidden @ lm_head.T).topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).flatten()
    assert (gaps > 1e-3).float().mean() >= 0.95, gaps.sort().values[:5]
