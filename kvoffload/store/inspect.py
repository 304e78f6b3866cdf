"""`kvoffload inspect URL`: a store's figures, read without creating or changing anything (a path that
is not a store is an error, never a new store)."""

from __future__ import annotations

from .errors import StoreConfigError
from .lmdb_store import read_stats
from .url import MAX_SIZE, redact_url
from .url_config import LMDBSpec, MemorySpec, MooncakeSpec, RedisSpec, S3Spec, TieredSpec, parse_store_url


def inspect_store(url: str) -> dict:
    spec = parse_store_url(url)
    if isinstance(spec, LMDBSpec):
        return read_stats(spec.path)
    if isinstance(spec, RedisSpec):
        return _redis_stats(spec, url)
    if isinstance(spec, S3Spec):
        return _s3_stats(spec, url)
    if isinstance(spec, MooncakeSpec):
        return _mooncake_stats(spec)
    if isinstance(spec, TieredSpec):
        tiers = {"lmdb": read_stats(spec.lmdb.path)} if spec.lmdb else {}
        if spec.redis:
            tiers["redis"] = _redis_stats(spec.redis, None)
        if spec.s3:
            tiers["s3"] = _s3_stats(spec.s3, None)
        if spec.mooncake:
            tiers["mooncake"] = _mooncake_stats(spec.mooncake)
        return {"url": redact_url(url), **tiers}
    assert isinstance(spec, MemorySpec)
    raise StoreConfigError("a memory:// store lives inside one process: there is nothing to inspect")


def _redis_stats(spec: RedisSpec, url: str | None) -> dict:
    from .opening import open_spec

    with open_spec(spec, url=url) as store:
        return store.stats()


def _s3_stats(spec: S3Spec, url: str | None) -> dict:
    """The bucket's figures under the prefix; opened with no capacity bound, so that nothing is evicted."""
    import dataclasses

    from .opening import open_spec

    with open_spec(dataclasses.replace(spec, capacity=MAX_SIZE), url=url) as store:
        return {**store.stats(), "capacity": spec.capacity}


def _mooncake_stats(spec: MooncakeSpec) -> dict:
    """The pool's address and this URL's options: a client reads no per-prefix totals from Mooncake, and
    joining the pool to look would contribute memory; `kvoffload inspect` changes nothing."""
    return {"url": spec.url(), "master": spec.master, "metadata": spec.metadata, "namespace": spec.namespace}
