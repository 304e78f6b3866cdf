"""What the connector costs when it finds nothing, in the real vLLM engine (the CPU build, or a CUDA GPU
with `--device cuda`: `vllm_profiles`): every prompt new, so each step pays the lookups and the saves of
new blocks and never a load. Target: step time within 1% of no connector, the 95% interval of that
paired figure shown (on a GPU measured in three runs on the same engines, each run paired on its own).
A run takes batches until the interval of every kvoffload configuration is narrower than the target
(at least `MIN_BATCHES`, at most `MAX_BATCHES`): the figure then resolves the target, or says it cannot.

Measures, same batches, same run, engines in-process (scheduler and worker in one process):
- the time spent inside KVOffloadConnector's hooks (every one timed, scheduler and worker side) per
  engine step, as a share of the step time without a connector: the connector's own cost;
- engine step time with KVOffloadConnector (memory, LMDB, tiered), with a connector that does nothing
  (what vLLM's connector machinery costs by itself) and without one: wall time, CPU time of the engine's
  thread, CPU time of the whole engine process (the connector's background thread included).
All engines are up at once and take the batches in turn (the order rotating), so each batch runs on
every engine within one round. On a shared machine a slow minute lands on one round: compared with
the medians of each engine's own batches, the median over batches of each batch's ratio to the same
batch without a connector (paired) cancels it; its 95% interval is a bootstrap of that median over
the batches (`interval`, seeded: the same batches give the same interval). The engine thread's CPU
time leaves out the time it was descheduled, the bulk of the noise on a busy box; it also leaves out
the background thread's work, which the process CPU time counts.
Step time = a batch's `generate` time / the engine steps it took; one untimed batch first on every engine
(the first batch of a shape pays the CPU kernels' set-up, many times a step). Every engine computes on
one thread (`common.ENGINE_THREADS`), leaving a core to the background threads, as `bench stall` does."""

from __future__ import annotations

import os
import statistics
import tempfile
from typing import Any
from unittest import mock

import numpy as np
import torch

from .common import ENGINE_THREADS, machine
from .vllm_profiles import profile
from .vllm_ttft import engines

NAMES = ["none", "noop_connector", "kvoffload_memory", "kvoffload_lmdb", "kvoffload_tiered"]
OURS = ("kvoffload_memory", "kvoffload_lmdb", "kvoffload_tiered")
TARGET_PERCENT = 1.0  # step time with the connector (no hits) vs without, paired
# Batches per run: (at least, at most); more until every kvoffload row's interval is narrower than the target.
BATCHES = {"quick": (2, 2), "cuda": (8, 64), "cpu": (24, 24)}
RESAMPLES = 2000
MEASURES = {"step_ms": "seconds", "step_cpu_ms": "thread_cpu_seconds", "step_process_cpu_ms": "process_cpu_seconds"}


def _percent(ratio: float) -> float:
    return round((ratio - 1) * 100, 2)


def interval(ratios: list[float]) -> list[float]:
    """The 95% interval of the median of per-batch ratios (bootstrap, seeded), as percent over 1."""
    values = np.asarray(ratios, dtype=np.float64)
    if len(values) < 2:
        return [_percent(float(values[0]))] * 2 if len(values) else [0.0, 0.0]
    picks = np.random.default_rng(0).integers(0, len(values), (RESAMPLES, len(values)))
    low, high = np.percentile(np.median(values[picks], axis=1), [2.5, 97.5])
    return [_percent(float(low)), _percent(float(high))]


def _ratios(rows: dict[str, list[dict]], name: str, base: str, field: str) -> list[float]:
    """Batch i of `name` over batch i of `base` (both ran in the same round), per step."""
    return [(a[field] / a["steps"]) / (b[field] / b["steps"]) for a, b in zip(rows[name], rows[base])]


def _resolved(rows: dict[str, list[dict]]) -> bool:
    """Every kvoffload row's 95% interval is narrower than the target."""
    widths = (high - low for low, high in (interval(_ratios(rows, name, "none", "seconds")) for name in OURS))
    return all(width < TARGET_PERCENT for width in widths)


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
        return _percent(statistics.median(_ratios(rows, name, base, field)))

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
        "overhead_interval_percent": {name: interval(_ratios(rows, name, "none", "seconds")) for name in others},
        "target_resolved": _resolved(rows),
        "overhead_cpu_percent": {name: paired(name, "none", "thread_cpu_seconds") for name in others},
        "overhead_process_cpu_percent": {name: paired(name, "none", "process_cpu_seconds") for name in others},
        "overhead_unpaired_percent": {name: _percent(results[name]["step_ms"] / base) for name in others},
        "overhead_beyond_vllm_hooks_percent": {name: paired(name, "noop_connector", "seconds") for name in OURS},
    }


RUNS_ON_GPU = 3  # the whole paired measurement, repeated on the same engines (the target must hold in each)


def run(quick: bool = False, progress=None, device: str = "cpu", eager: bool = False) -> dict:
    where = profile(device, eager)
    gpu = where.device == "cuda"
    batch_size, prompt_tokens, max_tokens = (2, 96, 8) if quick else (4, 512, 32)
    least, most = BATCHES["quick" if quick else where.device]
    runs = RUNS_ON_GPU if gpu and not quick else 1
    gen = torch.Generator().manual_seed(11)

    def batch() -> list[list[int]]:  # new prompts: no hits
        return [torch.randint(3, 512, (prompt_tokens,), generator=gen).tolist() for _ in range(batch_size)]

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
            first = batch()
            for name in NAMES:  # the batch's shapes seen once (kernels' first-use set-up)
                running[name].call("steps", prompts=first, max_tokens=max_tokens)
            i = 0  # batches so far, every run's
            for run_index, run_rows in enumerate(rows):
                while len(run_rows["none"]) < least or (len(run_rows["none"]) < most and not _resolved(run_rows)):
                    prompts, order = batch(), NAMES[i % len(NAMES) :] + NAMES[: i % len(NAMES)]
                    for name in order:
                        run_rows[name].append(running[name].call("steps", prompts=prompts, max_tokens=max_tokens))
                    i += 1
                    say(f"[bench overhead] run {run_index + 1}/{runs}, batch {len(run_rows['none'])} on every engine")
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
            + "; step time vs none (paired; wall [95% interval] / engine-thread CPU): "
            + ", ".join(
                f"{k} {v}% {s['overhead_interval_percent'][k]} / {s['overhead_cpu_percent'][k]}%"
                for k, v in s["overhead_percent"].items()
            )
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
                name: all(s["overhead_interval_percent"][name][1] <= TARGET_PERCENT for s in summaries) for name in OURS
            },
            "resolved_in_every_run": all(s["target_resolved"] for s in summaries),
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
            "batches": [len(run_rows["none"]) for run_rows in rows],
            "batches_min_max": [least, most],
            "batch_size": batch_size,
            "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens,
            "runs": runs,
        },
        **summary,
        **extra,
    }
