"""Do other requests' decode steps stall while one request's long prefix is saved, or loaded? The real
vLLM engine (the CPU build, or a CUDA GPU with `--device cuda`: `vllm_profiles`): no connector,
KVOffloadConnector on LMDB and on tiered (memory + LMDB); on a GPU also on memory, and vLLM's
OffloadingConnector and SimpleCPUOffloadConnector, with CUDA graphs (vLLM's default) unless `eager`.
On a GPU the rounds form three runs, each judged on its own as well as pooled.

The connector runs its saves and loads on a background thread (`connectors.jobs`), so a long prefill's
saves, or a long prefix's load, should not lengthen the steps of requests that are only decoding.
Target: decode-step p99 with the connector <= 1.1x the p99 without one.

One scenario run (`vllm_engine._stall`, engines in-process so the scheduler's own output is visible):
a few decode requests (short prompts, greedy, no end) run until each has its first token, then
`quiet` steps; then one long prompt (one output token) joins them and `window` steps follow.
- save: the long prompt is new: the engine prefills it (one step at these sizes: vLLM's token budget
  per step is above the prompt) and the connector saves its pages.
- load: the same long prompt again after the engine's own prefix cache was reset (and its saves were
  reported done), so the prefix can only come from the connector: the request waits while its pages
  are loaded, then prefills the last half block. No connector: it is recomputed in full.
Measured: the wall time of every `LLMEngine.step()` (scheduler, forward, sampling, the connector's
hooks, output processing). A *decode-only* step is one whose scheduler output has tokens for the
decode requests only (one each) and none for the long request: its compute is the same on every
engine, so a longer step is a stall; steps that carry a prefill chunk of the long prompt are compute,
not stall, and are reported separately (all steps). The connector's saves of a chunk start after that
chunk's step, so they overlap the decode-only steps after it. Per engine and scenario, decode-only
steps of every round pooled: p50, p99 and their ratio to no connector's; and the decode-only steps
taken while the long request's transfers were in flight (before the scheduler released it: a saving
request is held until its saves are reported, a loading one waits until its pages are in). `quiet`
steps (before the long prompt) give each engine's plain decode step for reference. The engines are up side by side and
take the rounds in turn, order rotating, so machine noise hits each alike.

Each engine computes on one thread (OMP_NUM_THREADS=1), leaving a core to the connector's background
thread and the OS, as a GPU server leaves its CPU cores free of the forward. With two OpenMP threads on
a 2-core machine, any other runnable thread (another process, or the connector's own) preempts one of
them and the other spins at the barrier: steps jump from ~8 ms to ~200 ms, with no connector as well,
which measures the machine's contention, not the connector."""

from __future__ import annotations

import os
import statistics
import tempfile
from typing import Any
from unittest import mock

import torch

from .common import ENGINE_THREADS, machine
from .vllm_profiles import PEERS_ON_GPU, profile
from .vllm_ttft import engines

NAMES = ["none", "kvoffload_lmdb", "kvoffload_tiered"]
ON_GPU_TOO = ["kvoffload_memory", *PEERS_ON_GPU]  # the peers may not start on every vLLM build: optional
TARGET_P99_RATIO = 1.1


def _pct(values: list[float], q: int) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[q - 1]


def _summary(seconds: list[float]) -> dict:
    return {
        "p50_ms": round(_pct(seconds, 50) * 1e3, 3),
        "p99_ms": round(_pct(seconds, 99) * 1e3, 3),
        "steps": len(seconds),
    }


SLOWEST = 6  # decode-only steps itemised per engine and scenario: at 6 rounds of 48 steps, those above p99
SPENT = ("s", "cpu", "hooks", "gc")  # a step's wall time; its thread's CPU time, its connector hooks, its GC


def _spent_p50(steps: list[dict]) -> dict:
    """The median of each of a step's measures (`SPENT`), ms."""
    return {f"{k}_ms": round(statistics.median(s[k] for s in steps) * 1e3, 3) for k in SPENT}


RUNS_ON_GPU = 3  # the rounds split into this many runs, each judged on its own (and all pooled)


