"""Build a runnable model from a checkpoint directory, with an identity for the layout fingerprint:
pages computed with other weights must never be served, so the weights are part of the model id."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import struct

from .config import GlmConfig, ModelConfigError
from .model import GlmModel
from .weights import load_weights

_HASH_ALL_BELOW = 256 << 20  # hash every byte of small checkpoints; headers and sizes of large ones


def checkpoint_id(directory: str) -> str:
    """A deterministic id of the config and weights (same files -> same id on every machine)."""
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    digest = hashlib.blake2b(digest_size=16)
    with open(os.path.join(directory, "config.json"), "rb") as f:
        digest.update(json.dumps(json.load(f), sort_keys=True).encode())
    whole = sum(os.path.getsize(p) for p in files) <= _HASH_ALL_BELOW
    for path in files:
        digest.update(os.path.basename(path).encode())
        digest.update(os.path.getsize(path).to_bytes(8, "little"))
        with open(path, "rb") as f:
            if whole:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            else:  # the safetensors header: names, dtypes, shapes and offsets of every tensor
                size = f.read(8)
                if len(size) < 8:
                    raise ModelConfigError(f"{path}: not a safetensors file (shorter than its header)")
                digest.update(f.read(min(struct.unpack("<Q", size)[0], os.path.getsize(path))))  # garbage: no huge read
    return f"glm5next:{digest.hexdigest()}"


def load_model(directory: str, device: str = "cpu") -> tuple[GlmConfig, GlmModel, str]:
    """(config, model with its weights on `device`, model id)."""
    config = GlmConfig.from_pretrained(directory)
    weights = {name: t.to(device) for name, t in load_weights(directory, config=config).items()}
    return config, GlmModel(config, weights), checkpoint_id(directory)
