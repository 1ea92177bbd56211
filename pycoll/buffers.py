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
        arr = obj.view(np.ndarray)  # a subclass (np.matrix stays 2-D when flattened) as a plain array
    elif hasattr(obj, "__array_interface__") or hasattr(obj, "__dlpack__"):
        try:
            arr = np.asarray(obj) if hasattr(obj, "__array_interface__") else np.from_dlpack(obj)
        except Exception as exc:  # noqa: BLE001 - a foreign export can fail in any way (BufferError, RuntimeError, ...)
            raise InvalidArgumentError(
                f"{what} of type {type(obj).__name__} could not be read as an array ({type(exc).__name__}: {exc})", op=op
            ) from None
    else:
        try:
            mv = memoryview(obj)
        except TypeError:
            raise InvalidArgumentError(
                f"{what} of type {type(obj).__name__} exposes no buffer (expected a NumPy array, an object with the "
                "buffer protocol, __array_interface__ or __dlpack__)",
                op=op,
            ) from None
        return _memoryview_array(mv, what, op)
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        raise InvalidArgumentError(f"{what} is not contiguous (shape {arr.shape}, strides {arr.strides})", op=op)
    return arr.reshape(-1, order="A")


def _memoryview_array(mv: memoryview, what: str, op: str) -> np.ndarray:
    """A flat array over a buffer-protocol object's memory, keeping its element type and read-only flag."""
    if not mv.contiguous:
        raise InvalidArgumentError(f"{what} is not contiguous", op=op)
    try:
        dtype: Optional[np.dtype] = np.dtype(np.uint8) if mv.format in ("B", "c") else datatypes.format_dtype(mv.format)
    except (TypeError, ValueError):
        dtype = None  # e.g. 'Zd' (complex): NumPy's PEP 3118 reader below knows it
    if dtype is None or dtype.itemsize != mv.itemsize or not mv.c_contiguous:
        try:
            arr = np.asarray(mv)
        except Exception:  # noqa: BLE001 - NumPy rejects formats it cannot map in several ways
            raise InvalidArgumentError(f"{what} has an unsupported element format {mv.format!r}", op=op) from None
        return arr.reshape(-1, order="A")
    arr = np.frombuffer(mv, dtype=np.uint8) if mv.nbytes else np.empty(0, np.uint8)
    arr = arr.view(dtype)
    arr.flags.writeable = not mv.readonly  # an empty read-only buffer stays read-only
    return arr


def _reinterpret(arr: np.ndarray, dtype: np.dtype, what: str, op: str) -> np.ndarray:
    if arr.dtype == dtype:
        return arr
    if arr.dtype.hasobject:  # references, not data: never reinterpreted (NumPy would raise TypeError)
        raise InvalidArgumentError(f"{what}: dtype {arr.dtype} holds Python objects, not data", op=op)
    if arr.nbytes % dtype.itemsize:
        raise InvalidArgumentError(
            f"{what}: {arr.nbytes} bytes are not a whole number of {dtype.name} elements", op=op
        )
    return arr.view(np.uint8).view(dtype) if arr.size else np.empty(0, dtype)


def _dtype_of(spec: Any, what: str, op: str) -> np.dtype:
    """The dtype a spec names; only element types pycoll supports (no strings, subarrays, records)."""
    try:
        dtype = datatypes.resolve(spec)
    except (TypeError, ValueError, KeyError, SyntaxError) as exc:  # np.dtype's answers to nonsense vary
        raise InvalidArgumentError(f"{what}: {spec!r} is not a datatype ({exc})", op=op) from None
    _check_supported(dtype, what, op)
    return dtype


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
    block, and without one the buffer must split evenly into blocks, as in mpi4py.
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
                if not (displ is None or (_is_int(displ) and displ == 0)):
                    raise InvalidArgumentError(f"{what}: a displacement ({displ!r}) is only allowed in vector specs", op=op)
            if not _is_int(c):
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
    elif blocks > 1 and arr.shape[0] % blocks:  # as mpi4py: no silent truncation
        raise InvalidArgumentError(
            f"{what}: {arr.shape[0]} elements do not split into {blocks} equal blocks (one per rank)", op=op
        )
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
    if writable:
        if not arr.flags.writeable:
            raise InvalidArgumentError(f"{what} is read-only", op=op)
        _check_disjoint(counts, displs, what, op)
    return VBuf(arr, arr.dtype, counts, displs)


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _int_list(seq: Any, size: int, name: str, what: str, op: str) -> list[int]:
    """Per-rank integers; one integer means the same count for every rank, or a stride of displacements (mpi4py)."""
    if _is_int(seq):
        return [int(seq) * i for i in range(size)] if name == "displs" else [int(seq)] * size
    try:
        values = list(seq)
    except TypeError:
        raise InvalidArgumentError(f"{what}: {name} must be a sequence of integers, got {seq!r}", op=op) from None
    if not all(_is_int(x) for x in values):  # int() would accept 1.5 or "3"
        raise InvalidArgumentError(f"{what}: {name} must be integers, got {values!r}", op=op)
    if len(values) != size:
        raise InvalidArgumentError(f"{what}: {name} has {len(values)} entries for {size} ranks", op=op)
    return [int(x) for x in values]


def _check_disjoint(counts: list[int], displs: list[int], what: str, op: str) -> None:
    """Blocks that are written must not overlap: MPI forbids writing an element twice."""
    spans = sorted((d, c, i) for i, (c, d) in enumerate(zip(counts, displs)) if c > 0)
    for (d0, c0, i0), (d1, c1, i1) in zip(spans, spans[1:]):
        if d1 < d0 + c0:
            raise InvalidArgumentError(
                f"{what}: the blocks of ranks {i0} and {i1} overlap (elements {d1} to {min(d0 + c0, d1 + c1) - 1})", op=op
            )


def overlaps(a: np.ndarray, b: np.ndarray) -> bool:
    """True if two arrays may share memory (bounds check; cheap)."""
    return a.size > 0 and b.size > 0 and np.may_share_memory(a, b)
