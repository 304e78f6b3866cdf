"""The `kvoffload` command: `demo` (the main job of `make demo`), `verify` (cold/warm proof on the
bundled GLM runner), `bench` (offload benchmarks), `inspect` (a store's statistics), `vllm` (vLLM's own
command line on every vLLM build) and `write-model` (a small model to serve on a CPU)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .errors import INPUT_ERRORS, KVOffloadError
from .paths import bench_results_dir

BENCHMARKS = {  # name -> (kvoffload.tools.bench module, what it measures)
    "store": ("store", "memory and LMDB put/get GB/s against memcpy and raw file I/O"),
    "footprint": ("footprint", "bytes stored per token, by group, for the GLM presets and TP sizes"),
    "ttft": ("ttft", "bundled runner: cold vs warm time to first token from memory and LMDB"),
    "transfer": ("transfer", "device <-> host page movement against a raw pinned copy"),
    "vllm-ttft": ("vllm_ttft", "vLLM engine: cold and warm TTFT, every tier and vLLM's own connectors"),
    "overhead": ("overhead", "vLLM engine: step time with the connector and no hits"),
    "redis": ("redis_tier", "Redis tier GB/s against raw pipelined SET/GET"),
    "s3": ("s3_tier", "S3 tier GB/s, p50/p99 against raw obstore/boto3, LMDB, loopback HTTP"),
    "mooncake": ("mooncake_tier", "Mooncake tier GB/s, p50/p99 against its raw client, Redis, loopback TCP"),
    "faults": ("faults", "LMDB fault campaign: killed writers, damaged files, contention"),
    "datapath": ("datapath", "save/load through the real tiers against raw copies and reads (GPU)"),
    "stall": ("stall", "vLLM engine: decode-step stalls while another request's prefix moves"),
    "trace": ("trace", "cache and retention policies on a synthetic multi-turn trace"),
    "prefetch": ("prefetch", "vLLM engine: a queued request's prefix prefetched from LMDB"),
    "warmstart": ("warmstart", "a restarted process's first restore against a raw copy (GPU)"),
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvoffload")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "(not installed)"


def _refuse(exc: Exception) -> int:
    message = (
        f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) and exc.filename and exc.strerror else str(exc)
    )
    print(f"kvoffload: {message}", file=sys.stderr)
    return 2


def _count(text: str) -> int:
    """argparse type: an integer of at least 1 (0 or less would run nothing, or divide by zero)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _print_report(report: dict, as_json: bool) -> int:
    from .tools.demo import report_lines

    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print("\n".join(report_lines(report)))
    return 0 if report["ok"] else 1


def _demo(args: argparse.Namespace) -> int:
    from .tools.demo import run_demo

    return _print_report(run_demo(args.store, progress=_progress), args.json)


# the verify flags whose names are `verify`'s keywords (--model and --prompts are not)
VERIFY_FLAGS = ("preset", "restart", "separate", "block_size", "max_tokens", "device", "kernels", "yes")


def _verify(args: argparse.Namespace) -> int:
    from .tools.verify import verify

    same = {name: getattr(args, name) for name in VERIFY_FLAGS}
    progress = None if args.quiet else _progress
    report = verify(args.store, model_dir=args.model, prompts_file=args.prompts, progress=progress, **same)
    return _print_report(report, args.json)


ON_DEVICES = ("vllm-ttft", "overhead", "stall")  # the vLLM engine benchmarks with a CPU and a GPU profile
OPTION_OF = {"model": ("vllm-ttft",), "trace": ("stall",)}  # the options only some of them take


class BenchOptionError(KVOffloadError, ValueError):
    """A benchmark option the chosen benchmark does not take."""


