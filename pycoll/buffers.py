"""Parsing of mpi4py buffer specs (buf, [buf, count], [buf, count, dtype], [buf, counts, displs, dtype])."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from . import datatypes
from .datatypes import Datatype
from .errors import InvalidArgumentError


class _InPlace:
    """The ``MPI.IN_PLACE`` sentinel."""

    _instance: Optional["_InPlace"] = None

    def __new__(cls) -> "_InPlace":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "MPI.IN_PLACE"

    def __reduce__(self):
        return (_InPlace, ())


IN_PLACE = _InPlace()

_DLPACK_CPU = 1
_DLPACK_CUDA = (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


@dataclass
class Buf:
    """A resolved buffer: a flat array of ``count`` elements over the user's memory (no copy)."""

    array: np.ndarray
    dtype: np.dtype
    memory: str = "host"  # the memory backend that owns it; "cuda" slots in later

    @property
    def count(self) -> int:
        return int(self.array.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


@dataclass
class VBuf:
    """A resolved vector buffer: one flat array and per-rank (count, displacement) in elements."""

    array: np.ndarray
    dtype: np.dtype
    counts: list[int]
    displs: list[int]
    memory: str = "host"

    def part(self, i: int) -> np.ndarray:
        return self.array[self.displs[i] : self.displs[i] + self.counts[i]]


def _is_cuda(obj: Any) -> bool:
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is not None:
        try:
            return int(dev()[0]) in _DLPACK_CUDA
        except Exception:
            return False
    return False


def _as_flat_array(obj: Any, what: str, op: str) -> np.ndarray:
    """A 1-D view of the object's memory, no copy; raises InvalidArgumentError otherwise."""
    if type(obj) is np.ndarray:  # the common case: host memory, no protocol to ask
        if obj.ndim == 1 and obj.flags.c_contiguous:
            return obj
        if not (obj.flags.c_contiguous or obj.flags.f_contiguous):
            raise InvalidArgumentError(f"{what} is not contiguous (shape {obj.shape}, strides {obj.strides})", op=op)
        return obj.reshape(-1, order="A")
    if _is_cuda(obj):
        raise InvalidArgumentError(
            f"{what} is a CUDA array; this pycoll build has host buffers only (the cuda memory backend is not installed)",
            op=op,
        )
    if isinstance(obj, np.ndarray):
        arr = obj
    elif hasattr(obj, "__array_interface__"):
        arr = np.asarray(obj)
    elif hasattr(obj, "__dlpack__"):
        arr = np.from_dlpack(obj)
    else:
        try:
            mv = memoryview(obj)
        except TypeError:
            raise InvalidArgumentError(
                f"{what} of type {type(obj).__name__} exposes no buffer (expected a NumPy array, an object with the "
                "buffer protocol, __array_interface__ or __dlpack__)",
                op=op,
            ) from None
        if not mv.contiguous:
            raise InvalidArgumentError(f"{what} is not contiguous", op=op)
        arr = np.frombuffer(mv, dtype=np.uint8) if mv.nbytes else np.empty(0, np.uint8)
        if mv.format not in ("B", "b", "c"):
            try:
                arr = arr.view(datatypes.format_dtype(mv.format))
            except (TypeError, ValueError):
                raise InvalidArgumentError(f"{what} has an unsupported element format {mv.format!r}", op=op) from None
        if not mv.readonly:
            arr.flags.writeable = True
        return arr
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        raise InvalidArgumentError(f"{what} is not contiguous (shape {arr.shape}, strides {arr.strides})", op=op)
    return arr.reshape(-1, order="A")


def _reinterpret(arr: np.ndarray, dtype: np.dtype, what: str, op: str) -> np.ndarray:
    if arr.dtype == dtype:
        return arr
    if arr.nbytes % dtype.itemsize:
        raise InvalidArgumentError(
            f"{what}: {arr.nbytes} bytes are not a whole number of {dtype.name} elements", op=op
        )
    return arr.view(np.uint8).view(dtype) if arr.size else np.empty(0, dtype)


def _dtype_of(spec: Any, what: str, op: str) -> np.dtype:
    try:
        return datatypes.resolve(spec)
    except TypeError as exc:
        raise InvalidArgumentError(f"{what}: {exc}", op=op) from None


def _check_supported(dtype: np.dtype, what: str, op: str) -> None:
    try:
        datatypes.from_numpy(dtype)
    except KeyError:
        raise InvalidArgumentError(f"{what}: dtype {dtype} is not supported", op=op) from None


def _is_datatype(x: Any) -> bool:
    return isinstance(x, (Datatype, np.dtype, type, str))


def parse(spec: Any, what: str, op: str, *, writable: bool = False, blocks: int = 1) -> Buf:
    """Resolve ``buf``, ``[buf, count]``, ``[buf, dtype]`` or ``[buf, count, dtype]``.

    With ``blocks`` > 1 (one block per rank, as in Allgather's recvbuf) an explicit count is per
    block, and without one each block is ``len // blocks`` elements, as in mpi4py.
    """
    count: Optional[int] = None
    dtype: Optional[np.dtype] = None
    obj = spec
    if isinstance(spec, (list, tuple)):
        if not 1 <= len(spec) <= 3:
            raise InvalidArgumentError(f"{what}: a buffer spec has 1 to 3 items, got {len(spec)}", op=op)
        obj, rest = spec[0], list(spec[1:])
        if rest and _is_datatype(rest[-1]):
            dtype = _dtype_of(rest.pop(), what, op)
        if rest:
            c = rest.pop()
            if isinstance(c, (tuple, list)) and len(c) == 2:  # mpi4py's (count, displ)
                c, displ = c
                if displ:
                    raise InvalidArgumentError(f"{what}: a displacement is only allowed in vector specs", op=op)
            if not isinstance(c, (int, np.integer)) or isinstance(c, bool):
                raise InvalidArgumentError(f"{what}: count must be an integer, got {c!r}", op=op)
            count = int(c)
        if rest:
            raise InvalidArgumentError(f"{what}: could not read buffer spec {spec!r}", op=op)
    arr = _as_flat_array(obj, what, op)
    if dtype is not None:
        arr = _reinterpret(arr, dtype, what, op)
    _check_supported(arr.dtype, what, op)
    if count is not None:
        if count < 0:
            raise InvalidArgumentError(f"{what}: count {count} is negative", op=op)
        if count * blocks > arr.shape[0]:
            per = f" ({blocks} blocks of {count})" if blocks > 1 else ""
            raise InvalidArgumentError(
                f"{what}: count {count * blocks}{per} exceeds the buffer's {arr.shape[0]} {arr.dtype.name} elements",
                op=op,
            )
        arr = arr[: count * blocks]
    elif blocks > 1:
        arr = arr[: arr.shape[0] // blocks * blocks]
    if writable and not arr.flags.writeable:
        raise InvalidArgumentError(f"{what} is read-only", op=op)
    return Buf(arr, arr.dtype)


def parse_vector(spec: Any, what: str, op: str, size: int, *, writable: bool = False) -> VBuf:
    """Resolve ``[buf, counts]``, ``[buf, counts, displs]``, ``[buf, counts, displs, dtype]``."""
    if not isinstance(spec, (list, tuple)) or len(spec) < 2:
        base = parse(spec, what, op, writable=writable)
        if base.count % size:
            raise InvalidArgumentError(
                f"{what}: without counts the {base.count} elements must split evenly over {size} ranks", op=op
            )
        each = base.count // size
        return VBuf(base.array, base.dtype, [each] * size, [i * each for i in range(size)])
    items = list(spec)
    dtype = _dtype_of(items.pop(), what, op) if _is_datatype(items[-1]) else None
    obj = items[0]
    counts_spec: Any = items[1] if len(items) > 1 else None
    displs_spec: Any = items[2] if len(items) > 2 else None
    if isinstance(counts_spec, tuple) and len(counts_spec) == 2 and displs_spec is None and not np.isscalar(counts_spec[0]):
        counts_spec, displs_spec = counts_spec  # mpi4py's (counts, displs)
    if len(items) > 3:
        raise InvalidArgumentError(f"{what}: could not read vector spec", op=op)
    arr = _as_flat_array(obj, what, op)
    if dtype is not None:
        arr = _reinterpret(arr, dtype, what, op)
    _check_supported(arr.dtype, what, op)
    counts = _int_list(counts_spec, size, "counts", what, op)
    if displs_spec is None:
        displs = [int(x) for x in np.concatenate(([0], np.cumsum(counts)[:-1]))] if size else []
    else:
        displs = _int_list(displs_spec, size, "displs", what, op)
    for i, (c, d) in enumerate(zip(counts, displs)):
        if c < 0 or d < 0 or d + c > arr.shape[0]:
            raise InvalidArgumentError(
                f"{what}: rank {i}'s block (count {c}, displacement {d}) does not fit in {arr.shape[0]} elements",
                op=op,
            )
    if writable and not arr.flags.writeable:
        raise InvalidArgumentError(f"{what} is read-only", op=op)
    return VBuf(arr, arr.dtype, counts, displs)


def _int_list(seq: Any, size: int, name: str, what: str, op: str) -> list[int]:
    if isinstance(seq, (int, np.integer)):
        return [int(seq)] * size
    try:
        values = [int(x) for x in seq]
    except TypeError:
        raise InvalidArgumentError(f"{what}: {name} must be a sequence of integers", op=op) from None
    if len(values) != size:
        raise InvalidArgumentError(f"{what}: {name} has {len(values)} entries for {size} ranks", op=op)
    return values


def overlaps(a: np.ndarray, b: np.ndarray) -> bool:
    """True if two arrays may share memory (bounds check; cheap)."""
    return a.size > 0 and b.size > 0 and np.may_share_memory(a, b)
