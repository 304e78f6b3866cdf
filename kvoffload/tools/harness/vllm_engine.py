"""The real vLLM engine (the CPU build here) in a child process that takes commands: the one vLLM driver
of the benchmarks and of the tests (tests/support/vllm_harness.py is a thin layer over it). This
module is the parent's side; `vllm_child` runs in the child. Several
engines (one per connector configuration) can stay up side by side, so a benchmark alternates between
them and a slow minute on a shared machine lands on every configuration alike.

Commands (one JSON object per line on the child's stdin; one JSON reply per line on a private pipe):
    {"op": "ttft", "prompts": [[ids]]}   each prompt alone, one output token: seconds, cached tokens
    {"op": "steps", "prompts": [[ids]], "max_tokens": n}   one batch: seconds, engine steps, CPU seconds of
        the calling thread (in-process engines: the engine's) and of the whole process
    {"op": "generate", "prompts": [[ids] or {"tokens": [ids], "cache_salt": s, "lora": dir}], "max_tokens": n}
        one greedy batch (a prompt may carry a cache salt and a LoRA adapter directory): per prompt its tokens and
        the scheduler's local / external (connector) split of its cached tokens; the round's deltas of
        vLLM's Prometheus counters (needs engine_kwargs disable_log_stats=False)
    {"op": "reset", "reset_connector": false}   empty the engine's own prefix cache (by default the
        connector's store stays)
    {"op": "stall", "decode_prompts": [[ids]], "long_prompt": [ids], "quiet_steps": q, "window_steps": w}
        in-process engines only: every step's wall time and scheduled tokens while decode requests run and
        one long prompt (one output token) joins them (`_stall`)
    {"op": "queued", "first": [ids], "first_max_tokens": n, "prompt": [ids], "max_tokens": m, "store": url}
        in-process engines only: `prompt` is added while `first` runs (with max_num_seqs=1 it waits in
        vLLM's queue): its time to first token, when `first` finished (both from adding it), its tokens
        and cached tokens, and the deltas of the store's counters over the run (`_queued`)
    {"op": "abort", "prompts": [[ids]], "steps": k}   the prompts added, k steps, all aborted mid-flight, the
        engine drained (`_abort`)
    {"op": "audit"}   engines started with audit=True: the pages saved and restored per group, restored pages
        equal to the store's and to the saved bytes, and the worker's layout (`page_audit`)
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import IO


class EngineRunError(RuntimeError):
    pass


def child_env(extra_env: dict | None = None) -> dict[str, str]:
    """This checkout importable, a 1 GiB CPU KV cache, offline; then `extra_env` on top."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    for key, value in (
        ("VLLM_CPU_KVCACHE_SPACE", "1"),
        ("VLLM_NO_USAGE_STATS", "1"),
        ("DO_NOT_TRACK", "1"),
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
    ):
        env.setdefault(key, value)
    env.update({k: str(v) for k, v in (extra_env or {}).items()})
    return env


def stop_group(proc: subprocess.Popen, first: int = signal.SIGTERM, grace: float = 15.0) -> None:
    """Stop a child started with start_new_session=True and everything left in its process group (vLLM's
    engine core and workers)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(first)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(min(1.0, grace) if sig == signal.SIGTERM else 0)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


class Engine:
    """One engine process; `call(op, ...)` sends a command and returns its reply."""

    def __init__(
        self,
        model_dir: str,
        kv_transfer_config: dict | None,
        *,
        block_size: int,
        max_model_len: int,
        dtype: str = "float32",
        timeout: float = 600,
        in_process: bool = False,
        engine_kwargs: dict | None = None,
        extra_env: dict | None = None,
        warmup: bool = True,
        audit: bool = False,
        wait: bool = True,
    ):
        """`in_process`: scheduler and worker in the child itself (VLLM_ENABLE_V1_MULTIPROCESSING=0), which
        also lets the child time every hook of the connector (`connector_seconds` in `steps` replies).
        `timeout`: seconds for start-up and for each reply. `engine_kwargs` go to `vllm.LLM` on top of the
        defaults (eager, prefix caching, no tokenizer, seed 0). `warmup`: one 5-token request before the
        first command (its prefix-cache entries reset), so the first timed call pays no lazy start-up.
        `audit`: check every page the connector restores byte for byte (`page_audit`; the `audit` command
        reports), in-process engines only. `block_size` None: vLLM's choice. `wait=False`: return once the
        process is started; `ready()` waits for it."""
        spec = {
            "model": os.path.abspath(model_dir),
            "kv_transfer_config": kv_transfer_config,
            "block_size": block_size,
            "max_model_len": max_model_len,
            "dtype": dtype,
            "in_process": in_process,
            "engine_kwargs": dict(engine_kwargs or {}),
            "warmup": warmup,
            "audit": audit,
        }
        if audit and not in_process:
            raise ValueError("audit=True needs in_process=True (the connector's worker must be in the child)")
        env = child_env(extra_env)
        if in_process:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.timeout = timeout
        self.log = tempfile.NamedTemporaryFile(prefix="kvoffload-engine-", suffix=".log", delete=False)
        replies, self._reply_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvoffload.tools.harness.vllm_child", json.dumps(spec), str(self._reply_w)],
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            pass_fds=(self._reply_w,),
            text=True,
            start_new_session=True,
        )
        assert self.proc.stdin is not None  # stdin=PIPE
        self.stdin: IO[str] = self.proc.stdin
        self._closed_log = ""  # the log, once `close` removed its file
        os.close(self._reply_w)
        self.replies = os.fdopen(replies)
        self.startup_s = None
        if wait:
            self.ready()

    def ready(self) -> Engine:
        """Wait for the engine's start-up (`wait=False` lets several engines start side by side)."""
        if self.startup_s is None:
            try:
                self.startup_s = self._reply()["startup_s"]
            except BaseException:
                self.close(graceful=False)
                raise
        return self

    def _reply(self) -> dict:
        ready, _, _ = select.select([self.replies], [], [], self.timeout)
        if not ready:
            stop_group(self.proc, grace=5.0)
            raise EngineRunError(
                f"the vLLM engine did not answer within {self.timeout:.0f} s; log tail:\n{self.log_text()[-6000:]}"
            )
        line = self.replies.readline()
        if not line:
            stop_group(self.proc, grace=10.0)
            raise EngineRunError(
                f"the vLLM engine exited (status {self.proc.returncode}); log tail:\n{self.log_text()[-6000:]}"
            )
        return json.loads(line)

    def call(self, op: str, **args) -> dict:
        self.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.stdin.flush()
        return self._reply()

    def log_text(self) -> str:
        """The child's output so far (stdout and stderr)."""
        with open(self.log.name, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def close(self, graceful: bool = True) -> str:
        """End the engine (stdin closed: it exits, at most 60 s; not `graceful`: terminated at once) and its
        process group; returns its log (again on a second call)."""
        if self.replies.closed:
            return self._closed_log
        with contextlib.suppress(BrokenPipeError):
            self.stdin.close()
        if graceful:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        stop_group(self.proc, grace=5.0 if graceful else 0.5)
        self.replies.close()
        text = self._closed_log = self.log_text()
        os.unlink(self.log.name)
        return text

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(graceful=kind is None or not issubclass(kind, KeyboardInterrupt))  # Ctrl-C: no waiting
