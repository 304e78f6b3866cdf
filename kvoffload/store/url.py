"""The scheme-independent half of store URL parsing: splitting a URL into scheme, path and options
(unknown options are an error, not silently ignored), human byte sizes, booleans, and redacting
passwords. Each scheme's options, and the grammar, are in `url_config.py`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Context, Decimal, localcontext
from urllib.parse import parse_qsl, unquote, urlsplit

from .errors import StoreConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "p": 1000**5,
    "pb": 1000**5,
    "e": 1000**6,
    "eb": 1000**6,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
    "eib": 1024**6,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$", re.ASCII)  # no nan, inf or exponents
MAX_SIZE = 2**63 - 1  # what LMDB's map size, mmap and C sizes take


def parse_size(text: str | int, what: str = "size") -> int:
    """'4GiB' -> 4294967296; '1.5GB' -> 1500000000; plain integers are bytes. Exact (Decimal, not
    float: a float overflows on long input and rounds), and at most MAX_SIZE."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.match(text) if isinstance(text, str) else None
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise StoreConfigError(f"invalid {what} {_short(text)}: use bytes or a unit such as 512MiB, 4GiB, 100GB")
        number = m.group(1).lstrip("0")
        if len(number.partition(".")[0]) > len(str(MAX_SIZE)):
            value = MAX_SIZE + 1  # too large already, whatever the unit: spare Decimal a huge number
        else:
            with localcontext(Context(prec=len(number) + 20)):  # enough digits for the product to be exact
                value = int(Decimal(number or "0") * _UNITS[unit])
    if value > MAX_SIZE:
        raise StoreConfigError(f"{what} {_short(text)} is too large: at most {MAX_SIZE} bytes (8 EiB)")
    if value <= 0:
        raise StoreConfigError(f"{what} must be positive, got {_short(text)}")
    return value


def _short(text) -> str:
    shown = repr(text)
    return shown if len(shown) <= 40 else f"{shown[:30]}...({len(shown)} characters)"


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
            f"invalid store URL {redact_url(url) if isinstance(url, str) else url!r}: expected "
            "memory://?capacity=4GiB, lmdb:///abs/dir?capacity=100GiB, redis://host:6379/0 "
            "or tiered://?memory=4GiB&lmdb=/abs/dir&lmdb_capacity=100GiB"
        )
    if "#" in url:  # urlsplit would drop the rest as a fragment: options, even part of a path or password
        raise StoreConfigError(
            f"'#' in store URL {redact_url(url)!r}: a store URL has no #fragment; "
            "percent-encode a '#' in a path or password as %23"
        )
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed [IPv6] host
        raise StoreConfigError(f"invalid store URL {redact_url(url)!r}: {exc}") from None
    options: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False):
        if name in options:
            raise StoreConfigError(f"option {name!r} given twice in {redact_url(url)!r}")
        options[name] = value
    path = unquote(parts.netloc + parts.path)
    return StoreURL(parts.scheme.lower(), path, options)


_ENCODED = r"%(?:25)*"  # a delimiter %-encoded once or more: how it appears in a nested URL
_AT = re.compile(rf"@|{_ENCODED}40", re.I)
_COLON = re.compile(rf":|{_ENCODED}3A", re.I)
# A URL starts the string or an option value (tiered://?redis=redis://...); scheme-like text elsewhere
# may be part of a password.
_SCHEME = re.compile(rf"(?:^|(?<==))[a-z][a-z0-9+.-]*(?::|{_ENCODED}3A)(?:/|{_ENCODED}2F){{2}}", re.I)


def redact_url(url: str) -> str:
    """The URL with every password replaced by ***, for logs, reports and errors (nested URLs, raw or
    %-encoded, included). Conservative, as a password may hold any delimiter: the userinfo ends at the
    last '@' before the next nested URL, the password starts at its first ':'. Some host or option
    text may be hidden with it; no password character is ever shown."""
    cuts = [(0, 0), *(m.span() for m in _SCHEME.finditer(url)), (len(url), len(url))]
    spans: list[list[int]] = []
    for (_, start), (end, _) in zip(cuts, cuts[1:]):
        last = spans[-1] if spans else None
        if last and _COLON.search(url, *last) and not _AT.search(url, *last):
            last[1] = end  # a password may have started and not ended yet: scheme-like text inside it
        else:
            spans.append([start, end])
    for start, end in reversed(spans):
        ats = list(_AT.finditer(url, start, end))
        if not ats:
            continue
        at = ats[-1]  # the last '@' of the span
        colon = _COLON.search(url, start, at.start())
        if colon:
            url = url[: colon.end()] + "***" + url[at.start() :]
    return url
