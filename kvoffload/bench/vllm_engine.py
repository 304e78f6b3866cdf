"""Run the real vLLM engine (the CPU build here) in a child process and time it, for the benchmarks.

The parent (`run_engine`) writes a spec, starts `python -m kvoffload.bench.vllm_engine spec out`, and
reads the JSON the child leaves. The child builds one `vllm.LLM` and, per phase, either times each
prompt alone with one output token (`ttft`: time to first token of a lone request) or whole batches
while counting engine steps (`steps`: mean engine step time). Between phases the engine's own prefix
cache is reset, so any later hit comes from the KV connector."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


class EngineRunError(RuntimeError):
    pass


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    for key, value in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_NO_USAGE_STATS", "1"), ("DO_NOT_TRACK", "1"),
                       ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")):
        env.setdefault(key, value)
    return env


def run_engine(model_dir: str, kv_transfer_config: dict | None, phases: list[dict], *, block_size: int,
               max_model_len: int, dtype: str = "float32", timeout: float = 900) -> dict:
    """phases: [{"mode": "ttft", "prompts": [[ids]]} | {"mode": "steps", "batches": [[[ids]]],
    "max_tokens": n}]; returns {"phases": [...], "startup_s": s}."""
    spec = {"model": os.path.abspath(model_dir), "kv_transfer_config": kv_transfer_config, "phases": phases,
            "block_size": block_size, "max_model_len": max_model_len, "dtype": dtype}
    with tempfile.TemporaryDirectory(prefix="kvoffload-bench-") as tmp:
        spec_path, out_path, log_path = (os.path.join(tmp, n) for n in ("spec.json", "out.json", "child.log"))
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        with open(log_path, "wb") as log:
            proc = subprocess.run([sys.executable, "-m", "kvoffload.bench.vllm_engine", spec_path, out_path],
                                  stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env(),
                                  timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(out_path):
            with open(log_path, "rb") as f:
                tail = f.read().decode("utf-8", "replace")[-4000:]
            raise EngineRunError(f"vLLM engine run failed (exit {proc.returncode}):\n{tail}")
        with open(out_path) as f:
            return json.load(f)


def _child(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = dict(model=spec["model"], dtype=spec["dtype"], block_size=spec["block_size"],
                  max_model_len=spec["max_model_len"], enforce_eager=True, enable_prefix_caching=True,
                  skip_tokenizer_init=True, seed=0)
    if spec["kv_transfer_config"]:
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    started = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - started
    engine, steps = llm.llm_engine, [0]
    step = engine.step

    def counted_step(*args, **kw):
        steps[0] += 1
        return step(*args, **kw)

    engine.step = counted_step
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": [3, 4, 5, 6, 7]}], one, use_tqdm=False)  # warm-up
    results = []
    for phase in spec["phases"]:
        llm.reset_prefix_cache()
        if phase["mode"] == "ttft":
            rows = []
            for prompt in phase["prompts"]:
                t0 = time.perf_counter()
                (out,) = llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
                rows.append({"seconds": time.perf_counter() - t0, "prompt_tokens": len(prompt),
                             "cached_tokens": out.num_cached_tokens, "token": out.outputs[0].token_ids[0]})
            results.append({"mode": "ttft", "rows": rows})
        else:
            params = SamplingParams(temperature=0.0, max_tokens=phase["max_tokens"], ignore_eos=True,
                                    detokenize=False)
            rows = []
            for batch in phase["batches"]:
                llm.reset_prefix_cache()
                steps[0] = 0
                t0 = time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
                rows.append({"seconds": time.perf_counter() - t0, "steps": steps[0],
                             "cached_tokens": sum(o.num_cached_tokens for o in outs)})
            results.append({"mode": "steps", "rows": rows})
    with open(out_path, "w") as f:
        json.dump({"phases": results, "startup_s": startup}, f)


if __name__ == "__main__":
    _child(*sys.argv[1:3])
