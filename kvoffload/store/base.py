"""The one interface every tier implements. A store knows keys and bytes only: what the bytes mean
(which page of which group) is the layout model's business, and keys come from the key chain."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar, cast

import numpy as np

from .buffers import Buffer, byte_view, copy_into, writable_view
from .errors import EntryTooLargeError, KeyTooLongError

T = TypeVar("T")
log = logging.getLogger(__name__)

# fill(destinations) writes the values in place (None: the tier had no room for that one) and says
# which it filled; a tier publishes only those, after fill returns.
Fill = Callable[[list["np.ndarray | None"]], list[bool]]


class ItemColumns(Sequence[tuple[bytes, int]]):
    """(key, size) pairs kept as their two columns: a batch of thousands of small pages goes through
    `Store.reserve` and `Reservation.items` without a tuple per page (the arena reads the columns)."""

    __slots__ = ("keys", "sizes")

    def __init__(self, keys: list[bytes], sizes: list[int]):
        if len(keys) != len(sizes):
            raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")
        self.keys, self.sizes = keys, sizes

    @staticmethod
    def of(items: Sequence[tuple[bytes, int]]) -> ItemColumns:
        """`items` as columns: themselves if they are, else their two columns (one transpose, in C)."""
        if isinstance(items, ItemColumns):
            return items
        keys, sizes = (list(column) for column in zip(*items)) if items else ([], [])
        return ItemColumns(keys, sizes)

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i):  # an index or a slice, as a list's
        if isinstance(i, slice):
            return ItemColumns(self.keys[i], self.sizes[i])
        return self.keys[i], self.sizes[i]

    def __iter__(self):
        return zip(self.keys, self.sizes)


@dataclass(frozen=True)
class Reservation:
    """Destinations `Store.reserve` handed out for `items` ((key, size) pairs), until `publish`.
    `addresses`: each destination's host address (0 for none), where the tier knows them without
    asking numpy (the arena: a device copies runs of adjacent slots without a per-page lookup; its
    `destinations` are made only when read, so a device transfer, which copies by address, makes none)."""

    items: Sequence[tuple[bytes, int]]
    destinations: Sequence[np.ndarray | None]
    handle: object = None  # the tier's
    addresses: np.ndarray | None = None  # int64
    # int64, with `addresses`: bytes a copy may cover from each address on, to reach the next value with
    # it (its slot; 0 where no copy may run on past it: another allocation follows)
    room: np.ndarray | None = None
    evicted: Sequence[bytes] | None = None  # the keys making room for it took out, where the tier tells

    def filled_all(self) -> list[bool]:
        """Every value that has a destination: the flags to publish once all of them were written."""
        if self.addresses is not None:
            return (self.addresses != 0).tolist()
        return [out is not None for out in self.destinations]


class Lease(NamedTuple):
    """A value held in place for the caller (a DMA source, a write-behind source): the tier does not
    evict, reuse or overwrite its bytes until `Store.release` is called with it. A tuple: a batch of
    small pages makes thousands of these."""

    key: bytes
    view: np.ndarray  # uint8, exactly the value's bytes
    slot: int | None = None  # the tier's handle; None for a private copy (nothing to release)
    address: int = 0  # the view's host address where the tier knows it (0: ask the view)


class HeldBatch(NamedTuple):
    """Values held in place by host address for one device copy (`Store.acquire_batch`): what `acquire`
    holds, without a view or a lease per value (a batch of thousands of small pages), until
    `Store.release_batch`."""

    addresses: np.ndarray  # int64 per key: the value's host address, 0 for a miss
    sizes: np.ndarray  # int64 per key: its bytes, 0 for a miss
    handle: object  # the tier's, for `release_batch`
    room: np.ndarray | None = None  # int64 per key: as `Reservation.room`


def host_address(view: np.ndarray, known: int = 0) -> int:
    """The host address of a value's bytes: `known` (the tier's) or the view's own (a slow lookup)."""
    return known or view.ctypes.data


