"""Memory backends: where buffers live and the kernels (reduce, copy, scale) that run on them."""

from __future__ import annotations

import ctypes
import threading
from typing import Callable, Optional, Protocol

import numpy as np

from .config import bool_param, param
from .ops import Op
from .pages import PAGE, short_distance, slow_at_short_distance


def _parse_short_distance(raw: str) -> Optional[bool]:
    low = raw.strip().lower()
    if low not in ("auto", "bounce", "direct"):
        raise ValueError("expected auto, bounce or direct")
    return None if low == "auto" else low == "bounce"


SHORT_DISTANCE_COPIES = param(
    "PYCOLL_SHORT_DISTANCE", None, _parse_short_distance,
    "Copies whose destination lies 1-63 bytes past the source modulo a page, which rep movsb runs several times "
    "slower on some CPUs: 'bounce' them through a buffer half a page from both, copy them 'direct', or 'auto' "
    "(each kind of copy, memcpy and the kernel's cross-memory copy, is timed at both distances once per process).")
_bounces: dict[str, bool] = {}

KEEP_FREED = bool_param(
    "PYCOLL_KEEP_FREED", True,
    "Where glibc is the allocator, keep freed blocks up to 64 MiB in the process (mallopt: M_MMAP_THRESHOLD 64 MiB, "
    "M_TRIM_THRESHOLD 128 MiB), as MPICH's UCX does, so that a new array on every call reuses memory already "
    "faulted in instead of fresh pages (2 ranks, Alltoallv of 1 MiB blocks on a new send and receive array each "
    "call: 0.33 ms against 3.2). 0 leaves glibc's defaults. Set when pycoll starts in a process.",
)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_freed_memory() -> bool:
    """Have glibc keep freed blocks up to 64 MiB for reuse (``PYCOLL_KEEP_FREED``); whether it was done."""
    if not KEEP_FREED.get():
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: other allocators read mallopt differently, or not at all
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 64 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 128 << 20))


def bounces_short_distance(kind: str, copy: Callable[[int, int, int], object]) -> bool:
    """Whether copies of ``kind`` (``copy(dst, src, nbytes)``) at the short distance go through a bounce buffer:
    as PYCOLL_SHORT_DISTANCE says, else whether this CPU runs them slowly (timed on first use, then kept)."""
    forced = SHORT_DISTANCE_COPIES.get()
    if forced is not None:
        return forced
    if kind not in _bounces:
        _bounces[kind] = slow_at_short_distance(copy)
    return _bounces[kind]


class MemoryBackend(Protocol):
    """What an algorithm needs from the memory its buffers live in."""

    name: str

    def reduce(self, op: Op, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None: ...

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None: ...

    def scale(self, arr: np.ndarray, divisor: int) -> None: ...

    def scratch(self, count: int, dtype: np.dtype) -> np.ndarray: ...

    def release(self, arr: np.ndarray) -> None: ...


def _data_field_offset() -> int:
    """Where a NumPy array object keeps its data pointer (NumPy's ``PyArrayObject_fields.data``, right after the
    object header), checked against ``__array_interface__`` on arrays and views; -1 where it is not there."""
    offset = object.__basicsize__
    probes = np.arange(4, dtype=np.float64), np.zeros(3, np.uint8)[1:], np.empty((2, 3), np.int32).T
    for a in probes:
        if ctypes.c_size_t.from_address(id(a) + offset).value != a.__array_interface__["data"][0]:
            return -1
    return offset


DATA_FIELD = _data_field_offset()  # for the hottest callers, which read the word themselves
_word_at = ctypes.c_size_t.from_address


def host_address(arr: np.ndarray) -> int:
    """The address of a NumPy array's first byte, read from the array object itself: about 0.2 µs, where
    ``__array_interface__`` takes about 3 and ``ctypes.addressof(c_char.from_buffer(arr))`` 1."""
    if DATA_FIELD < 0 or not isinstance(arr, np.ndarray):
        return arr.__array_interface__["data"][0]
    return _word_at(id(arr) + DATA_FIELD).value


_POOLED = 6  # scratch buffers kept for reuse
_APART_FROM = 4096  # copies from this size go through a middle buffer at the short distance (libc's rep movsb)
_SAME_FROM = 64 << 10  # copies from this size onto themselves are skipped


class HostMemory:
    """NumPy arrays in host memory; reductions are ufuncs writing through ``out=`` (no temporaries)."""

    name = "host"

    def reduce(self, op: Op, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        op.ufunc(a, b, out=out)  # type: ignore[misc]

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        n = dst.nbytes
        if n < _APART_FROM:
            if n:
                np.copyto(dst, src)
            return
        bounce = bounces_short_distance("memcpy", ctypes.memmove)
        if bounce or n >= _SAME_FROM:  # the addresses cost 0.5 µs: asked for where they can save more
            d, s = host_address(dst), host_address(src)
            if d == s and dst.dtype == src.dtype:
                return
            if bounce and short_distance(d, s) and dst.flags.c_contiguous and src.flags.c_contiguous:
                self._copy_apart(dst, src, s)
                return
        np.copyto(dst, src)

    def plain(self, dst: np.ndarray, src: np.ndarray) -> bool:
        """Whether ``copy(dst, src)`` is one memcpy of contiguous arrays of one dtype and size, at a distance this CPU
        copies well: what another copier (the TCP exchange's loop in C) may make in its place, a piece at a time."""
        if dst.dtype != src.dtype or dst.nbytes != src.nbytes or not (dst.flags.c_contiguous and src.flags.c_contiguous):
            return False
        if dst.nbytes < _APART_FROM or not bounces_short_distance("memcpy", ctypes.memmove):
            return True
        return not short_distance(host_address(dst), host_address(src))

    def _copy_apart(self, dst: np.ndarray, src: np.ndarray, s: int) -> None:
        """dst = src through a buffer half a page from both: on some CPUs libc's memcpy runs about 10x slower when the
        destination lies a few bytes past the source within a page (``pages.short_distance``); two copies at good
        distances win there."""
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
