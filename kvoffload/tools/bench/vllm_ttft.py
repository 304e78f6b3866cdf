"""Time to first token in the real vLLM engine, on the CPU build or a CUDA GPU (`--device`): no connector,
KVOffloadConnector on the memory, LMDB and tiered stores, and the peers (vLLM's ExampleConnector on the
CPU; its OffloadingConnector and SimpleCPUOffloadConnector on a GPU, with CUDA graphs unless `eager`),
same model, same prompts, same run. One engine per
configuration, all up at once (one at a time for the Llama-3.1-8B shape, `--model llama-3.1-8b`, whose
engines do not fit the GPU side by side); every prompt is run alone with one output token on each engine in turn
(cold); then once more on the no-connector engine, served by its own prefix cache (`local`: the engine's
step time for the uncached suffix); then every engine's prefix cache is reset and the prompts run again
(warm: a prefix can now only come from the connector), `repeats` times. On a GPU the LMDB engine is then
restarted with the page cache dropped (`kvoffload_lmdb_restart`: warm from disk in a fresh process),
and a raw pinned host-to-device copy of each prefix's bytes is timed in this process: the warm-from-
memory target is 1.5 x (that copy + the local step). The first token of every phase must agree."""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
from typing import Any

import torch

from ..harness.vllm_engine import Engine, EngineRunError
from .common import drop_page_cache, machine
from .vllm_profiles import CPU, PEERS_ON_GPU, Profile, profile

BLOCK, MODEL = CPU.block, CPU.model  # the CPU profile's (other benchmarks and tests import them)
LENGTHS = {"cpu": ([256, 1024, 2048], [128]), "cuda": ([4096, 16384, 65536], [1024])}  # full, quick
TARGET_RATIO = 1.5


def connector_configs(tmp: str) -> dict[str, dict | None]:
    return CPU.connector_configs(tmp)


@contextlib.contextmanager
def engines(
    names,
    tmp: str,
    max_model_len: int,
    progress,
    in_process: bool = False,
    where: Profile = CPU,
    capacity: str = "2GiB",
    kv_bytes: int | None = None,
    optional=(),
):
    """The named configurations' engines, started side by side and all up, closed on exit. `kv_bytes`: the
    GPU KV cache of each (vLLM's memory profiling would see the other engines' memory). An `optional`
    engine that fails to start (a peer connector this vLLM build cannot run) is left out, said once."""
    model = f"{tmp}/model"
    if not os.path.isdir(model):  # written once per run (each group of engines after the first reuses it)
        where.write_model(model)
    configs = where.connector_configs(tmp, capacity)
    kwargs = dict(where.engine_kwargs, **({"kv_cache_memory_bytes": kv_bytes} if kv_bytes else {}))
    with contextlib.ExitStack() as stack:
        running = {}
        progress(f"starting {len(names)} engines: {', '.join(names)}")
        for name in names:
            running[name] = stack.enter_context(
                Engine(
                    model,
                    configs[name],
                    block_size=where.block,
                    max_model_len=max_model_len,
                    in_process=in_process,
                    dtype=where.dtype,
                    engine_kwargs=kwargs,
                    wait=False,
                )
            )
        for name, engine in list(running.items()):
            try:
                engine.ready()
            except EngineRunError as exc:
                if name not in optional:
                    raise
                del running[name]
                progress(f"the {name} engine did not start; left out: {str(exc)[-400:]}")
                continue
            progress(f"the {name} engine is up ({engine.startup_s:.0f} s)")
        yield running


