"""The child's side of `vllm_engine.Engine`: starts `vllm.LLM`, then answers the commands listed in
`vllm_engine`'s docstring, one JSON reply per command on the private pipe."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any

HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "build_connector_worker_meta",
    "get_kv_connector_stats",
    "bind_connector_metadata",
    "clear_connector_metadata",
)


def _time_connector_hooks(kv_transfer_config: dict | None) -> dict[str, float]:
    """Wrap every hook of the configured connector class with a timer; returns the running seconds per
    hook, and in all under "total". A hook called from another (request_finished_all_groups ->
    request_finished) is inside the outer one's time, so only the outermost call counts."""
    import functools
    import importlib

    spent, depth = {"total": 0.0}, [0]
    if not kv_transfer_config or "kv_connector_module_path" not in kv_transfer_config:
        return spent
    module = importlib.import_module(kv_transfer_config["kv_connector_module_path"])
    cls = getattr(module, kv_transfer_config["kv_connector"])
    for name in HOOKS:
        fn = getattr(cls, name, None)
        if fn is None:
            continue

        def timed(*args, __fn=fn, __name=name, **kwargs):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return __fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                depth[0] -= 1
                if depth[0] == 0:
                    spent["total"] += elapsed
                    spent[__name] = spent.get(__name, 0.0) + elapsed

        setattr(cls, name, functools.wraps(fn)(timed))
    return spent


@contextlib.contextmanager
def _traced(path: str | None):
    """With a `path`: torch.profiler over the block (every thread's CUDA calls, the device's kernels and
    copies per stream), written there as a gzipped Chrome trace (chrome://tracing, Perfetto)."""
    if not path:
        yield
        return
    import torch
    import torch.profiler as tp

    activities = [tp.ProfilerActivity.CPU, *([tp.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])]
    with tp.profile(activities=activities) as profiler:
        yield
    profiler.export_chrome_trace(path)


