"""kvoffload: offload the prefix-cacheable KV of hybrid models to host memory and disk, and bring it
back bit for bit. Public surface: `open_store`, the layout model (`kvoffload.spec`) and the key chain.

`Store` and `open_store` are imported on first use (module `__getattr__`), so importing a submodule
alone -- vLLM imports `kvoffload.connectors.vllm_plugin` in every process -- loads no store stack
(numpy, lmdb, xxhash)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .store import Store, open_store

__version__ = "0.1.0"
__all__ = ["Store", "open_store", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("Store", "open_store"):
        from . import store

        return getattr(store, name)
    if not name.startswith("_"):  # a submodule, as `import kvoffload` used to bind `kvoffload.store`
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
