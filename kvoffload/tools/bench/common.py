"""What every benchmark shares: timing (median of repeats), machine facts, a result's common head, the
page-cache drop, and writing results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import psutil


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "memory_GiB": round(psutil.virtual_memory().total / 2**30, 1),
        "processor": platform.processor(),
    }


def new_result(benchmark: str, quick: bool, device: str | None = None, **fields: object) -> dict:
    """A result's common head (name, quick, date, machine and the device it ran on), then its own
    `fields`: one key order for all."""
    host = {**machine(), "device": device} if device else machine()
    return {"benchmark": benchmark, "quick": quick, "date": time.strftime("%Y-%m-%d"), "machine": host, **fields}


def drop_page_cache() -> str:
    """'dropped' when the kernel's page cache could be emptied (root on Linux), else why not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "dropped"
    except OSError as exc:
        return f"warm (could not drop the page cache: {exc.strerror})"


# OMP_NUM_THREADS of in-process vLLM CPU engines in the step-time benchmarks (`stall`, `overhead`): one
# compute thread leaves a core to the connector's background threads and the OS, as a GPU server leaves
# its CPU cores free of the forward (and as vLLM's CPU backend reserves cores for the serving process).
# With two OpenMP threads on a 2-core machine any other runnable thread preempts one of them and the
# other spins at the barrier, which measures the machine's contention, not the connector.
ENGINE_THREADS = "1"


def write_result(name: str, result: dict, out_dir: str | None) -> str | None:
    if out_dir is None:
        return None
    os.makedirs(out_dir, exist_ok=True)
    where = "-gpu" if result.get("device") == "cuda" else ""
    path = os.path.join(out_dir, f"{name}{where}-{'quick' if result.get('quick') else 'full'}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return path
