"""Prefetch in the real vLLM engine (the CPU build here): the time to first token of a request that waits
in vLLM's queue while its prefix lives on LMDB only, with and without prefetch, and without a connector
(recompute), same model, same prompts, same run.

Set-up: one engine writes every measured prompt's pages through `tiered://` (memory in front of LMDB) and
exits (its write-behind flushed); each measured engine then starts on its own copy of that LMDB store:
a restarted engine, memory tier empty. One request at a time (`max_num_seqs=1`): per round, a short new
prompt starts decoding FIRST_TOKENS tokens, the measured prompt is added as soon as it runs and waits
in the queue behind it; the page cache of the engine's LMDB file is dropped just before (no root
needed: `posix_fadvise`), so without prefetch its load reads the disk. Engines take the rounds in turn,
order rotating. Reported, medians over rounds:
- `ttft_s`: from adding the measured prompt to its first token (includes waiting for the slot);
- `after_slot_s`: from the moment the running request finished to that first token: the load (or the
  prefill) and the step that computes the first token -- what prefetch can shorten;
- the store's counters: pages prefetched, memory and disk hits.
Baseline in the same run: a raw sequential read of as many bytes as one prefix (page cache dropped)."""

from __future__ import annotations

import contextlib
import shutil
import statistics
import tempfile

import torch

from ..harness.vllm_engine import Engine
from .common import machine
from .datapath import _drop_file_cache, _raw_read, _raw_write
from .vllm_models import kv_bytes_per_token, llama_sizes, tiny_llama

BLOCK = 32
# Wide KV (8 KV heads of 128, 4 layers, float32): 32 KiB per token, so a prefix is tens of MB and its
# load is visible beside a tiny model's compute.
MODEL = llama_sizes(hidden=256, intermediate=512, layers=4, heads=8, kv_heads=8, head_dim=128, positions=4096)
NAMES = ("none", "tiered_no_prefetch", "tiered_prefetch")


def _connector(store: str, **extra) -> dict:
    return {
        "kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": "kvoffload.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": store, **extra},
    }


def _tiered(directory: str) -> str:
    return f"tiered://?memory=512MiB&lmdb={directory}&lmdb_capacity=1GiB"


def run(quick: bool = False, progress=None) -> dict:
    rounds, prefix_tokens, first_tokens = (2, 512, 16) if quick else (6, 2048, 48)
    say = progress or (lambda message: None)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (prefix_tokens + BLOCK // 2,), generator=gen).tolist() for _ in range(rounds)]
    firsts = [[torch.randint(3, 512, (48,), generator=gen).tolist() for _ in range(rounds)] for _ in NAMES]
    max_len = prefix_tokens + BLOCK + 64
    rows: dict[str, list[dict]] = {name: [] for name in NAMES}
    with tempfile.TemporaryDirectory(prefix="kvoffload-prefetch-") as tmp:
        model = tiny_llama(f"{tmp}/model", **MODEL)
        say(f"[bench prefetch] writing {rounds} prefixes of {prefix_tokens} tokens to LMDB")
        with Engine(model, _connector(_tiered(f"{tmp}/written")), block_size=BLOCK, max_model_len=max_len) as writer:
            writer.call("ttft", prompts=prompts)
        stores = {name: f"{tmp}/{name}" for name in NAMES[1:]}
        for directory in stores.values():
            shutil.copytree(f"{tmp}/written", directory)
        prefix_bytes = prefix_tokens * kv_bytes_per_token(MODEL, 4)  # float32
        configs = {
            "none": None,
            "tiered_no_prefetch": _connector(_tiered(stores["tiered_no_prefetch"]), prefetch_bytes="0"),
            "tiered_prefetch": _connector(_tiered(stores["tiered_prefetch"])),
        }
        with contextlib.ExitStack() as stack:
            engines = {}
            for name in NAMES:
                say(f"[bench prefetch] starting the {name} engine")
                engines[name] = stack.enter_context(
                    Engine(
                        model,
                        configs[name],
                        block_size=BLOCK,
                        max_model_len=max_len,
                        in_process=True,
                        engine_kwargs={"max_num_seqs": 1},
                    )
                )
            for i, prompt in enumerate(prompts):
                for k in range(len(NAMES)):
                    n = (i + k) % len(NAMES)
                    name = NAMES[n]
                    config = configs[name]
                    store = {"store": config["kv_connector_extra_config"]["store"]} if config else {}
                    if name in stores:
                        _drop_file_cache(f"{stores[name]}/data.mdb")
                    rows[name].append(
                        engines[name].call(
                            "queued",
                            first=firsts[n][i],
                            first_max_tokens=first_tokens,
                            prompt=prompt,
                            max_tokens=1,
                            **store,
                        )
                    )
                say(f"[bench prefetch] round {i + 1}/{rounds} on every engine")
        _raw_write(tmp, prefix_bytes)
        raw_read_s = _raw_read(tmp, prefix_bytes)
    tokens = {name: [r["tokens"] for r in measured] for name, measured in rows.items()}
    if any(t != tokens["none"] for t in tokens.values()):
        raise AssertionError("a connector engine's first tokens differ from the recomputed ones")
    results = {}
    for name, measured in rows.items():
        cached = [r["num_cached_tokens"] for r in measured]
        if name != "none" and min(cached) < prefix_tokens:
            raise AssertionError(f"{name}: a measured prompt did not get its whole prefix from the connector: {cached}")
        counters = (
            {k: sum(r["store"].get(k, 0) for r in measured) for k in ("prefetched", "memory_hits", "promotions")}
            if name != "none"
            else {}
        )
        results[name] = {
            "ttft_ms": round(statistics.median(r["ttft_s"] for r in measured) * 1e3, 1),
            "after_slot_ms": round(statistics.median(r["ttft_s"] - r["first_finished_s"] for r in measured) * 1e3, 1),
            "cached_tokens": statistics.median(cached),
            **counters,
        }
    ratio = results["tiered_prefetch"]["after_slot_ms"] / results["tiered_no_prefetch"]["after_slot_ms"]
    after = ", ".join(f"{k} {v['after_slot_ms']} ms" for k, v in results.items())
    say(f"[bench prefetch] after the slot freed: {after}; prefetch / no prefetch = {ratio:.2f}")
    return {
        "benchmark": "prefetch",
        "quick": quick,
        "machine": machine(),
        "workload": {
            "rounds": rounds,
            "prefix_tokens": prefix_tokens,
            "first_max_tokens": first_tokens,
            "block_size": BLOCK,
            "model": MODEL,
            "prefix_bytes_on_disk": prefix_bytes,
        },
        "raw_cold_read_ms": round(raw_read_s * 1e3, 1),
        "raw_cold_read_GBps": round(prefix_bytes / raw_read_s / 1e9, 3),
        "prefetch_vs_no_prefetch_after_slot": round(ratio, 3),
        "results": results,
    }