def _bench(args: argparse.Namespace) -> int:
    import importlib
    import inspect

    from .tools.bench.common import write_result

    module = importlib.import_module(f"kvoffload.tools.bench.{BENCHMARKS[args.name][0]}")
    options: dict = {}
    for flag, value, default in (
        ("device", args.device, "cpu"),
        ("eager", args.eager, False),
        ("model", args.model, "small"),
        ("trace", args.trace, None),
    ):
        if value != default:
            if flag not in inspect.signature(module.run).parameters:
                having = ", ".join(n for n in ON_DEVICES if n in OPTION_OF.get(flag, ON_DEVICES))
                raise BenchOptionError(f"bench {args.name} has no --{flag} (those with one: {having})")
            options[flag] = value
    if args.model != "small" and args.device != "cuda":
        raise BenchOptionError(f"--model {args.model} runs on a GPU only (--device cuda): 16 GB of weights")
    result = module.run(quick=args.quick, progress=None if args.json else _progress, **options)
    path = write_result(args.name, result, args.out)
    try:
        from .tools.bench.plots import plot

        figure = plot(result, path) if path else "no plot (no --out directory)"
    except ImportError:
        figure = "no plot (matplotlib is not installed: pip install 'kvoffload[bench]')"
    print(json.dumps(result, indent=2) if args.json else f"results: {path}\nplot: {figure}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .store import inspect_store

    print(json.dumps(inspect_store(args.url), indent=2))
    return 0


def _vllm(args: list[str]) -> int:
    from .tools.vllm_cli import main as vllm_main

    return vllm_main(args)


WRITE_MODEL_LAYERS_MAX = 64  # a few MB each; enough for any example


def _write_model(args: argparse.Namespace) -> int:
    from .tools.bench.vllm_models import tiny_llama

    if args.layers > WRITE_MODEL_LAYERS_MAX:
        raise BenchOptionError(f"--layers {args.layers}: at most {WRITE_MODEL_LAYERS_MAX}")
    path = tiny_llama(os.path.abspath(args.dir), num_hidden_layers=args.layers)
    print(f"{path}: a float32 LlamaForCausalLM with random weights, {args.layers} layers, vocab 512, no tokenizer")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["vllm"]:  # every later argument is vLLM's, options included
        return _vllm(argv[1:])
    parser = argparse.ArgumentParser(prog="kvoffload", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="cold run, offload to LMDB, restart, warm run, report")
    demo.add_argument("--store", help="store URL (default: LMDB under ~/.cache/kvoffload/demo-store)")
    demo.add_argument("--json", action="store_true", help="print the report as JSON")
    demo.set_defaults(func=_demo)
    ver = sub.add_parser("verify", help="prove cold == warm on the bundled runner; exit 0 only if all equal")
    ver.add_argument(
        "--store",
        default="memory://?capacity=1GiB",
        help="memory://, lmdb://, redis://, s3://, mooncake:// or tiered:// URL",
    )
    source = ver.add_mutually_exclusive_group()
    source.add_argument(
        "--preset",
        default="tiny",
        help="a runner preset, its random checkpoint written once: tiny (default, 7 MiB), vllm-4l (1.2 GiB), "
        "pruned-4l (31.6 GiB), full (597 GiB; the last two only with --yes)",
    )
    source.add_argument("--model", help="a GLM-5.3-Flash checkpoint directory")
    ver.add_argument(
        "--prompts", help="file with one prompt per line, space-separated token ids (default: the built-in edge cases)"
    )
    mode = ver.add_mutually_exclusive_group()
    mode.add_argument("--restart", action="store_true", help="run the warm phase in a new process")
    mode.add_argument(
        "--separate",
        action="store_true",
        help="run cold and warm each in a new process: two independent runners sharing only the store (e.g. redis://)",
    )
    ver.add_argument("--device", default="cpu", help="cpu or cuda[:N] (NVIDIA or ROCm GPU; default cpu)")
    ver.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "torch", "triton", "aiter"],
        help="runner kernel backend (auto: triton on a GPU, torch on the CPU)",
    )
    ver.add_argument(
        "--block-size",
        type=_count,
        default=16,
        help="tokens per cache block (a multiple of the model's index_kpool; default 16); "
        "the built-in prompts grow with it",
    )
    ver.add_argument("--max-tokens", type=_count, default=8, help="greedy decode steps compared per prompt (default 8)")
    ver.add_argument("--yes", action="store_true", help="write a preset's checkpoint however large")
    ver.add_argument(
        "--json",
        action="store_true",
        help="per prompt: tokens_equal, pages_equal, hit_tokens, cold and warm prefill seconds; totals",
    )
    ver.add_argument("--quiet", action="store_true", help="no progress output")
    ver.set_defaults(func=_verify)
    bench = sub.add_parser(
        "bench",
        help="offload benchmarks with same-run baselines (JSON)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="benchmarks:\n" + "\n".join(f"  {name:<10} {what}" for name, (_, what) in BENCHMARKS.items()),
    )
    bench.add_argument("name", choices=list(BENCHMARKS), metavar="NAME", help="the benchmark (listed below)")
    bench.add_argument("--quick", action="store_true", help="small sizes: checks the benchmark, not the machine")
    bench.add_argument(
        "--out",
        default=bench_results_dir(),
        help="directory for the JSON result and plot (default %(default)s; the project's own figures are "
        "written with --out bench/results)",
    )
    bench.add_argument("--json", action="store_true", help="print the result JSON instead of progress")
    bench.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help=f"where the vLLM engine runs ({', '.join(ON_DEVICES)}; default cpu: vLLM's CPU build)",
    )
    bench.add_argument(
        "--eager",
        action="store_true",
        help="run the GPU engines with enforce_eager (default: CUDA graphs, as vLLM serves)",
    )
    bench.add_argument(
        "--model",
        default="small",
        choices=["small", "llama-3.1-8b"],
        help="vllm-ttft on a GPU: the benchmark's small model (its KV weighs a real one's; default) or the whole "
        "Llama-3.1-8B shape (16 GB of random weights written on the machine; engines one at a time)",
    )
    bench.add_argument(
        "--trace",
        metavar="DIR",
        help="stall: record one round's steps per engine with torch.profiler into DIR (gzipped Chrome traces: "
        "every thread's CUDA calls, the device's kernels and copies per stream)",
    )
    bench.set_defaults(func=_bench)
    inspect = sub.add_parser("inspect", help="print a store's statistics as JSON")
    inspect.add_argument("url", help="store URL, e.g. lmdb:///var/cache/kvoffload")
    inspect.set_defaults(func=_inspect)
    sub.add_parser(  # listed for --help; main() hands its arguments to vLLM before parsing
        "vllm",
        help="vLLM's command line (e.g. kvoffload vllm serve MODEL ...), on the CUDA wheel and the CPU build",
        add_help=False,
    )
    model = sub.add_parser("write-model", help="write a small llama model (random weights) to serve on a CPU")
    model.add_argument("dir", help="the model directory to write")
    model.add_argument("--layers", type=_count, default=2, help="hidden layers (default 2)")
    model.set_defaults(func=_write_model)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except INPUT_ERRORS as exc:
        return _refuse(exc)
    except KeyboardInterrupt:  # Ctrl-C: the context managers on the way out have stopped every child
        print("kvoffload: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
