"""Device <-> host page movement for GLM-shaped pages (the pruned-4l geometry: MLA latent + indexer pages
and KDA state pages, hundreds of blocks) against a raw pinned memcpy of the same bytes, same run.

Two workloads: `all_groups` is every cacheable page of each block (a prefill's save with a KDA
checkpoint per block: bytes dominated by the 4 MiB KDA states), `mla_pages` the MLA latent + indexer
pages only (the bulk of a warm prefix: thousands of small spans, where one copy per span is slow). Each
is saved from one half of the cache (device -> host) and loaded into the other (host -> device), alone
and both at once (each on its own stream, driven from one thread). Rows: the staged transfer (gather kernel + one copy
per staging batch), the naive one-copy-per-span path, the raw memcpy of the same byte count. End-to-end rows
add the memory store (its host-side copy) for context. Without a GPU the same code runs on a host
buffer (`device: cpu`), which checks the benchmark, not the link."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch

from ...connectors import batch_plan
from ...connectors.device_transfer import DeviceTransfer
from ...connectors.plan import Page
from ...connectors.transfer import page_spans
from ...spec import GroupKind
from ...store import open_store
from .common import median_seconds, new_result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_gbps(fn, nbytes: int, repeats: int, device: torch.device) -> float:
    def synced():
        fn()
        _sync(device)

    fn()  # warm-up: staging allocation, kernel compilation
    _sync(device)
    return round(nbytes / median_seconds(synced, repeats) / 1e9, 2)


def pages_of(layout, blocks: range, kinds, tag: str = "") -> list:
    """The pages of `kinds` of the blocks, placed at their own blocks, keyed by tag, group and block."""
    groups = [g for g in layout.cacheable_groups if g.kind in kinds]
    return [Page(f"{tag}{g.name}-{b}".encode(), g, b, b) for b in blocks for g in groups]


def _nbytes(items) -> int:
    return sum(p.group.used_bytes_per_block for p in items)


def run(
    quick: bool = False,
    preset: str = "pruned-4l",
    block_size: int = 64,
    blocks: int = 1024,
    repeats: int = 7,
    progress=None,
) -> dict:
    from glm_integration.cache import PagedCache
    from glm_integration.config import preset as make_preset

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if quick or device.type != "cuda":
        preset, blocks, repeats = ("pruned-4l", 16, 3) if device.type == "cuda" else ("tiny", 64, 3)
    cache = PagedCache(make_preset(preset), block_size, blocks, device=device)
    cache.buffer.random_(0, 256)
    progress = progress or (lambda message: None)
    workloads = {
        "all_groups": ({GroupKind.PAGED, GroupKind.STATE}, max(2, blocks // 8)),
        "mla_pages": ({GroupKind.PAGED}, blocks // 2),
    }
    results = {}
    for name, (kinds, n) in workloads.items():
        save_items = pages_of(cache.layout, range(n), kinds)
        load_items = pages_of(cache.layout, range(n, 2 * n), kinds)
        results[name] = _workload(cache, save_items, load_items, device, repeats)
        progress(
            f"[bench transfer] {preset} {name}: {n} blocks, {results[name]['bytes'] / 2**20:.0f} MiB each way; "
            + ", ".join(f"{k} {v}" for k, v in results[name]["ratios"].items())
        )
    geometry = {"preset": preset, "block_size": block_size, "cache_blocks": blocks, "repeats": repeats}
    geometry["block_stride"] = cache.block_stride
    return new_result("transfer", quick, _device_name(device), geometry=geometry, results=results)


def _workload(cache, save_items, load_items, device, repeats) -> dict:
    gpu = device.type == "cuda"
    nbytes = _nbytes(save_items)
    saver, loader = DeviceTransfer(cache.buffer), DeviceTransfer(cache.buffer)
    raw_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    raw_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=gpu)
    raw_host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=gpu)
    raw_back = torch.empty(nbytes, dtype=torch.uint8, device=device)
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)] if gpu else [None, None]

    def on(i):
        return torch.cuda.stream(streams[i]) if gpu else nullcontext()

    def raw_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        """The link's copy on a GPU; on the CPU one plain memcpy (numpy's): torch splits a large CPU copy
        over OpenMP threads, which on a busy small machine wait for each other at a barrier (0.1 GB/s)."""
        if gpu:
            dst.copy_(src, non_blocking=True)
        else:
            np.copyto(dst.numpy(), src.numpy())

    def raw_save(sync=True):
        with on(0):
            raw_copy(raw_host, raw_device)
        if sync:
            _sync(device)

    def raw_load(sync=True):
        with on(1):
            raw_copy(raw_back, raw_host_in)
        if sync:
            _sync(device)

    def raw_both():
        raw_save(sync=False)
        raw_load()

    def staged_save():
        for _ in saver._pack(save_items):
            pass

    def load_batches():
        for i, batch in enumerate(batch_plan.batches(load_items, loader.staging_bytes)):
            loader._unpack_batch(batch, lambda host, offsets: [True] * len(offsets), index=i % 2)
            yield

    def staged_load():
        for _ in load_batches():
            pass
        _sync(device)

    def staged_both():
        """One thread drives both directions, as an engine's worker does: each load batch is queued
        between two save batches, so both links stay busy."""
        live, done = [saver._pack(save_items), load_batches()], object()
        while live:
            live = [batches for batches in live if next(batches, done) is not done]
        _sync(device)

    spans = [span for p in save_items for span in page_spans(p.group, p.block)]

    def per_span_save():  # the naive path: one device-to-host copy per span
        at = 0
        for offset, n in spans:
            raw_host[at : at + n].copy_(cache.buffer[offset : offset + n], non_blocking=gpu)
            at += n
        _sync(device)

    rows = {
        "raw_memcpy_save_GBps": _median_gbps(raw_save, nbytes, repeats, device),
        "raw_memcpy_load_GBps": _median_gbps(raw_load, nbytes, repeats, device),
        "raw_memcpy_both_GBps": _median_gbps(raw_both, 2 * nbytes, repeats, device),
        "staged_save_GBps": _median_gbps(staged_save, nbytes, repeats, device),
        "staged_load_GBps": _median_gbps(staged_load, nbytes, repeats, device),
        "staged_both_GBps": _median_gbps(staged_both, 2 * nbytes, repeats, device),
        "per_span_save_GBps": _median_gbps(per_span_save, nbytes, max(1, repeats // 2), device),
    }
    store = open_store(f"memory://?capacity={nbytes + (64 << 20)}")
    saver.save(store, save_items)
    moved = [saved._replace(block=into.block) for saved, into in zip(save_items, load_items)]

    def store_load():
        loader.load(store, moved)
        _sync(device)

    end_to_end = {
        "memory_store_save_GBps": _median_gbps(
            lambda: saver.save(store, save_items), nbytes, max(1, repeats // 2), device
        ),
        "memory_store_load_GBps": _median_gbps(store_load, nbytes, max(1, repeats // 2), device),
    }
    store.close()
    ratio = lambda a, b: round(rows[a] / rows[b], 3)  # noqa: E731
    return {
        "pages": len(save_items),
        "spans": len(spans),
        "bytes": nbytes,
        "staging_bytes": saver.staging_bytes,
        "span_copy": "triton" if saver.copier.use_triton else "foreach",
        **rows,
        "end_to_end": end_to_end,
        "ratios": {
            "save_vs_memcpy": ratio("staged_save_GBps", "raw_memcpy_save_GBps"),
            "load_vs_memcpy": ratio("staged_load_GBps", "raw_memcpy_load_GBps"),
            "both_vs_memcpy": ratio("staged_both_GBps", "raw_memcpy_both_GBps"),
            "per_span_save_vs_memcpy": ratio("per_span_save_GBps", "raw_memcpy_save_GBps"),
        },
    }


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (host buffer)"
