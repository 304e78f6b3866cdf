"""`kvoffload demo`, the main job of `make demo`: the tiny GLM-5.3-Flash runner cold, offload to the
embedded default store (LMDB in the local cache directory), a process restart, the warm run from disk,
and a short report: hits, equality, bytes stored per token by group, prefill cold vs warm, throughput."""

from __future__ import annotations

import sys

from ..paths import demo_store_url
from ..store import StoreConfigError, parse_store_url
from .verify import verify


def _rate(nbytes: int, microseconds: int) -> str:
    return f"{nbytes / max(microseconds, 1):.0f} MB/s" if microseconds else "n/a"


def report_lines(report: dict) -> list[str]:
    t, cold, warm = report["totals"], report["counters"]["cold"], report["counters"]["warm"]
    by_group = " + ".join(f"{name} {v:.0f}" for name, v in t["bytes_per_token_by_group"].items())
    expected = sum(p["expected_hit_tokens"] for p in report["prompts"])
    cases = len({p["case"] for p in report["prompts"]})
    return [
        f"store            {report['store']}"
        + ("  (warm run in a new process)" if report["restart"] else "")
        + ("  (cold and warm in two independent processes)" if report.get("separate") else ""),
        f"runner           {report.get('device', 'cpu')}, {report.get('kernels', 'torch')} kernels",
        f"prompts          {t['prompts']} in {cases} cases, {report['max_tokens']} new tokens each",
        f"tokens equal     {t['tokens_equal']}/{t['prompts']} (cold vs warm, greedy)",
        f"pages equal      {t['pages_equal']}/{t['prompts']} ({t['restored_pages']} restored pages, byte for byte)",
        f"hit tokens       {t['hit_tokens']} of {expected} expected",
        f"stored per token {t['stored_bytes_per_token']:.0f} B (expected {t['expected_bytes_per_token']:.0f} B = "
        f"{by_group}; tail ring 0)",
        f"                 storing the whole packed block under every group key would take "
        f"{t['whole_packed_block_bytes_per_token']:.0f} B per token",
        f"prefill          cold {t['cold_prefill_seconds'] * 1e3:.0f} ms, "
        f"warm {t['warm_prefill_seconds'] * 1e3:.0f} ms "
        f"(warm computes only the uncached suffix)",
        f"throughput       save {_rate(cold.get('saved_bytes', 0), cold.get('save_microseconds', 0))}, "
        f"load {_rate(warm.get('loaded_bytes', 0), warm.get('load_microseconds', 0))}",
        *(f"PROBLEM          {p}" for p in report["problems"]),
        f"result           {'OK' if report['ok'] else 'MISMATCH'}",
    ]


def run_demo(store_url: str | None = None, progress=None) -> dict:
    progress = progress or (lambda message: print(message, file=sys.stderr, flush=True))
    url = store_url or demo_store_url()
    if parse_store_url(url).process_local:
        raise StoreConfigError(
            "the demo's warm run is a new process, and memory:// lives in one: use lmdb://, redis:// or tiered://"
        )
    progress(f"[demo] tiny GLM-5.3-Flash runner, store {url}")
    return verify(url, preset="tiny", restart=True, progress=progress)
