"""The self-describing header every persistent entry carries: format version, layout fingerprint,
payload length and an xxh3-128 checksum over the header fields and the payload. Verified on every
read, so a flipped bit, a torn write or another layout's page is a miss and never a load."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import xxhash

FORMAT_VERSION = 1
MAGIC = b"KVOF"
FINGERPRINT_BYTES = 16
_FIELDS = struct.Struct("<4sHH16sQ")  # magic, version, flags, fingerprint, payload length
HEADER_BYTES = _FIELDS.size + 16  # + checksum


def normalize_fingerprint(fingerprint: bytes | str | None) -> bytes:
    """16 bytes identifying the layout; None means 'no layout' (all zeros)."""
    if fingerprint is None:
        return bytes(FINGERPRINT_BYTES)
    if isinstance(fingerprint, str):
        fingerprint = fingerprint.encode()
    if len(fingerprint) == FINGERPRINT_BYTES:
        return bytes(fingerprint)
    return hashlib.blake2b(fingerprint, digest_size=FINGERPRINT_BYTES).digest()


def _checksum(fields: bytes, payload: memoryview) -> bytes:
    h = xxhash.xxh3_128(fields)
    h.update(payload)
    return h.digest()


def encode_header(fingerprint: bytes, payload: memoryview) -> bytes:
    fields = _FIELDS.pack(MAGIC, FORMAT_VERSION, 0, fingerprint, payload.nbytes)
    return fields + _checksum(fields, payload)


@dataclass(frozen=True)
class Header:
    version: int
    fingerprint: bytes
    length: int
    checksum: bytes
    fields: bytes


def decode_header(raw: memoryview | bytes) -> Header | None:
    """The header, or None when the bytes are not one of ours at all."""
    if len(raw) < HEADER_BYTES:
        return None
    fields = bytes(raw[: _FIELDS.size])
    magic, version, _flags, fingerprint, length = _FIELDS.unpack(fields)
    if magic != MAGIC:
        return None
    return Header(version, fingerprint, length, bytes(raw[_FIELDS.size : HEADER_BYTES]), fields)


def verify(header: Header | None, fingerprint: bytes, payload: memoryview | None) -> str | None:
    """None when the payload is good for this layout, else the reason it must not be served. Damage
    first -- no magic, a payload of another length, a checksum that fails (the checksum covers every
    header field: a flipped version or fingerprint bit fails it) -- and only then what an intact entry
    may differ in: its format version, its layout (`fingerprint_mismatch`, the one kept in a store)."""
    if header is None:
        return "bad_header"
    if payload is None or payload.nbytes != header.length:
        return "length_mismatch"
    if _checksum(header.fields, payload) != header.checksum:
        return "checksum_failures"
    if header.version != FORMAT_VERSION:
        return "version_mismatch"
    if header.fingerprint != fingerprint:
        return "fingerprint_mismatch"
    return None
