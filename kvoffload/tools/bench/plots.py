"""One figure per benchmark result (PNG beside its JSON), drawn with matplotlib without a display."""

from __future__ import annotations

import os


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
    return plt, fig, ax


def _bars(ax, labels, series: dict[str, list[float]]) -> bool:
    """Grouped bars; more than ten groups lie on their side, one readable label a row (returns True)."""
    width = 0.8 / len(series)
    at = [[x + i * width - 0.4 + width / 2 for x in range(len(labels))] for i in range(len(series))]
    if len(labels) <= 10:
        for positions, (name, values) in zip(at, series.items()):
            ax.bar(positions, values, width, label=name)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        return False
    for positions, (name, values) in zip(at, series.items()):
        ax.barh(positions, values, width, label=name)
    ax.set_yticks(range(len(labels)), [label.replace("\n", ", ") for label in labels], fontsize=7)
    ax.invert_yaxis()
    ax.figure.set_size_inches(ax.figure.get_size_inches()[0] * 1.3, 1.5 + 0.3 * len(labels))
    return True


def _store(ax, result):
    sizes = [r["value_bytes"] / 1024 for r in result["results"]]
    for key, label in (
        ("memcpy_GBps", "memcpy"),
        ("memory_get_GBps", "memory get"),
        ("raw_write_fsync_GBps", "raw write+fsync"),
        ("lmdb_put_GBps", "LMDB put"),
        ("raw_read_GBps", "raw read"),
        ("lmdb_get_GBps", "LMDB get"),
    ):
        ax.plot(sizes, [r[key] for r in result["results"]], marker="o", label=label)
    for key, label in (("lmdb_get_warm", "LMDB get, page cache,"), ("memcpy", "memcpy,")):
        beside = [r["beside_engine_steps"][key]["GBps"] for r in result["results"]]
        ax.plot(sizes, beside, marker="x", linestyle="--", label=f"{label} beside engine steps")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="value size (KiB)", ylabel="GB/s", title="Store throughput vs same-run baselines")


def _footprint(ax, result):
    rows = [r for r in result["results"] if r.get("block_source", "vllm") == "vllm"]
    _bars(
        ax,
        [f"{r['preset']} TP{r['tp']}\nblock {r['block_size']}" for r in rows],
        {
            "every rank stores everything": [r["per_tp_group_bytes_per_token_before"] for r in rows],
            "replicated groups once per TP group": [r["per_tp_group_bytes_per_token_after"] for r in rows],
        },
    )
    ax.set_yscale("log")
    ax.set(ylabel="bytes stored per token per TP group", title="Footprint per cached token at vLLM's block size")


def _ttft(ax, result):
    rows = result["results"]
    x = [r["prefix_tokens"] for r in rows]
    for key, label in (
        ("cold_ms", "cold prefill"),
        ("warm_memory_ms", "warm from memory"),
        ("warm_lmdb_ms", "warm from LMDB"),
    ):
        ax.plot(x, [r[key] for r in rows], marker="o", label=label)
    ax.set(xlabel="prefix tokens", ylabel="ms", title="Bundled runner: time to first token", yscale="log")


def _vllm_ttft(ax, result):
    rows = result["results"]
    series = {"no connector (cold)": [r["none_cold_ms"] for r in rows]}
    for name in result["configs"]:
        if name != "none":
            series[f"{name} warm"] = [r[f"{name}_warm_ms"] for r in rows]
    _bars(ax, [str(r["prefix_tokens"]) for r in rows], series)
    ax.set(xlabel="prefix tokens", ylabel="ms", title="vLLM CPU engine: time to first token")


def _overhead(ax, result):
    names = list(result["results"])
    rows = result["results"]
    _bars(
        ax,
        names,
        {
            "step ms": [rows[n]["step_ms"] for n in names],
            "engine thread CPU ms": [rows[n].get("step_cpu_ms", 0) for n in names],
            "ms inside the connector's hooks": [rows[n].get("connector_ms_per_step", 0) for n in names],
        },
    )
    ax.set(ylabel="ms per engine step", title="Connector cost with no hits (vLLM CPU engine)")


