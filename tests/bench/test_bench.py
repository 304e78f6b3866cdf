"""Every benchmark runs in --quick mode and writes well-formed JSON (its speed is not a test)."""

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import subprocess_env


def _bench(name, tmp_path, *options):
    out = subprocess.run([sys.executable, "-m", "kvoffload.cli", "bench", name, "--quick", "--out", str(tmp_path),
                          *options],
                         env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / f"{name}-quick.png").stat().st_size > 10_000, "no plot drawn"
    with open(tmp_path / f"{name}-quick.json") as f:
        return json.load(f)


def test_store_benchmark_json(tmp_path):
    result = _bench("store", tmp_path)
    assert result["benchmark"] == "store" and result["quick"] is True and result["machine"]["cpus"]
    assert len(result["results"]) == 2
    for row in result["results"]:
        for key in ("memcpy_GBps", "memory_get_GBps", "raw_write_fsync_GBps", "raw_read_GBps",
                    "lmdb_put_GBps", "lmdb_get_GBps"):
            assert row[key] > 0, key
        assert set(row["ratios"]) == {"memory_get_vs_memcpy", "lmdb_put_vs_raw_write", "lmdb_get_vs_raw_read",
                                      "lmdb_get_warm_beside_engine_vs_alone", "memcpy_beside_engine_vs_alone",
                                      "engine_step_p99_beside_lmdb_vs_alone"}
        for beside in row["beside_engine_steps"].values():  # an engine step never takes less than alone
            assert beside["GBps"] > 0 and beside["steps"] >= 200
            assert beside["step_p99_ms"] >= beside["step_p50_ms"] >= beside["step_alone_ms"] == 3.0


def test_footprint_benchmark_json(tmp_path):
    result = _bench("footprint", tmp_path)
    rows = {(r["preset"], r["tp"], r["block_source"]): r for r in result["results"]}
    assert ("pruned-4l", 8, "vllm") in rows and ("tiny", 1, "runner") in rows
    for row in rows.values():
        assert row["our_amplification"] == 1.0 and row["tail_ring_bytes_per_token"] == 0.0
        assert abs(sum(row["by_group"].values()) - row["stored_bytes_per_token_per_rank"]) < 1e-6
        assert row["amplification_of_whole_block_scheme"] > 1.0
        assert row["replicated_groups"] == (["mla"] if row["tp"] > 1 else [])
        mla = row["by_group"]["mla"]  # stored once per TP group instead of once per rank
        assert row["per_tp_group_bytes_per_token_after"] == pytest.approx(
            row["per_tp_group_bytes_per_token_before"] - (row["tp"] - 1) * mla)
    assert rows[("pruned-4l", 4, "runner")]["stored_bytes_per_token_per_rank"] < rows[("pruned-4l", 1, "runner")][
        "stored_bytes_per_token_per_rank"]  # KDA heads shard across ranks
    # vLLM's block for GLM-5.3-Flash's pruned geometry (same KDA and MLA widths as the full model).
    assert [rows[("pruned-4l", tp, "vllm")]["block_size"] for tp in (1, 2, 4)] == [4352, 2176, 1152]


def test_ttft_benchmark_json(tmp_path):
    result = _bench("ttft", tmp_path)
    (row,) = result["results"]
    assert row["prefix_tokens"] == 64 and row["cold_ms"] > 0
    assert row["warm_memory_ms"] > 0 and row["warm_lmdb_ms"] > 0  # the run asserts hits and equal tokens


def test_transfer_benchmark_json(tmp_path):
    result = _bench("transfer", tmp_path)
    assert set(result["results"]) == {"all_groups", "mla_pages"}
    for row in result["results"].values():
        assert row["bytes"] > 0 and row["spans"] >= row["pages"] > 0
        for key in ("raw_memcpy_save_GBps", "raw_memcpy_load_GBps", "raw_memcpy_both_GBps", "staged_save_GBps",
                    "staged_load_GBps", "staged_both_GBps", "per_span_save_GBps"):
            assert row[key] > 0, key
        assert row["end_to_end"]["memory_store_save_GBps"] > 0 and row["end_to_end"]["memory_store_load_GBps"] > 0
        assert set(row["ratios"]) == {"save_vs_memcpy", "load_vs_memcpy", "both_vs_memcpy", "per_span_save_vs_memcpy"}


