"""Model identity for keys and fingerprints: what the model computes, not where it lives.

Two stored pages may only be interchanged when the same config ran over the same weights. So the
identity binds
- a canonical digest of the whole model config (every field: rope settings, dtypes, quantization,
  layer types, head sizes...), minus the few fields that only say where or by which library version
  the config was written (`UNBOUND_CONFIG_FIELDS`); and
- the weights: a content digest of every weight file (name, size and every byte), or a revision the
  user vouches for (then nothing is hashed).
Neither depends on absolute paths or file times, so equal models agree across restarts and machines.

Hashing every byte of a large checkpoint takes a while (BENCHMARKS.md), so each file's digest is cached
in the user cache directory, under its real path, size, mtime, ctime and inode: an unchanged file is
never read twice, a rewritten one is. A file changed in the last `_RACY_S` seconds is hashed but not
cached: its timestamps could still match a later write in the same clock tick (git's "racy clean").
"Now" is `clock_ns` (time.time_ns, the clock file times are in; a test passes its own).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeGuard

import xxhash

from ..errors import ConfigError
from ..flock import flock_within
from ..paths import weight_digest_cache

# Config fields that cannot change a KV byte: where the config was read from, and which library wrote it.
UNBOUND_CONFIG_FIELDS = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})
WEIGHT_PATTERNS = (".safetensors", ".bin", ".pt", ".pth", ".gguf")

_CHUNK = 8 << 20
_THREADS = 8  # files hashed at once
_RACY_S = 2.0  # a file younger than this is not cached (timestamps have a clock tick's resolution)
_CACHE_ENTRIES = 4096  # the least recently hashed entries beyond this are dropped
_LOCK_WAIT_S = 3600.0  # another process hashing the same cache: wait at most this long, then hash too
_PROGRESS_ABOVE = 1 << 30  # report progress when more than this many bytes must be read
_PROGRESS_EVERY_S = 5.0


class ModelIdentityError(ConfigError):
    """The model's identity cannot be established (no weight files, unreadable config): say what to set."""


def _canonical(value):
    """JSON-ready and order-free: mappings sorted by key, sequences as lists, floats exact, the rest str."""
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_canonical(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)  # inf/nan are not JSON
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)  # torch.dtype and other library objects: their printed name


