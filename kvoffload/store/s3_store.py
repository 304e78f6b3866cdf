"""The coldest tier: an S3 bucket (AWS, or any S3 server: SeaweedFS, MinIO, Ceph RGW...), through
obstore (the Rust `object_store` crate; chosen over boto3 by measurement: BENCHMARKS.md). Its URL and
options: url_config.py's docstring. Prefixes kept here outlive every host.

Objects: `<prefix>/kvoffload:<namespace>:<page key, hex>`, one per page, each the entry header (format
version, fingerprint, length, xxh3-128 checksum) and the page: a flipped, truncated or foreign object is
a counted miss (remote.py). Many small pages go out as concurrent requests (THREADS at once); a value
larger than MULTIPART_BYTES is a multipart upload in PART_BYTES parts, and one larger than RANGED_BYTES
is read back as parallel ranged gets. An S3 put is atomic: a put killed midway leaves no object, and a
multipart upload that never completes is not an object either (obstore aborts it on an error; a process
killed mid-upload leaves parts only, which a bucket lifecycle rule AbortIncompleteMultipartUpload
removes: docs/stores.md).

Capacity: the tier keeps an index of the objects under its prefix (listed at start-up, oldest first,
then kept as an LRU of this process's reads and writes) and deletes the least recently used objects once
their total passes `capacity=`. Several hosts on one prefix each keep their own index; a lifecycle
expiry rule on the bucket bounds it for all of them (docs/stores.md).

Failures: credentials come from the standard chain (environment, AWS_PROFILE in the shared credentials
file, web identity, instance metadata), never from the URL, never logged. An unreachable bucket is a
clear start-up error; at run time a refused, failed or timed-out request (`timeout=` bounds each, no
retries) makes the endpoint skipped for NODE_RETRY_SECONDS: reads are counted misses, writes dropped and
counted, never an exception into the engine."""

from __future__ import annotations

import configparser
import functools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from .buffers import Buffer
from .errors import StoreConfigError
from .remote import RemoteTier
from .url_config import S3Spec

THREADS = 16  # concurrent requests for a batch of pages (measured: 2.4x one at a time for 72 KiB pages)
PART_BYTES = 8 << 20  # a multipart upload's part and a ranged get's range
MULTIPART_BYTES = 16 << 20  # values above this are uploaded in parts
RANGED_BYTES = 16 << 20  # values above this are read as parallel ranged gets
MAX_OBJECT_KEY = 1024  # S3's limit on an object key, in bytes


def _obstore():
    try:
        import obstore
    except ImportError as exc:  # pragma: no cover - the extra is part of every install we make
        raise StoreConfigError("s3:// needs obstore: pip install 'kvoffload[s3]'") from exc
    return obstore


def _profile_credentials() -> dict[str, str]:
    """Static keys of AWS_PROFILE (or "default") in the shared credentials file, where the environment
    names none: obstore reads the environment, web identity and instance metadata itself."""
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return {}
    path = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials")
    parser = configparser.ConfigParser()
    try:
        parser.read(path)
    except configparser.Error:
        return {}
    section = os.environ.get("AWS_PROFILE", "default")
    if not parser.has_section(section):
        return {}
    found = {
        "access_key_id": parser.get(section, "aws_access_key_id", fallback=""),
        "secret_access_key": parser.get(section, "aws_secret_access_key", fallback=""),
        "token": parser.get(section, "aws_session_token", fallback=""),
    }
    return {k: v for k, v in found.items() if v} if found["access_key_id"] else {}