@pytest.mark.slow
def test_vllm_ttft_benchmark_json(tmp_path):
    """Four vLLM engine processes; the run itself asserts that warm first tokens equal cold ones."""
    result = _bench("vllm-ttft", tmp_path)
    assert result["configs"] == ["none", "kvoffload_memory", "kvoffload_lmdb", "example_connector"]
    (row,) = result["results"]
    assert row["prefix_tokens"] == 128 and row["none_cold_ms"] > 0
    assert row["none_warm_cached_tokens"] == 0  # no connector: nothing survives the prefix-cache reset
    for name in ("kvoffload_memory", "kvoffload_lmdb", "example_connector"):
        assert row[f"{name}_warm_cached_tokens"] == 128, name  # the warm prefix came from the connector
        assert row[f"{name}_warm_ms"] > 0 and row[f"{name}_speedup"] > 0


@pytest.mark.slow
def test_overhead_benchmark_json(tmp_path):
    result = _bench("overhead", tmp_path)
    ours = {"kvoffload_memory", "kvoffload_lmdb", "kvoffload_tiered"}
    assert set(result["results"]) == {"none", "noop_connector"} | ours
    for row in result["results"].values():
        assert row["step_ms"] > 0 and row["steps_per_batch"] >= result["workload"]["max_tokens"]
    assert set(result["overhead_percent"]) == {"noop_connector"} | ours
    assert set(result["overhead_beyond_vllm_hooks_percent"]) == ours
    own = result["connector_hooks_percent_of_step"]
    assert set(own) == ours and all(v > 0 for v in own.values())  # hooks were timed
    assert result["results"]["none"]["connector_ms_per_step"] == 0
    assert result["workload"]["batches"] == [2] and isinstance(result["target_resolved"], bool)
    for name, (low, high) in result["overhead_interval_percent"].items():  # the median lies in its interval
        assert low <= result["overhead_percent"][name] <= high, name


def test_overhead_interval_narrows_with_batches_and_says_when_the_target_is_resolved():
    """The bootstrap interval of the median paired ratio: the same batches give the same interval, it holds
    the median, and more batches of the same spread narrow it; a run is resolved once every kvoffload row's
    interval is narrower than the target."""
    from kvoffload.tools.bench import overhead

    rng = np.random.default_rng(5)
    few, many = (list(1.005 + 0.02 * rng.standard_normal(n)) for n in (8, 200))
    low, high = overhead.interval(few)
    assert overhead.interval(few) == [low, high] and low <= overhead._percent(float(np.median(few))) <= high
    many_low, many_high = overhead.interval(many)
    assert many_high - many_low < high - low and many_low < 0.5 < many_high

    def rows(ratios):  # per-batch step times: none at 10 ms a step, each kvoffload row at ratio x that
        row = lambda seconds: {"seconds": seconds, "steps": 10}  # noqa: E731
        return {"none": [row(0.1)] * len(ratios), **{name: [row(0.1 * r) for r in ratios] for name in overhead.OURS}}

    assert overhead._resolved(rows(many)) and not overhead._resolved(rows(few))


def test_redis_benchmark_json(tmp_path):
    result = _bench("redis", tmp_path)
    assert [r["value_KiB"] for r in result["results"]] == [64, 1024]
    for row in result["results"]:
        for key in ("raw_set_GBps", "save_GBps", "raw_get_GBps", "load_GBps"):
            assert row[key] > 0, key
        assert set(row["ratios"]) == {"save_vs_raw_set", "load_vs_raw_get"}


def test_s3_benchmark_json(tmp_path):
    result = _bench("s3", tmp_path)
    assert [r["value"] for r in result["results"]] == ["72KiB", "2MiB"]
    for row in result["results"]:
        for target in ("s3", "lmdb", "raw_obstore", "raw_loopback_http"):
            assert row[target]["save_GBps"] > 0 and row[target]["load_GBps"] > 0, target
            assert 0 < row[target]["get"]["p50_ms"] <= row[target]["get"]["p99_ms"], target


def test_mooncake_benchmark_json(tmp_path):
    result = _bench("mooncake", tmp_path)
    assert [r["value"] for r in result["results"]] == ["72KiB", "2MiB"]
    for row in result["results"]:
        for target in ("mooncake", "redis", "raw_mooncake", "raw_loopback_tcp"):
            assert row[target]["save_GBps"] > 0 and row[target]["load_GBps"] > 0, target
            assert 0 < row[target]["get"]["p50_ms"] <= row[target]["get"]["p99_ms"], target


