"""WHERE bytes live: `open_store(url)` returns a `Store` for one of these tiers.

    memory://?capacity=4GiB[&pinned=auto|true|false][&reserve=auto|true|false][&evict=lru|s3fifo]
        reserve: allocate the whole capacity at open (auto: when pinned; no save then waits for page-locking)
        evict: which entry a full tier evicts (eviction.py): lru (default), or s3fifo (scan-resistant)
    lmdb:///abs/dir?capacity=100GiB[&evict=lru|s3fifo]
        evict: as memory's, kept in the file: a store with entries keeps the policy it was written with
    redis://[user:password@]host:port/db?namespace=...   (rediss:// TLS; redis+cluster://h:p,h:p/ a cluster)
    tiered://?memory=4GiB&lmdb=/abs/dir&lmdb_capacity=100GiB[&redis=<redis URL, %-encoded if it has a query>]
             [&write=behind|through][&behind_bytes=2GiB][&behind_age=30][&evict=lru|s3fifo][&lmdb_evict=lru|s3fifo]
        evict: the memory tier's policy; lmdb_evict: LMDB's
        write=behind (default): a put returns once in memory; a background thread writes the disk behind it
        (at most behind_bytes waiting, default min(memory/2, 2GiB); an entry waiting longer than behind_age
        seconds, default 30, is dropped: kept in memory only). write=through: a put returns once on disk.
"""

from __future__ import annotations

from .base import Store
from .errors import EntryTooLargeError, IncompatibleStoreError, StoreConfigError
from .inspect import inspect_store
from .lmdb_store import LMDBStore
from .memory import MemoryStore
from .opening import open_spec, open_store, shared_store
from .url_config import LMDBSpec, MemorySpec, RedisSpec, StoreSpec, TieredSpec, parse_store_url
from .tiered import TieredStore
from .url import parse_size

__all__ = ["Store", "open_store", "open_spec", "shared_store", "parse_store_url", "MemoryStore", "LMDBStore",
           "TieredStore", "StoreConfigError", "EntryTooLargeError", "IncompatibleStoreError", "parse_size",
           "inspect_store", "MemorySpec", "LMDBSpec", "RedisSpec", "TieredSpec", "StoreSpec"]
