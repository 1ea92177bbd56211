"""Memory backends: where buffers live and the kernels (reduce, copy, scale) that run on them."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .ops import Op


class MemoryBackend(Protocol):
    """What an algorithm needs from the memory its buffers live in."""

    name: str

    def reduce(self, op: Op, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None: ...

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None: ...

    def scale(self, arr: np.ndarray, divisor: int) -> None: ...

    def scratch(self, count: int, dtype: np.dtype) -> np.ndarray: ...


class HostMemory:
    """NumPy arrays in host memory; reductions are ufuncs writing through ``out=`` (no temporaries)."""

    name = "host"

    def reduce(self, op: Op, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        op.ufunc(a, b, out=out)  # type: ignore[misc]

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        if dst.size and not (dst.ctypes.data == src.ctypes.data and dst.dtype == src.dtype):
            np.copyto(dst, src)

    def scale(self, arr: np.ndarray, divisor: int) -> None:
        if arr.size:
            np.divide(arr, arr.dtype.type(divisor), out=arr)

    def scratch(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A flat array of ``count`` elements (contents undefined)."""
        return np.empty(count, dtype)


HOST = HostMemory()


def backend(name: str) -> MemoryBackend:
    if name == "host":
        return HOST
    raise KeyError(f"no memory backend {name!r} in this build")
