"""The bundled GLM runner's adapter: loads on admission (before prefill), saves after prefill, and
reports hit tokens. Thin on purpose: what to move and how lives in `plan`, `transfer`, `offloader`."""

from __future__ import annotations

from ..store import Store
from .offloader import Observer, Offloader
from .transfer import make_transfer


class RunnerConnector:
    def __init__(self, store: Store, engine, observer: Observer | None = None):
        self.layout = engine.cache.layout
        self.offloader = Offloader(store, self.layout, make_transfer(engine.cache.buffer), observer)
        engine.connector = self

    def on_admit(self, engine, request) -> None:
        have = len(request.blocks)
        prompt_keys = request.keys
        total = self.offloader.lookup(prompt_keys, len(request.prompt), have)
        if total <= have:
            return
        engine.ensure_blocks(request, total * engine.block_size)
        if self.offloader.load(prompt_keys, have, total, request.blocks).ok:
            engine.mark_checkpoint(request.blocks[total - 1])
            request.computed = total * engine.block_size
            request.loaded_tokens = (total - have) * engine.block_size

    def after_prefill(self, engine, request) -> None:
        full = len(request.prompt) // engine.block_size
        checkpoints = [i for i in range(full) if engine.pool.has_checkpoint(request.blocks[i])]
        self.offloader.save(request.keys, full, checkpoints, request.blocks)