class S3Store(RemoteTier):
    kind = "S3"
    spec_type = S3Spec
    spec: S3Spec

    def __init__(
        self,
        spec: S3Spec | str,
        fingerprint: bytes | str | None = None,
        url: str | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(spec, fingerprint, url, clock=clock)
        self.capacity = self.spec.capacity
        self.max_key_bytes = (MAX_OBJECT_KEY - len(self.spec.prefix) - 1 - len(self.prefix)) // 2
        self._obstore = _obstore()
        self._not_found = (self._obstore.exceptions.NotFoundError, FileNotFoundError)
        self.client = self._connect(self.spec)
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="kvoffload-s3")
        self._lock = threading.Lock()  # the index only: never held across a request, no other lock taken under it
        self._index: OrderedDict[str, int] = OrderedDict()  # object path -> its bytes, least recently used first
        self._bytes = 0
        self._load_index()

    # -- start-up ------------------------------------------------------------------------------------
    def _connect(self, spec: S3Spec) -> Any:
        from obstore.store import S3Store as Client

        options: dict[str, Any] = {"region": spec.region, **_profile_credentials()}
        if spec.endpoint:
            options["endpoint"] = spec.endpoint
        timeout = timedelta(seconds=spec.timeout)
        try:
            return Client(
                spec.bucket,
                prefix=spec.prefix or None,
                client_options={
                    "timeout": timeout,
                    "connect_timeout": timeout,
                    "allow_http": bool(spec.endpoint and spec.endpoint.startswith("http://")),
                },
                retry_config={"max_retries": 0, "retry_timeout": timeout},
                **options,
            )
        except Exception as exc:  # noqa: BLE001 - obstore's configuration errors have several types
            raise StoreConfigError(f"S3 store {self.url}: {exc}") from None

    def _load_index(self) -> None:
        """Every object under the prefix (all namespaces: the capacity is the prefix's), oldest first.
        A bucket that cannot be listed (unreachable, missing, refused credentials) is a start-up error."""
        found: list[tuple[Any, str, int]] = []
        try:
            for chunk in self._obstore.list(self.client, chunk_size=1000):  # prefix= is a whole path segment
                found.extend(
                    (meta["last_modified"], meta["path"], meta["size"])
                    for meta in chunk
                    if meta["path"].startswith("kvoffload:")
                )
        except Exception as exc:  # noqa: BLE001 - any failure here means the tier cannot work
            raise StoreConfigError(f"cannot list S3 bucket {self.spec.bucket} at {self.url}: {exc}") from None
        found.sort(key=lambda item: (item[0], item[1]))
        for _, path, size in found:
            self._index[path] = size
            self._bytes += size
        self._evict([])  # a smaller capacity than last time

    def _describe(self, exc: BaseException) -> object:
        """obstore's errors run to dozens of lines (a Rust debug dump): the first line and the kind."""
        text = str(exc)
        kinds = [k for k in ("Timeout", "TimedOut", "Connect", "status: 403", "status: 5") if k in text]
        return f"{type(exc).__name__}: {text.splitlines()[0][:160] if text else ''} {'/'.join(kinds)}".strip()

    # -- objects ---------------------------------------------------------------------------------------
    def _path(self, key: bytes) -> str:
        return self.prefix.decode() + key.hex()

    def _run(self, fn: Callable[[int], Any], n: int, what: str) -> list[Any]:
        """fn(i) for i < n, concurrently; per i its result, or None where the endpoint failed or is backed
        off (counted `what` once per batch, logged once per back-off) -- never an exception."""
        results: list[Any] = [None] * n
        errors: list[BaseException] = []
        skipped = [0]

        def one(i: int) -> None:
            if self._is_down():
                skipped[0] += 1
                return
            try:
                results[i] = fn(i)
            except self._not_found:
                results[i] = None
            except Exception as exc:  # noqa: BLE001 - a timeout, refused connection, 5xx: the endpoint failed
                errors.append(exc)
                self._mark_down()

        if n == 1:
            one(0)
        else:
            list(self._pool.map(one, range(n)))
        if errors:
            self._failed("", errors[0], what, len(errors) + skipped[0])
        elif skipped[0]:
            self._count(**{what: skipped[0]})
        return results

    # -- the Store primitives --------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        views = self._views(items, overhead=self.entry_overhead)
        paths = [self._path(key) for key, _ in views]

        def put(i: int) -> bool:
            view = views[i][1]
            header = self._header(view)
            if view.nbytes + len(header) > MULTIPART_BYTES:  # parts: no whole copy of the value
                self._obstore.put(self.client, paths[i], [header, view], chunk_size=PART_BYTES, max_concurrency=8)
            else:
                self._obstore.put(self.client, paths[i], b"".join((header, view)), use_multipart=False)
            return True

        written = [ok is True for ok in self._run(put, len(views), "write_errors")]
        sizes = [views[i][1].nbytes for i in range(len(views)) if written[i]]
        with self._lock:
            for i, ok in enumerate(written):
                if ok:
                    self._touch(paths[i], views[i][1].nbytes + self.entry_overhead)
        self._evict(paths)
        self._count(puts=len(sizes), put_bytes=sum(sizes), dropped_puts=len(views) - len(sizes))
        return written

    def _touch(self, path: str, size: int) -> None:
        """Under the lock: `path` (of `size` bytes) was just written or read: the most recently used."""
        old = self._index.pop(path, None)
        self._bytes += size - (old or 0)
        self._index[path] = size

    def _evict(self, keep: Sequence[str]) -> None:
        """Delete the least recently used objects until the index fits the capacity (never one of `keep`,
        just written)."""
        victims: list[tuple[str, int]] = []
        protected = set(keep)
        with self._lock:
            if self._bytes > self.capacity:
                for path in list(self._index):  # least recently used first
                    if self._bytes <= self.capacity:
                        break
                    if path in protected:
                        continue
                    size = self._index.pop(path)
                    self._bytes -= size
                    victims.append((path, size))
        if not victims:
            return
        for start in range(0, len(victims), 1000):  # S3's DeleteObjects takes 1000 keys a call
            self._run(functools.partial(self._delete_objects, victims[start : start + 1000]), 1, "write_errors")
        self._count(evictions=len(victims), evicted_bytes=sum(size for _, size in victims))
        mine = self.prefix.decode()
        self._report_evicted([bytes.fromhex(p[len(mine) :]) for p, _ in victims if p.startswith(mine)])

    def _delete_objects(self, victims: list[tuple[str, int]], _: int) -> None:
        self._obstore.delete(self.client, [path for path, _ in victims])

    def _get(self, path: str) -> Any:
        """The object's bytes (a buffer): parallel ranged gets for one the index knows is large."""
        with self._lock:
            size = self._index.get(path)
        if size is None or size <= RANGED_BYTES:
            return self._obstore.get(self.client, path).bytes()
        starts = list(range(0, size, PART_BYTES))
        parts = self._obstore.get_ranges(
            self.client, path, starts=starts, ends=[min(s + PART_BYTES, size) for s in starts], coalesce=0
        )
        out = bytearray(size)
        for start, part in zip(starts, parts):
            out[start : start + len(part)] = part
        return out

    def read_many(self, keys: Sequence[bytes], consume: Callable[[int, memoryview], None]) -> list[bool]:
        paths = [self._path(key) for key in keys]

        def get(i: int) -> memoryview | None:  # verified on the request's thread, beside the other requests
            raw = self._get(paths[i])
            with self._lock:
                self._touch(paths[i], len(raw))
            return self._unwrap(raw)

        payloads = self._run(get, len(keys), "read_errors")
        served = [False] * len(keys)
        nbytes = 0
        for i, payload in enumerate(payloads):
            if payload is None:
                continue
            consume(i, payload)
            served[i] = True
            nbytes += payload.nbytes
        hits = sum(served)
        self._count(hits=hits, misses=len(keys) - hits, get_bytes=nbytes)
        return served

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """From the index; a key it lacks (another host may have written it) is asked of the bucket."""
        paths = [self._path(key) for key in keys]
        with self._lock:
            known = [path in self._index for path in paths]
        unknown = [i for i, k in enumerate(known) if not k]
        if unknown:
            heads = self._run(lambda j: self._obstore.head(self.client, paths[unknown[j]]), len(unknown), "read_errors")
            with self._lock:
                for i, meta in zip(unknown, heads):
                    if meta is not None:
                        known[i] = True
                        if paths[i] not in self._index:
                            self._touch(paths[i], int(meta["size"]))
        return known

    def delete(self, key: bytes) -> bool:
        path = self._path(key)
        with self._lock:
            size = self._index.pop(path, None)
            if size is not None:
                self._bytes -= size
        self._run(lambda i: self._obstore.delete(self.client, path), 1, "write_errors")
        return size is not None

    def clear(self, owner: str) -> bool:
        self._log.warning(
            "S3 store %s: not cleared: a bucket is shared by design; delete its objects under %r with S3's own tools",
            self.url,
            f"{self.spec.prefix}/{self.prefix.decode()}" if self.spec.prefix else self.prefix.decode(),
        )
        return False

    def _usage(self) -> dict[str, int]:
        """What this process's index holds (the objects under the prefix, all namespaces)."""
        with self._lock:
            return {"entries": len(self._index), "bytes_used": self._bytes}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
