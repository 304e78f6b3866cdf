"""How a URL (or a parsed spec) becomes an open `Store`: one opener per spec type, and the per-process
table of stores shared by the components of one engine (`shared_store`)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from .base import Store
from .errors import StoreConfigError
from .lmdb_store import LMDBStore
from .memory import MemoryStore
from .tiered import TieredStore
from .url import redact_url
from .url_config import (
    LMDBSpec,
    MemorySpec,
    MooncakeSpec,
    RedisSpec,
    S3Spec,
    StoreSpec,
    TieredSpec,
    parse_store_url,
)


def open_store(url: str, *, fingerprint: bytes | str | None = None) -> Store:
    """Open the store a URL names. `fingerprint` (the layout fingerprint) is stamped on every
    persistent entry and checked on every read: entries of another layout are never served."""
    return open_spec(parse_store_url(url), fingerprint=fingerprint, url=url)


def open_spec(spec: StoreSpec, *, fingerprint: bytes | str | None = None, url: str | None = None) -> Store:
    """Open the store a spec describes (`url`: what its stats show, redacted where it has a password)."""
    return _OPENERS[type(spec)](spec, fingerprint, url)


def _memory(spec: MemorySpec, fingerprint, url: str | None) -> Store:
    return MemoryStore(spec.capacity, pinned=spec.pinned, url=url, reserve=spec.reserve, evict=spec.evict)


def _lmdb(spec: LMDBSpec, fingerprint, url: str | None) -> Store:
    return LMDBStore(spec.path, spec.capacity, fingerprint=fingerprint, url=url, evict=spec.evict)


def _redis(spec: RedisSpec, fingerprint, url: str | None) -> Store:
    from .redis_store import RedisStore

    return RedisStore(spec, fingerprint=fingerprint, url=url)


def _s3(spec: S3Spec, fingerprint, url: str | None) -> Store:
    from .s3_store import S3Store

    return S3Store(spec, fingerprint=fingerprint, url=url)


def _mooncake(spec: MooncakeSpec, fingerprint, url: str | None) -> Store:
    from .mooncake_store import MooncakeStore

    return MooncakeStore(spec, fingerprint=fingerprint, url=url)


def _tiered(spec: TieredSpec, fingerprint, url: str | None) -> Store:
    """Memory in front of LMDB, of a shared tier (Redis, S3, Mooncake), or of LMDB in front of a shared
    tier (the last one). Memory writes the next tier behind (write=behind, the default) or through
    (write=through); LMDB in front of the shared tier writes it through, on the memory tier's writer
    thread; a hit in the last tier is copied into LMDB and memory (read-through)."""
    front = _memory(spec.memory, None, None)
    backs = []
    if spec.lmdb:
        backs.append(_lmdb(spec.lmdb, fingerprint, None))
    if spec.redis:
        backs.append(_redis(spec.redis, fingerprint, None))
    if spec.s3:
        backs.append(_s3(spec.s3, fingerprint, None))
    if spec.mooncake:
        backs.append(_mooncake(spec.mooncake, fingerprint, None))
    back = backs[0] if len(backs) == 1 else TieredStore(backs[0], backs[1], write="through")
    return TieredStore(
        front, back, url=redact_url(url) if url else spec.url(), write=spec.write, **spec.behind_options()
    )


# spec type -> its opener (each takes that spec type; `open_spec` looks it up by the spec's own type)
_OPENERS: dict[type, Callable[[Any, bytes | str | None, str | None], Store]] = {
    MemorySpec: _memory,
    LMDBSpec: _lmdb,
    RedisSpec: _redis,
    S3Spec: _s3,
    MooncakeSpec: _mooncake,
    TieredSpec: _tiered,
}


def _no_segment(spec: StoreSpec) -> StoreSpec:
    """The spec with any Mooncake tier joining as a client only (segment=0)."""
    if isinstance(spec, MooncakeSpec):
        return dataclasses.replace(spec, segment=0, capacity=spec.capacity or spec.segment)
    if isinstance(spec, TieredSpec) and spec.mooncake:
        return dataclasses.replace(spec, mooncake=dataclasses.replace(spec.mooncake, segment=0))
    return spec


_shared: dict[str, tuple[Store, bytes | None]] = {}
_shared_lock = threading.Lock()


def shared_store(url: str, *, fingerprint: bytes | str | None = None) -> Store:
    """One store per URL per process, for components of one engine that live in the same process
    (vLLM's scheduler and a single worker): a memory tier is then truly shared, and an LMDB
    environment is opened once, as LMDB requires.

    A store's fingerprint is fixed when it opens. `fingerprint=None` asks for presence only (vLLM's
    scheduler looks keys up, never reads an entry, and cannot know the workers' byte layout): it gets
    the store open now, whatever its fingerprint, so it must ask again at each use rather than keep
    the object; a `tiered://` store opened so reserves and page-locks no memory (only a store with a
    fingerprint is ever written). The first caller with a fingerprint replaces a store opened for presence only (closed,
    then opened with the fingerprint: what it holds stays on disk or in Redis); a store open with
    another fingerprint is refused."""
    from .entry import normalize_fingerprint

    wanted = None if fingerprint is None else normalize_fingerprint(fingerprint)
    with _shared_lock:
        store, opened_with = _shared.get(url, (None, None))
        if store is not None and wanted is not None and opened_with != wanted:
            if opened_with is not None:
                raise StoreConfigError(
                    f"store {redact_url(url)!r} is already open in this process for another "
                    "layout fingerprint: one process serves one layout per store"
                )
            store.close()
            store = None
        if store is None:
            spec = parse_store_url(url)
            if wanted is None and isinstance(spec, TieredSpec):
                # Presence only (vLLM's scheduler, in its own process): its memory tier is never written,
                # so it must not reserve or page-lock the arena the workers' stores hold.
                spec = dataclasses.replace(spec, memory=dataclasses.replace(spec.memory, pinned=False, reserve=False))
            if wanted is None:  # nor contribute memory to a Mooncake pool
                spec = _no_segment(spec)
            store = open_spec(spec, fingerprint=fingerprint, url=url)
            _shared[url] = (store, wanted)
        return store
