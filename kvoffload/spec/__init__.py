"""WHAT is cached: the layout model of a hybrid paged KV cache, its adapters, and the key chain."""

from .keys import KEY_BYTES, KeyChain, page_key, request_salt, shard_key
from .layout import CacheGroup, CacheLayout, GroupKind, Region
from .vllm import UnsupportedLayoutError, from_vllm, group_kinds

__all__ = [
    "CacheGroup",
    "CacheLayout",
    "GroupKind",
    "Region",
    "KeyChain",
    "page_key",
    "request_salt",
    "shard_key",
    "KEY_BYTES",
    "group_kinds",
    "from_vllm",
    "UnsupportedLayoutError",
]