def test_faults_benchmark_json(tmp_path):
    result = _bench("faults", tmp_path)
    r = result["results"]
    assert r["sigkill"]["rounds"] == 5 and r["sigkill"]["acknowledged"] > 0
    assert r["sigkill"]["lost"] == r["sigkill"]["wrong_bytes"] == 0
    assert r["corruption"]["trials"] == 6 and r["corruption"]["wrong_bytes"] == 0
    assert r["corruption"]["crashed_or_failed"] == 0
    assert r["concurrency"]["operations"] > 0 and r["concurrency"]["wrong_bytes"] == 0


def test_datapath_benchmark_json(tmp_path):
    result = _bench("datapath", tmp_path)
    assert set(result["results"]) == {"all_groups", "mla_pages"}
    for row in result["results"].values():
        for key in ("raw_memcpy_save_GBps", "arena_save_GBps", "arena_load_GBps", "arena_both_GBps"):
            assert row[key] > 0, key
        assert set(row["ratios"]) == {"save_vs_memcpy", "load_vs_memcpy", "both_vs_memcpy"}
    tiered = result["results"]["all_groups"]["tiered_lmdb"]
    assert tiered["behind_written"] > 0 and tiered["behind_dropped"] == 0
    assert tiered["drain_GBps"] > 0 and tiered["lmdb_only_load_GBps"] > 0 and tiered["lmdb_store_load_GBps"] > 0
    assert tiered["plain_file_load_GBps"] > 0 and tiered["ratios"]["lmdb_store_load_vs_plain_file_load"] > 0


@pytest.mark.slow
def test_stall_benchmark_json(tmp_path):
    """Three in-process vLLM engines; the run itself asserts that the reloaded prefix came from the connector."""
    result = _bench("stall", tmp_path, "--trace", str(tmp_path / "traces"))
    assert set(result["results"]) == {"none", "kvoffload_lmdb", "kvoffload_tiered"}
    for name in result["results"]:  # one round's window per engine and scenario, as torch.profiler saw it
        for scenario in ("save", "load"):
            with gzip.open(tmp_path / "traces" / f"{name}-{scenario}.json.gz") as f:
                events = json.load(f)["traceEvents"]
            assert any(e.get("name") == "aten::copy_" for e in events), (name, scenario)
    assert result["target"]["p99_ratio_max"] == 1.1
    window = result["workload"]["window_steps"] * result["workload"]["rounds"]
    for name, row in result["results"].items():
        assert set(row) == {"save", "load"}
        for scenario, r in row.items():
            assert 0 < r["decode_only"]["steps"] < r["all_steps"]["steps"] == window, (name, scenario)
            assert 0 < r["decode_only"]["p50_ms"] <= r["decode_only"]["p99_ms"]
            assert r["quiet_p50_ms"] > 0 and r["long_prefill_steps"] >= 1
            slowest = r["slowest_decode_only"]
            assert len(slowest) == 6 and slowest[0]["s_ms"] >= r["decode_only"]["p99_ms"]
            assert [s["s_ms"] for s in slowest] == sorted((s["s_ms"] for s in slowest), reverse=True)
            for spent in [*slowest, r["quiet_p50_spent_ms"]]:  # the step's parts lie within it
                assert 0 <= spent["gc_ms"] <= spent["s_ms"] and 0 <= spent["cpu_ms"] <= spent["s_ms"] * 1.05 + 0.05
                assert (spent["hooks_ms"] > 0) == (name != "none") and spent["hooks_ms"] <= spent["s_ms"]
            for spent in slowest:  # the hooks above 0.1 ms, by name: within the step's hooks
                assert sum(spent["hooks_over_0.1ms"].values()) <= spent["hooks_ms"] + 0.01
                assert not spent["hooks_over_0.1ms"] or name != "none"
            if name != "none":
                assert {"p50_ratio", "p99_ratio", "p99_target_met"} <= set(r)
    assert result["results"]["none"]["load"]["long_cached_tokens"] == 0  # recomputed: no connector
    for name in ("kvoffload_lmdb", "kvoffload_tiered"):
        assert result["results"][name]["load"]["long_cached_tokens"] == result["workload"]["long_prefix_tokens"]


