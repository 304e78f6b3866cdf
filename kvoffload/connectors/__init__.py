"""WHO moves bytes and WHEN: `plan` (which pages of a request to save or load), `transfer` (moving
them between a cache buffer and a store), `offloader` (the engine-facing API over both), and thin
adapters for engines: `runner` (the bundled GLM runner) and `vllm` (vLLM's KV connector API: the
`KVOffloadConnector` facade in `vllm`, over its scheduler half `vllm_scheduler` and worker half
`vllm_worker`).

The names below are imported on first use (module `__getattr__`), so importing one submodule alone --
vLLM imports `vllm_plugin` in every process -- loads no store stack (numpy, lmdb, xxhash)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .offloader import LoadResult, Offloader
    from .plan import Page, hit_blocks, pages_for_load, pages_for_save
    from .transfer import Transfer

_LAZY = {
    "LoadResult": "offloader",
    "Offloader": "offloader",
    "Page": "plan",
    "hit_blocks": "plan",
    "pages_for_load": "plan",
    "pages_for_save": "plan",
    "Transfer": "transfer",
}
__all__ = ["LoadResult", "Offloader", "Page", "Transfer", "hit_blocks", "pages_for_load", "pages_for_save"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
