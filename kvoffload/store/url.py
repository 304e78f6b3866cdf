"""Parsing of store URLs (`memory://?capacity=4GiB`, `lmdb:///abs/dir?capacity=100GiB`, `tiered://...`)
and of human byte sizes. Unknown options are an error, not silently ignored."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlsplit

from .errors import StoreConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, what: str = "size") -> int:
    """'4GiB' -> 4294967296; '1.5GB' -> 1500000000; plain integers are bytes."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.match(str(text))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise StoreConfigError(f"invalid {what} {text!r}: use bytes or a unit such as 512MiB, 4GiB, 100GB")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise StoreConfigError(f"{what} must be positive, got {text!r}")
    return value


def parse_bool(text: str, what: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise StoreConfigError(f"invalid {what} {text!r}: use true or false")


@dataclass(frozen=True)
class StoreURL:
    scheme: str
    path: str
    options: dict[str, str]

    def take(self, allowed: set[str]) -> dict[str, str]:
        """The options, after checking that none is unknown for this scheme."""
        unknown = sorted(set(self.options) - allowed)
        if unknown:
            raise StoreConfigError(
                f"unknown option(s) {', '.join(unknown)} for {self.scheme}:// "
                f"(allowed: {', '.join(sorted(allowed)) or 'none'})"
            )
        return dict(self.options)


def parse_url(url: str) -> StoreURL:
    if not isinstance(url, str) or "://" not in url:
        raise StoreConfigError(
            f"invalid store URL {url!r}: expected memory://?capacity=4GiB, lmdb:///abs/dir?capacity=100GiB "
            "or tiered://?memory=4GiB&lmdb=/abs/dir&lmdb_capacity=100GiB"
        )
    parts = urlsplit(url)
    options: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False):
        if name in options:
            raise StoreConfigError(f"option {name!r} given twice in {url!r}")
        options[name] = value
    path = unquote(parts.netloc + parts.path)
    return StoreURL(parts.scheme.lower(), path, options)


def redact_url(url: str) -> str:
    """The URL with any password replaced by ***, for logs and reports (nested URLs included)."""
    return re.sub(r"(://[^/@?&,:]*:)[^@/?&]*@", r"\1***@", re.sub(r"(%3A%2F%2F[^%@?&]*%3A)[^@?&]*?(%40|@)",
                                                             r"\1***\2", url, flags=re.I))
