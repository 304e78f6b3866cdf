"""Deterministic chained block keys.

key(block i) = BLAKE2b-128(context, key(block i-1), token ids of block i), where the context binds the
layout fingerprint, a namespace and the request's salt. Equal prefixes under equal context give equal
keys in every process and on every machine (no Python `hash()`, no PYTHONHASHSEED dependence); a salt
changes the chain from its first block; a key names its whole prefix, not just its own block.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import numpy as np

KEY_BYTES = 16
_PERSON_CONTEXT = b"kvoffload-ctx"
_PERSON_BLOCK = b"kvoffload-blk"
_PERSON_PAGE = b"kvoffload-page"


def _as_bytes(value: bytes | str | None) -> bytes:
    if value is None:
        return b""
    return value.encode() if isinstance(value, str) else bytes(value)


def _framed(*parts: bytes) -> bytes:
    """Length-prefixed concatenation, so ('ab', 'c') and ('a', 'bc') never collide."""
    return b"".join(len(p).to_bytes(8, "little") + p for p in parts)


def request_salt(
    cache_salt: str | bytes | None = None, lora: str | None = None, mm_ids: Sequence[str] = ()
) -> bytes | None:
    """One request's salt from what a client controls (its cache salt) and what the engine adds (LoRA
    adapter, multimodal inputs): every part framed in a fixed order, so no choice of cache salt can
    spell another request's adapter or inputs (a salt '|lora:x' is not LoRA 'x'). None: no salt."""
    if not cache_salt and lora is None and not mm_ids:
        return None
    return _framed(
        b"cache_salt",
        _as_bytes(cache_salt),
        b"lora",
        _as_bytes(lora) if lora is not None else b"",
        b"lora_set",
        b"1" if lora is not None else b"0",
        b"mm",
        _framed(*(_as_bytes(i) for i in mm_ids)),
    )


class KeyChain:
    """Keys for the full blocks of token sequences under one layout, namespace and salt."""

    def __init__(
        self, fingerprint: bytes, block_size: int, namespace: bytes | str = b"", salt: bytes | str | None = None
    ):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.fingerprint, self.namespace, self.salt = bytes(fingerprint), _as_bytes(namespace), salt
        self.context = hashlib.blake2b(
            _framed(bytes(fingerprint), _as_bytes(namespace), _as_bytes(salt)),
            digest_size=KEY_BYTES,
            person=_PERSON_CONTEXT,
        ).digest()
        # The block hash with its framed context already fed: each block key copies it (a lookup keys a
        # whole prompt on the engine's thread).
        self._block_hash = hashlib.blake2b(_framed(self.context), digest_size=KEY_BYTES, person=_PERSON_BLOCK)

    def with_salt(self, salt: bytes | str | None) -> KeyChain:
        """The same chain under a per-request salt (cache isolation between tenants)."""
        return KeyChain(self.fingerprint, self.block_size, self.namespace, salt)

    def block_key(self, parent: bytes | None, block_tokens: Sequence[int]) -> bytes:
        if len(block_tokens) != self.block_size:
            raise ValueError(f"a block holds {self.block_size} tokens, got {len(block_tokens)}")
        return self._next(parent, np.asarray(block_tokens, dtype="<i8").tobytes())

    def _next(self, parent: bytes | None, tokens: bytes) -> bytes:
        """BLAKE2b-128(_framed(context, parent, tokens)), the context's part precomputed, the rest framed inline."""
        parent = parent or b""
        h = self._block_hash.copy()
        h.update(len(parent).to_bytes(8, "little") + parent + len(tokens).to_bytes(8, "little") + tokens)
        return h.digest()

    def keys(self, token_ids: Sequence[int], parent: bytes | None = None) -> list[bytes]:
        """Keys of every full block of `token_ids` (a trailing partial block has none)."""
        keys = []
        step = self.block_size * 8  # bytes of one block's "<i8" tokens
        n = len(token_ids) // self.block_size * self.block_size
        data = np.asarray(token_ids[:n], dtype="<i8").tobytes()  # one conversion for the whole prompt
        for at in range(0, len(data), step):
            parent = self._next(parent, data[at : at + step])
            keys.append(parent)
        return keys


def shard_key(block_key: bytes, tp_rank: int, tp_size: int, tp_replicas: int = 1) -> bytes:
    """A block key as tensor-parallel rank `tp_rank` of `tp_size` stores it. Ranks hold shards of a
    group (their own KDA heads: one key per rank) unless `tp_replicas` consecutive ranks hold the very
    same bytes (an MLA latent, an indexer row: replicated on every rank), which then share one key, so
    such a page is stored once per TP group instead of once per rank. One rank needs no tag."""
    if tp_size == 1:
        return block_key
    if tp_replicas == 1:
        return page_key(block_key, f"tp{tp_rank}/{tp_size}")
    shards = tp_size // tp_replicas
    return page_key(block_key, f"tp-shard{tp_rank // tp_replicas}/{shards}/{tp_size}")


@functools.lru_cache(maxsize=1 << 15)
def page_key(block_key: bytes, group: str) -> bytes:
    """The store key of one group's page (or checkpoint) for the prefix a block key names. Remembered
    for the last 32k pages: a lookup and the load after it name the same pages (a hash each)."""
    name = group.encode()
    h = _PAGE_HASH.copy()
    h.update(len(block_key).to_bytes(8, "little") + block_key + len(name).to_bytes(8, "little") + name)  # _framed
    return h.digest()


_PAGE_HASH = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON_PAGE)  # copied: cheaper than a new one
