"""Admission of a `tiered://` store (`admit=N`, write-behind only; default 1: every value goes behind): a
value goes below memory only on its N-th use, where its put is the first use and every read served
from memory (a hit on a prefix) or put again (a recompute) is another; until then it lives in memory
only and is counted (`behind_not_admitted`). One-off prompts then never cost back-tier bandwidth nor
evict reused prefixes from the back tier. At most ADMIT_TRACKED keys wait for admission (the oldest are
forgotten). Kept apart from the write-behind (tiered_behind.py): it decides which keys go behind, never
how.

Locks: `_lock` guards the use counts only; it is a leaf (nothing is called under it, the store's
counters are counted after it is released).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from .errors import StoreConfigError

ADMIT_TRACKED = 1 << 20  # keys remembered while they wait for admission (admit > 1)
WRITE_MODES = ("behind", "through")
MAX_ADMIT = 1000


def write_options(write: str, admit: int | str, where: str) -> tuple[str, int]:
    """(write, admit) if a tiered store can take them, else a StoreConfigError saying what to change
    (`where`: the store or URL, for the message). The one check of `write=` and `admit=`: TieredStore's
    constructor calls it, being public API, and so does the tiered:// URL parser (url_config.py), which
    must refuse a bad URL when it is parsed -- vLLM's scheduler and the connector config only parse --
    and before any tier of it opens. `admit` may be the URL's text: anything but a whole number from 1
    to MAX_ADMIT is refused."""
    if write not in WRITE_MODES:
        raise StoreConfigError(f"{where} write= takes {' or '.join(WRITE_MODES)}, got {str(write)[:40]!r}")
    if isinstance(admit, str) and admit.isascii() and admit.isdigit():
        admit = int(admit)
    if not isinstance(admit, int) or not 1 <= admit <= MAX_ADMIT:
        raise StoreConfigError(f"{where} admit= takes a number of uses from 1 to {MAX_ADMIT}, got {str(admit)[:40]!r}")
    if admit > 1 and write != "behind":
        raise StoreConfigError(f"{where} admit= above 1 needs write=behind, got admit={admit} with write={write}")
    return write, admit


class Admission:
    """`admitted(keys, put=...)`: which keys go behind now; `count` is the store's counter."""

    def __init__(self, admit: int, count: Callable[..., None]):
        self.admit, self._count = admit, count
        self._uses: OrderedDict[bytes, int] = OrderedDict()  # key -> uses so far, while waiting for admission
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """The keys waiting for admission."""
        return len(self._uses)

    def admitted(self, keys: Sequence[bytes], *, put: bool) -> list[bytes]:
        """The keys whose use now is their `admit`-th: those go behind. A put starts counting a key; a
        read counts only keys already waiting."""
        if self.admit == 1 or not keys:
            return list(keys) if put else []
        ready, waiting = [], 0
        with self._lock:
            for key in keys:
                uses = self._uses.pop(key, 0)
                if not put and not uses:
                    continue  # admitted before, or never put here
                if uses + 1 >= self.admit:
                    ready.append(key)
                    continue
                self._uses[key] = uses + 1
                waiting += put
                while len(self._uses) > ADMIT_TRACKED:
                    self._uses.popitem(last=False)
        self._count(behind_not_admitted=waiting, behind_admitted=len(ready))
        return ready
