"""WHERE bytes live: `open_store(url)` returns a `Store` for one of these tiers.

    memory://?capacity=4GiB[&pinned=auto|true|false][&reserve=auto|true|false][&evict=lru|s3fifo]
        reserve: allocate the whole capacity at open (auto: when pinned; no save then waits for page-locking)
        evict: which entry a full tier evicts (eviction.py): lru (default), or s3fifo (scan-resistant)
    lmdb:///abs/dir?capacity=100GiB
    redis://[user:password@]host:port/db?namespace=...   (rediss:// TLS; redis+cluster://h:p,h:p/ a cluster)
    tiered://?memory=4GiB&lmdb=/abs/dir&lmdb_capacity=100GiB[&redis=<redis URL, %-encoded if it has a query>]
             [&write=behind|through][&behind_bytes=2GiB][&behind_age=30][&evict=lru|s3fifo]
        write=behind (default): a put returns once in memory; a background thread writes the disk behind it
        (at most behind_bytes waiting, default min(memory/2, 2GiB); an entry waiting longer than behind_age
        seconds, default 30, is dropped: kept in memory only). write=through: a put returns once on disk.
"""

from __future__ import annotations

import threading

from .base import Store
from .errors import EntryTooLargeError, IncompatibleStoreError, StoreConfigError
from .eviction import POLICIES
from .lmdb_store import LMDBStore
from .memory import MemoryStore
from .tiered import TieredStore
from .url import parse_bool, parse_size, parse_url, redact_url

from .inspect import REDIS_SCHEMES, inspect_store
DEFAULT_MEMORY_CAPACITY = "4GiB"
DEFAULT_LMDB_CAPACITY = "16GiB"  # allocated on disk at open (x1.31): a default must stay modest

__all__ = ["Store", "open_store", "shared_store", "MemoryStore", "LMDBStore", "TieredStore", "StoreConfigError",
           "EntryTooLargeError", "IncompatibleStoreError", "parse_size", "inspect_store"]


def _auto_bool(option: str | None, name: str) -> bool | None:
    if option is None or option.lower() == "auto":
        return None
    return parse_bool(option, name)


def evict_option(opts: dict[str, str], scheme: str) -> str:
    """The memory tier's eviction policy (evict=, default lru)."""
    name = opts.get("evict", "lru").strip().lower()
    if name not in POLICIES:
        raise StoreConfigError(f"{scheme}:// evict= takes {' or '.join(POLICIES)}, got {opts['evict'][:40]!r}")
    return name


def open_store(url: str, *, fingerprint: bytes | str | None = None) -> Store:
    """Open the store a URL names. `fingerprint` (the layout fingerprint) is stamped on every
    persistent entry and checked on every read: entries of another layout are never served."""
    parsed = parse_url(url)
    if parsed.scheme == "memory":
        opts = parsed.take({"capacity", "pinned", "reserve", "evict"})
        if parsed.path not in ("", "/"):
            raise StoreConfigError(f"memory:// takes no path, got {redact_url(parsed.path)!r} in {redact_url(url)!r}")
        capacity = parse_size(opts.get("capacity", DEFAULT_MEMORY_CAPACITY), "memory capacity")
        return MemoryStore(capacity, pinned=_auto_bool(opts.get("pinned"), "pinned"), url=url,
                           reserve=_auto_bool(opts.get("reserve"), "reserve"), evict=evict_option(opts, "memory"))
    if parsed.scheme == "lmdb":
        opts = parsed.take({"capacity"})
        if not parsed.path:
            raise StoreConfigError("lmdb:// needs an absolute directory, e.g. lmdb:///var/cache/kvoffload "
                                   f"({redact_url(url)!r})")
        capacity = parse_size(opts.get("capacity", DEFAULT_LMDB_CAPACITY), "lmdb capacity")
        return LMDBStore(parsed.path, capacity, fingerprint=fingerprint, url=url)
    if parsed.scheme in REDIS_SCHEMES:
        from .redis_store import RedisStore

        return RedisStore(url, fingerprint=fingerprint)
    if parsed.scheme == "tiered":
        return _tiered(url, parsed.take({"memory", "lmdb", "lmdb_capacity", "pinned", "reserve", "redis", "write",
                                         "behind_bytes", "behind_age", "admit", "evict"}), fingerprint)
    raise StoreConfigError(f"unknown store scheme {parsed.scheme!r} in {redact_url(url)!r}: use memory://, lmdb://, "
                           "redis:// (rediss://, redis+cluster://) or tiered://")