def _stall(llm, command: dict, hook_seconds: dict[str, float]) -> dict:
    """Decode requests (greedy, no end) are started and stepped until each has its first token, then
    `quiet_steps` more; then the long prompt (one output token) is added and `window_steps` steps follow.
    Each of those steps: its wall time (`LLMEngine.step`, perf_counter), the long request's scheduled
    tokens and the number of decode requests scheduled (from the scheduler's own output), and where its
    time went: the calling thread's CPU time (the rest it waited: for the GIL, or blocked), the time in
    the connector's hooks (`hook_seconds`, ours only; each hook's above 0.1 ms in "by_hook") and in
    Python's garbage collector; with "trace"
    (a path), the window's steps under torch.profiler (`_traced`). Then stepping
    goes on until the long request has left the scheduler (a connector holds a finished request until
    its saves are reported), the decode requests are aborted and the engine is drained."""
    import gc

    import torch
    from vllm import SamplingParams

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # VLLM_ENABLE_V1_MULTIPROCESSING=0
    seen: list[dict] = []
    schedule = scheduler.schedule
    collecting = [0.0, 0.0]  # the collector's total seconds, the running collection's start

    def timed_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collecting[1] = time.perf_counter()
        else:
            collecting[0] += time.perf_counter() - collecting[1]

    def recorded(*args, **kw):
        out = schedule(*args, **kw)
        seen.append(dict(out.num_scheduled_tokens))
        return out

    def step() -> tuple[dict, dict, list]:
        seen.clear()
        hooks, collected, cpu = dict(hook_seconds), collecting[0], time.thread_time()
        t0 = time.perf_counter()
        with torch.profiler.record_function("stall step") if tracing_steps else contextlib.nullcontext():
            outs = engine.step()
        spent = {
            "s": time.perf_counter() - t0,
            "cpu": time.thread_time() - cpu,
            "hooks": hook_seconds["total"] - hooks["total"],
            "by_hook": {
                name: round(1e3 * (seconds - hooks.get(name, 0.0)), 3)
                for name, seconds in hook_seconds.items()
                if name != "total" and seconds - hooks.get(name, 0.0) > 1e-4
            },
            "gc": collecting[0] - collected,
        }
        return spent, (seen[0] if seen else {}), outs

    tag = f"stall{time.monotonic_ns()}"
    scheduler.schedule = recorded
    gc.callbacks.append(timed_gc)
    tracing = contextlib.ExitStack()  # the window's steps (with "trace"), each marked "stall step"
    tracing_steps = False
    try:
        decode = SamplingParams(
            temperature=0.0, max_tokens=command.get("decode_max_tokens", 1024), ignore_eos=True, detokenize=False
        )
        ids = {
            engine.add_request(f"{tag}-d{i}", {"prompt_token_ids": p}, decode)
            for i, p in enumerate(command["decode_prompts"])
        }
        started: set[str] = set()
        while len(started) < len(ids):
            _, _, outs = step()
            started |= {o.request_id for o in outs if o.outputs and o.outputs[0].token_ids}

        def row(spent: dict, tokens: dict) -> dict:
            return {
                **spent,
                "long": tokens.get(long_id, 0),
                "decode": sum(1 for r in tokens if r in ids),
                "other": sum(1 for r in tokens if r not in ids and r != long_id),
            }

        long_id = None
        quiet = [row(*step()[:2]) for _ in range(command["quiet_steps"])]
        long_id = engine.add_request(
            f"{tag}-long",
            {"prompt_token_ids": command["long_prompt"]},
            SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False),
        )
        window, finished_at, left_at, cached = [], None, None, None
        n = 0
        tracing.enter_context(_traced(command.get("trace")))
        tracing_steps = bool(command.get("trace"))
        while n < command["window_steps"] or left_at is None:
            spent, tokens, outs = step()
            n += 1
            if n <= command["window_steps"]:
                window.append(row(spent, tokens))
            for o in outs:
                if o.request_id == f"{tag}-long" and o.finished:
                    finished_at, cached = n, o.num_cached_tokens
            if finished_at is not None and left_at is None and long_id not in scheduler.requests:
                left_at = n
            if n > 100_000:
                raise RuntimeError("the long request never left the scheduler")
            if n == command["window_steps"]:
                tracing.close()
                tracing_steps = False
        engine.abort_request([f"{tag}-d{i}" for i in range(len(ids))])
        while scheduler.has_requests() or engine.has_unfinished_requests():
            engine.step()
    finally:
        tracing.close()
        scheduler.schedule = schedule
        gc.callbacks.remove(timed_gc)
    return {
        "quiet": quiet,
        "window": window,
        "long_finished_step": finished_at,
        "long_left_step": left_at,
        "long_cached_tokens": cached,
    }


def _queued(llm, command: dict) -> dict:
    """`first` is added and stepped until it has its first token; then `prompt` is added, and the engine
    stepped until both finished: the time from adding `prompt` to its first token, its tokens and
    cached tokens, and the store's counters (`shared_store(command["store"])`, the worker's own store
    in an in-process engine; none without "store") as deltas over those steps."""
    from vllm import SamplingParams

    from kvoffload.store import shared_store

    engine, tag = llm.llm_engine, f"queued{time.monotonic_ns()}"

    def params(n: int):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    engine.add_request(f"{tag}-first", {"prompt_token_ids": command["first"]}, params(command["first_max_tokens"]))
    while not any(o.outputs and o.outputs[0].token_ids for o in engine.step()):
        pass

    def stats() -> dict[str, Any]:
        return shared_store(command["store"]).stats() if command.get("store") else {}

    before = stats()
    added = time.perf_counter()
    engine.add_request(f"{tag}-queued", {"prompt_token_ids": command["prompt"]}, params(command["max_tokens"]))
    ttft = tokens = cached = first_done = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == f"{tag}-first" and o.finished:
                first_done = time.perf_counter() - added
            if o.request_id != f"{tag}-queued":
                continue
            if ttft is None and o.outputs and o.outputs[0].token_ids:
                ttft = time.perf_counter() - added
            if o.finished:
                tokens, cached = list(o.outputs[0].token_ids), o.num_cached_tokens
    after = stats()
    counters = {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float))}
    return {
        "ttft_s": ttft,
        "first_finished_s": first_done,
        "tokens": tokens,
        "num_cached_tokens": cached,
        "store": counters,
    }


