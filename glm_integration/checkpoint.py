"""Deterministic random GLM-5.3-Flash checkpoints, for tests without the real weights.

Same (config, seed) gives byte-identical files. Each tensor draws from its own generator, seeded from
(seed, name), so a tensor's values do not depend on which other tensors exist: `pruned-4l` layers 0-3
equal `full` layers 0-3 for the same seed. Scales keep activations O(1) through the stack, and the
parameters HF initialises to constants (indexer pool ape/gate, router correction bias, KDA A_log and
dt_bias, hyper-connection base/scale) are randomised: constants there make scores tie, and ties make
greedy decoding and top-k selection fragile under reordering.

Two formats hold the same values. `hf` is transformers' `Glm5NextTextModel` state dict plus `lm_head`.
`vllm` is the release spelling that vLLM's own `glm5next` model loads (architecture
`Glm5NextForCausalLM`): `model.` prefixes, experts one by one (`mlp.experts.E.gate_proj.weight` ...),
the KDA conv as `q_conv1d`/`k_conv1d`/`v_conv1d` [C, 1, K], KDA gate tensors directly under
`self_attn.`, hyper-connections as `hc_attn_*`/`hc_ffn_*`; its config.json spells MLA layers
`full_attention` (accepted by transformers before and after the `indexed_attention` rename) and adds
the keys vLLM reads that transformers does not define (`mhc`, `mla_use_nope`, `topk_method`,
`scoring_func`, `indexer_rope_interleave`, `moe_router_dtype`). Tensor dtypes are the HF format's in both
(vLLM casts on load), so `weights.load_weights` returns the same tensors from either directory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys

import torch

from .config import MLA, PRESETS, GlmConfig, ModelConfigError, preset
from .weights import _RENAMES, INDEX_FILE, SINGLE_FILE, tensor_dtype, tensor_shapes

MAX_SHARD_BYTES = 4 << 30
UNFORCED_BYTES = 2 << 30  # the CLI writes bigger checkpoints only with --force
FORMATS = ("hf", "vllm")
VLLM_ARCHITECTURE = "Glm5NextForCausalLM"  # vLLM's registry: the text-only glm5next model
# Config keys vLLM's glm5next reads as attributes that transformers' Glm5NextTextConfig does not define;
# the values are what this model computes (NoPE MLA, sigmoid routing with a correction bias, fp32 router).
VLLM_CONFIG_KEYS = {
    "mla_use_nope": True,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "indexer_rope_interleave": True,  # inert: the indexer has no RoPE part (qk_rope_head_dim 0)
    "moe_router_dtype": "float32",
}
VLLM_MLA_LAYER_TYPE = "full_attention"
_CHUNK_ELEMENTS = 1 << 24  # generate big tensors in row blocks so bf16 checkpoints need no fp32 copy
_NORM_SUFFIXES = ("norm.weight", "layernorm.weight", "enorm.weight", "hnorm.weight")


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _draw(shape, gen, kind: str, a: float, b: float, dtype: torch.dtype) -> torch.Tensor:
    """normal(a, b) or uniform(a, b), filled in fixed row blocks and cast per block."""
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(shape[0], -1) if len(shape) > 1 else out.view(1, -1)
    rows = max(1, _CHUNK_ELEMENTS // max(1, flat.shape[1]))
    for start in range(0, flat.shape[0], rows):
        block = torch.empty(flat[start : start + rows].shape, dtype=torch.float32)
        if kind == "normal":
            block.normal_(a, b, generator=gen)
        else:
            block.uniform_(a, b, generator=gen)
        flat[start : start + rows] = block.to(dtype)
    return out


def init_tensor(config: GlmConfig, seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The value of one named tensor: a pure function of (seed, name, shape, dtype)."""
    gen, dtype, H = _generator(seed, name), tensor_dtype(config, name), config.hidden_size
    leaf = name.rsplit(".", 1)[-1]
    if name == "embed_tokens.weight":
        return _draw(shape, gen, "normal", 0.0, 1.0, dtype)
    if name == "lm_head.weight":  # logits with std ~4: top-1/top-2 gaps rarely under 1e-3
        return _draw(shape, gen, "normal", 0.0, 4.0 / math.sqrt(H), dtype)
    if name.endswith(_NORM_SUFFIXES):
        return _draw(shape, gen, "uniform", 0.9, 1.1, dtype)
    if name.endswith("k_norm.bias"):
        return _draw(shape, gen, "normal", 0.0, 0.1, dtype)
    if leaf == "A_log":  # decay rate exp(A_log) in [0.37, 1.65]
        return _draw(shape, gen, "uniform", -1.0, 0.5, dtype)
    if leaf == "dt_bias":  # per-channel decay from ~0.99 to ~0.3 per token: KDA state carries real memory
        return _draw(shape, gen, "uniform", -5.0, -1.0, dtype)
    if leaf == "index_kpool_compress_ape":
        return _draw(shape, gen, "normal", 0.0, 1.0, dtype)
    if leaf == "e_score_correction_bias":
        return _draw(shape, gen, "normal", 0.0, 0.1, dtype)
    if leaf == "base":  # hyper-connection pre/post/comb biases
        return _draw(shape, gen, "normal", 0.0, 0.5, dtype)
    if leaf == "scale":
        return _draw(shape, gen, "uniform", 0.5, 1.5, dtype)
    if len(shape) >= 2:
        # Projections (incl. indexer gate, conv taps, stacked experts): fan-in is the last dimension.
        return _draw(shape, gen, "normal", 0.0, 1.0 / math.sqrt(shape[-1]), dtype)
    raise ValueError(f"no init rule for {name} {shape}")