def test_trace_benchmark_json(tmp_path):
    result = _bench("trace", tmp_path)
    rows = {r["policy"]: r for r in result["results"]}
    assert result["requests"] == sum(result["by_kind"].values()) > 0
    assert rows["no offload"]["hit_tokens"] == 0 and rows["no offload"]["ttft_saved_s_total"] == 0
    assert rows["memory only, LRU"]["disk_written_bytes"] == 0
    everything = [r for name, r in rows.items() if name.endswith("store everything")]
    admitted = [r for r in rows.values() if r["admit"] and r["admit"] > 1 and r["disk_capacity"]]
    assert everything and admitted
    for row in everything + admitted + [rows["memory only, LRU"]]:
        assert 0 < row["hit_tokens"] < row["prompt_tokens"] and row["ttft_saved_s_total"] > 0
        assert row["memory_read_bytes"] + row["disk_read_bytes"] > 0
    for row in everything:  # every computed page goes behind, unless the write-behind bound dropped it
        assert row["disk_written_bytes"] + row["disk_dropped_bytes"] == row["memory_written_bytes"]
    for row in admitted:  # admission writes only what was used again
        assert 0 < row["disk_written_bytes"] < everything[0]["disk_written_bytes"]
    # S3-FIFO in memory beside LRU: memory only, and with a disk storing everything or admitting at 2 uses
    s3fifo = [r for r in rows.values() if r["evict"] == "s3fifo"]
    assert rows["memory only, S3-FIFO"] in s3fifo and rows["memory only, S3-FIFO"]["disk_written_bytes"] == 0
    for row in s3fifo:
        twin = rows[row["policy"].replace(", S3-FIFO memory", "").replace("S3-FIFO", "LRU")]
        assert twin["evict"] == "lru" and (twin["admit"], twin["disk_capacity"]) == (row["admit"], row["disk_capacity"])
        assert 0 < row["hit_tokens"] < row["prompt_tokens"] and row["ttft_saved_s_total"] > 0
        assert row["memory_evictions"] > 0 and row["prompt_tokens"] == twin["prompt_tokens"]
    # S3-FIFO on the disk under pressure, beside the same set-up with LRU there
    disk_s3fifo = [r for r in rows.values() if r["disk_evict"] == "s3fifo"]
    assert len(disk_s3fifo) == 1 and disk_s3fifo[0]["evict"] == "lru"
    twin = rows[disk_s3fifo[0]["policy"].replace(", S3-FIFO disk", "")]
    assert twin["disk_evict"] == "lru" and twin["disk_capacity"] == disk_s3fifo[0]["disk_capacity"] == min(
        r["disk_capacity"] or 1 << 62 for r in rows.values())
    for row in disk_s3fifo:
        assert 0 < row["hit_tokens"] < row["prompt_tokens"] and row["ttft_saved_s_total"] > 0
        assert row["disk_written_bytes"] + row["disk_dropped_bytes"] == row["memory_written_bytes"]
    # the queue model: time to first token includes the wait; hits shorten the queue for everyone
    for row in rows.values():
        assert row["ttft_s_mean"] >= row["queue_wait_s_mean"] >= 0 and row["queued_requests"] <= result["requests"]
        assert row["prefetched_bytes"] == 0 or row["prefetch"]
    assert rows["no offload"]["ttft_s_mean"] > max(r["ttft_s_mean"] for r in everything)
    prefetching = [r for r in rows.values() if r["prefetch"]]
    assert len(prefetching) == 2
    roomy = max(prefetching, key=lambda r: r["disk_capacity"])  # nothing evicted from disk: prefetch moves
    twin = rows[roomy["policy"].removesuffix(", prefetch")]  # pages between tiers, what is stored and hit stays
    assert (roomy["hit_tokens"], roomy["disk_written_bytes"]) == (twin["hit_tokens"], twin["disk_written_bytes"])
    assert {(r["admit"], bool(r["disk_capacity"])) for r in s3fifo} == {(1, False), (1, True), (2, True)}


@pytest.mark.slow
def test_prefetch_benchmark_json(tmp_path):
    """Four vLLM engines; the run itself asserts equal first tokens and whole-prefix connector hits."""
    result = _bench("prefetch", tmp_path)
    rows = result["results"]
    assert set(rows) == {"none", "tiered_no_prefetch", "tiered_prefetch"}
    assert rows["none"]["cached_tokens"] == 0
    assert rows["tiered_prefetch"]["prefetched"] > 0 and rows["tiered_prefetch"]["memory_hits"] > 0
    assert rows["tiered_no_prefetch"]["prefetched"] == 0 and rows["tiered_no_prefetch"]["memory_hits"] == 0
    assert all(r["ttft_ms"] >= r["after_slot_ms"] > 0 for r in rows.values())
    assert result["raw_cold_read_GBps"] > 0 and result["prefetch_vs_no_prefetch_after_slot"] > 0


