"""A small engine: requests, a block pool with a prefix cache over full blocks keyed by kvoffload's
chained block keys, block-aligned chunked prefill (so every block boundary gets its KDA checkpoint,
as vLLM's mamba align mode does), and greedy decode.

A block enters the prefix cache once it is full and computed: its latent rows, its pooled indexer rows
and, in its KDA pages, the recurrent state at its end boundary never change afterwards. A hit always
leaves at least one prompt token to compute (the logits come from it)."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from kvoffload.spec import KeyChain

from .cache import PagedCache
from .layers.chunk import Chunk
from .model import GlmModel


class OutOfBlocksError(RuntimeError):
    """The cache has no free or evictable block: give the engine more blocks or fewer requests."""


class BlockPool:
    """Free blocks, reference counts, and the prefix cache: full blocks by block key, least recently
    used first, plus which blocks hold a KDA checkpoint at their end boundary (a prefix can only end
    at such a block)."""

    def __init__(self, num_blocks: int):
        self.refs = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.cached: OrderedDict[bytes, int] = OrderedDict()
        self.key_of: dict[int, bytes] = {}
        self.checkpoints: set[int] = set()

    def allocate(self) -> int:
        if not self.free:
            for key, block in self.cached.items():  # evict the least recently used unreferenced block
                if self.refs[block] == 0:
                    del self.cached[key], self.key_of[block]
                    self.free.append(block)
                    break
        if not self.free:
            raise OutOfBlocksError(f"all {len(self.refs)} cache blocks are in use")
        block = self.free.pop()
        self.refs[block] = 1
        self.checkpoints.discard(block)
        return block

    def peek(self, key: bytes) -> int | None:
        return self.cached.get(key)

    def acquire(self, block: int) -> None:
        self.refs[block] += 1
        key = self.key_of.get(block)
        if key is not None:
            self.cached.move_to_end(key)

    def register(self, key: bytes, block: int) -> None:
        if key not in self.cached and block not in self.key_of:
            self.cached[key] = block
            self.key_of[block] = key

    def mark_checkpoint(self, block: int) -> None:
        self.checkpoints.add(block)

    def has_checkpoint(self, block: int) -> bool:
        return block in self.checkpoints

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0 and block not in self.key_of:
            self.free.append(block)


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    salt: str | None = None
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    tail_block: int = -1
    computed: int = 0
    cached_tokens: int = 0  # prefix served by the engine's own prefix cache
    loaded_tokens: int = 0  # prefix served by an offload connector
    prefill_seconds: float = 0.0
    keys: list[bytes] = field(default_factory=list)
    registered: int = 0  # blocks already entered into the prefix cache

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens


class Engine:
    def __init__(
        self,
        model: GlmModel,
        cache: PagedCache,
        *,
        namespace: str = "glm_integration",
        prefill_chunk: int | None = None,
        split_at_blocks: bool = True,
    ):
        self.model, self.cache = model, cache
        self.block_size = cache.block_size
        self.pool = BlockPool(cache.num_blocks)
        self.chain = KeyChain(cache.layout.fingerprint, self.block_size, namespace=namespace)
        self.prefill_chunk = prefill_chunk or self.block_size
        self.split_at_blocks = split_at_blocks
        self.connector = None  # an offload connector (kvoffload.connectors.runner) may attach itself

    # -- admission -------------------------------------------------------------------------------------
    def add(self, prompt: list[int], max_tokens: int, salt: str | None = None) -> Request:
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        vocab = self.model.config.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"token ids must be in [0, {vocab})")
        request = Request(list(prompt), max_tokens, salt)
        request.tail_block = self.pool.allocate()
        chain = self.chain.with_salt(salt)
        request.keys = chain.keys(request.prompt)
        found = []
        for key in request.keys[: (len(prompt) - 1) // self.block_size]:
            block = self.pool.peek(key)
            if block is None:
                break
            found.append(block)
        # a prefix can only end where a KDA checkpoint is held
        hit_blocks = max((i + 1 for i, b in enumerate(found) if self.pool.has_checkpoint(b)), default=0)
        for block in found[:hit_blocks]:
            self.pool.acquire(block)
            request.blocks.append(block)
        request.computed = request.cached_tokens = hit_blocks * self.block_size
        request.registered = hit_blocks
        if self.connector is not None:
            self.connector.on_admit(self, request)
        return request

    def mark_checkpoint(self, block: int) -> None:
        """`block`'s KDA pages hold the state at its end boundary (computed, or restored by a connector)."""
        self.pool.mark_checkpoint(block)

    def ensure_blocks(self, request: Request, end: int) -> None:
        while len(request.blocks) * self.block_size < end:
            request.blocks.append(self.pool.allocate())

    # -- compute ---------------------------------------------------------------------------------------
    def _run(self, request: Request, start: int, end: int, decode: bool) -> torch.Tensor:
        self.ensure_blocks(request, end)
        chunk = Chunk(
            start, end, tuple(request.blocks), request.tail_block, self.block_size, decode, self.cache.buffer.device
        )
        logits = self.model.forward(request.tokens[start:end], chunk, self.cache)
        request.computed = end
        if end % self.block_size == 0:
            self.mark_checkpoint(request.blocks[end // self.block_size - 1])
        self._register_full_blocks(request)
        return logits

    def _register_full_blocks(self, request: Request) -> None:
        tokens = request.tokens
        full = request.computed // self.block_size
        if len(request.keys) < full:
            request.keys = self.chain.with_salt(request.salt).keys(tokens[: full * self.block_size])
        for i in range(request.registered, full):
            self.pool.register(request.keys[i], request.blocks[i])
        request.registered = max(request.registered, full)

    def prefill(self, request: Request) -> None:
        started = time.perf_counter()
        n = len(request.prompt)
        logits = None
        while request.computed < n:
            start = request.computed
            end = min(n, start + self.prefill_chunk)
            if self.split_at_blocks:
                end = min(end, (start // self.block_size + 1) * self.block_size)
            logits = self._run(request, start, end, decode=False)
        if logits is None:  # admission (and a connector's hits) leave at least the last prompt token to compute
            raise RuntimeError(f"prefill of a request whose {n} prompt tokens were all computed already")
        request.output.append(int(torch.argmax(logits[-1])))
        request.prefill_seconds = time.perf_counter() - started
        if self.connector is not None:
            self.connector.after_prefill(self, request)

    def decode_step(self, request: Request) -> None:
        position = len(request.tokens) - 1
        logits = self._run(request, position, position + 1, decode=True)
        request.output.append(int(torch.argmax(logits[-1])))

    def finish(self, request: Request) -> None:
        for block in request.blocks:
            self.pool.release(block)
        self.pool.release(request.tail_block)
        request.blocks, request.tail_block = [], -1

    def generate(
        self, prompts: list[list[int]], max_tokens: int, salts: list[str | None] | None = None
    ) -> list[Request]:
        """Admit and prefill each prompt in order (a later prompt hits the blocks of an earlier one),
        decode them in lock-step, free their blocks."""
        requests = []
        for i, prompt in enumerate(prompts):
            requests.append(self.add(prompt, max_tokens, (salts or [None] * len(prompts))[i]))
            self.prefill(requests[-1])
        while not all(r.done for r in requests):
            for request in requests:
                if not request.done:
                    self.decode_step(request)
        for request in requests:
            self.finish(request)
        return requests