def _abort(llm, command: dict) -> dict:
    """Add `prompts` (long generations), step the engine `steps` times (loads and saves of their blocks
    go out), abort them all while those may still be in flight, then step until the engine is idle."""
    from vllm import SamplingParams

    engine, tag = llm.llm_engine, f"abort{time.monotonic_ns()}"
    params = SamplingParams(
        temperature=0.0, max_tokens=command.get("max_tokens", 256), ignore_eos=True, detokenize=False
    )
    ids = [engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params) for i, p in enumerate(command["prompts"])]
    for _ in range(command["steps"]):
        engine.step()
    engine.abort_request([f"{tag}-{i}" for i in range(len(ids))])
    drained = 0
    while engine.has_unfinished_requests():
        engine.step()
        drained += 1
        if drained > 100_000:
            raise RuntimeError("the engine never drained after the aborts")
    return {"aborted": len(ids), "drain_steps": drained}


def _record_prefill_stats() -> dict[str, dict]:
    """Keep each request's PrefillStats (the scheduler's local / external split of its cached tokens),
    keyed by the request id the caller gave: `RequestOutput` carries only their sum, so the front end's
    `OutputProcessor.process_outputs` is wrapped to copy them as they pass."""
    import dataclasses

    from vllm.v1.engine import output_processor as op

    prefill: dict[str, dict] = {}
    orig = op.OutputProcessor.process_outputs

    def process_outputs(self, engine_core_outputs, *args, **kwargs):
        for eco in engine_core_outputs:
            stats = getattr(eco, "prefill_stats", None)
            if stats is None:
                continue
            state = self.request_states.get(eco.request_id)
            key = getattr(state, "external_req_id", None) or eco.request_id
            prefill.setdefault(key, dataclasses.asdict(stats))
        return orig(self, engine_core_outputs, *args, **kwargs)

    op.OutputProcessor.process_outputs = process_outputs  # type: ignore[method-assign]  # the patch is the point
    return prefill


# Prometheus counters (names as LLM.get_metrics() reports them) returned per `generate` as deltas.
COUNTERS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:prompt_tokens_by_source",
    "vllm:num_preemptions",
)


def _counters(llm) -> dict[str, float]:
    snap: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name not in COUNTERS or not hasattr(m, "value"):
            continue
        key = m.name.removeprefix("vllm:")
        if "source" in m.labels:
            key += f"{{source={m.labels['source']}}}"
        snap[key] = snap.get(key, 0.0) + float(m.value)
    return snap


_lora_ids: dict[str, int] = {}


