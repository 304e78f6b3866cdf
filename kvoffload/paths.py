"""Where kvoffload keeps things by default, in one place: everything under the user cache directory
($XDG_CACHE_HOME, else ~/.cache), in `kvoffload/`."""

from __future__ import annotations

import os


def cache_dir() -> str:
    """kvoffload's directory in the user cache, read from the environment at each call."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvoffload")


def vllm_store_url() -> str:
    """The vLLM connector's store when kv_connector_extra_config names none."""
    return f"lmdb://{os.path.join(cache_dir(), 'vllm-store')}?capacity=16GiB"


def demo_store_url() -> str:
    """`kvoffload demo`'s store."""
    return f"lmdb://{os.path.join(cache_dir(), 'demo-store')}?capacity=1GiB"


def weight_digest_cache() -> str:
    """The weight files' digests, keyed by path, size and mtime (spec.identity)."""
    return os.path.join(cache_dir(), "weight-digests.json")


def preset_model_dir(preset: str) -> str:
    """A runner preset's checkpoint (seed 0), written once and reused."""
    return os.path.join(cache_dir(), "models", f"{preset}-seed0")


def bench_results_dir() -> str:
    """`kvoffload bench`'s results, unless --out names another folder."""
    return os.path.join(cache_dir(), "bench-results")
