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

    def release(self, arr: np.ndarray) -> None: ...


_POOLED = 6  # scratch buffers kept for reuse


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

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []  # byte buffers handed back by finished calls

    def scratch(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A flat array of ``count`` elements (contents undefined): the smallest pooled buffer that fits, else a new one."""
        nbytes = count * dtype.itemsize
        fits = [i for i, raw in enumerate(self._free) if raw.nbytes >= nbytes]
        if fits:
            raw = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
            return raw[:nbytes].view(dtype)
        return np.empty(max(nbytes, 64), np.uint8)[:nbytes].view(dtype)

    def release(self, arr: np.ndarray) -> None:
        """Give a scratch array back once nothing reads or writes it any more; the pool keeps the largest few."""
        raw = arr.base if arr.base is not None else arr
        while raw.base is not None:
            raw = raw.base
        if not isinstance(raw, np.ndarray):
            return
        self._free.append(raw)
        if len(self._free) > _POOLED:  # drop the smallest: fresh large buffers cost page faults on every call
            del self._free[min(range(len(self._free)), key=lambda i: self._free[i].nbytes)]


HOST = HostMemory()


def backend(name: str, stream: object = None) -> MemoryBackend:
    """The backend for "host" (NumPy) or "cuda" (device arrays, pycoll.cuda.memory; imports numba.cuda, with ``stream``)."""
    if name == "host":
        return HOST
    if name == "cuda":
        from .cuda.memory import CudaMemory

        return CudaMemory(stream)
    raise KeyError(f"no memory backend {name!r} in this build")
