"""Memory backends: where buffers live and the kernels (reduce, copy, scale) that run on them."""

from __future__ import annotations

import threading
from typing import Protocol

import numpy as np

from .ops import Op
from .transport.cma import PAGE, short_distance


class MemoryBackend(Protocol):
    """What an algorithm needs from the memory its buffers live in."""

    name: str

    def reduce(self, op: Op, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None: ...

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None: ...

    def scale(self, arr: np.ndarray, divisor: int) -> None: ...

    def scratch(self, count: int, dtype: np.dtype) -> np.ndarray: ...

    def release(self, arr: np.ndarray) -> None: ...


_POOLED = 6  # scratch buffers kept for reuse
_APART_FROM = 4096  # copies from this size go through a middle buffer at the short distance (libc's rep movsb)


class HostMemory:
    """NumPy arrays in host memory; reductions are ufuncs writing through ``out=`` (no temporaries)."""

    name = "host"

    def reduce(self, op: Op, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        op.ufunc(a, b, out=out)  # type: ignore[misc]

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        if not dst.size:
            return
        d, s = dst.ctypes.data, src.ctypes.data
        if d == s and dst.dtype == src.dtype:
            return
        if dst.nbytes >= _APART_FROM and short_distance(d, s) and dst.flags.c_contiguous and src.flags.c_contiguous:
            self._copy_apart(dst, src, s)
        else:
            np.copyto(dst, src)

    def _copy_apart(self, dst: np.ndarray, src: np.ndarray, s: int) -> None:
        """dst = src through a buffer half a page from both: libc's memcpy runs about 10x slower when the destination
        lies a few bytes past the source within a page (``cma.short_distance``); two copies at good distances win."""
        n = src.nbytes
        buf = getattr(self._apart, "buf", None)
        if buf is None or buf.nbytes < n + PAGE:
            buf = self._apart.buf = np.empty(max(n, 1 << 16) + PAGE, np.uint8)
        at = (s + PAGE // 2 - buf.ctypes.data) % PAGE
        mid = buf[at:at + n].view(src.dtype).reshape(src.shape)
        np.copyto(mid, src)
        np.copyto(dst, mid)

    def scale(self, arr: np.ndarray, divisor: int) -> None:
        if arr.size:
            np.divide(arr, arr.dtype.type(divisor), out=arr)

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []  # byte buffers handed back by finished calls
        self._apart = threading.local()  # .buf: this thread's middle for copies at the short distance

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
