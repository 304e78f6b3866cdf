"""`kvoffload verify`: prove that offloaded KV is exactly what the model needs.

For a prompt set, run the bundled GLM runner cold (nothing in the store for this run: every case of every
run has its own key namespace, so prompts sharing a prefix are each computed in full, and a cold load can
only mean a store that already held this run's pages), save through the runner connector, drop the
device cache (with `restart`: in a new process), run warm from the store, and compare: identical greedy
tokens, every restored page byte-equal to the page the cold run saved (BLAKE2b-256 of each page), every
expected page restored, hit tokens as the layout predicts, and no page of a SKIP group (the kpool tail
ring) ever stored or restored.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field

import torch

from ..connectors.plan import max_hit_blocks, pages_for_load
from ..connectors.runner import RunnerConnector
from ..errors import INPUT_ERRORS, ConfigError
from ..paths import preset_model_dir
from ..spec import GroupKind
from ..store import StoreConfigError, open_store, parse_store_url
from ..store.url import redact_url


def builtin_longest(config, block_size: int) -> int:
    """The longest prompt of `builtin_cases`, known before any is drawn."""
    return max(config.index_topk + 2 * block_size + 3, 4 * block_size + 5)


def builtin_cases(config, block_size: int) -> list[tuple[str, list[list[int]]]]:
    """Named cases, each a batch of prompts run together: the edge cases of pools, blocks and top-k."""
    gen = torch.Generator().manual_seed(1234)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()

    kpool, topk, b = config.index_kpool, config.index_topk, block_size
    shared = tokens(2 * b + b // 2)  # diverges mid-block
    return [
        ("shorter_than_kpool", [tokens(max(kpool - 1, 1))]),
        ("equal_to_kpool", [tokens(kpool)]),
        ("one_block", [tokens(b)]),
        ("block_multiple", [tokens(3 * b)]),
        ("block_multiple_plus_one", [tokens(2 * b + 1)]),
        ("longer_than_topk", [tokens(max(topk + 2 * b + 3, 4 * b + 5))]),
        ("shared_prefix_diverging_mid_block", [shared + tokens(b), shared + tokens(b // 2 + 3)]),
        ("batch_of_three", [tokens(b + 5), tokens(2 * b + 7), tokens(3 * b + 2)]),
    ]


class InputError(ConfigError):
    """A prompt file or verify option this model cannot run: the user's to fix (a failed check is not)."""


def read_prompt_file(path: str, vocab_size: int | None = None) -> list[tuple[str, list[list[int]]]]:
    """One prompt per non-blank line, space-separated token ids, each in [0, vocab_size)."""
    cases = []
    with open(path, encoding="utf-8") as f:
        try:
            lines = f.readlines()
        except UnicodeDecodeError:
            raise InputError(f"{path}: not a text file of token ids") from None
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                prompt = [int(t) for t in line.split()]
            except ValueError:
                raise InputError(f"{path}:{number}: a prompt is space-separated token ids") from None
            if vocab_size and (bad := [t for t in prompt if not 0 <= t < vocab_size]):
                raise InputError(
                    f"{path}:{number}: token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})"
                )
            cases.append((f"{os.path.basename(path)}:{number}", [prompt]))
    if not cases:
        raise InputError(f"{path}: no prompts")
    return cases


ASK_ABOVE_BYTES = 2 << 30  # a preset checkpoint larger than this is written only with `yes`