def _per_direction(result, raw: str, ours: str, key: str, tag: str = "") -> tuple[list[str], dict[str, list[float]]]:
    """Labels and two series, per workload and direction (save, load, both): a raw memcpy's GB/s (`raw`)
    and kvoffload's `key`_<direction>_GBps (`ours`); `transfer` and `datapath` draw these alike."""
    labels: list[str] = []
    series: dict[str, list[float]] = {raw: [], ours: []}
    for workload, row in result["results"].items():
        for direction in ("save", "load", "both"):
            labels.append(f"{workload}\n{tag}{direction}")
            series[raw].append(row[f"raw_memcpy_{direction}_GBps"])
            series[ours].append(row[f"{key}_{direction}_GBps"])
    return labels, series


def _transfer(ax, result):
    _bars(ax, *_per_direction(result, "raw pinned memcpy", "staged (kvoffload)", "staged"))
    ax.set(ylabel="GB/s", title=f"Device <-> host pages ({result['machine'].get('device', '')})")


def _datapath(ax, result):
    labels, series = _per_direction(result, "raw baseline", "kvoffload", "arena", tag="arena ")
    tiered = result["results"]["all_groups"]["tiered_lmdb"]
    for label, raw, ours in (
        ("LMDB drain\n(fsync write)", "raw_write_fsync_GBps", "drain_GBps"),
        ("cold tiered\n(seq. read)", "raw_sequential_read_GBps", "lmdb_only_load_GBps"),
        ("cold lmdb\n(seq. read)", "raw_sequential_read_GBps", "lmdb_store_load_GBps"),
        ("cold lmdb\n(file pread)", "plain_file_load_GBps", "lmdb_store_load_GBps"),
    ):
        if ours not in tiered or raw not in tiered:  # a result from before the row existed
            continue
        labels.append(label)
        series["raw baseline"].append(tiered[raw])
        series["kvoffload"].append(tiered[ours])
    _bars(ax, labels, series)
    ax.set(ylabel="GB/s", title=f"Data path through the tiers, fresh keys ({result['machine'].get('device', '')})")


def _redis(ax, result):
    rows = result["results"]
    _bars(
        ax,
        [f"{r['value_KiB']} KiB" for r in rows],
        {
            "raw SET": [r["raw_set_GBps"] for r in rows],
            "kvoffload save": [r["save_GBps"] for r in rows],
            "raw GET": [r["raw_get_GBps"] for r in rows],
            "kvoffload load": [r["load_GBps"] for r in rows],
        },
    )
    ax.set(ylabel="GB/s", title="Redis tier vs raw SET/GET through the same client")


def _tiers(ax, result, title: str):
    """Save and load GB/s of every target in each row (the tier, its raw client, the baselines)."""
    rows = result["results"]
    tiers = [k for k in rows[0] if isinstance(rows[0][k], dict)]
    series = {}
    for tier in tiers:
        series[f"{tier} save"] = [r[tier]["save_GBps"] for r in rows]
        series[f"{tier} load"] = [r[tier]["load_GBps"] for r in rows]
    _bars(ax, [r["value"] for r in rows], series)
    ax.set(ylabel="GB/s", title=title)


def _s3(ax, result):
    _tiers(ax, result, "S3 tier vs raw clients, LMDB and a loopback HTTP copy (same run)")


def _mooncake(ax, result):
    _tiers(ax, result, "Mooncake tier vs its raw client, Redis and a loopback TCP copy (same run)")


def _faults(ax, result):
    r = result["results"]
    sigkill = r["sigkill"]
    rows = {
        "SIGKILL: acknowledged entries": (sigkill["acknowledged"], sigkill["lost"] + sigkill["wrong_bytes"]),
        "damaged stores: reads": (
            r["corruption"]["reads"],
            r["corruption"]["wrong_bytes"] + r["corruption"]["crashed_or_failed"],
        ),
        "threads x processes: operations": (r["concurrency"]["operations"], r["concurrency"]["wrong_bytes"]),
    }
    _bars(
        ax,
        list(rows),
        {"checked": [v[0] for v in rows.values()], "lost, wrong or crashed": [v[1] for v in rows.values()]},
    )
    ax.set_yscale("log")
    ax.set(ylabel="count (log)", title="LMDB fault campaign: every byte checked (no orange bar: nothing lost)")


