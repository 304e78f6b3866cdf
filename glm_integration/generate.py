"""`python -m glm_integration.generate --model DIR --prompt-ids "1 2 3" --max-tokens N [--json]`:
greedy generation with the bundled runner."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from .cache import INDEX_FORMATS, PagedCache
from .engine import Engine
from .loader import load_model


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise SystemExit(f"--prompt-ids must be space-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glm_integration.generate", description=__doc__)
    parser.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors)")
    parser.add_argument(
        "--prompt-ids",
        required=True,
        action="append",
        help="space-separated token ids; repeat the flag for a batch of requests",
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--index-format", choices=INDEX_FORMATS, default="fp32")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="fixed CPU threads (results are bit-stable for a given count; 1 is fastest at tiny sizes)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config, model, model_id = load_model(args.model)
    cache = PagedCache(config, args.block_size, args.num_blocks, index_format=args.index_format, model_id=model_id)
    engine = Engine(model, cache)
    started = time.perf_counter()
    requests = engine.generate([parse_ids(p) for p in args.prompt_ids], args.max_tokens)
    seconds = time.perf_counter() - started
    if args.json:
        out = {
            "tokens": requests[0].output,
            "requests": [
                {"tokens": r.output, "cached_tokens": r.cached_tokens, "prefill_seconds": r.prefill_seconds}
                for r in requests
            ],
            "seconds": seconds,
            "model_id": model_id,
        }
        print(json.dumps(out))
    else:
        for r in requests:
            print(" ".join(map(str, r.output)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