def _file_name(config: GlmConfig, name: str) -> str:
    """HF text-model names; the MTP layer is stored as `layers.<num_hidden_layers>.` like the release."""
    if name.startswith("mtp."):
        return f"layers.{config.num_hidden_layers}.{name[4:]}"
    return name


_HC = (".attn_hc.", ".ffn_hc.")


def _check_vllm(config: GlmConfig) -> None:
    """What vLLM's glm5next cannot represent with these weights."""
    shared = [i for i in config.mla_layers if config.indexer_types[i] != "full"]
    if shared:  # vLLM gives every MLA layer its own indexer; shared layers have no indexer weights here
        raise ModelConfigError(f"format 'vllm' needs indexer_types 'full' on every MLA layer; shared: {shared}")
    if config.n_shared_experts == 0:
        raise ModelConfigError("format 'vllm' needs n_shared_experts >= 1")


def vllm_config_dict(config: GlmConfig, mhc: bool = True) -> dict:
    """config.json for vLLM's glm5next: the HF text config, MLA layers spelled `full_attention`, the
    glm5next architecture and the keys vLLM reads beyond transformers' config (`mhc` among them)."""
    _check_vllm(config)
    d = config.to_hf_dict()
    d["layer_types"] = [VLLM_MLA_LAYER_TYPE if t == MLA else t for t in d["layer_types"]]
    d.update(architectures=[VLLM_ARCHITECTURE], model_type="glm5_next_text", mhc=bool(mhc), **VLLM_CONFIG_KEYS)
    return d


