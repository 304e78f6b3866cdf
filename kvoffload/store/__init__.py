"""WHERE bytes live: `open_store(url)` returns a `Store` for one of these tiers: `memory://` (one
process's host memory), `lmdb:///abs/dir` (local disk), `redis://` (rediss://, redis+cluster://: shared
by many hosts) and `tiered://` (memory in front of LMDB and/or Redis, writing behind or through).
Every scheme's options, defaults and rules: the docstring of `url_config.py`, next to the parser."""

from __future__ import annotations

from .base import Store
from .errors import EntryTooLargeError, IncompatibleStoreError, KeyTooLongError, StoreConfigError
from .inspect import inspect_store
from .lmdb_store import LMDBStore
from .memory import MemoryStore
from .opening import open_spec, open_store, shared_store
from .tiered import TieredStore
from .url import parse_size
from .url_config import LMDBSpec, MemorySpec, RedisSpec, StoreSpec, TieredSpec, parse_store_url

__all__ = [
    "Store",
    "open_store",
    "open_spec",
    "shared_store",
    "parse_store_url",
    "MemoryStore",
    "LMDBStore",
    "TieredStore",
    "StoreConfigError",
    "EntryTooLargeError",
    "KeyTooLongError",
    "IncompatibleStoreError",
    "parse_size",
    "inspect_store",
    "MemorySpec",
    "LMDBSpec",
    "RedisSpec",
    "TieredSpec",
    "StoreSpec",
]