def _results(rows: dict, decoders: int, long_prefix: int) -> dict:
    """Per engine and scenario, the decode-only steps of the given rounds (see the module docstring)."""
    results: dict[str, dict[str, dict]] = {}
    for name in rows:
        results[name] = {}
        for scenario, measured in rows[name].items():
            steps = [s for m in measured for s in m["window"]]
            if any(s["other"] for s in steps) or any(s["decode"] != decoders for s in steps):
                raise AssertionError(f"{name} {scenario}: a window step did not schedule every decode request")
            decode_only = [s["s"] for s in steps if s["long"] == 0]
            cached = [m["long_cached_tokens"] for m in measured]
            expected = 0 if name in ("none", "noop_connector") or scenario == "save" else long_prefix
            if cached != [expected] * len(measured):
                raise AssertionError(f"{name} {scenario}: long prompt cached tokens {cached}, expected {expected}")
            in_flight = [s["s"] for m in measured for s in m["window"][: m["long_left_step"]] if s["long"] == 0]
            # where the slowest decode-only steps (those that make the p99) lost their time
            slowest = sorted(
                (
                    {**s, "round": r, "at": i}
                    for r, m in enumerate(measured)
                    for i, s in enumerate(m["window"], 1)
                    if s["long"] == 0
                ),
                key=lambda s: -s["s"],
            )[:SLOWEST]
            results[name][scenario] = {
                "decode_only": _summary(decode_only),
                "decode_only_in_flight": {
                    "steps": len(in_flight),
                    **(
                        {
                            "p50_ms": round(statistics.median(in_flight) * 1e3, 3),
                            "max_ms": round(max(in_flight) * 1e3, 3),
                        }
                        if in_flight
                        else {}
                    ),
                },
                "all_steps": _summary([s["s"] for s in steps]),
                "quiet_p50_ms": round(statistics.median(s["s"] for m in measured for s in m["quiet"]) * 1e3, 3),
                "quiet_p50_spent_ms": _spent_p50([s for m in measured for s in m["quiet"]]),
                "slowest_decode_only": [
                    {
                        "round": s["round"],
                        "step": s["at"],
                        **{f"{k}_ms": round(s[k] * 1e3, 3) for k in SPENT},
                        "hooks_over_0.1ms": s["by_hook"],
                    }
                    for s in slowest
                ],
                "long_prefill_steps": statistics.median(sum(1 for s in m["window"] if s["long"]) for m in measured),
                "long_finished_step_median": statistics.median(m["long_finished_step"] for m in measured),
                "long_released_step_max": max(m["long_left_step"] for m in measured),
                "long_cached_tokens": expected,
            }
    for name in list(rows)[1:]:
        for scenario, row in results[name].items():
            base = results["none"][scenario]["decode_only"]
            row["p50_ratio"] = round(row["decode_only"]["p50_ms"] / base["p50_ms"], 3)
            row["p99_ratio"] = round(row["decode_only"]["p99_ms"] / base["p99_ms"], 3)
            row["p99_target_met"] = row["p99_ratio"] <= TARGET_P99_RATIO
    return results


TRACED_ROUND = 1  # with `trace`: the round whose window each engine records (the second: the first warms engines up)


