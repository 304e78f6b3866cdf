"""Deterministic random GLM-5.3-Flash checkpoints in HF format, for tests without the real weights.

Same (config, seed) gives byte-identical files. Each tensor draws from its own generator, seeded from
(seed, name), so a tensor's values do not depend on which other tensors exist: `pruned-4l` layers 0-3
equal `full` layers 0-3 for the same seed. Scales keep activations O(1) through the stack, and the
parameters HF initialises to constants (indexer pool ape/gate, router correction bias, KDA A_log and
dt_bias, hyper-connection base/scale) are randomised: constants there make scores tie, and ties make
greedy decoding and top-k selection fragile under reordering.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys

import torch

from .config import PRESETS, GlmConfig, preset
from .weights import INDEX_FILE, SINGLE_FILE, tensor_dtype, tensor_shapes

MAX_SHARD_BYTES = 4 << 30
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


def write_checkpoint(config: GlmConfig, seed: int, out_dir: str, max_shard_bytes: int = MAX_SHARD_BYTES) -> dict:
    """Write config.json and the weights (one `model.safetensors`, or shards plus an index when large).

    Existing `model*.safetensors` files and index in `out_dir` are replaced so no stale shard remains.
    Returns a summary: tensors, bytes, files.
    """
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    for old in os.listdir(out_dir):
        if old == INDEX_FILE or (old.startswith("model") and old.endswith(".safetensors")):
            os.remove(os.path.join(out_dir, old))

    shards = _plan_shards(config, max_shard_bytes)
    files = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    weight_map, total = {}, 0
    for file, entries in zip(files, shards):
        tensors = {}
        for name, shape in entries:
            t = init_tensor(config, seed, name, shape)
            tensors[_file_name(config, name)] = t
            total += t.numel() * t.element_size()
        weight_map.update((n, file) for n in tensors)
        tmp = os.path.join(out_dir, file + ".tmp")
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors writes 0600; give the usual umask-derived mode
        os.replace(tmp, os.path.join(out_dir, file))
        del tensors

    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config.to_hf_dict(), f, indent=2, sort_keys=True)
        f.write("\n")
    return {"tensors": len(weight_map), "bytes": total, "files": files}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m glm_integration.checkpoint", description="Write a deterministic random GLM-5.3-Flash checkpoint."
    )
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--force", action="store_true", help="allow the multi-GB presets (pruned-4l, full)")
    args = parser.parse_args(argv)

    config = preset(args.preset)
    if args.preset != "tiny" and not args.force:
        size = sum(math.prod(s) * tensor_dtype(config, n).itemsize for n, s in tensor_shapes(config).items())
        print(f"refusing: preset {args.preset} is {size / 2**30:.1f} GiB; pass --force to write it", file=sys.stderr)
        return 2
    summary = write_checkpoint(config, args.seed, args.out)
    print(
        f"wrote {args.preset} seed={args.seed}: {summary['tensors']} tensors, "
        f"{summary['bytes'] / 2**20:.1f} MiB in {len(summary['files'])} file(s) -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
