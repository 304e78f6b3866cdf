"""What the vLLM scheduler knows of the store, built once from the parsed store spec (`StoreIndex`): the
store this process opens for presence lookups (not for a memory:// store, which lives in the workers),
the mirror of a memory tier living in the workers (`mirrored_tier`), fed by the workers' reports, and the
store's clearing at a reset."""

from __future__ import annotations

import logging
from typing import Protocol, cast

from ..store import Store, StoreSpec, shared_store
from ..store.url import redact_url
from .vllm_messages import StoredPages

log = logging.getLogger("kvoffload.connectors.vllm")


class MirrorIndex:
    """The scheduler's view of a worker's memory tier: the same byte capacity and eviction policy
    (`evict=`), fed by `StoredPages`. A page it still believes present but the worker evicted fails its
    load and is recomputed, never served wrong."""

    def __init__(self, capacity: int, evict: str = "lru"):
        from ..store.eviction import make_policy

        self.capacity, self.used = capacity, 0
        self.sizes: dict[bytes, int] = {}
        self.policy = make_policy(evict, capacity, self.sizes)

    def _drop(self, key: bytes) -> None:
        self.used -= self.sizes.pop(key, 0)
        self.policy.remove(key)

    def update(self, report: StoredPages) -> set[bytes]:
        """Apply a report; returns the keys it no longer holds (missing at a load, evicted)."""
        dropped = report.missing | report.evicted
        for key in dropped:
            self._drop(key)
        for key, size in report.added.items():
            self._drop(key)
            self.sizes[key] = size
            self.policy.insert(key, size)
            self.used += size
            while self.used > self.capacity and (victim := self.policy.victim(lambda k: True)) is not None:
                self._drop(victim)
                dropped.add(victim)
        return {key for key in dropped if key not in self.sizes}

    def clear(self) -> None:
        self.used = 0
        self.sizes.clear()
        self.policy.clear()  # else it would offer the cleared keys as victims (reported removed again)

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        found = [k in self.sizes for k in keys]
        for key, there in zip(keys, found):
            if there:
                self.policy.touch(key)
        return found


def mirrored_tier(spec: StoreSpec) -> _ProcessMemory | None:
    """The memory tier the scheduler mirrors from the workers' reports, as it lives in each worker
    process: a memory:// store, and the memory front of a tiered:// store with admit > 1, where a page
    waits there for the use that admits it to the back tier. The back tier (LMDB, Redis) is read directly
    by the scheduler process; with admit=1 every page goes behind, so that is enough: None, and the
    workers then report no written keys."""
    local = spec.memory_front if spec.admit > 1 else spec
    if local is None or not local.process_local:
        return None
    return cast(_ProcessMemory, local)  # only a memory tier lives in one process: it has both


def _mirror_for(spec: StoreSpec, workers: int) -> MirrorIndex | None:
    """The mirror of every worker's `mirrored_tier` together, or None."""
    memory = mirrored_tier(spec)
    return None if memory is None else MirrorIndex(workers * memory.capacity, memory.evict)


class _ProcessMemory(Protocol):
    """What the mirror needs of a memory tier's spec."""

    capacity: int
    evict: str


class StoreIndex:
    """Presence of pages for the scheduler: the mirrored memory tiers first, then the store this process
    opens. Built once from the connector's parsed `spec`; the store object is asked for at each use, as
    a worker in this process may reopen it with its layout fingerprint (`shared_store`)."""

    def __init__(self, spec: StoreSpec, url: str, workers: int, namespace: str):
        self.spec, self.url, self.namespace = spec, url, namespace
        self.mirror = _mirror_for(spec, workers)
        store = self._store
        if store is not None:  # a memory store lives in the workers; others open here, at start-up
            store.claim(namespace)

    @property
    def _store(self) -> Store | None:
        return None if self.spec.process_local else shared_store(self.url)

    def present(self, keys: list[bytes], lookup: bool = True) -> list[bool]:
        """Whether each page is in the mirrored memory tiers or the store. For a `lookup` the mirror's
        recency is refreshed as the load will; otherwise (KV events, evictions) nothing is touched."""
        store = self._store
        if self.mirror is None:
            return cast(Store, store).contains_many(keys)  # no mirror: the store is this process's
        found = self.mirror.contains_many(keys) if lookup else [k in self.mirror.sizes for k in keys]
        rest = [i for i, there in enumerate(found) if not there]
        if rest and store is not None:
            for i, there in zip(rest, store.contains_many([keys[i] for i in rest])):
                found[i] = there
        return found

    def gone(self, keys: set[bytes]) -> set[bytes]:
        """Of the keys a tier let go (evicted, or dropped from the mirror), those the store lacks now: a
        page a tiered:// front evicted may be on disk, one LMDB evicted may have been written again."""
        if not keys or self._store is None:
            return keys
        ordered = list(keys)  # none of them in the mirror: it let them go, or there is none
        return {key for key, there in zip(ordered, self.present(ordered, lookup=False)) if not there}

    def apply(self, report: StoredPages) -> set[bytes]:
        """A step's worker report: the keys no tier of the workers holds any more (missing, evicted)."""
        return self.mirror.update(report) if self.mirror is not None else report.missing | report.evicted

    def clear(self) -> bool:
        """`reset_prefix_cache(reset_connector=True)`: the store this process opens, cleared (`Store.clear`),
        and the mirror emptied; False, with the reason logged, when the store was not cleared."""
        store = self._store
        if store is not None and not store.clear(self.namespace):
            log.warning(
                "KVOffloadConnector: reset_cache: the store %s was not cleared (see above)", redact_url(store.url)
            )
            return False
        if self.mirror is not None:
            self.mirror.clear()
        return True