def run(quick: bool = False, progress=None, device: str = "cpu", eager: bool = False, trace: str | None = None) -> dict:
    """`trace`: a directory; each engine's window steps of one round (`TRACED_ROUND`), save and load, are
    recorded there by torch.profiler (`<engine>-<scenario>.json.gz`): where a slow step waited."""
    where = profile(device, eager)
    gpu = where.device == "cuda"
    block = where.block
    # long prompt: whole blocks + half a block (the half block is recomputed on a load)
    rounds, decoders, decode_tokens, long_blocks, quiet, window = (
        (2, 4, 48, 16, 8, 64) if quick else (6, 4, 48, 512, 8, 48) if gpu else (16, 4, 48, 124, 8, 64)
    )
    runs = RUNS_ON_GPU if gpu and not quick else 1
    long_tokens = long_blocks * block + block // 2
    max_model_len = long_tokens + 64 if quick else long_tokens + 1024 if gpu else where.model["max_position_embeddings"]
    gen = torch.Generator().manual_seed(23)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 512, (n,), generator=gen).tolist()

    say = progress or (lambda message: None)
    if trace:
        os.makedirs(trace, exist_ok=True)
    names = NAMES + (ON_GPU_TOO if gpu else [])
    rows: dict[str, dict[str, list]] = {name: {"save": [], "load": []} for name in names}
    threads = {} if gpu else {"OMP_NUM_THREADS": ENGINE_THREADS}
    stored = rounds * long_tokens * where.kv_bytes_per_token
    capacity = f"{max(2, -(-stored * 5 // 4) >> 30)}GiB"
    kv_tokens = long_tokens + decoders * (max_model_len + block)
    kv_bytes = max(4 << 30, kv_tokens * where.kv_bytes_per_token) if gpu else None
    with (
        tempfile.TemporaryDirectory(prefix="kvoffload-stall-") as tmp,
        mock.patch.dict(os.environ, threads),
        engines(
            names,
            tmp,
            max_model_len,
            lambda m: say(f"[bench stall] {m}"),
            in_process=True,
            where=where,
            capacity=capacity,
            kv_bytes=kv_bytes,
            optional=PEERS_ON_GPU,
        ) as running,
    ):
        names = [name for name in names if name in running]
        rows = {name: rows[name] for name in names}
        for r in range(rounds):
            long_prompt = tokens(long_tokens)
            order = names[r % len(names) :] + names[: r % len(names)]
            for scenario in ("save", "load"):
                decode_prompts = [tokens(decode_tokens) for _ in range(decoders)]  # new: no hits
                for name in order:
                    rows[name][scenario].append(
                        running[name].call(
                            "stall",
                            decode_prompts=decode_prompts,
                            long_prompt=long_prompt,
                            quiet_steps=quiet,
                            window_steps=window,
                            decode_max_tokens=max_model_len - decode_tokens,
                            trace=os.path.join(trace, f"{name}-{scenario}.json.gz")
                            if trace and r == TRACED_ROUND
                            else None,
                        )
                    )
                if scenario == "save":
                    for name in order:
                        if not running[name].call("reset")["ok"]:
                            raise AssertionError(f"{name}: the engine's prefix cache could not be reset")
            say(f"[bench stall] round {r + 1}/{rounds} on every engine")
        startup = {name: round(engine.startup_s, 1) for name, engine in running.items()}

    results = _results(rows, decoders, long_blocks * block)
    for name in names[1:]:
        for scenario, row in results[name].items():
            say(
                f"[bench stall] {name} {scenario}: decode-only p50 {row['decode_only']['p50_ms']} ms "
                f"({row['p50_ratio']}x), p99 {row['decode_only']['p99_ms']} ms ({row['p99_ratio']}x)"
            )
    extra: dict[str, Any] = {}
    if runs > 1:
        per = rounds // runs
        split = [
            _results(
                {n: {sc: m[i * per : (i + 1) * per] for sc, m in rows[n].items()} for n in names},
                decoders,
                long_blocks * block,
            )
            for i in range(runs)
        ]
        extra["p99_ratio_per_run"] = {
            f"{name} {sc}": [r[name][sc]["p99_ratio"] for r in split] for name in names[1:] for sc in ("save", "load")
        }
        extra["p99_target_met_in_every_run"] = {
            key: all(v <= TARGET_P99_RATIO for v in values) for key, values in extra["p99_ratio_per_run"].items()
        }
    label = where.engine + ", in-process" + ("" if gpu else f", OMP_NUM_THREADS={ENGINE_THREADS}")
    return {
        "benchmark": "stall",
        "quick": quick,
        "device": where.device,
        "machine": machine(),
        "engine": label,
        "model": {"architecture": f"LlamaForCausalLM {where.dtype}, random weights", **where.model},
        "workload": {
            "rounds": rounds,
            "runs": runs,
            "decode_requests": decoders,
            "decode_prompt_tokens": decode_tokens,
            "long_prompt_tokens": long_tokens,
            "long_prefix_tokens": long_blocks * block,
            "long_prefix_bytes": long_blocks * block * where.kv_bytes_per_token,
            "quiet_steps": quiet,
            "window_steps": window,
            "max_model_len": max_model_len,
        },
        "definition": (
            "decode-only step: an LLMEngine.step() whose scheduler output schedules one token for "
            "each decode request and none for the long request; p50/p99 of their wall times over "
            "the window steps after the long prompt is added, all rounds pooled; all_steps "
            "includes the steps that carry the long prompt's prefill chunks"
        ),
        "target": {"p99_ratio_max": TARGET_P99_RATIO, "of": "decode_only p99 vs no connector, same scenario"},
        "startup_s": startup,
        "results": results,
        **extra,
    }