def check_keys(keys: Sequence[object], max_key_bytes: int | None, url: str) -> list[bytes]:
    """`check_key` of a batch: a batch of plain byte strings in the length limits is checked in C
    (`map`), without a call per key."""
    if set(map(type, keys)) <= {bytes} and keys:
        lengths = set(map(len, cast(Sequence[bytes], keys)))
        if min(lengths) > 0 and (max_key_bytes is None or max(lengths) <= max_key_bytes):
            return cast(list[bytes], list(keys))  # all bytes, checked above
    return [check_key(key, max_key_bytes, url) for key in keys]


def check_key(key: object, max_key_bytes: int | None, url: str) -> bytes:
    """A key as bytes, or a clear error: keys are non-empty bytes within the tier's key length."""
    if type(key) is bytes and key and (max_key_bytes is None or len(key) <= max_key_bytes):
        return key  # the common case, first: a batch checks thousands of keys
    if not isinstance(key, (bytes, bytearray)) or not key:
        raise TypeError(f"keys are non-empty bytes, got {type(key).__name__}")
    if max_key_bytes is not None and len(key) > max_key_bytes:
        raise KeyTooLongError(f"a {len(key)}-byte key is longer than {url} takes ({max_key_bytes} bytes)")
    return bytes(key)


class Store(ABC):
    """Key -> bytes with a byte capacity. Misses, corrupt entries and full tiers are normal outcomes
    (a `None`, a `False`, a counter in `stats()`); only caller bugs raise."""

    url: str
    capacity: int

    # Reported by every tier, zero until they happen (tiers add their own, e.g. checksum_failures).
    COUNTERS: tuple[str, ...] = (
        "hits",
        "misses",
        "puts",
        "put_bytes",
        "get_bytes",
        "evictions",
        "evicted_bytes",
        "dropped_puts",
    )

    def __init__(self) -> None:
        self._counters: Counter[str] = Counter({name: 0 for name in self.COUNTERS})
        self._counter_lock = threading.Lock()

    # -- the primitives a tier implements -------------------------------------------------------
    @abstractmethod
    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        """Store every (key, value); True for each value durable in this tier when this returns."""

    @abstractmethod
    def read_many(self, keys: Sequence[bytes], consume: Callable[[int, memoryview], None]) -> list[bool]:
        """Call `consume(i, view)` for each present, verified key i (the view is only valid during the
        call); return which keys were served. The one read path all `get*` forms share."""

    @abstractmethod
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Presence without reading values (a later read may still miss: eviction, corruption)."""

    @abstractmethod
    def delete(self, key: bytes) -> bool:
        """Remove `key`; True if it was present."""

    @abstractmethod
    def _usage(self) -> dict[str, int]:
        """Tier-specific figures for `stats()`: at least entries and bytes_used."""

    def close(self) -> None:  # noqa: B027 - an optional hook: tiers without resources keep this no-op
        """Release resources; the store must not be used afterwards."""

    # -- clearing (a connector's reset) ---------------------------------------------------------------
    # Keys are digests: no tier can tell which deployment wrote an entry. So a tier remembers who uses it
    # (`claim`, a key namespace) and clears everything only while nobody else ever did.
    def claim(self, owner: str) -> None:  # noqa: B027 - an optional hook: a tier that never clears ignores it
        """Record that `owner` (a key namespace) keeps entries here; `clear` refuses once others did."""

    def clear(self, owner: str) -> bool:
        """Remove every entry if `owner` is the only namespace that claimed this tier; False (nothing
        removed) when others did or the tier cannot clear (here: the default)."""
        return False

    # -- prefetch (a queued request's prefix, read ahead of its load) ---------------------------------
    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Move values closer ahead of a read: a tier with a faster tier in front of a slower one copies
        the slower tier's values of `keys` into the faster one. Returns how many it moved; a
        single-tier store has nowhere to move them (0)."""
        return 0

    def advise(self, keys: Sequence[bytes]) -> None:  # noqa: B027 - a hint: tiers without a disk ignore it
        """A hint that `keys` will be read soon, in this order (a load of many batches): a disk tier starts
        reading their bytes into the page cache now, in the background, so the load's later batches find
        them there instead of letting the disk idle between batches. Never waits for I/O, never changes
        what is stored; a tier without a disk ignores it (here)."""

    # -- eviction reports (a connector tells a router which entries went) ---------------------------------
    _on_evict: Callable[[list[bytes]], None] | None = None

    def watch_evictions(self, listener: Callable[[list[bytes]], None] | None) -> None:
        """From now on call `listener(keys)` with the keys this store no longer holds because it made room
        (never deleted or cleared ones): after the change, outside the store's locks, on the thread that
        wrote. One listener (None: stop); unwatched, no key is collected. A tier that cannot tell (Redis
        evicts on its own) never calls it."""
        self._on_evict = listener

    def _report_evicted(self, keys: Sequence[bytes]) -> None:
        listener = self._on_evict
        if listener is None or not keys:
            return
        try:
            listener(list(keys))
        except Exception:  # a report is advisory: it must never fail the write that evicted
            log.exception("store %s: eviction listener failed", self.url)

    # -- in-place access (the pinned arena implements these without a copy) ----------------------------
    in_place: bool = False  # True when write_many / acquire hand out the tier's own (pinned) memory
    process_local: bool = False  # its entries live in this process's memory only (the memory tier)

    @property
    def memory_front(self) -> Store | None:
        """The memory tier in front of a slower one, which prefetch fills (None: no such tier)."""
        return None

    def write_many(self, items: Sequence[tuple[bytes, int]], fill: Fill) -> list[bool]:
        """Store values of the given sizes that `fill` writes straight into their destinations; True
        per value stored. `reserve`, then `fill`, then `publish` (a caller that streams batches, a
        device transfer, calls the two itself to reserve the next batch while this one is copied)."""
        reservation = self.reserve(items)
        filled = None
        try:
            filled = list(fill(list(reservation.destinations)))
            if len(filled) != len(reservation.items):
                raise ValueError(f"fill returned {len(filled)} flags for {len(reservation.items)} values")
        finally:
            written = self.publish(
                reservation,
                filled
                if filled is not None and len(filled) == len(reservation.items)
                else [False] * len(reservation.items),
            )
        return written

    def reserve(self, items: Sequence[tuple[bytes, int]]) -> Reservation:
        """Destinations for values of the given sizes (None: no room), invisible to every reader until
        `publish`. Every reservation must be published, with False flags to give it up. Here: private
        buffers (the arena hands out its slots)."""
        items = list(items)
        return Reservation(items, [np.empty(n, dtype=np.uint8) for _, n in items])

    def publish(self, reservation: Reservation, filled: Sequence[bool]) -> list[bool]:
        """Make the values `filled` marks visible; True per value stored (`put_many`'s flags)."""
        items, written = reservation.items, [False] * len(reservation.items)
        chosen = [i for i, ok in enumerate(filled) if ok and reservation.destinations[i] is not None]
        for i, ok in zip(
            chosen, self.put_many([(items[i][0], reservation.destinations[i]) for i in chosen]) if chosen else []
        ):
            written[i] = ok
        return written

    def acquire(self, keys: Sequence[bytes], *, touch: bool = True) -> list[Lease | None]:
        """Hold each present value in place (None for a miss) until `release`. `touch` counts the reads
        and refreshes recency; write-behind passes False. Here: private copies (one copy)."""
        leases: list[Lease | None] = [None] * len(keys)

        def consume(i: int, view: memoryview) -> None:
            leases[i] = Lease(keys[i], np.frombuffer(view, dtype=np.uint8).copy())

        self.read_many(keys, consume)
        return leases

    def release(self, leases: Iterable[Lease | None]) -> None:  # noqa: B027 - the default acquire copies: nothing held
        """Give back what `acquire` held (None entries and private copies are ignored)."""

    def acquire_batch(self, keys: Sequence[bytes], *, touch: bool = True) -> HeldBatch:
        """`acquire` by host address, for a device copy: one `HeldBatch` until `release_batch`. Here:
        `acquire`'s leases (the arena holds a batch without a lease per value)."""
        leases = self.acquire(keys, touch=touch)
        addresses = [0 if lease is None else host_address(lease.view, lease.address) for lease in leases]
        sizes = [0 if lease is None else lease.view.nbytes for lease in leases]
        return HeldBatch(np.asarray(addresses, dtype=np.int64), np.asarray(sizes, dtype=np.int64), leases)

    def release_batch(self, held: HeldBatch) -> None:
        """Give back what `acquire_batch` held."""
        self.release(cast(list[Lease | None], held.handle))  # the default batch's handle: its leases

    # -- derived forms ------------------------------------------------------------------------------
    def put(self, key: bytes, value: Buffer) -> bool:
        return self.put_many([(key, value)])[0]

    def get(self, key: bytes) -> bytes | None:
        found: list[bytes] = []
        self.read_many([key], lambda _, view: found.append(bytes(view)))
        return found[0] if found else None

    def get_into(self, key: bytes, out: Buffer) -> int | None:
        """Copy the value of `key` into `out`; the number of bytes written, or None on a miss."""
        return self.get_many([key], [out])[0]

    def get_many(self, keys: Sequence[bytes], outs: Sequence[Buffer]) -> list[int | None]:
        """Fill each caller buffer straight from the tier (one copy); bytes written or None per key."""
        if len(keys) != len(outs):
            raise ValueError(f"get_many: {len(keys)} keys but {len(outs)} destination buffers")
        views = [writable_view(o) for o in outs]
        sizes: list[int | None] = [None] * len(keys)

        def consume(i: int, view: memoryview) -> None:
            sizes[i] = copy_into(views[i], view)

        self.read_many(keys, consume)
        return sizes

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def stats(self) -> dict[str, int | str]:
        with self._counter_lock:
            counters = dict(self._counters)
        return {"url": self.url, "capacity": self.capacity, **counters, **self._usage()}

    def counter(self, name: str) -> int:
        """`stats()[name]` for one of its counters, without the tier's usage figures (no I/O, no
        transaction): cheap enough to read on every engine step."""
        with self._counter_lock:
            return self._counters.get(name, 0)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"

    # -- helpers for tiers --------------------------------------------------------------------------
    def _count(self, **deltas: int) -> None:
        with self._counter_lock:
            for name, delta in deltas.items():
                self._counters[name] += delta

    max_key_bytes: int | None = None  # a tier's key length limit, if it has one
    entry_overhead: int = 0  # bytes a tier adds to each value, counted against max_entry_bytes

    def fits(self, nbytes: int) -> bool:
        """Whether a value of `nbytes` can ever be stored here (a smaller capacity refuses it on every put)."""
        return nbytes + self.entry_overhead <= self.max_entry_bytes

    @property
    def max_entry_bytes(self) -> int:
        """The largest value this tier takes (with `overhead`, its per-entry header where it has one)."""
        return self.capacity

    def _views(self, items: Iterable[tuple[bytes, Buffer]], overhead: int = 0) -> list[tuple[bytes, memoryview]]:
        """Validate a batch before anything is written, so a bad item loses nothing of the others."""
        out = []
        for key, value in items:
            key = check_key(key, self.max_key_bytes, self.url)
            view = byte_view(value)
            if view.nbytes + overhead > self.max_entry_bytes:
                raise EntryTooLargeError(
                    f"a {view.nbytes}-byte value cannot fit in {self.url}: it takes entries up to "
                    f"{self.max_entry_bytes} bytes (capacity {self.capacity} bytes); raise the capacity"
                )
            out.append((key, view))
        return out
