"""What the connector costs when it finds nothing, in the real vLLM engine (the CPU build, or a CUDA GPU
with `--device cuda`: `vllm_profiles`): every prompt new, so each step pays the lookups and the saves of
new blocks and never a load. Target: step time within 2% of no connector (on a GPU measured in three
runs on the same engines, each run paired on its own).

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
from typing import Any
from unittest import mock

import torch

from .common import ENGINE_THREADS, machine
from .vllm_profiles import profile
from .vllm_ttft import engines

NAMES = ["none", "noop_connector", "kvoffload_memory", "kvoffload_lmdb", "kvoffload_tiered"]
OURS = ("kvoffload_memory", "kvoffload_lmdb", "kvoffload_tiered")
TARGET_PERCENT = 2.0  # step time with the connector (no hits) vs without, paired
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
        results[name] = {
            key: round(statistics.median(per_step(r, field) for r in measured), 3) for key, field in MEASURES.items()
        }
        results[name].update(
            batch_ms=round(statistics.median(r["seconds"] for r in measured) * 1e3, 1),
            steps_per_batch=statistics.median(r["steps"] for r in measured),
            connector_ms_per_step=round(statistics.median(per_step(r, "connector_seconds") for r in measured), 4),
        )

    def paired(name: str, base: str, field: str) -> float:
        return _percent(
            statistics.median(per_step(a, field) / per_step(b, field) for a, b in zip(rows[name], rows[base]))
        )

    others = [name for name in rows if name != "none"]
    base = results["none"]["step_ms"]
    batches = {
        name: {key: [round(per_step(r, field), 3) for r in measured] for key, field in MEASURES.items()}
        for name, measured in rows.items()
    }
    return {
        "results": results,
        "per_batch": batches,
        "connector_hooks_percent_of_step": {
            name: round(results[name]["connector_ms_per_step"] / base * 100, 2) for name in OURS
        },
        "overhead_percent": {name: paired(name, "none", "seconds") for name in others},
        "overhead_cpu_percent": {name: paired(name, "none", "thread_cpu_seconds") for name in others},
        "overhead_process_cpu_percent": {name: paired(name, "none", "process_cpu_seconds") for name in others},
        "overhead_unpaired_percent": {name: _percent(results[name]["step_ms"] / base) for name in others},
        "overhead_beyond_vllm_hooks_percent": {name: paired(name, "noop_connector", "seconds") for name in OURS},
    }


RUNS_ON_GPU = 3  # the whole paired measurement, repeated on the same engines (the target must hold in each)


def run(quick: bool = False, progress=None, device: str = "cpu", eager: bool = False) -> dict:
    where = profile(device, eager)
    gpu = where.device == "cuda"
    batches, batch_size, prompt_tokens, max_tokens = (
        (2, 2, 96, 8) if quick else (6, 4, 512, 32) if gpu else (24, 4, 512, 32)
    )
    runs = RUNS_ON_GPU if gpu and not quick else 1
    gen = torch.Generator().manual_seed(11)
    work = [
        [torch.randint(3, 512, (prompt_tokens,), generator=gen).tolist() for _ in range(batch_size)]
        for _ in range(batches * runs + 1)
    ]  # the first one warms every engine up, untimed
    say = progress or (lambda message: None)
    rows: list[dict[str, list[dict]]] = [{name: [] for name in NAMES} for _ in range(runs)]
    threads = {} if gpu else {"OMP_NUM_THREADS": ENGINE_THREADS}
    with (
        tempfile.TemporaryDirectory(prefix="kvoffload-overhead-") as tmp,
        mock.patch.dict(os.environ, threads),
    ):  # the engines inherit it
        with engines(
            NAMES,
            tmp,
            prompt_tokens + max_tokens + 64,
            lambda m: say(f"[bench overhead] {m}"),
            in_process=True,
            where=where,
            capacity="4GiB" if gpu else "2GiB",
            kv_bytes=4 << 30 if gpu else None,
        ) as running:
            for name in NAMES:  # the batch's shapes seen once (kernels' first-use set-up)
                running[name].call("steps", prompts=work[0], max_tokens=max_tokens)
            for i, batch in enumerate(work[1:]):
                order = NAMES[i % len(NAMES) :] + NAMES[: i % len(NAMES)]
                for name in order:
                    steps = running[name].call("steps", prompts=batch, max_tokens=max_tokens)
                    rows[i // batches][name].append(steps)
                run_index, batch_index = divmod(i, batches)
                say(f"[bench overhead] run {run_index + 1}/{runs}, batch {batch_index + 1}/{batches} on every engine")
    for run_rows in rows:
        for name, measured in run_rows.items():
            if any(r["cached_tokens"] for r in measured):
                raise AssertionError(f"{name}: a batch hit a cache; the overhead run must have no hits")
    summaries = [summarize(run_rows) for run_rows in rows]
    summary = summaries[0]
    for i, s in enumerate(summaries):
        say(
            f"[bench overhead] run {i + 1}: time in the connector's hooks per step, share of the step: "
            + ", ".join(f"{k} {v}%" for k, v in s["connector_hooks_percent_of_step"].items())
            + "; step time vs none (paired; wall / engine-thread CPU): "
            + ", ".join(f"{k} {v}% / {s['overhead_cpu_percent'][k]}%" for k, v in s["overhead_percent"].items())
        )
    extra: dict[str, Any] = {}
    if runs > 1:
        extra["runs"] = summaries
        extra["overhead_percent_per_run"] = {
            name: [s["overhead_percent"][name] for s in summaries] for name in summary["overhead_percent"]
        }
        extra["target"] = {
            "overhead_percent_max": TARGET_PERCENT,
            "met_in_every_run": {
                name: all(s["overhead_percent"][name] <= TARGET_PERCENT for s in summaries) for name in OURS
            },
        }
    return {
        "benchmark": "overhead",
        "quick": quick,
        "device": where.device,
        "machine": machine(),
        "engine": where.engine,
        "model": {"architecture": f"LlamaForCausalLM {where.dtype}, random weights", **where.model},
        "workload": {
            **({} if gpu else {"omp_num_threads": ENGINE_THREADS}),
            "batches": batches,
            "batch_size": batch_size,
            "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens,
            "runs": runs,
        },
        **summary,
        **extra,
    }
