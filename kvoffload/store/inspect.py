"""`kvoffload inspect URL`: a store's figures, read without creating or changing anything (a path that
is not a store is an error, never a new store)."""

from __future__ import annotations

from .errors import StoreConfigError
from .lmdb_store import read_stats
from .url import parse_url, redact_url

REDIS_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")


def inspect_store(url: str) -> dict:
    parsed = parse_url(url)
    if parsed.scheme == "lmdb":
        parsed.take({"capacity"})
        return read_stats(parsed.path)
    if parsed.scheme in REDIS_SCHEMES:
        return _redis_stats(url)
    if parsed.scheme == "tiered":
        opts = parsed.take({"memory", "lmdb", "lmdb_capacity", "pinned", "reserve", "redis", "write", "behind_bytes",
                             "behind_age"})
        tiers = {"lmdb": read_stats(opts["lmdb"])} if "lmdb" in opts else {}
        if "redis" in opts:
            tiers["redis"] = _redis_stats(opts["redis"])
        return {"url": redact_url(url), **tiers}
    if parsed.scheme == "memory":
        raise StoreConfigError("a memory:// store lives inside one process: there is nothing to inspect")
    raise StoreConfigError(f"unknown store scheme {parsed.scheme!r} in {redact_url(url)!r}")


def _redis_stats(url: str) -> dict:
    from . import open_store

    with open_store(url) as store:
        return store.stats()
