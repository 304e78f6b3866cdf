"""Errors a store raises. Every one is a `ValueError` or `OSError` subclass with a message that
says what to change; read/write faults at run time are counted misses, never exceptions."""


class StoreConfigError(ValueError):
    """A store URL, option or directory that cannot work (bad scheme, size, path, permissions)."""


class EntryTooLargeError(ValueError):
    """A value larger than the tier's whole capacity: it could never be stored."""


class IncompatibleStoreError(StoreConfigError):
    """An on-disk store written by an incompatible kvoffload format version."""
