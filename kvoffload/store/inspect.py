"""`kvoffload inspect URL`: a store's figures, read without creating or changing anything (a path that
is not a store is an error, never a new store)."""

from __future__ import annotations

from .errors import StoreConfigError
from .lmdb_store import read_stats
from .url import redact_url
from .url_config import LMDBSpec, MemorySpec, RedisSpec, TieredSpec, parse_store_url


def inspect_store(url: str) -> dict:
    spec = parse_store_url(url)
    if isinstance(spec, LMDBSpec):
        return read_stats(spec.path)
    if isinstance(spec, RedisSpec):
        return _redis_stats(spec, url)
    if isinstance(spec, TieredSpec):
        tiers = {"lmdb": read_stats(spec.lmdb.path)} if spec.lmdb else {}
        if spec.redis:
            tiers["redis"] = _redis_stats(spec.redis, None)
        return {"url": redact_url(url), **tiers}
    assert isinstance(spec, MemorySpec)
    raise StoreConfigError("a memory:// store lives inside one process: there is nothing to inspect")


def _redis_stats(spec: RedisSpec, url: str | None) -> dict:
    from .opening import open_spec

    with open_spec(spec, url=url) as store:
        return store.stats()