def _tiered(url: str, opts: dict[str, str], fingerprint) -> Store:
    """Memory in front of LMDB, of Redis, or of LMDB in front of Redis (Redis is then the shared last tier).
    Memory writes the next tier behind (write=behind, the default) or through (write=through); LMDB in
    front of Redis writes Redis through, on the memory tier's writer thread."""
    if "lmdb" not in opts and "redis" not in opts:
        raise StoreConfigError("tiered:// needs lmdb=/abs/dir and/or redis=<URL> (and optionally memory=): "
                               f"{redact_url(url)!r}")
    write = opts.get("write", "behind").lower()
    if write not in ("behind", "through"):
        raise StoreConfigError(f"tiered:// write= takes behind or through, got {opts['write'][:40]!r}")
    behind = {}
    if write == "through" and ({"behind_bytes", "behind_age"} & set(opts)):
        raise StoreConfigError("tiered:// behind_bytes= and behind_age= apply to write=behind only: "
                               f"{redact_url(url)!r}")
    if "behind_bytes" in opts:
        behind["behind_bytes"] = parse_size(opts["behind_bytes"], "behind_bytes")
    if "behind_age" in opts:
        try:
            behind["behind_age"] = float(opts["behind_age"])
        except ValueError:
            behind["behind_age"] = float("nan")
        if not 0 < behind["behind_age"] < float("inf"):
            raise StoreConfigError(f"tiered:// behind_age= takes a positive number of seconds, got "
                                   f"{opts['behind_age'][:40]!r}")
    if "admit" in opts:
        if not opts["admit"].isdigit() or not 1 <= int(opts["admit"]) <= 1000:
            raise StoreConfigError(f"tiered:// admit= takes a number of uses from 1 to 1000, got {opts['admit'][:40]!r}")
        if write == "through" and int(opts["admit"]) > 1:
            raise StoreConfigError(f"tiered:// admit= above 1 needs write=behind: {redact_url(url)!r}")
        behind["admit"] = int(opts["admit"])
    if "redis" in opts and parse_url(opts["redis"]).scheme not in REDIS_SCHEMES:
        raise StoreConfigError("tiered:// redis= takes a redis://, rediss:// or redis+cluster:// URL: "
                               f"{redact_url(url)!r}")
    front = MemoryStore(parse_size(opts.get("memory", DEFAULT_MEMORY_CAPACITY), "memory capacity"),
                        pinned=_auto_bool(opts.get("pinned"), "pinned"),
                        reserve=_auto_bool(opts.get("reserve"), "reserve"), evict=evict_option(opts, "tiered"))
    backs = []
    if "lmdb" in opts:
        backs.append(LMDBStore(opts["lmdb"], parse_size(opts.get("lmdb_capacity", DEFAULT_LMDB_CAPACITY),
                                                        "lmdb_capacity"), fingerprint=fingerprint))
    if "redis" in opts:
        backs.append(open_store(opts["redis"], fingerprint=fingerprint))
    back = backs[0] if len(backs) == 1 else TieredStore(backs[0], backs[1], write="through")
    return TieredStore(front, back, url=redact_url(url), write=write, **behind)


_shared: dict[str, Store] = {}
_shared_lock = threading.Lock()


def shared_store(url: str, *, fingerprint: bytes | str | None = None) -> Store:
    """One store per URL per process, for components of one engine that live in the same process
    (vLLM's scheduler and a single worker): a memory tier is then truly shared, and an LMDB
    environment is opened once, as LMDB requires. A fingerprint given later fills one left unset."""
    with _shared_lock:
        store = _shared.get(url)
        if store is None:
            store = _shared[url] = open_store(url, fingerprint=fingerprint)
        elif fingerprint is not None:
            _adopt_fingerprint(store, fingerprint)
        return store


def _adopt_fingerprint(store: Store, fingerprint) -> None:
    from .entry import normalize_fingerprint

    tiers = [store]
    while tiers:
        tier = tiers.pop()
        if hasattr(tier, "fingerprint") and not any(tier.fingerprint):
            tier.fingerprint = normalize_fingerprint(fingerprint)
        tiers += [t for t in (getattr(tier, "front", None), getattr(tier, "back", None)) if t is not None]
