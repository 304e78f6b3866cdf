"""`kvoffload demo`: a store round trip on the embedded default (LMDB in a local cache directory).

It offloads the cacheable pages of a synthetic GLM-5.3-Flash-shaped cache (MLA latent + DSA indexer
pages, three KDA state checkpoints; the kpool tail ring is skipped), keyed by the chained block keys,
then reopens the store the way a restarted process would and checks every page byte for byte.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass

import numpy as np

from .spec import CacheGroup, CacheLayout, GroupKind, KeyChain, Region, page_key
from .store import open_store


def default_store_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvoffload", "demo-store")


def demo_layout(num_blocks: int = 64) -> CacheLayout:
    """A GLM-5.3-Flash-shaped packed cache at small width: block 16 tokens, index_kpool 4."""
    block = 16
    latent, indexer = block * 32 * 4, (block // 4) * 132  # fp32 latent rows; fp8 pooled rows + scale
    kda = 3 * 128 * 3 * 2 + 4 * 32 * 32 * 4  # bf16 conv window + fp32 recurrent S, per layer
    tail = 8 * 128 * 2
    stride = 2 * latent + 2 * indexer
    stride = max(stride, 2 * kda)

    def region(offset, layer_stride, names, used, dtype):
        return Region(0, offset, layer_stride, stride, tuple(names), used, used, dtype)

    groups = (
        CacheGroup(0, "kda0", GroupKind.STATE, block, (region(0, kda, ["l0", "l5"], kda, "bfloat16+float32"),)),
        CacheGroup(1, "kda1", GroupKind.STATE, block, (region(0, kda, ["l1", "l6"], kda, "bfloat16+float32"),)),
        CacheGroup(2, "kda2", GroupKind.STATE, block, (region(0, kda, ["l3", "l8"], kda, "bfloat16+float32"),)),
        CacheGroup(3, "mla", GroupKind.PAGED, block,
                   (region(0, latent, ["l2.attn", "l7.attn"], latent, "float32"),
                    region(2 * latent, indexer, ["l2.indexer", "l7.indexer"], indexer, "uint8")),
                   tokens_per_state=4),
        CacheGroup(4, "tail", GroupKind.SKIP, 8, (region(0, tail, ["l2.tail", "l7.tail"], tail, "bfloat16"),)),
    )
    return CacheLayout(model_id="demo/glm5next-shaped", groups=groups, block_size=block, hash_block_size=block,
                       hit_alignment=block, num_blocks=num_blocks, buffer_sizes=(stride * num_blocks,),
                       index_kpool=4)


@dataclass
class DemoReport:
    store_url: str
    prompts: int
    blocks: int
    pages: int
    stored_bytes: int
    save_seconds: float
    load_seconds: float
    pages_equal: bool
    bytes_per_token: dict[str, int]
    stats: dict

    def lines(self) -> list[str]:
        mb = self.stored_bytes / 1e6
        return [
            f"store            {self.store_url}",
            f"saved            {self.pages} pages for {self.blocks} blocks of {self.prompts} prompts ({mb:.1f} MB)",
            f"bytes per token  " + ", ".join(f"{k} {v}" for k, v in self.bytes_per_token.items()),
            f"save             {self.save_seconds * 1e3:.0f} ms ({mb / max(self.save_seconds, 1e-9):.0f} MB/s, durable)",
            f"load (reopened)  {self.load_seconds * 1e3:.0f} ms ({mb / max(self.load_seconds, 1e-9):.0f} MB/s, verified)",
            f"pages equal      {'yes' if self.pages_equal else 'NO'}",
            f"misses / checksum failures  {self.stats.get('misses', 0)} / {self.stats.get('checksum_failures', 0)}",
        ]


def run_demo(store_dir: str | None = None, prompts: int = 8, prompt_blocks: int = 16, seed: int = 0,
             progress=None) -> DemoReport:
    progress = progress or (lambda message: print(message, file=sys.stderr, flush=True))
    layout = demo_layout()
    store_dir = store_dir or default_store_dir()
    shutil.rmtree(store_dir, ignore_errors=True)  # the demo starts cold every time
    url = f"lmdb://{store_dir}?capacity=1GiB"
    rng = np.random.default_rng(seed)
    chain = KeyChain(layout.fingerprint, layout.block_size, namespace="demo")
    pages: dict[bytes, np.ndarray] = {}
    for p in range(prompts):
        tokens = rng.integers(0, 512, size=prompt_blocks * layout.block_size).tolist()
        for block_key in chain.keys(tokens):
            for group in layout.cacheable_groups:
                pages[page_key(block_key, group.name)] = rng.integers(
                    0, 256, group.used_bytes_per_block, dtype=np.uint8)
    progress(f"[demo] {len(pages)} pages of {len(layout.cacheable_groups)} cacheable groups "
             f"(tail ring skipped) -> {url}")

    with open_store(url, fingerprint=layout.fingerprint) as store:
        start = time.perf_counter()
        items = list(pages.items())
        for i in range(0, len(items), 64):
            if not all(store.put_many(items[i:i + 64])):
                raise RuntimeError(f"store refused pages: {store.stats()}")
        save_seconds = time.perf_counter() - start
    progress("[demo] saved and closed; reopening as a restarted process would")

    with open_store(url, fingerprint=layout.fingerprint) as store:
        outs = {k: np.empty_like(v) for k, v in pages.items()}
        start = time.perf_counter()
        keys = list(pages)
        sizes = store.get_many(keys, [outs[k] for k in keys])
        load_seconds = time.perf_counter() - start
        equal = all(s == pages[k].nbytes for s, k in zip(sizes, keys)) and all(
            np.array_equal(outs[k], pages[k]) for k in keys)
        stats = store.stats()
    return DemoReport(
        store_url=url, prompts=prompts, blocks=prompts * prompt_blocks, pages=len(pages),
        stored_bytes=sum(v.nbytes for v in pages.values()), save_seconds=save_seconds, load_seconds=load_seconds,
        pages_equal=equal,
        bytes_per_token={g.name: g.used_bytes_per_block // layout.block_size for g in layout.groups if g.cacheable},
        stats=stats)
