"""vLLM KV cache events (`BlockStored` / `BlockRemoved`) for the blocks the connector's store holds, so a
prefix-aware router that reads vLLM's event stream (`--kv-events-config`) also sees the offloaded cache.

Fields follow vLLM's own OffloadingConnector (`offloading/events.py`):
- `medium`: vLLM's names, "CPU" for a `memory://` store, "STORAGE" for LMDB, Redis and `tiered://` (the
  store as a whole: a block is held while each page is in one of its tiers).
- `block_hashes`: vLLM's own hashes of the request (`Request.block_hashes`, what routers compare), one
  per `hash_block_size` tokens: a physical block of `r` hash units carries its `r` hashes, `block_size`
  is the hash unit, `token_ids` the whole block's tokens, `parent_block_hash` the hash just before it.
- `lora_id` / `lora_name` from the request; `extra_keys` left None (as the OffloadingConnector does);
  `group_idx` the cache group when the model has one cacheable group, else None (a block is all groups).

A block is *held* in the store when a hit through it can be served: the PAGED pages of the block on
every TP rank and, for a model with STATE groups, the STATE checkpoint at its end boundary (`plan`).
In a hybrid model a block without a checkpoint is therefore never announced. A block is announced once
per medium: when a save makes it held (checked against the store when save jobs are reported, a few
times: a `tiered://` write-behind reaches the disk later) or a lookup finds it held (after a restart,
say; pages of a save in flight count, as for hits). It is removed when a load finds a page of it missing,
on `reset_cache`, and when a page of it is evicted and the store no longer holds it: evicted from the
scheduler's mirror of a memory tier (`memory://`, a `tiered://` front with admit > 1), or by the store
itself in the process that writes it (LMDB's LRU, a tiered store's memory front; `Store.watch_evictions`),
reported by the worker in `StoredPages.evicted` (at most `vllm_worker.MAX_EVICTED` keys a step). A page a
tiered front evicted that is on disk (or one evicted from disk but still in memory) is still held.
Memory is bounded: payloads are kept for at most `max_blocks` blocks (the oldest forgotten: its removal
is then not reported), and the event list is drained by vLLM every step; nothing is recorded, and no
worker collects evicted keys, unless vLLM has events enabled.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .plan import Contains, held_keys

MEDIA = {"memory": "CPU"}  # every other scheme: "STORAGE"


def medium_for(scheme: str) -> str:
    return MEDIA.get(scheme, "STORAGE")


@dataclass
class _Block:
    hashes: list  # vLLM's block hashes of this physical block (ExternalBlockHash)
    parent: bytes | int | None  # the hash before it (an ExternalBlockHash), None for the first block
    token_ids: list[int]
    lora_id: int | None
    lora_name: str | None
    pages: list[bytes]  # every page a hit through this block needs (all ranks)
    checks: int = 0


class KVEvents:
    """Block payloads from save/lookup to removal, and the events not yet taken by vLLM."""

    MAX_CHECKS = 8  # a saved block not held after this many job reports (no checkpoint, a dropped save) is dropped
    MAX_PENDING = 4096  # saved blocks waiting to be seen held (each check queries all their pages)

    def __init__(
        self,
        layout,
        medium: str,
        hash_block_size: int,
        contains: Contains,
        max_blocks: int = 1 << 16,
    ):
        self.layout, self.medium, self.contains, self.max_blocks = layout, medium, contains, max_blocks
        self.hash_block_size = hash_block_size or layout.block_size
        cacheable = list(layout.cacheable_groups)
        self.group_idx = cacheable[0].index if len(cacheable) == 1 else None
        self._pending: OrderedDict[bytes, _Block] = OrderedDict()  # saved, not yet seen held
        self._held: OrderedDict[bytes, _Block] = OrderedDict()  # announced
        self._owner: dict[bytes, bytes] = {}  # page key of an announced block -> its block key
        self._events: list = []

    def _block(self, request, block_keys: Sequence[bytes], i: int) -> _Block | None:
        r = self.layout.block_size // self.hash_block_size
        hashes = list(getattr(request, "block_hashes", None) or [])[i * r : (i + 1) * r]
        if len(hashes) < r or r < 1:
            return None  # vLLM has no hash for it (no prefix caching hash): nothing a router could match
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        tokens = list(request.prompt_token_ids or [])[i * self.layout.block_size : (i + 1) * self.layout.block_size]
        lora = getattr(request, "lora_request", None)
        pages = held_keys(self.layout, block_keys, i)
        return _Block(
            [maybe_convert_block_hash(h) for h in hashes],
            maybe_convert_block_hash(request.block_hashes[i * r - 1]) if i > 0 else None,
            tokens,
            lora.adapter_id if lora is not None else None,
            lora.name if lora is not None else None,
            pages,
        )

    def saved(self, request, block_keys: Sequence[bytes], indices: Iterable[int]) -> None:
        """A save job wrote pages of these blocks: check them once the job is reported (`check`)."""
        for i in sorted(set(indices)):
            key = block_keys[i]
            if key in self._held or key in self._pending:
                continue
            block = self._block(request, block_keys, i)
            if block is not None:
                self._pending[key] = block
                while len(self._pending) > self.MAX_PENDING:
                    self._pending.popitem(last=False)

    def held(self, request, block_keys: Sequence[bytes], indices: Iterable[int]) -> None:
        """A lookup found these blocks held: announce those not announced yet."""
        for i in indices:
            if block_keys[i] not in self._held and (block := self._block(request, block_keys, i)) is not None:
                self._announce(block_keys[i], block)

    def check(self) -> None:
        """After save jobs were reported: announce the pending blocks the store now holds."""
        if not self._pending:
            return
        keys = list(self._pending)
        wanted = [p for key in keys for p in self._pending[key].pages]
        present = dict(zip(wanted, self.contains(wanted)))
        for key in keys:
            block = self._pending[key]
            if all(present[p] for p in block.pages):
                del self._pending[key]
                self._announce(key, block)
            else:
                block.checks += 1
                if block.checks >= self.MAX_CHECKS:
                    del self._pending[key]

    def _announce(self, key: bytes, block: _Block) -> None:
        from vllm.distributed.kv_events import BlockStored

        self._pending.pop(key, None)
        self._held[key] = block
        self._owner.update((p, key) for p in block.pages)
        self._events.append(
            BlockStored(
                block_hashes=block.hashes,
                parent_block_hash=block.parent,
                token_ids=block.token_ids,
                block_size=self.hash_block_size,
                lora_id=block.lora_id,
                medium=self.medium,
                lora_name=block.lora_name,
                group_idx=self.group_idx,
            )
        )
        while len(self._held) > self.max_blocks:
            self._forget(next(iter(self._held)))

    def _forget(self, key: bytes) -> _Block:
        block = self._held.pop(key)
        for p in block.pages:
            self._owner.pop(p, None)
        return block

    def removed(self, page_keys: Iterable[bytes]) -> None:
        """Pages gone from the store (evicted, missing at a load): their blocks are not held."""
        gone = {self._owner[p] for p in page_keys if p in self._owner}
        hashes = [h for key in gone for h in self._forget(key).hashes]
        if hashes:
            self._remove_event(hashes)

    def cleared(self) -> None:
        """`reset_cache` emptied the store: every announced block is removed."""
        hashes = [h for block in self._held.values() for h in block.hashes]
        self._held.clear()
        self._owner.clear()
        self._pending.clear()
        if hashes:
            self._remove_event(hashes)

    def _remove_event(self, hashes: list) -> None:
        from vllm.distributed.kv_events import BlockRemoved

        self._events.append(BlockRemoved(block_hashes=hashes, medium=self.medium, group_idx=self.group_idx))

    def take(self) -> list:
        events, self._events = self._events, []
        return events
