"""What every remote tier shares (Redis, S3; Mooncake later), written once: key namespacing, the entry
header on every value, the counted failures, and the back-off from an endpoint that failed.

- Keys are `kvoffload:<namespace>:` + the page key: tenants sharing a server or bucket never see each
  other's values.
- Every value is the LMDB entry header (format version, fingerprint, length, xxh3-128 checksum) and the
  page; a read verifies it: a damaged, truncated or foreign value is a miss, counted under the reason
  (`checksum_failures`, `length_mismatch`, `bad_header`, `fingerprint_mismatch`), never served.
- A node or endpoint that failed (unreachable, timed out, refused) is skipped for NODE_RETRY_SECONDS:
  its keys are counted misses (`read_errors`) or dropped writes (`write_errors`) at once instead of a
  timeout per call; the pace is measured by `clock` (time.monotonic; a test passes its own). The
  warning is logged once per back-off, on the tier's own module logger."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from . import entry
from .base import Store
from .errors import StoreConfigError
from .url import redact_url
from .url_config import parse_store_url

NODE_RETRY_SECONDS = 5.0  # a server, cluster node or endpoint that failed is skipped this long


class RemoteTier(Store):
    """The shared half of a remote tier; a subclass adds the client and the Store primitives."""

    entry_overhead = entry.HEADER_BYTES
    kind = "remote"  # how logs name the tier ("Redis", "S3")

    spec_type: type = object  # the URL spec a subclass opens (RedisSpec, S3Spec)

    def __init__(
        self,
        spec,
        fingerprint: bytes | str | None,
        url: str | None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`spec`: the tier's parsed URL, or the URL itself; `url`: what logs and stats show (redacted)."""
        if isinstance(spec, str):
            parsed, url = parse_store_url(spec), spec
            if not isinstance(parsed, self.spec_type):
                raise StoreConfigError(f"{type(self).__name__} takes a {self.kind} URL, got {parsed.url()!r}")
            spec = parsed
        super().__init__()
        self.spec = spec
        self.url = redact_url(url) if url else spec.url()  # never a password
        namespace = spec.namespace
        self._clock = clock
        self.namespace = namespace
        self.fingerprint = entry.normalize_fingerprint(fingerprint)
        self.prefix = f"kvoffload:{namespace}:".encode()
        self._down_until: dict[str, float] = {}  # node or endpoint name -> skipped until (clock)
        self._count(checksum_failures=0, read_errors=0, write_errors=0)
        self._log = logging.getLogger(type(self).__module__)

    # -- keys ----------------------------------------------------------------------------------------
    def _key(self, key: bytes) -> bytes:
        return self.prefix + key

    # -- values: the entry header ----------------------------------------------------------------------
    def _header(self, view: memoryview) -> bytes:
        """The header to write before `view` (the value is header + view, in one object or key)."""
        return entry.encode_header(self.fingerprint, view)

    def _wrap(self, view: memoryview) -> bytes:
        return b"".join((self._header(view), view))  # one copy

    def _unwrap(self, raw: bytes | memoryview) -> memoryview | None:
        """The verified payload of a stored value, or None (a counted, logged miss)."""
        view = memoryview(raw)
        payload = view[entry.HEADER_BYTES :]
        problem = entry.verify(entry.decode_header(view), self.fingerprint, payload)
        if problem:
            self._count(**{problem: 1})
            self._log.warning(
                "%s store %s: an entry failed verification (%s); treated as a miss", self.kind, self.url, problem
            )
            return None
        return payload

    # -- back-off ---------------------------------------------------------------------------------------
    def _is_down(self, name: str = "") -> bool:
        return self._down_until.get(name, 0.0) > self._clock()

    def _any_down(self) -> bool:
        now = self._clock()
        return any(until > now for until in self._down_until.values())

    def _mark_down(self, name: str = "") -> None:
        self._down_until[name] = self._clock() + NODE_RETRY_SECONDS

    def _describe(self, exc: BaseException) -> object:
        """What a warning shows of a client's exception."""
        return exc

    def _failed(self, name: str, exc: BaseException, what: str, count: int) -> None:
        """`count` keys failed on `name` (what: read_errors or write_errors): count them, log once, back off."""
        self._log.warning(
            "%s store %s: %s failed (%s); skipped for %.0f s: %s",
            self.kind,
            self.url,
            name or "the server",
            self._describe(exc),
            NODE_RETRY_SECONDS,
            "misses" if what == "read_errors" else "writes dropped",
        )
        self._count(**{what: count})
        self._mark_down(name)