def _raw_link_ms(nbytes: int, repeats: int = 5) -> float:
    """A raw pinned host -> device copy of `nbytes` (the link's speed, measured in this run), median ms."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def engine_groups(names: list[str], where: Profile) -> list[list[str]]:
    """The engines up together: all of them, or one at a time where they do not fit side by side."""
    return [[name] for name in names] if where.sequential else [list(names)]


def run(
    quick: bool = False,
    prompts_per_length: int | None = None,
    progress=None,
    device: str = "cpu",
    eager: bool = False,
    model: str = "small",
) -> dict:
    where = profile(device, eager, model)
    gpu = where.device == "cuda"
    lengths = LENGTHS[where.device][1 if quick else 0]
    per_length = prompts_per_length or (1 if quick or gpu else 3)
    repeats = 2 if gpu else 1
    block = where.block
    gen = torch.Generator().manual_seed(7)
    # prefix + half a block: every connector (the peers included) can serve exactly the prefix
    prompts = [
        torch.randint(3, 512, (n + block // 2,), generator=gen).tolist() for n in lengths for _ in range(per_length)
    ]
    say = progress or (lambda message: None)
    peers = list(PEERS_ON_GPU) if gpu else ["example_connector"]
    names = ["none", "kvoffload_memory", "kvoffload_lmdb", *(["kvoffload_tiered"] if gpu else []), *peers]
    measured: dict[str, dict[str, list[dict]]] = {name: {"cold": [], "warm": []} for name in names}
    measured["none"]["local"] = []
    stored = sum(len(p) for p in prompts) * where.kv_bytes_per_token
    capacity = f"{max(2, -(-stored * 5 // 4) >> 30)}GiB"  # every prefix fits, with room
    # the longest prompt and an eighth more: six engines share one GPU's memory
    kv_bytes = max(4 << 30, (max(lengths) + 2 * block) * where.kv_bytes_per_token * 9 // 8) if gpu else None
    startup: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvoffload-vllm-ttft-") as tmp:
        for group in engine_groups(names, where):
            with engines(
                group,
                tmp,
                max(lengths) + block,
                lambda m: say(f"[bench vllm-ttft] {m}"),
                where=where,
                capacity=capacity,
                kv_bytes=kv_bytes,
                optional=peers if gpu else (),
            ) as running:
                for prompt in prompts:
                    for name, engine in running.items():
                        measured[name]["cold"] += engine.call("ttft", prompts=[prompt])["rows"]
                    if "none" in running:
                        measured["none"]["local"] += running["none"].call("ttft", prompts=[prompt])["rows"]
                for _ in range(repeats):
                    for engine in running.values():
                        if not engine.call("reset")["ok"]:
                            raise AssertionError("an engine's prefix cache could not be reset")
                    for prompt in prompts:
                        for name, engine in running.items():
                            measured[name]["warm"] += engine.call("ttft", prompts=[prompt])["rows"]
                startup.update({name: round(engine.startup_s, 1) for name, engine in running.items()})
        names = [name for name in names if name in startup]  # a peer that did not start is left out
        if gpu:  # a fresh process warm from disk, the page cache dropped
            dropped = drop_page_cache()
            configs = where.connector_configs(tmp, capacity)
            with Engine(
                f"{tmp}/model",
                configs["kvoffload_lmdb"],
                block_size=block,
                dtype=where.dtype,
                max_model_len=max(lengths) + block,
                engine_kwargs=dict(where.engine_kwargs, kv_cache_memory_bytes=kv_bytes),
            ) as restarted:
                measured["kvoffload_lmdb_restart"] = {
                    "warm": restarted.call("ttft", prompts=prompts)["rows"],
                    "cold": measured["kvoffload_lmdb"]["cold"],
                }
            names.append("kvoffload_lmdb_restart")
            startup["page_cache"] = dropped
    rows = []
    for n in lengths:
        row: dict[str, Any] = {"prefix_tokens": n, "prompt_tokens": n + block // 2}
        # A warm run computes the suffix over restored KV, as vLLM's own prefix cache does: in bf16 its first
        # token is compared with that run's (a full prefill sums in another order and may break a near-tie).
        same_length = [r for r in measured["none"]["local" if gpu else "cold"] if r["prompt_tokens"] == n + block // 2]
        for name in names:
            cold, warm = (
                [r for r in measured[name][phase] if r["prompt_tokens"] == row["prompt_tokens"]]
                for phase in ("cold", "warm")
            )
            reference = same_length if name != "none" else cold
            if any(r["token"] != reference[j % len(reference)]["token"] for j, r in enumerate(warm)):  # prompt order
                raise AssertionError(f"{name}: warm first tokens differ from cold ones at prefix {n}")
            row[f"{name}_cold_ms"] = round(statistics.median(r["seconds"] for r in cold) * 1e3, 2)
            row[f"{name}_warm_ms"] = round(statistics.median(r["seconds"] for r in warm) * 1e3, 2)
            row[f"{name}_warm_cached_tokens"] = min(r["cached_tokens"] for r in warm)
        for name in names[1:]:
            row[f"{name}_speedup"] = round(row["none_cold_ms"] / row[f"{name}_warm_ms"], 2)
        if gpu:
            local = [r for r in measured["none"]["local"] if r["prompt_tokens"] == row["prompt_tokens"]]
            row["local_prefix_cache_ms"] = round(statistics.median(r["seconds"] for r in local) * 1e3, 2)
            row["prefix_bytes"] = n * where.kv_bytes_per_token
            row["raw_link_ms"] = round(_raw_link_ms(row["prefix_bytes"]), 2)
            row["target_ms"] = round(TARGET_RATIO * (row["raw_link_ms"] + row["local_prefix_cache_ms"]), 2)
            row["memory_of_target"] = round(row["kvoffload_memory_warm_ms"] / row["target_ms"], 3)
            row["memory_target_met"] = row["kvoffload_memory_warm_ms"] <= row["target_ms"]
        rows.append(row)
        say(
            f"[bench vllm-ttft] prefix {n}: no connector {row['none_cold_ms']} ms; warm: "
            + ", ".join(f"{k} {row[f'{k}_warm_ms']} ms" for k in names[1:])
        )
    return {
        "benchmark": "vllm-ttft",
        "quick": quick,
        "device": where.device,
        "machine": machine(),
        "engine": where.engine,
        "model": {
            "architecture": f"LlamaForCausalLM {where.dtype}, random weights",
            "kv_bytes_per_token": where.kv_bytes_per_token,
            **where.model,
        },
        "configs": names,
        "prompts_per_length": per_length,
        "warm_repeats": repeats,
        "startup_s": startup,
        **(
            {
                "target": {
                    "memory_warm_ms_max": f"{TARGET_RATIO} x (raw pinned H2D copy of the prefix's bytes "
                    "+ the no-connector engine's TTFT served by its own prefix cache)"
                }
            }
            if gpu
            else {}
        ),
        "results": rows,
    }
