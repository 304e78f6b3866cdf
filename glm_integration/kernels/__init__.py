"""Per-op kernel dispatch. Layers call `ops.<name>(...)`; a backend (the torch reference, Triton on
NVIDIA and AMD GPUs, aiter on ROCm) registers implementations op by op, and an op it lacks falls back
to the reference. So a new backend slots in one kernel at a time without touching the layers."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from . import torch_ref

_REFERENCE = "torch"
_backends: dict[str, dict[str, Callable]] = {_REFERENCE: {name: getattr(torch_ref, name) for name in torch_ref.OPS}}
_active = _REFERENCE
_MODULES = {"triton": "triton_ops", "aiter": "aiter_ops"}  # imported on first use: each registers its ops


def register(backend: str, name: str, fn: Callable) -> None:
    if name not in torch_ref.OPS:
        raise KeyError(f"unknown op {name!r}; ops are {', '.join(torch_ref.OPS)}")
    _backends.setdefault(backend, {})[name] = fn


def use_backend(backend: str) -> None:
    """Select the backend for all later calls (ops it does not implement use the torch reference)."""
    global _active
    if backend not in _backends and backend in _MODULES:
        try:
            importlib.import_module(f"{__name__}.{_MODULES[backend]}")
        except ImportError as exc:
            raise ValueError(f"kernel backend {backend!r} is not available here: {exc}") from exc
    if backend not in _backends:
        known = sorted({*_backends, *_MODULES})
        raise ValueError(f"unknown kernel backend {backend!r}; known: {', '.join(known)}")
    _active = backend


def backend_for(device, requested: str = "auto") -> str:
    """`auto`: Triton for a GPU device when it imports, else the torch reference."""
    if requested != "auto":
        return requested
    if str(device).startswith("cuda"):  # ROCm builds of torch also name their GPUs cuda
        try:
            import triton  # noqa: F401

            return "triton"
        except ImportError:
            pass
    return _REFERENCE


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
