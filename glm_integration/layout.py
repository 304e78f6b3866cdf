"""`python -m glm_integration.layout --preset P [--block-size B] [--json]`: the runner's paged cache
groups (PAGED / STATE / SKIP), block size and bytes per block per group, without allocating it."""

from __future__ import annotations

import argparse
import json
import sys

from .cache import INDEX_FORMATS, PagedCache
from .config import PRESETS, preset


def describe(name: str, block_size: int, index_format: str) -> dict:
    cache = PagedCache(preset(name), block_size, 1, index_format=index_format, model_id=f"preset:{name}", device="meta")
    layout = cache.layout
    return {
        "preset": name,
        "block_size": layout.block_size,
        "index_kpool": layout.index_kpool,
        "block_stride_bytes": cache.block_stride,
        "stored_bytes_per_block": layout.stored_bytes_per_block(),
        "groups": [
            {
                "name": g.name,
                "kind": g.kind.value,
                "layers": list(g.layer_names),
                "bytes_per_block": g.used_bytes_per_block,
                "regions": [
                    {"offset": r.offset, "layer_stride": r.layer_stride, "used_bytes": r.used_bytes, "dtype": r.dtype}
                    for r in g.regions
                ],
            }
            for g in layout.groups
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glm_integration.layout", description=__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--index-format", choices=INDEX_FORMATS, default="fp8")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    info = describe(args.preset, args.block_size, args.index_format)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(
        f"preset {info['preset']}: block {info['block_size']} tokens, index_kpool {info['index_kpool']}, "
        f"stored {info['stored_bytes_per_block']} bytes per block"
    )
    for g in info["groups"]:
        print(f"  {g['name']:6} {g['kind']:6} {g['bytes_per_block']:>12} bytes/block  layers {', '.join(g['layers'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