def release_tensors(config: GlmConfig, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One runner (HF) tensor as the release-format tensors vLLM loads; the inverse of the renames and
    fusions `weights.load_weights` applies."""
    if name == "lm_head.weight":
        return [(name, tensor)]
    file = "model." + _file_name(config, name)
    if file.endswith(".mlp.experts.gate_up_proj"):  # [E, 2I, H], [gate | up] along dim 1
        base, inter = file.rsplit(".", 1)[0], tensor.shape[1] // 2
        return [
            (f"{base}.{e}.{proj}.weight", part.clone())
            for e in range(tensor.shape[0])
            for proj, part in (("gate_proj", tensor[e, :inter]), ("up_proj", tensor[e, inter:]))
        ]
    if file.endswith(".mlp.experts.down_proj"):  # [E, H, I]
        base = file.rsplit(".", 1)[0]
        return [(f"{base}.{e}.down_proj.weight", tensor[e].clone()) for e in range(tensor.shape[0])]
    if file.endswith(".self_attn.conv1d.weight"):  # [3C, 1, K] -> q, k, v convs of [C, 1, K]
        base = file.removesuffix("conv1d.weight")
        return [(f"{base}{x}_conv1d.weight", part.clone()) for x, part in zip("qkv", tensor.chunk(3, dim=0))]
    for release, hf in _RENAMES:
        file = file.replace(hf, release)
    return [(file, tensor)]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _plan_shards(config: GlmConfig, max_shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    shards: list[list] = [[]]
    size = 0
    for name, shape in tensor_shapes(config).items():
        nbytes = math.prod(shape) * tensor_dtype(config, name).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def checkpoint_bytes(config: GlmConfig) -> int:
    return sum(math.prod(s) * tensor_dtype(config, n).itemsize for n, s in tensor_shapes(config).items())


def write_checkpoint(
    config: GlmConfig,
    seed: int,
    out_dir: str,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    format: str = "hf",
    mhc: bool = True,
    progress=None,
) -> dict:
    """Write config.json and the weights (one `model.safetensors`, or shards plus an index when large).

    `format`: "hf" (transformers' names) or "vllm" (the release names vLLM's glm5next loads; same
    values). `mhc=False` (vllm only) writes `"mhc": false` and no hyper-connection tensors, the
    variant vLLM runs without hyper-connections; the runner cannot load that one.
    Existing `model*.safetensors` files and index in `out_dir` are replaced so no stale shard remains.
    `progress(message)` hears of each file written when there are several. Returns a summary: tensors,
    bytes, files.
    """
    from safetensors.torch import save_file

    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if format == "hf" and not mhc:
        raise ValueError("mhc=False is only for format 'vllm'")
    hf_config = config.to_hf_dict() if format == "hf" else vllm_config_dict(config, mhc)
    os.makedirs(out_dir, exist_ok=True)
    for old in os.listdir(out_dir):
        if old == INDEX_FILE or (old.startswith("model") and old.endswith(".safetensors")):
            os.remove(os.path.join(out_dir, old))

    shards = _plan_shards(config, max_shard_bytes)
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    total = 0
    for file, entries in zip(files, shards):
        tensors = {}
        for name, shape in entries:
            if not mhc and any(h in "." + name for h in _HC):
                continue
            t = init_tensor(config, seed, name, shape)
            parts = [(_file_name(config, name), t)] if format == "hf" else release_tensors(config, name, t)
            del t
            for file_name, part in parts:
                tensors[file_name] = part
                total += part.numel() * part.element_size()
        weight_map.update((n, file) for n in tensors)
        tmp = os.path.join(out_dir, file + ".tmp")
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors writes 0600; give the usual umask-derived mode
        os.replace(tmp, os.path.join(out_dir, file))
        del tensors
        if progress and len(files) > 1:
            progress(f"checkpoint: {file} written ({total / 2**30:.1f} of {checkpoint_bytes(config) / 2**30:.1f} GiB)")

    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
        f.write("\n")
    return {"tensors": len(weight_map), "bytes": total, "files": files}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m glm_integration.checkpoint",
        description="Write a deterministic random GLM-5.3-Flash checkpoint.",
    )
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="hf",
        help="hf: transformers' names; vllm: the release names vLLM's glm5next loads (same values)",
    )
    parser.add_argument("--no-mhc", action="store_true", help='vllm format: "mhc": false, no hyper-connection tensors')
    parser.add_argument(
        "--force",
        action="store_true",
        help=f"allow presets over {UNFORCED_BYTES >> 30} GiB (pruned-4l, full); tiny and vllm-4l need none",
    )
    args = parser.parse_args(argv)
    if args.no_mhc and args.format != "vllm":
        parser.error("--no-mhc needs --format vllm")

    config = preset(args.preset)
    size = checkpoint_bytes(config)
    if size > UNFORCED_BYTES and not args.force:
        print(f"refusing: preset {args.preset} is {size / 2**30:.1f} GiB; pass --force to write it", file=sys.stderr)
        return 2
    try:
        summary = write_checkpoint(config, args.seed, args.out, format=args.format, mhc=not args.no_mhc)
    except ModelConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.preset} ({args.format}) seed={args.seed}: {summary['tensors']} tensors, "
        f"{summary['bytes'] / 2**20:.1f} MiB in {len(summary['files'])} file(s) -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