def test_warmstart_benchmark_needs_a_gpu(capsys):
    """The first-restore benchmark times the GPU path only: on a CPU machine a one-line refusal, exit 2."""
    import torch

    from kvoffload.cli import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the benchmark runs (see BENCHMARKS, bench warmstart)")
    assert main(["bench", "warmstart", "--quick", "--out", ""]) == 2
    assert "needs a CUDA or ROCm device" in capsys.readouterr().err


def test_warmstart_reports_the_median_process_and_equal_pages_only_if_every_process_had_them():
    """A first restore happens once per process: the row is the median of its fresh processes (not the
    best), each process's figure is kept, and one process with unequal pages fails the row."""
    from kvoffload.tools.bench.warmstart import _median_row

    runs = [
        {
            "first_of_raw": r,
            "second_of_raw": 0.9,
            "warm_of_raw": w,
            "warm_restore_ms": 5.0 / w,
            "raw_pinned_copy_ms": 5.0,
            "warm_up_ms": 700.0,
            "pages_equal": True,
            "first_restore_ms": m,
        }
        for r, m, w in ((0.91, 5.0, 0.80), (0.70, 6.5, 0.93), (0.84, 5.4, 0.88))
    ]
    row = _median_row(runs)
    assert row["first_of_raw"] == 0.84 and row["first_restore_ms"] == 5.4 and row["pages_equal"]
    # the warm figure is the median of the processes' warm medians, not the median-first process's own
    assert runs[2]["warm_of_raw"] == 0.88
    for key in ("warm_of_raw", "warm_restore_ms"):  # the median warm restore now in another process
        runs[2][key], runs[0][key] = runs[0][key], runs[2][key]
    row = _median_row(runs)
    assert row["first_of_raw"] == 0.84 and row["warm_of_raw"] == 0.88 and row["warm_restore_ms"] == 5.0 / 0.88
    assert [r["first_of_raw"] for r in row["runs"]] == [0.91, 0.70, 0.84]
    # each process keeps the times its ratios came from: the row's warm figure can be checked against them
    assert [(r["warm_restore_ms"], r["raw_pinned_copy_ms"]) for r in row["runs"]] == [
        (5.0 / 0.88, 5.0),
        (5.0 / 0.93, 5.0),
        (5.0 / 0.80, 5.0),
    ]
    assert all(r["raw_pinned_copy_ms"] / r["warm_restore_ms"] == pytest.approx(r["warm_of_raw"]) for r in row["runs"])
    runs[0]["pages_equal"] = False
    assert _median_row(runs)["pages_equal"] is False
    assert "runs" not in _median_row(runs[:1])  # one process (the warm start off): its own row


def test_a_whole_model_checkpoint_is_written_tensor_by_tensor_and_loads_as_written(tmp_path):
    """`write_llama` (the Llama-3.1-8B shape's writer, here at small sizes): transformers loads every tensor
    of the index, none missing or left over, in bf16; the same seed writes the same weights. Its engines
    run one at a time (`engine_groups`); the others side by side."""
    import dataclasses

    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from kvoffload.tools.bench.vllm_models import llama_sizes, write_llama
    from kvoffload.tools.bench.vllm_profiles import CPU
    from kvoffload.tools.bench.vllm_ttft import engine_groups

    sizes = llama_sizes(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, positions=512)
    profile = dataclasses.replace(CPU, model=sizes, vocab=300, sequential=True)
    first = profile.write_model(str(tmp_path / "a"))
    model, info = LlamaForCausalLM.from_pretrained(first, output_loading_info=True)
    assert not any(info.values()) and model.dtype == torch.bfloat16 and model.config.vocab_size == 300
    again = write_llama(str(tmp_path / "b"), sizes, vocab=300)
    assert all(torch.equal(t, load_file(f"{again}/model-layer001.safetensors")[k])
               for k, t in load_file(f"{first}/model-layer001.safetensors").items())
    assert engine_groups(["none", "a", "b"], profile) == [["none"], ["a"], ["b"]]
    assert engine_groups(["none", "a", "b"], CPU) == [["none", "a", "b"]]
