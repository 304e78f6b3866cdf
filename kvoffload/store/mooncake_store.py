"""A pool shared across hosts: Mooncake Store (the KV pool vLLM, SGLang, LMCache and FlexKV speak), through
Mooncake's own Python client (`mooncake-transfer-engine`, `pip install 'kvoffload[mooncake]'`). Its URL
and options: url_config.py's docstring; when to choose it over Redis or LMDB: docs/stores.md.

Where values live: in the memory segments that clients contribute to the pool (`segment=`): every process
opening this tier contributes its own, unless `segment=0`. A contributor that exits takes its segment's
values with it (after the master's `client_ttl`): those keys become misses, never wrong bytes. A pool that
must outlive the engines has long-lived contributors (`python -m kvoffload.tools.mooncake_pool`, or
Mooncake's own store service), and the engines then open it with `segment=0`. What Mooncake evicts when
the pool is full is a miss too.

Values: `kvoffload:<namespace>:<page key, hex>`, each the entry header and the page (remote.py): a
damaged, truncated or foreign value is a counted miss. Writes are upserts, so a damaged value is replaced
whole by the next save. A Mooncake put allocates, transfers, then commits: a client killed mid-put leaves
no value visible. Each batch of pages is one `upsert_batch` / `get_batch` / `batch_is_exist` call, as many
pages as fit the client's transfer buffer (`buffer=`), which bounds an entry's size; a page of PARTS_BYTES
or more goes in a call of its own, as header and page (`upsert_parts`: no joined copy of the page).

Failures: the client returns error codes and never raises, but a hung master holds a call for half a
minute or more: every call runs on a thread of its own and is given up after `timeout=` seconds (the
call finishes or fails in the background; a value it writes late is verified like any other). A refused,
failed or timed-out call to the master or a peer (an RPC or transfer failure) makes the pool skipped for
NODE_RETRY_SECONDS: reads are counted misses, writes dropped and counted; a full pool drops that batch's
writes without a back-off. When the master is back, the client mounts its segment again and the tier
serves again."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence

from .buffers import Buffer
from .errors import StoreConfigError
from .remote import RemoteTier
from .url_config import MooncakeSpec

NOT_FOUND = -704  # OBJECT_NOT_FOUND
OUTAGE = -800  # codes at or below: a transfer (-8xx) or RPC (-9xx) failure, the master or a peer is out
DEFAULT_VALUE_BYTES = 1 << 20  # the value size a read plans its batches with before it has seen one
PARTS_BYTES = 1 << 20  # values from this size go as header + page (`upsert_parts`): no joined copy


def _client_class():
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise StoreConfigError(
            "mooncake:// needs Mooncake's client: pip install 'kvoffload[mooncake]' (on Debian or Ubuntu also "
            f"apt-get install libibverbs1): {exc}"
        ) from None
    return MooncakeDistributedStore


def reaching_address(host: str) -> str:
    """The address of this host's interface that reaches `host` (no packet is sent): what peers use to
    reach this process's segment."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class MooncakeStore(RemoteTier):
    kind = "Mooncake"
    spec_type = MooncakeSpec
    spec: MooncakeSpec

    def __init__(
        self,
        spec: MooncakeSpec | str,
        fingerprint: bytes | str | None = None,
        url: str | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(spec, fingerprint, url, clock=clock)
        spec = self.spec
        self.capacity = spec.capacity if spec.capacity is not None else spec.segment
        self._value_bytes = DEFAULT_VALUE_BYTES  # the largest value seen: how many keys a read asks at once
        # the client's calls, one at a time (its buffer is one arena); held by the thread running the call, no other
        # lock taken under it (the counters' lock is taken only by the caller, outside it)
        self._lock = threading.Lock()
        client_class = _client_class()
        try:  # Mooncake's setup retries a dead master for over a minute: ask once, here, first
            socket.create_connection((spec.host, spec.port), timeout=5).close()
        except OSError as exc:
            raise StoreConfigError(f"Mooncake store {self.url}: no master answers at {spec.master} ({exc})") from None
        self.client = client_class()
        local = spec.local or reaching_address(spec.host)
        code = self.client.setup(
            local, spec.metadata, spec.segment, spec.buffer, spec.protocol, spec.device, spec.master
        )
        if code != 0:
            raise StoreConfigError(
                f"Mooncake store {self.url}: cannot join the pool (error {code}): is a master running at "
                f"{spec.master} with its metadata server at {spec.metadata}?"
            )

    @property
    def max_entry_bytes(self) -> int:
        """An entry travels through the client's transfer buffer whole."""
        return self.spec.buffer

    # -- calls ---------------------------------------------------------------------------------------------
    def _name(self, key: bytes) -> str:
        return self.prefix.decode() + key.hex()

    def _call(self, what: str, count: int, fn, *args):
        """`fn(*args)` on the client, given up after the timeout; None (`count` keys counted `what`) where the
        pool is backed off, the call timed out, or an earlier call still holds the client that long."""
        if self._is_down():
            self._count(**{what: count})
            return None
        timeout = self.spec.timeout
        if not self._lock.acquire(timeout=timeout):
            self._failed("", TimeoutError(f"a call has held the client for over {timeout} s"), what, count)
            return None
        done, result = threading.Event(), [None]

        def run() -> None:
            try:
                result[0] = fn(*args)
            finally:
                self._lock.release()
                done.set()

        threading.Thread(target=run, name="kvoffload-mooncake", daemon=True).start()
        if not done.wait(timeout):
            self._failed("", TimeoutError(f"no answer within {timeout} s"), what, count)
            return None
        return result[0]

    def _outage(self, code: int, what: str, count: int) -> bool:
        """True (counted, logged, backed off) where `code` says the master or a peer is out."""
        if code > OUTAGE:
            return False
        self._failed("", RuntimeError(f"Mooncake error {code}"), what, count)
        return True

    def _batches(self, sizes: Sequence[int]) -> list[tuple[int, int]]:
        """Consecutive [start, end) runs of values whose bytes fit the transfer buffer together."""
        runs, start, total = [], 0, 0
        for i, size in enumerate(sizes):
            if i > start and total + size > self.spec.buffer:
                runs.append((start, i))
                start, total = i, 0
            total += size
        if start < len(sizes):
            runs.append((start, len(sizes)))
        return runs

    # -- the Store primitives --------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        views = self._views(items, overhead=self.entry_overhead)
        written = [False] * len(views)
        sizes = [view.nbytes + self.entry_overhead for _, view in views]
        self._value_bytes = max(self._value_bytes, *sizes, 0)
        small = [i for i, size in enumerate(sizes) if size < PARTS_BYTES]
        for start, end in self._batches([sizes[i] for i in small]):
            self._put_batch(views, small[start:end], written)
        for i in (i for i, size in enumerate(sizes) if size >= PARTS_BYTES):  # a call each: no copy of the page
            key, view = views[i]
            code = self._call("write_errors", 1, self.client.upsert_parts, self._name(key), self._header(view), view)
            written[i] = code == 0
            if code is not None and self._outage(code, "write_errors", 1):
                break
        ok = sum(written)
        self._count(
            puts=ok,
            put_bytes=sum(views[i][1].nbytes for i in range(len(views)) if written[i]),
            dropped_puts=len(views) - ok,
        )
        return written

    def _put_batch(self, views, batch: list[int], written: list[bool]) -> None:
        """One upsert of the values `batch` indexes (their bytes fit the transfer buffer together)."""
        names = [self._name(views[i][0]) for i in batch]
        values = [self._wrap(views[i][1]) for i in batch]
        code = self._call("write_errors", len(batch), self.client.upsert_batch, names, values)
        if code is None or self._outage(code, "write_errors", len(batch)):
            return
        if code == 0:
            for i in batch:
                written[i] = True
            return
        for i, name, value in zip(batch, names, values):  # which failed: one at a time (the rare path)
            code = self._call("write_errors", 1, self.client.upsert, name, value)
            written[i] = code == 0
            if code is not None and self._outage(code, "write_errors", 1):
                return

    def read_many(self, keys: Sequence[bytes], consume: Callable[[int, memoryview], None]) -> list[bool]:
        served = [False] * len(keys)
        per_call = max(1, self.spec.buffer // (self._value_bytes + self.entry_overhead))
        nbytes = 0
        for start in range(0, len(keys), per_call):
            names = [self._name(k) for k in keys[start : start + per_call]]
            values = self._call("read_errors", len(names), self.client.get_batch, names)
            if values is None:
                continue
            empty = [j for j, raw in enumerate(values) if not raw]
            if empty and len(empty) < len(names):  # a batch over the buffer returns its tail empty: ask again
                present = self._call("read_errors", len(empty), self.client.batch_is_exist, [names[j] for j in empty])
                for j, there in zip(empty, present or []):
                    if there == 1:
                        values[j] = self._call("read_errors", 1, self.client.get, names[j]) or b""
            for j, raw in enumerate(values):
                if not raw:
                    continue
                payload = self._unwrap(raw)
                if payload is None:
                    continue
                consume(start + j, payload)
                served[start + j] = True
                nbytes += payload.nbytes
        hits = sum(served)
        self._count(hits=hits, misses=len(keys) - hits, get_bytes=nbytes)
        return served

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        found = self._call("read_errors", len(keys), self.client.batch_is_exist, [self._name(k) for k in keys])
        if (
            found is None
            or any(code <= OUTAGE for code in found)
            and self._outage(min(found), "read_errors", len(keys))
        ):
            return [False] * len(keys)
        return [code == 1 for code in found]

    def delete(self, key: bytes) -> bool:
        """A value a reader holds a lease on (Mooncake's, seconds long) stays until the lease ends."""
        code = self._call("write_errors", 1, self.client.remove, self._name(key))
        return code == 0

    def clear(self, owner: str) -> bool:
        self._log.warning(
            "Mooncake store %s: not cleared: a pool is shared by design; remove its keys with Mooncake's own "
            "tools (they start with %r)",
            self.url,
            self.prefix.decode(),
        )
        return False

    def _usage(self) -> dict[str, int]:
        """Mooncake keeps no per-prefix totals a client can read: this process's contribution."""
        return {"entries": -1, "bytes_used": -1, "segment": self.spec.segment}

    def close(self) -> None:
        if self._lock.acquire(timeout=self.spec.timeout):  # a call still stuck on a hung master: leave it
            try:
                self.client.close()
            finally:
                self._lock.release()
