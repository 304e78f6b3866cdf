"""Per-op kernel dispatch. Layers call `ops.<name>(...)`; a backend (the torch reference here; Triton
and aiter later) registers implementations op by op, and an op it lacks falls back to the reference.
So a new backend slots in one kernel at a time without touching the layers."""

from __future__ import annotations

from collections.abc import Callable

from . import torch_ref

_REFERENCE = "torch"
_backends: dict[str, dict[str, Callable]] = {_REFERENCE: {name: getattr(torch_ref, name) for name in torch_ref.OPS}}
_active = _REFERENCE


def register(backend: str, name: str, fn: Callable) -> None:
    if name not in torch_ref.OPS:
        raise KeyError(f"unknown op {name!r}; ops are {', '.join(torch_ref.OPS)}")
    _backends.setdefault(backend, {})[name] = fn


def use_backend(backend: str) -> None:
    """Select the backend for all later calls (ops it does not implement use the torch reference)."""
    global _active
    if backend not in _backends:
        raise ValueError(f"unknown kernel backend {backend!r}; available: {', '.join(sorted(_backends))}")
    _active = backend


def active_backend() -> str:
    return _active


class _Ops:
    def __getattr__(self, name: str) -> Callable:
        table = _backends[_active]
        if name in table:
            return table[name]
        if name in _backends[_REFERENCE]:
            return _backends[_REFERENCE][name]
        raise AttributeError(f"no kernel op {name!r}")


ops = _Ops()
