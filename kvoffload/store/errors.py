"""Errors a store raises, under `kvoffload.errors`. Every one has a message that says what to change;
read/write faults at run time are counted misses, never exceptions."""

from ..errors import ConfigError, StoreError


class StoreConfigError(ConfigError):
    """A store URL, option or directory that cannot work (bad scheme, size, path, permissions)."""


class KeyTooLongError(StoreError, ValueError):
    """A key longer than the tier takes (LMDB's is 511 bytes): shorten it, e.g. hash it."""


class EntryTooLargeError(StoreError, ValueError):
    """A value larger than the tier's whole capacity: it could never be stored."""


class IncompatibleStoreError(StoreConfigError):
    """An on-disk store written by an incompatible kvoffload format version."""