def _stall(ax, result):
    labels: list[str] = []
    series: dict[str, list[float]] = {"decode-only p50": [], "decode-only p99": []}
    for scenario in ("save", "load"):
        for name, row in result["results"].items():
            labels.append(f"{scenario}\n{name.replace('kvoffload_', '')}")
            series["decode-only p50"].append(row[scenario]["decode_only"]["p50_ms"])
            series["decode-only p99"].append(row[scenario]["decode_only"]["p99_ms"])
    _bars(ax, labels, series)
    ax.set(ylabel="ms per engine step", title="Decode steps while another request's long prefix is saved / loaded")


def _trace(ax, result):
    rows = result["results"]
    short = (
        ("memory + disk ", "disk "),
        (" GiB", "G"),
        ("store everything", "all"),
        ("memory only", "memory"),
        (", S3-FIFO memory", ", S3-FIFO"),
        ("no offload", "none"),
        (", ", "\n"),
    )
    labels = []
    for row in rows:
        labels.append(row["policy"])
        for long, brief in short:
            labels[-1] = labels[-1].replace(long, brief)
    everything = next(r for r in rows if r["disk_capacity"] and r["admit"] == 1)["disk_written_bytes"]
    sideways = _bars(
        ax,
        labels,
        {
            "token hit rate (%)": [100 * r["hit_rate_tokens"] for r in rows],
            "disk written (% of store-everything)": [100 * r["disk_written_bytes"] / max(everything, 1) for r in rows],
        },
    )
    title = f"Policies on a trace of {result['requests']} requests (block {result['block_size']})"
    ax.set(**{"xlabel" if sideways else "ylabel": "%"}, title=title)


def _prefetch(ax, result):
    rows = result["results"]
    _bars(
        ax,
        [name.replace("tiered_", "tiered\n") for name in rows],
        {
            "time to first token (ms)": [r["ttft_ms"] for r in rows.values()],
            "after the slot freed (ms)": [r["after_slot_ms"] for r in rows.values()],
        },
    )
    ax.set(ylabel="ms (median)", title="A queued request, its prefix on LMDB only: with and without prefetch")


def _warmstart(ax, result):
    rows = [r for r in result["results"] if r["warm_start"]]
    cold = {(r["block_size"], r["prefix_tokens"]): r for r in result["results"] if not r["warm_start"]}
    _bars(
        ax,
        [f"block {r['block_size']}\n{r['prefix_tokens']} tok" for r in rows],
        {
            "first restore, warm start": [r["first_of_raw"] for r in rows],
            "first restore, set up on first use": [
                cold[(r["block_size"], r["prefix_tokens"])]["first_of_raw"] for r in rows
            ],
            "warm restore (median)": [r["warm_of_raw"] for r in rows],
        },
    )
    # Room above the bars (ratios near 1) for the legend.
    ax.set(ylabel="of a raw pinned copy of the same bytes", title="The first restore of a fresh process", ylim=(0, 1.3))


DRAW = {
    "store": _store,
    "footprint": _footprint,
    "ttft": _ttft,
    "vllm-ttft": _vllm_ttft,
    "overhead": _overhead,
    "transfer": _transfer,
    "redis": _redis,
    "s3": _s3,
    "mooncake": _mooncake,
    "faults": _faults,
    "datapath": _datapath,
    "stall": _stall,
    "trace": _trace,
    "prefetch": _prefetch,
    "warmstart": _warmstart,
}


def plot(result: dict, json_path: str) -> str:
    """Draw `result` next to its JSON file; returns the PNG's path."""
    plt, fig, ax = _figure()
    DRAW[result["benchmark"]](ax, result)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.splitext(json_path)[0] + ".png"
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":  # redraw figures from saved results: python -m kvoffload.tools.bench.plots FILE.json...
    import json
    import sys

    for name in sys.argv[1:]:
        with open(name) as f:
            print(plot(json.load(f), name))