def config_digest(config: Mapping) -> str:
    """BLAKE2b-128 (hex) of the canonical JSON of a model config, without `UNBOUND_CONFIG_FIELDS`
    (at the top level and in nested configs such as `text_config`)."""

    def bound(value):
        if isinstance(value, Mapping):
            return {k: bound(v) for k, v in value.items() if k not in UNBOUND_CONFIG_FIELDS}
        if isinstance(value, (list, tuple)):
            return [bound(v) for v in value]
        return value

    text = json.dumps(_canonical(bound(config)), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.blake2b(text.encode(), digest_size=16, person=b"kvoffload-cfg").hexdigest()


def weight_files(path: str) -> list[str]:
    """The weight files of a checkpoint directory (top level, sorted by name), or `path` itself."""
    if os.path.isfile(path):
        return [path]
    names = sorted(n for n in os.listdir(path) if n.endswith(WEIGHT_PATTERNS))
    return [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _file_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _hash_file(path: str, buffer: bytearray, tick: Callable[[int], None]) -> str:
    digest = xxhash.xxh3_128()
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            tick(n)
    return digest.hexdigest()


class _DigestCache:
    """{real path: {"key": [size, mtime_ns, ctime_ns, inode, dev], "xxh3_128": hex, "used": time}} in
    one JSON file, 0600 in a 0700 directory, replaced atomically; writers take turns on a lock file."""

    def __init__(self, path: str):
        self.path = path

    def load(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as f:
                entries = json.load(f)
            return {k: v for k, v in entries.items() if isinstance(v, dict)} if isinstance(entries, dict) else {}
        except (OSError, ValueError):  # damaged or unreadable: hash again, rewrite it
            return {}

    def save(self, entries: dict, say: Callable[[str], None]) -> None:
        try:
            self._save(entries)
        except OSError as exc:  # a read-only home: the digest is still right, only not remembered
            say(f"kvoffload: cannot write the weight digest cache {self.path}: {exc}")

    def _save(self, entries: dict) -> None:
        if len(entries) > _CACHE_ENTRIES:

            def used(p):
                value = entries[p].get("used")
                return value if isinstance(value, (int, float)) else 0

            newest = sorted(entries, key=used, reverse=True)[:_CACHE_ENTRIES]
            entries = {p: entries[p] for p in newest}
        directory = os.path.dirname(self.path)
        fd, tmp = tempfile.mkstemp(prefix=".weight-digests-", dir=directory)  # 0600
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(entries, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def locked(self, progress: Callable[[str], None]):
        """Held while hashing, so that the scheduler and N workers starting at once hash each file once."""
        try:
            os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
            fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            progress(f"kvoffload: no weight digest cache ({exc}): hashing without it")
            yield
            return
        try:
            if not flock_within(
                fd,
                _LOCK_WAIT_S,
                poll=0.2,
                on_wait=lambda: progress("kvoffload: waiting for another process hashing model weights"),
            ):
                progress("kvoffload: weight digest cache still locked; hashing without it")
            yield
        finally:
            os.close(fd)  # releases the lock


def weights_digest(
    path: str,
    *,
    cache_path: str | None = None,
    progress: Callable[[str], None] | None = _stderr,
    clock_ns: Callable[[], int] = time.time_ns,
) -> str:
    """BLAKE2b-128 (hex) over every weight file of `path` (sorted by name): its name, size and xxh3-128
    of its content. Per-file digests are cached (`cache_path`, default in the user cache directory), those
    of files last changed more than `_RACY_S` seconds before `clock_ns()` only."""
    files = weight_files(path)
    if not files:
        raise ModelIdentityError(f"no weight files ({', '.join('*' + p for p in WEIGHT_PATTERNS)}) in {path}")
    say = progress or (lambda _m: None)
    cache = _DigestCache(cache_path or weight_digest_cache())
    digests = _cached(cache, files)
    if len(digests) < len(files):
        with cache.locked(say):
            entries = cache.load()  # another process may have hashed them meanwhile
            digests = _cached(cache, files, entries)
            _hash_missing(files, digests, entries, say, clock_ns)
            cache.save(entries, say)
    total = hashlib.blake2b(digest_size=16, person=b"kvoffload-wts")
    for f in files:
        name = os.path.basename(f).encode()
        total.update(len(name).to_bytes(8, "little") + name + os.stat(f).st_size.to_bytes(8, "little"))
        total.update(bytes.fromhex(digests[f]))
    return total.hexdigest()


def _cached(cache: _DigestCache, files: Iterable[str], entries: dict | None = None) -> dict[str, str]:
    entries = cache.load() if entries is None else entries
    found: dict[str, str] = {}
    for f in files:
        entry = entries.get(os.path.realpath(f))
        digest = entry.get("xxh3_128") if isinstance(entry, dict) else None
        if entry and entry.get("key") == _file_key(os.stat(f)) and _is_digest(digest):
            found[f] = digest
    return found


def _is_digest(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value)


def _hash_missing(
    files: list[str],
    digests: dict[str, str],
    entries: dict,
    say: Callable[[str], None],
    clock_ns: Callable[[], int] = time.time_ns,
) -> None:
    """Hash the files not in `digests`, several at once (xxh3 releases the GIL: a sharded checkpoint in
    the page cache hashes at memory speed per core), and cache the settled ones in `entries`."""
    todo = [f for f in files if f not in digests]
    size = sum(os.stat(f).st_size for f in todo)
    done, started, last = 0, time.monotonic(), time.monotonic()
    lock = threading.Lock()
    loud = size > _PROGRESS_ABOVE
    if loud:
        say(f"kvoffload: hashing {len(todo)} weight file(s), {size / 1e9:.1f} GB, once (cached afterwards)")

    def tick(n: int) -> None:
        nonlocal done, last
        with lock:
            done += n
            now = time.monotonic()
            if loud and now - last >= _PROGRESS_EVERY_S:
                last = now
                say(
                    f"kvoffload: hashed {done / 1e9:.1f} / {size / 1e9:.1f} GB "
                    f"({done / 1e9 / max(now - started, 1e-9):.2f} GB/s)"
                )

    def one(path: str) -> tuple[str, os.stat_result, str, os.stat_result]:
        before = os.stat(path)
        return path, before, _hash_file(path, bytearray(_CHUNK), tick), os.stat(path)

    threads = max(1, min(_THREADS, os.cpu_count() or 1, len(todo)))
    with ThreadPoolExecutor(threads, thread_name_prefix="kvoffload-hash") as pool:
        for path, before, digest, after in pool.map(one, todo):
            digests[path] = digest
            settled = clock_ns() - max(after.st_mtime_ns, after.st_ctime_ns) > _RACY_S * 1e9
            if _file_key(before) == _file_key(after) and settled:
                entries[os.path.realpath(path)] = {"key": _file_key(after), "xxh3_128": digest, "used": time.time()}
    if loud:
        say(f"kvoffload: hashed {size / 1e9:.1f} GB in {time.monotonic() - started:.1f} s")


def weights_identity(path: str | None, revision: str | None = None, **kw) -> str:
    """'revision:<r>' when the user vouches for a revision (nothing hashed), else 'content:<digest>'."""
    if revision:
        return f"revision:{revision}"
    if not path:
        raise ModelIdentityError("no local weight files and no model_revision")
    return f"content:{weights_digest(path, **kw)}"


def model_identity(config: Mapping, weights: str) -> str:
    """One string for keys and fingerprints: 'cfg:<config digest>/<weights identity>'."""
    return f"cfg:{config_digest(config)}/{weights}"
