"""kvoffload: offload the prefix-cacheable KV of hybrid models to host memory and disk, and bring it
back bit for bit. Public surface: `open_store`, the layout model (`kvoffload.spec`) and the key chain."""

from .store import Store, open_store

__version__ = "0.1.0"
__all__ = ["Store", "open_store", "__version__"]
