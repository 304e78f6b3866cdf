"""A tier shared by many hosts: Redis, standalone or Cluster (sharding, failover), through redis-py.
Its URLs (redis://, rediss:// with TLS, redis+cluster:// and rediss+cluster:// naming seed nodes) and
their options: url_config.py's docstring.

Keys: `kvoffload:<namespace>:` + the page key. Page keys are chained from the model's identity (the
runner's layout fingerprint, vLLM's model/cache identity) and carry the TP rank where pages are
sharded, so every model and rank has its own keys; the layout fingerprint itself is not in the key
because a vLLM scheduler, which looks pages up, cannot compute the workers' byte layout. Values carry
the same header as LMDB entries (format version, fingerprint, length, xxh3-128 checksum), verified on
every read: another layout's value is a counted miss (`fingerprint_mismatch`). Nothing is unpickled.
Writes go out in pipelined batches of bounded bytes; reads fetch many keys per round trip.

Capacity is the server's: `maxmemory` with an LRU or LFU eviction policy; without one the store warns
at start-up (unbounded growth is an operator error). A wrong password or an unreachable server is a
clear start-up error; at run time a node down, a timeout or a resharding in progress is a counted miss
and a failed write is dropped and counted: never a crash, never wrong bytes. `timeout=` bounds both
connecting and each reply, and redis-py's retries are off: a dead or hung node costs one timeout, then
it is skipped (standalone server or cluster node) for NODE_RETRY_SECONDS, its keys counted misses. The
back-off and the slot-map reload's pace are measured by `clock` (time.monotonic; a test passes its own).
Namespacing, the entry header, the counters and the back-off are every remote tier's: remote.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from .buffers import Buffer
from .errors import StoreConfigError
from .remote import NODE_RETRY_SECONDS, RemoteTier
from .url import parse_size
from .url_config import RedisSpec

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = "1TiB"  # what the store reports when the server sets no maxmemory
PIPELINE_BYTES = 64 << 20  # one pipelined write batch
__all__ = ["NODE_RETRY_SECONDS", "RedisStore"]


def _redis():
    try:
        import redis
    except ImportError as exc:  # pragma: no cover - the extra is part of every install we make
        raise StoreConfigError("redis:// needs the redis client: pip install 'kvoffload[redis]'") from exc
    return redis


class RedisStore(RemoteTier):
    kind = "Redis"
    spec_type = RedisSpec
    spec: RedisSpec

    def __init__(
        self,
        spec: RedisSpec | str,
        fingerprint: bytes | str | None = None,
        url: str | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(spec, fingerprint, url, clock=clock)
        self._refreshed = float("-inf")  # never reloaded yet
        redis = _redis()
        self._errors = (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            redis.exceptions.ResponseError,
            redis.exceptions.ClusterError,
            OSError,
        )
        self.cluster = self.spec.cluster
        self.client = self._connect(redis, self._client_options(self.spec))
        self.capacity = self._capacity(self.spec.capacity)

    # -- start-up ------------------------------------------------------------------------------------
    @staticmethod
    def _client_options(spec: RedisSpec) -> dict:
        kwargs: dict[str, object] = {"socket_timeout": spec.timeout, "socket_connect_timeout": spec.timeout}
        if spec.username:
            kwargs["username"] = spec.username
        if spec.password:
            kwargs["password"] = spec.password
        if spec.scheme.startswith("rediss"):
            kwargs["ssl"] = True
            kwargs.update(dict(spec.tls))
        return kwargs

    def _connect(self, redis, kwargs: dict):
        nodes, where = self.spec.hosts, self.spec.where
        # redis-py's default retries turn a 1 s timeout into 15 s: one attempt, then _down_until skips the
        # node. The cluster client's own retries (its node clients have none) only serve start-up: when its
        # default node is down, the next try asks another one.
        Retry, NoBackoff = redis.retry.Retry, redis.backoff.NoBackoff
        try:
            if self.cluster:
                from redis.cluster import ClusterNode, RedisCluster

                client = RedisCluster(
                    startup_nodes=[ClusterNode(h, p) for h, p in nodes],
                    require_full_coverage=False,
                    retry=Retry(NoBackoff(), 2),
                    **kwargs,
                )
            else:
                client = redis.Redis(
                    host=nodes[0][0], port=nodes[0][1], db=self.spec.db, retry=Retry(NoBackoff(), 0), **kwargs
                )
            client.ping()
        except redis.exceptions.AuthenticationError as exc:
            raise StoreConfigError(f"Redis at {where} refused the credentials in the URL: {exc}") from None
        except redis.exceptions.ResponseError as exc:
            if "WRONGPASS" in str(exc) or "NOAUTH" in str(exc) or "NOPERM" in str(exc):
                raise StoreConfigError(f"Redis at {where} refused the credentials in the URL: {exc}") from None
            raise StoreConfigError(f"Redis at {where}: {exc}") from None
        except (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            redis.exceptions.RedisClusterException,
            OSError,
        ) as exc:
            raise StoreConfigError(f"cannot reach Redis at {where}: {exc}") from None
        return client

    def _capacity(self, declared: int | None) -> int:
        """The declared capacity, else the servers' maxmemory; warn when nothing bounds growth."""
        limits, policies = [], set()
        try:
            for config in self._per_node(lambda c: c.config_get("maxmemory*")):
                limits.append(int(config.get("maxmemory", 0)))
                policies.add(config.get("maxmemory-policy", ""))
        except self._errors as exc:
            log.warning(
                "Redis store %s: cannot read the server's maxmemory settings (%s); make sure it "
                "evicts with an LRU policy",
                self.url,
                exc,
            )
            limits = []
        if limits and (0 in limits or not all(("lru" in p or "lfu" in p) for p in policies)):
            log.warning(
                "Redis store %s: the server has %s and policy %s: it will grow without bound or refuse "
                "writes when full; set maxmemory and maxmemory-policy allkeys-lru",
                self.url,
                "no maxmemory" if 0 in limits else f"maxmemory {sum(limits)}",
                "/".join(sorted(policies)),
            )
        if declared:
            return declared
        return sum(limits) if limits and 0 not in limits else parse_size(DEFAULT_CAPACITY)

    def _per_node(self, fn):
        """fn(client) on the server, or on every primary of a cluster; a node that fails is skipped by the
        next calls (see _route) rather than costing them a timeout again."""
        results = []
        for node in self.client.get_primaries() if self.cluster else [None]:
            try:
                results.append(fn(self.client.get_redis_connection(node) if node else self.client))
            except self._errors:
                self._mark_down(node.name if node else "")
                raise
        return results

    def _route(self, keys: Sequence[bytes]) -> tuple[list[tuple[str, Any, list[int]]], int, int]:
        """(node name, its client, indices of `keys`) per node owning some of them, how many keys are on
        a node that failed within the last seconds (skipped: misses instead of a timeout per call; the
        standalone server is the node "") and how many are in slots no node covers."""
        now = self._clock()
        if not self.cluster:
            if self._is_down(""):
                return [], len(keys), 0
            return [("", self.client, list(range(len(keys))))], 0, 0
        groups: dict[str, tuple[Any, list[int]]] = {}  # redis-py's node objects (untyped)
        skipped = uncovered = 0
        for i, key in enumerate(keys):
            try:
                node = self.client.nodes_manager.get_node_from_slot(self.client.keyslot(key))
            except self._errors:  # the slot is not covered (its node is gone, a reshard is under way)
                uncovered += 1
                continue
            if self._down_until.get(node.name, 0.0) > now:
                skipped += 1
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        routes = [(name, self.client.get_redis_connection(node), idx) for name, (node, idx) in groups.items()]
        return routes, skipped, uncovered

    def _pipelined(self, keys: Sequence[bytes], command, what: str) -> list:
        """Run `command(pipe, key)` for every key, one pipeline per node; None where a node, a timeout
        or a moved slot failed (each such key counted as `what`)."""
        results: list = [None] * len(keys)
        routes, skipped, uncovered = self._route(keys)
        stale = uncovered > 0  # the slot map needs a reload: a node failed, a slot moved or has no node
        if skipped + uncovered:
            self._count(**{what: skipped + uncovered})
        for name, client, indices in routes:
            pipe = client.pipeline(transaction=False)
            for i in indices:
                command(pipe, i, keys[i])
            try:
                answers = pipe.execute(raise_on_error=False)
            except self._errors as exc:  # logged once per back-off: the node is skipped until then
                self._failed(name, exc, what, len(indices))
                stale = True
                continue
            for i, answer in zip(indices, answers):
                if isinstance(answer, Exception):
                    stale = True  # MOVED, ASK, CLUSTERDOWN...
                    self._count(**{what: 1})
                else:
                    results[i] = answer
        if self.cluster and stale:
            self._refresh_slots()
        return results

    def _refresh_slots(self) -> None:
        """Reload the slot map (after a reshard or a failover); best effort, at most once a second. The
        node that failed last is asked last: a hung one would cost a timeout."""
        now = self._clock()
        if now - self._refreshed < 1.0:
            return
        self._refreshed = now
        last = max(self._down_until, key=lambda name: self._down_until[name], default=None)
        try:
            self.client.nodes_manager.initialize(last_failed_node_name=last)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the old map in place
            log.info("Redis store %s: slot map not refreshed (%s)", self.url, exc, exc_info=True)

    def clear(self, owner: str) -> bool:
        log.warning(
            "Redis store %s: not cleared: a Redis store is shared by design, and kvoffload does not "
            "know who else uses it; clear it with Redis's own tools (its keys start with %r)",
            self.url,
            self.prefix.decode(errors="replace"),
        )
        return False

    # -- the Store primitives --------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        views = self._views(items, overhead=self.entry_overhead)
        written = [False] * len(views)
        batch, size = [], 0
        for i, (_key, view) in enumerate(views):
            batch.append(i)
            size += view.nbytes
            if size >= PIPELINE_BYTES or i == len(views) - 1:
                self._write(views, batch, written)
                batch, size = [], 0
        ok = sum(written)
        self._count(
            puts=ok,
            put_bytes=sum(views[i][1].nbytes for i in range(len(views)) if written[i]),
            dropped_puts=len(views) - ok,
        )
        return written

    def _write(self, views, batch: list[int], written: list[bool]) -> None:
        def put(pipe, j, key):
            view = views[batch[j]][1]
            pipe.set(key, self._wrap(view))  # one copy

        results = self._pipelined([self._key(views[i][0]) for i in batch], put, "write_errors")
        for i, result in zip(batch, results):
            written[i] = result is True

    def read_many(self, keys: Sequence[bytes], consume: Callable[[int, memoryview], None]) -> list[bool]:
        served = [False] * len(keys)
        values = self._pipelined([self._key(k) for k in keys], lambda pipe, i, k: pipe.get(k), "read_errors")
        nbytes = 0
        for i, raw in enumerate(values):
            if not isinstance(raw, bytes):
                continue
            payload = self._unwrap(raw)
            if payload is None:
                continue
            consume(i, payload)
            served[i] = True
            nbytes += payload.nbytes
        hits = sum(served)
        self._count(hits=hits, misses=len(keys) - hits, get_bytes=nbytes)
        return served

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        found = self._pipelined([self._key(k) for k in keys], lambda pipe, i, k: pipe.exists(k), "read_errors")
        return [result == 1 for result in found]

    def delete(self, key: bytes) -> bool:
        """Through a pipeline too: the same routing and back-off as the batches (no cluster retries)."""
        return bool(self._pipelined([self._key(key)], lambda pipe, i, k: pipe.delete(k), "write_errors")[0])

    def _usage(self) -> dict[str, int]:
        """Server-wide figures (summed over a cluster's primaries): Redis keeps no per-prefix totals."""
        if self._any_down():
            return {"entries": -1, "bytes_used": -1}  # a node is down: no timeout for stats either
        try:
            entries = sum(self._per_node(lambda c: c.dbsize()))
            used = sum(int(info.get("used_memory", 0)) for info in self._per_node(lambda c: c.info("memory")))
        except self._errors:
            return {"entries": -1, "bytes_used": -1}
        return {"entries": entries, "bytes_used": used, "cluster": int(self.cluster)}

    def close(self) -> None:
        try:
            self.client.close()
        except self._errors:
            pass
