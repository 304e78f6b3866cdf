"""Time to first token on the bundled GLM runner: cold prefill against warm prefill from the memory and
LMDB tiers (restore + the uncached suffix), across prefix lengths, same run, same prompts. The warm run
uses a fresh device cache, so every hit comes from the store."""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from ...connectors.runner import RunnerConnector
from ...store import open_store
from ..verify import default_model_dir
from .common import machine

FULL_LENGTHS = [64, 256, 1024]
QUICK_LENGTHS = [64]


def _prefill_seconds(model, config, model_id, store, prompt: list[int], block: int) -> tuple[float, int, list]:
    from glm_integration.cache import PagedCache
    from glm_integration.engine import Engine

    engine = Engine(model, PagedCache(config, block, len(prompt) // block + 4, model_id=model_id))
    if store is not None:
        RunnerConnector(store, engine)
    request = engine.add(prompt, 1)
    engine.prefill(request)
    return request.prefill_seconds, request.loaded_tokens, request.output


def run(quick: bool = False, block_size: int = 16, repeats: int = 3, progress=None) -> dict:
    from glm_integration.loader import load_model

    torch.set_num_threads(1)
    config, model, model_id = load_model(default_model_dir("tiny"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        stores = {"memory": open_store("memory://?capacity=1GiB"), "lmdb": open_store(f"lmdb://{tmp}/db?capacity=1GiB")}
        for length in QUICK_LENGTHS if quick else FULL_LENGTHS:
            prompt = torch.randint(
                0, config.vocab_size, (length + 1,), generator=torch.Generator().manual_seed(length)
            ).tolist()
            cold = [_prefill_seconds(model, config, model_id, None, prompt, block_size) for _ in range(repeats)]
            row = {
                "prefix_tokens": length,
                "prompt_tokens": length + 1,
                "cold_ms": round(statistics.median(c[0] for c in cold) * 1e3, 2),
            }
            for name, store in stores.items():
                _prefill_seconds(model, config, model_id, store, prompt, block_size)  # save
                warm = [_prefill_seconds(model, config, model_id, store, prompt, block_size) for _ in range(repeats)]
                assert all(w[1] == length and w[2] == cold[0][2] for w in warm), "warm run did not hit or differs"
                row[f"warm_{name}_ms"] = round(statistics.median(w[0] for w in warm) * 1e3, 2)
                row[f"speedup_{name}"] = round(row["cold_ms"] / row[f"warm_{name}_ms"], 2)
            rows.append(row)
            if progress:
                progress(
                    f"[bench ttft] prefix {length}: cold {row['cold_ms']} ms, warm memory "
                    f"{row['warm_memory_ms']} ms, warm lmdb {row['warm_lmdb_ms']} ms"
                )
        for store in stores.values():
            store.close()
    return {
        "benchmark": "ttft",
        "engine": "bundled GLM runner (tiny, CPU, 1 thread)",
        "quick": quick,
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "block_size": block_size,
        "results": rows,
    }
