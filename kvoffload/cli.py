"""The `kvoffload` command: `demo` (the main job of `make demo`) and `inspect` (a store's contents)."""

from __future__ import annotations

import argparse
import json
import sys

from .store import StoreConfigError, open_store


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    report = run_demo(store_dir=args.store_dir, prompts=args.prompts)
    if args.json:
        print(json.dumps(report.__dict__, indent=2, default=str))
    else:
        print("\n".join(report.lines()))
    return 0 if report.pages_equal else 1


def _inspect(args: argparse.Namespace) -> int:
    with open_store(args.url) as store:
        print(json.dumps(store.stats(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvoffload", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="offload to the default LMDB store, reopen, verify, report")
    demo.add_argument("--store-dir", help="LMDB directory (default: ~/.cache/kvoffload/demo-store)")
    demo.add_argument("--prompts", type=int, default=8)
    demo.add_argument("--json", action="store_true", help="print the report as JSON")
    demo.set_defaults(func=_demo)
    inspect = sub.add_parser("inspect", help="print a store's statistics as JSON")
    inspect.add_argument("url", help="store URL, e.g. lmdb:///var/cache/kvoffload")
    inspect.set_defaults(func=_inspect)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except StoreConfigError as exc:
        print(f"kvoffload: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
