"""Zero-copy byte views over what callers hand us: bytes, bytearray, memoryview, numpy arrays
and (contiguous, CPU) torch tensors. Stores deal in these views only, so a page can go from a
cache buffer to a tier and back with one copy each way."""

from __future__ import annotations

from typing import Any

import numpy as np

Buffer = Any  # bytes | bytearray | memoryview | np.ndarray | torch.Tensor


def _torch_bytes(t) -> np.ndarray:
    if t.device.type != "cpu":
        raise TypeError(f"stores take host buffers; got a tensor on {t.device}")
    if not t.is_contiguous():
        raise ValueError("tensor buffers must be contiguous")
    import torch

    return t.detach().reshape(-1).view(torch.uint8).numpy()


def byte_view(value: Buffer) -> memoryview:
    """A flat, read-only `memoryview` of unsigned bytes over `value`, without copying."""
    if type(value).__module__.startswith("torch"):
        value = _torch_bytes(value)
    if isinstance(value, np.ndarray):
        if not value.flags.c_contiguous:
            raise ValueError("array buffers must be C-contiguous")
        value = value.reshape(-1).view(np.uint8)
    try:
        view = memoryview(value)
    except TypeError:
        raise TypeError(f"expected a bytes-like buffer, got {type(value).__name__}") from None
    if not view.c_contiguous:
        raise ValueError("buffers must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def writable_view(out: Buffer) -> memoryview:
    """A flat, writable `memoryview` of unsigned bytes over a caller's destination buffer."""
    view = byte_view(out)
    if view.readonly:
        raise TypeError(f"destination buffer is read-only ({type(out).__name__})")
    return view


def copy_into(out: memoryview, src: memoryview) -> int:
    """Copy `src` to the front of `out`; a destination too small is the caller's bug, said clearly."""
    n = src.nbytes
    if out.nbytes < n:
        raise ValueError(f"destination holds {out.nbytes} bytes but the stored value has {n}")
    np.copyto(np.frombuffer(out, np.uint8, n), np.frombuffer(src, np.uint8))
    return n


class _HostMemory:
    """Host bytes at an address, as numpy's array interface sees them: wrapped without ctypes, whose
    array type per length costs ~10 us for every new length."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, nbytes: int):
        self.__array_interface__ = {"data": (address, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


def host_bytes(address: int, nbytes: int) -> np.ndarray:
    """A uint8 array over `nbytes` of host memory at `address`, which the caller holds (an arena slot)."""
    return np.asarray(_HostMemory(address, nbytes))