def default_model_dir(preset: str, yes: bool = False, progress=None) -> str:
    """The preset's checkpoint (seed 0), written once into the user cache and reused. A large one is
    written only when the user said yes and the disk has room; a failed write leaves nothing behind."""
    from glm_integration.checkpoint import checkpoint_bytes, write_checkpoint
    from glm_integration.config import PRESETS
    from glm_integration.config import preset as make_preset

    if preset not in PRESETS:
        raise InputError(f"unknown preset {preset!r} (presets: {', '.join(PRESETS)})")
    path = preset_model_dir(preset)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    config = make_preset(preset)
    size = checkpoint_bytes(config)
    if size > ASK_ABOVE_BYTES and not yes:
        raise InputError(
            f"--preset {preset} writes a {size / 2**30:.1f} GiB random checkpoint to {path}: pass --yes to write it"
        )
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    free = shutil.disk_usage(parent).free
    if size * 1.05 > free:
        raise InputError(
            f"--preset {preset} needs {size / 2**30:.1f} GiB for its checkpoint; "
            f"{parent} has {free / 2**30:.1f} GiB free"
        )
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write_checkpoint(config, 0, tmp, progress=progress)
        os.replace(tmp, path)
    except OSError as exc:  # a full disk, say: the user's to fix, and nothing is left half-written
        raise InputError(f"--preset {preset}: writing its checkpoint to {path} failed: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


MEMORY_SHARE = 0.8  # of the memory available now, the most a verify run's caches may take


def check_sizes(layout, longest: int, batch: int, block_size: int, max_tokens: int, device: str) -> None:
    """Refuse, before anything is allocated, a block size or a token count whose caches cannot fit: the
    runner's cache for the largest case (`batch` prompts of at most `longest` tokens, plus the decode)."""
    import psutil

    per_block = sum(r.page_bytes * r.num_layers for g in layout.groups for r in g.regions)
    blocks = batch * ((longest + max_tokens) // block_size + 2) + 4
    need = 2 * blocks * per_block  # the cold and the warm runner's caches
    available = (
        torch.cuda.mem_get_info(torch.device(device))[0]
        if device.startswith("cuda")
        else psutil.virtual_memory().available
    )
    if need > MEMORY_SHARE * available:
        raise InputError(
            f"--block-size {block_size} and --max-tokens {max_tokens} need about {need / 2**30:.1f} GiB of cache "
            f"for prompts of up to {longest} tokens; {device} has {available / 2**30:.1f} GiB available"
        )


def case_namespace(namespace: str, case: int) -> str:
    """The keys of one case: its cold run finds nothing another case of the run saved."""
    return f"{namespace}/case{case}"


def _digest(data) -> str:
    return hashlib.blake2b(bytes(data), digest_size=32).hexdigest()


@dataclass
class PhaseResult:
    """What one phase (cold or warm) saw, JSON-ready so it can cross a process restart."""

    tokens: list[list[list[int]]] = field(default_factory=list)  # per case, per prompt
    hit_tokens: list[list[int]] = field(default_factory=list)
    loaded_tokens: list[list[int]] = field(default_factory=list)
    prefill_seconds: list[list[float]] = field(default_factory=list)
    pages: dict[str, dict] = field(default_factory=dict)  # key hex -> {group, kind, digest, bytes}
    restored: list[list[list[str]]] = field(default_factory=list)  # per case, per prompt: key hexes
    counters: dict[str, int] = field(default_factory=dict)


class _Recorder:
    """Observer: digests of saved pages; restored pages re-read from the cache after the load."""

    def __init__(self, layout, result: PhaseResult):
        self.layout, self.result = layout, result
        self.pending: list = []

    def saved(self, page, data) -> None:
        self.result.pages[page.key.hex()] = {
            "group": page.group.name,
            "kind": page.group.kind.value,
            "digest": _digest(data),
            "bytes": int(data.nbytes),
        }

    def loaded(self, page) -> None:
        self.pending.append(page)


class _VerifyingConnector(RunnerConnector):
    def __init__(self, store, engine, recorder: _Recorder, state_retention: str = "every"):
        super().__init__(store, engine, recorder, state_retention)
        self.recorder = recorder
        self.restored_now: list[str] = []

    def on_admit(self, engine, request) -> None:
        self.recorder.pending = []
        super().on_admit(engine, request)
        # read restored pages back from the cache, as the model will see them
        self.restored_now = []
        for page in self.recorder.pending:
            data = self.offloader.transfer.gather(page.group, page.block)
            self.recorder.result.pages.setdefault(
                page.key.hex(), {"group": page.group.name, "kind": page.group.kind.value}
            )
            self.recorder.result.pages[page.key.hex()]["restored_digest"] = _digest(data)
            self.restored_now.append(page.key.hex())
        request.restored_keys = list(self.restored_now)


def run_phase(
    model_dir: str,
    store,
    namespace: str,
    cases,
    block_size: int,
    max_tokens: int,
    threads: int = 1,
    progress=None,
    device: str = "cpu",
    kernels: str = "auto",
    state_retention: str = "every",
) -> PhaseResult:
    """One cold or warm pass over every case, each on a fresh device cache. `store` is a URL (opened
    here, stamped with the layout fingerprint) or an open `Store` shared with another phase.
    `state_retention`: 'every' by default, so that every checkpoint's bytes are checked and the bytes
    stored per token are the layout's (the runner's own default keeps fewer: `retention`)."""
    from glm_integration.cache import PagedCache
    from glm_integration.engine import Engine
    from glm_integration.kernels import backend_for, use_backend
    from glm_integration.loader import load_model

    torch.set_num_threads(threads)
    use_backend(backend_for(device, kernels))
    config, model, model_id = load_model(model_dir, device=device)
    result = PhaseResult()
    if isinstance(store, str):
        fingerprint = PagedCache(config, block_size, 1, model_id=model_id, device="meta").layout.fingerprint
        with open_store(store, fingerprint=fingerprint) as opened:
            return run_phase(
                model_dir,
                opened,
                namespace,
                cases,
                block_size,
                max_tokens,
                threads,
                progress,
                device,
                kernels,
                state_retention,
            )
    for c, (name, prompts) in enumerate(cases):
        need = sum((len(p) + max_tokens) // block_size + 2 for p in prompts) + 4
        cache = PagedCache(config, block_size, need, model_id=model_id, device=device)  # fresh and empty
        engine = Engine(model, cache, namespace=case_namespace(namespace, c))
        recorder = _Recorder(cache.layout, result)
        connector = _VerifyingConnector(store, engine, recorder, state_retention)
        requests = engine.generate(prompts, max_tokens)
        result.tokens.append([r.output for r in requests])
        result.hit_tokens.append([r.cached_tokens + r.loaded_tokens for r in requests])
        result.loaded_tokens.append([r.loaded_tokens for r in requests])
        result.prefill_seconds.append([r.prefill_seconds for r in requests])
        result.restored.append([getattr(r, "restored_keys", []) for r in requests])
        for k, v in connector.offloader.counters.items():
            result.counters[k] = result.counters.get(k, 0) + v
        if progress:
            progress(f"  {name}: {len(prompts)} prompt(s), hit tokens {result.hit_tokens[-1]}")
    return result


@dataclass
class PromptReport:
    case: str
    prompt_tokens: int
    tokens_equal: bool
    pages_equal: bool
    hit_tokens: int
    expected_hit_tokens: int
    restored_pages: int
    cold_prefill_seconds: float
    warm_prefill_seconds: float


def compare(cases, cold: PhaseResult, warm: PhaseResult, layout, block_size: int, namespace: str) -> dict:
    """Judge a cold/warm pair against the layout (independently of what the connector did)."""
    from kvoffload.spec import KeyChain

    reports, problems = [], []
    saved = {k: p for k, p in cold.pages.items() if "digest" in p}  # not the pages a cold run loaded
    skip_pages = [
        k
        for k, p in {**saved, **warm.pages}.items()
        if p.get("kind") == GroupKind.SKIP.value or layout.group(p["group"]).kind is GroupKind.SKIP
    ]
    if skip_pages:
        problems.append(f"{len(skip_pages)} page(s) of a SKIP group were stored or restored")
    for p in saved.values():
        if p["bytes"] != layout.group(p["group"]).used_bytes_per_block:
            problems.append(
                f"a {p['group']} page of {p['bytes']} bytes (the group uses "
                f"{layout.group(p['group']).used_bytes_per_block})"
            )
            break
    if any(cold.loaded_tokens[c][i] for c in range(len(cases)) for i in range(len(cases[c][1]))):
        problems.append("the cold run loaded pages: the store was not empty for this run")
    for c, (name, prompts) in enumerate(cases):
        for i, prompt in enumerate(prompts):
            hit = warm.hit_tokens[c][i]
            expected = max_hit_blocks(layout, len(prompt)) * block_size
            keys = KeyChain(layout.fingerprint, block_size, namespace=case_namespace(namespace, c)).keys(prompt)
            loaded_from = (hit - warm.loaded_tokens[c][i]) // block_size
            wanted = {p.key.hex() for p in pages_for_load(layout, keys, loaded_from, hit // block_size)}
            restored = warm.restored[c][i]
            pages_equal = set(restored) == wanted and all(
                warm.pages[k].get("restored_digest") == saved.get(k, {}).get("digest") for k in restored
            )
            reports.append(
                PromptReport(
                    case=name,
                    prompt_tokens=len(prompt),
                    tokens_equal=cold.tokens[c][i] == warm.tokens[c][i],
                    pages_equal=pages_equal,
                    hit_tokens=hit,
                    expected_hit_tokens=expected,
                    restored_pages=len(restored),
                    cold_prefill_seconds=cold.prefill_seconds[c][i],
                    warm_prefill_seconds=warm.prefill_seconds[c][i],
                )
            )
    blocks_saved: dict[str, int] = {}
    for p in saved.values():
        blocks_saved.setdefault(p["group"], 0)
        blocks_saved[p["group"]] += 1
    stored_bytes = sum(p["bytes"] for p in saved.values())
    paged = [g for g in layout.cacheable_groups if g.kind is GroupKind.PAGED]
    stored_blocks = max((blocks_saved.get(g.name, 0) for g in paged), default=0)
    ok = not problems and all(
        r.tokens_equal and r.pages_equal and r.hit_tokens == r.expected_hit_tokens for r in reports
    )
    return {
        "ok": ok,
        "problems": problems,
        "prompts": [asdict(r) for r in reports],
        "totals": {
            "prompts": len(reports),
            "tokens_equal": sum(r.tokens_equal for r in reports),
            "pages_equal": sum(r.pages_equal for r in reports),
            "hit_tokens": sum(r.hit_tokens for r in reports),
            "restored_pages": sum(r.restored_pages for r in reports),
            "stored_pages": len(saved),
            "stored_bytes": stored_bytes,
            "stored_bytes_per_token": stored_bytes / (stored_blocks * block_size) if stored_blocks else 0.0,
            "expected_bytes_per_token": layout.stored_bytes_per_block() / block_size,
            "whole_packed_block_bytes_per_token": len(layout.cacheable_groups)
            * layout.groups[0].regions[0].block_stride
            / block_size,
            "bytes_per_token_by_group": {g.name: g.used_bytes_per_block / block_size for g in layout.cacheable_groups},
            "cold_prefill_seconds": sum(r.cold_prefill_seconds for r in reports),
            "warm_prefill_seconds": sum(r.warm_prefill_seconds for r in reports),
        },
    }


def verify(
    store_url: str,
    *,
    model_dir: str | None = None,
    preset: str = "tiny",
    prompts_file: str | None = None,
    restart: bool = False,
    separate: bool = False,
    block_size: int = 16,
    max_tokens: int = 8,
    progress=None,
    device: str = "cpu",
    kernels: str = "auto",
    yes: bool = False,
) -> dict:
    """`yes`: write a preset's checkpoint however large (else refused above `ASK_ABOVE_BYTES`).
    `restart`: the warm phase runs in a new process. `separate`: the cold and the warm phase each run
    in a new process of their own, two independent runners sharing nothing but the store (a shared
    tier such as redis:// serving another instance)."""
    progress = progress or (lambda message: None)
    device = _check_device(device)
    if (restart or separate) and parse_store_url(store_url).process_local:
        raise StoreConfigError(
            "memory:// lives in one process: use lmdb://, redis://, s3:// or tiered:// with --restart or --separate"
        )
    if block_size < 1 or max_tokens < 1:
        raise InputError(f"block size and max tokens must be at least 1, got {block_size} and {max_tokens}")
    from glm_integration.kernels import backend_for, use_backend

    try:
        use_backend(backend_for(device, kernels))
    except ValueError as exc:  # only raised for a backend unknown or not installed here
        raise InputError(f"--kernels {kernels}: {exc}") from None
    model_dir = model_dir or default_model_dir(preset, yes, progress)
    from glm_integration.cache import PagedCache
    from glm_integration.config import GlmConfig
    from glm_integration.loader import checkpoint_id

    config = GlmConfig.from_pretrained(model_dir)
    if block_size % config.index_kpool:
        raise InputError(
            f"--block-size {block_size} must be a multiple of the model's index_kpool ({config.index_kpool})"
        )
    layout = PagedCache(config, block_size, 1, model_id=checkpoint_id(model_dir), device="meta").layout
    if prompts_file:
        cases = read_prompt_file(prompts_file, config.vocab_size)
        longest, batch = max(len(p) for _, ps in cases for p in ps), 1
    else:
        longest, batch = builtin_longest(config, block_size), 3  # its largest case: three prompts at once
    check_sizes(layout, longest, batch, block_size, max_tokens, device)
    if not prompts_file:
        cases = builtin_cases(config, block_size)
    namespace = f"verify/{uuid.uuid4()}"

    run = {"device": device, "kernels": kernels}
    phase = (model_dir, store_url, namespace, cases, block_size, max_tokens, run)
    shown = redact_url(store_url)
    started = (
        f"[verify] cold run of {sum(len(p) for _, p in cases)} prompts on {device} "
        f"({backend_for(device, kernels)} kernels) -> {shown}"
    )
    if separate:
        progress(started + ", in a new process")
        cold = _phase_in_new_process(*phase)
        progress("[verify] warm run in another new process (an independent runner sharing only the store)")
        warm = _phase_in_new_process(*phase)
    else:
        with open_store(store_url, fingerprint=layout.fingerprint) as store:
            progress(started)

            def in_this_process() -> PhaseResult:
                return run_phase(
                    model_dir,
                    store,
                    namespace,
                    cases,
                    block_size,
                    max_tokens,
                    progress=progress,
                    device=device,
                    kernels=kernels,
                )

            cold = in_this_process()
            if not restart:
                progress("[verify] device cache dropped; warm run")
                warm = in_this_process()
        if restart:
            progress("[verify] device cache dropped, process restarted; warm run")
            warm = _phase_in_new_process(*phase)
    report = compare(cases, cold, warm, layout, block_size, namespace)
    report.update(
        {
            "store": shown,
            "restart": restart,
            "separate": separate,
            "model": model_dir,
            "block_size": block_size,
            "max_tokens": max_tokens,
            "device": device,
            "kernels": backend_for(device, kernels),
            "counters": {"cold": cold.counters, "warm": warm.counters},
        }
    )
    return report


def _check_device(device: str) -> str:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {device}: this torch build sees no GPU (torch {torch.__version__})")
    if not (device == "cpu" or device.startswith("cuda")):
        raise InputError(f"--device must be cpu or cuda[:N] (ROCm GPUs are cuda too), got {device!r}")
    return device


def _phase_in_new_process(model_dir, store_url, namespace, cases, block_size, max_tokens, run) -> PhaseResult:
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = os.path.join(tmp, "phase.json"), os.path.join(tmp, "result.json")
        with open(spec, "w") as f:
            json.dump(
                {
                    "model_dir": model_dir,
                    "store_url": store_url,
                    "namespace": namespace,
                    "cases": cases,
                    "block_size": block_size,
                    "max_tokens": max_tokens,
                    **run,
                },
                f,
            )
        # progress on stderr; a session of its own: Ctrl-C stops the parent, which kills it (subprocess.run)
        proc = subprocess.run([sys.executable, "-m", "kvoffload.tools.verify", spec, out], start_new_session=True)
        if proc.returncode == 2 and os.path.exists(out):  # bad input, reported here as the parent's own
            with open(out) as f:
                raise InputError(json.load(f)["input_error"])
        if proc.returncode != 0:
            raise RuntimeError(f"the phase's process failed with exit status {proc.returncode}")
        with open(out) as f:
            return PhaseResult(**json.load(f))


def _phase_main(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)

    started = time.perf_counter()
    try:
        result = run_phase(
            spec["model_dir"],
            spec["store_url"],
            spec["namespace"],
            [(name, prompts) for name, prompts in spec["cases"]],
            spec["block_size"],
            spec["max_tokens"],
            progress=lambda message: print(message, file=sys.stderr, flush=True),
            device=spec["device"],
            kernels=spec["kernels"],
            state_retention=spec.get("state_retention", "every"),
        )
    except INPUT_ERRORS as exc:  # a store or checkpoint that cannot work: the parent says so, in one line
        with open(out_path, "w") as f:
            json.dump({"input_error": str(exc)}, f)
        return 2
    result.counters["process_seconds"] = int(time.perf_counter() - started)
    with open(out_path, "w") as f:
        json.dump(asdict(result), f)
    return 0


if __name__ == "__main__":
    sys.exit(_phase_main(*sys.argv[1:3]))