def _lora_request(directory: str):
    """One LoRARequest per adapter directory (named after it), the same id for every use."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(os.path.basename(directory), _lora_ids.setdefault(directory, len(_lora_ids) + 1), directory)


def _generate(llm, command: dict, prefill: dict[str, dict]) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=command["max_tokens"], ignore_eos=True, detokenize=False)
    prompts = [p if isinstance(p, dict) else {"tokens": p} for p in command["prompts"]]
    inputs = [
        {"prompt_token_ids": p["tokens"], **({"cache_salt": p["cache_salt"]} if "cache_salt" in p else {})}
        for p in prompts
    ]
    loras = [_lora_request(p["lora"]) if "lora" in p else None for p in prompts]
    before = _counters(llm)
    outs = llm.generate(inputs, params, use_tqdm=False, lora_request=loras if any(loras) else None)
    after = _counters(llm)
    rows = []
    for o in outs:
        st = prefill.pop(o.request_id, {})
        rows.append(
            {
                "tokens": list(o.outputs[0].token_ids),
                "num_cached_tokens": o.num_cached_tokens,
                "num_prompt_tokens": len(o.prompt_token_ids or []),
                "num_local_cached_tokens": st.get("num_local_cached_tokens"),
                "num_external_cached_tokens": st.get("num_external_cached_tokens"),
                "num_computed_tokens": st.get("num_computed_tokens"),
                "num_cache_creation_tokens": st.get("num_cache_creation_tokens"),
                "finish_reason": o.outputs[0].finish_reason,
                "kv_transfer_params": o.kv_transfer_params,
            }
        )
    return {"rows": rows, "metrics": {k: after[k] - before.get(k, 0.0) for k in after}}


RESET_WAIT_S = 300.0  # how long a reset may wait for a connector's saves in flight (a long prefix to disk)


def _reset(llm, one, reset_connector: bool) -> bool:
    """Empty the engine's prefix cache. vLLM refuses (False) while a connector still holds finished
    requests' blocks for saves in flight; they are released when the engine steps, so step it with a
    3-token prompt (under a block: nothing cached) until the reset goes through. On a GPU the first try
    fails most of the time; without these steps a "warm" run would hit the GPU prefix cache, not the store."""
    deadline = time.monotonic() + RESET_WAIT_S
    while not llm.reset_prefix_cache(reset_connector=reset_connector):
        if time.monotonic() > deadline:
            return False
        llm.generate([{"prompt_token_ids": [3, 4, 5]}], one, use_tqdm=False)
        time.sleep(0.01)
    return True


def _child(spec_json: str, reply_fd: str) -> None:
    spec = json.loads(spec_json)
    replies = os.fdopen(int(reply_fd), "w")

    def reply(obj: dict) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    prefill = _record_prefill_stats()
    kwargs = dict(
        model=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        enforce_eager=True,
        enable_prefix_caching=True,
        skip_tokenizer_init=True,
        seed=0,
    )
    if spec["block_size"]:  # else vLLM's choice (a hybrid model's block is vLLM's anyway)
        kwargs["block_size"] = spec["block_size"]
    if spec["kv_transfer_config"]:
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    kwargs.update(spec["engine_kwargs"])
    if isinstance(kwargs.get("kv_events_config"), dict):  # JSON-borne: vLLM's LLM wants the config object
        from vllm.config.kv_events import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**kwargs["kv_events_config"])
    hook_seconds = _time_connector_hooks(spec["kv_transfer_config"]) if spec["in_process"] else {"total": 0.0}
    started = time.perf_counter()
    llm = LLM(**kwargs)
    engine, steps = llm.llm_engine, [0]
    step = engine.step

    def counted_step(*args, **kw):
        steps[0] += 1
        return step(*args, **kw)

    engine.step = counted_step  # type: ignore[method-assign]  # counts the engine's steps
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    audit = None
    if spec.get("audit"):  # in-process engines only: the connector's worker lives in this process
        from .page_audit import PageAudit

        audit = PageAudit.install()
    if spec["warmup"]:
        llm.generate([TokensPrompt(prompt_token_ids=[3, 4, 5, 6, 7])], one, use_tqdm=False)
        llm.reset_prefix_cache()
    reply({"startup_s": time.perf_counter() - started})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] != "generate":
            prefill.clear()  # only `generate` reads them
        if command["op"] == "reset":
            reply({"ok": _reset(llm, one, command.get("reset_connector", False))})
        elif command["op"] == "ttft":
            rows = []
            for prompt in command["prompts"]:
                t0 = time.perf_counter()
                (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], one, use_tqdm=False)
                rows.append(
                    {
                        "seconds": time.perf_counter() - t0,
                        "prompt_tokens": len(prompt),
                        "cached_tokens": out.num_cached_tokens,
                        "token": out.outputs[0].token_ids[0],
                    }
                )
            reply({"rows": rows})
        elif command["op"] == "steps":
            params = SamplingParams(
                temperature=0.0, max_tokens=command["max_tokens"], ignore_eos=True, detokenize=False
            )
            steps[0], hooks_before = 0, hook_seconds["total"]
            t0, thread0, process0 = time.perf_counter(), time.thread_time(), time.process_time()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in command["prompts"]], params, use_tqdm=False)
            reply(
                {
                    "seconds": time.perf_counter() - t0,
                    "steps": steps[0],
                    "connector_seconds": hook_seconds["total"] - hooks_before,
                    "thread_cpu_seconds": time.thread_time() - thread0,
                    "process_cpu_seconds": time.process_time() - process0,
                    "cached_tokens": sum(o.num_cached_tokens for o in outs),
                }
            )
        elif command["op"] == "generate":
            reply(_generate(llm, command, prefill))
        elif command["op"] == "stall":
            reply(_stall(llm, command, hook_seconds))
        elif command["op"] == "queued":
            reply(_queued(llm, command))
        elif command["op"] == "abort":
            reply(_abort(llm, command))
        elif command["op"] == "audit":
            reply(audit.summary() if audit else {"error": "the engine was started without audit=True"})
        else:
            reply({"error": f"unknown op {command['op']!r}"})


if __name__ == "__main__":
    _child(*sys.argv[1:3])
