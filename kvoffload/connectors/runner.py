"""The bundled GLM runner's adapter: loads on admission (before prefill), saves after prefill, and
reports hit tokens. Thin on purpose: what to move and how lives in `plan`, `retention`, `transfer`,
`offloader`."""

from __future__ import annotations

import logging

from ..store import Store
from .offloader import Observer, Offloader
from .plan import hit_and_junction
from .retention import StateRetention, as_retention
from .transfer import make_transfer

log = logging.getLogger(__name__)


class RunnerConnector:
    def __init__(
        self,
        store: Store,
        engine,
        observer: Observer | None = None,
        state_retention: str | StateRetention | None = None,
    ):
        """`state_retention`: the block boundaries whose KDA checkpoint is saved (a
        `retention` policy or its string, e.g. 'last+exp'; default `retention.DEFAULT`)."""
        self.layout = engine.cache.layout
        self.retention = as_retention(state_retention)
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
        held = [i for i in range(full) if engine.pool.has_checkpoint(request.blocks[i])]
        checkpoints = self.retention.state_blocks(
            self.layout, len(request.prompt), held, junction=self._junction(request)
        )
        self.offloader.save(request.keys, full, checkpoints, request.blocks)

    def _junction(self, request) -> int:
        """Where the prompt diverges from a prefix the store holds without its checkpoint (blocks; 0:
        none), asked only of a policy with the `junction` rule (one presence query)."""
        if not self.retention.junction:
            return 0
        try:
            return hit_and_junction(self.layout, request.keys, len(request.prompt), self.offloader.store.contains_many)[
                1
            ]
        except Exception as exc:  # noqa: BLE001 - a broken store: no junction, the save still runs
            log.error("kvoffload junction lookup failed: %s", exc, exc_info=True)
            return 0
