"""Parsing of mpi4py buffer specs (buf, [buf, count], [buf, count, dtype], [buf, counts, displs, dtype]), host or CUDA."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
import threading
import weakref
from typing import Any, Iterator, Optional, Union

import numpy as np

from . import datatypes, dlpack
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


@dataclass(frozen=True)
class DeviceArray:
    """A flat, contiguous run of ``size`` elements in CUDA memory: the user's object (kept alive) and a byte range.

    pycoll reads device buffers through ``__cuda_array_interface__`` only, so parsing needs no CUDA library;
    pycoll.cuda.memory turns one into an array its kernels and copies take.
    """

    owner: Any  # the exporting object (CuPy/Numba array, torch tensor): keeps the memory alive
    base: int  # device address of the exported buffer's first byte
    start: int  # byte offset of this view from ``base``
    size: int
    dtype: np.dtype
    readonly: bool = False

    ndim = 1

    @property
    def shape(self) -> tuple[int]:
        return (self.size,)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ptr(self) -> int:
        return self.base + self.start

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice) -> "DeviceArray":
        if not isinstance(key, slice):
            raise TypeError("a DeviceArray takes slices only (its elements live on the device)")
        lo, hi, step = key.indices(self.size)
        if step != 1:
            raise ValueError("a DeviceArray slice must be contiguous")
        hi = max(lo, hi)
        return replace(self, start=self.start + lo * self.dtype.itemsize, size=hi - lo)

    def view(self, dtype: Any) -> "DeviceArray":
        dtype = np.dtype(dtype)
        if self.nbytes % dtype.itemsize:
            raise ValueError(f"{self.nbytes} bytes are not a whole number of {dtype.name} elements")
        return replace(self, size=self.nbytes // dtype.itemsize, dtype=dtype)

    @property
    def __cuda_array_interface__(self) -> dict:
        typestr = self.dtype.str if self.dtype.kind != "V" else f"|u{self.dtype.itemsize}"  # bfloat16: its carrier
        return {"shape": (self.size,), "typestr": typestr, "data": (self.ptr if self.size else 0, self.readonly),
                "strides": None, "version": 3}


AnyArray = Union[np.ndarray, DeviceArray]


@dataclass
class Buf:
    """A resolved buffer: a flat array of ``count`` elements over the user's memory (no copy), or, for a datatype
    whose elements are not one contiguous run, a packed copy of them (``packed``)."""

    array: AnyArray  # a NumPy array, or a DeviceArray for CUDA memory
    dtype: np.dtype
    memory: str = "host"  # "host" or "cuda": the memory backend that owns it
    datatype: Optional[Datatype] = None  # the datatype the spec named (None: the array's own element type)
    elements: int = 1  # elements of ``dtype`` in one element of ``datatype`` (more than 1 for a derived type)
    packed: Optional["Packed"] = None  # set when ``array`` is a copy of the elements, not the user's memory

    def finish(self) -> None:
        """Put a writable packed copy back into the user's buffer (nothing for a view)."""
        if self.packed is not None:
            self.packed.unpack()

    @property
    def count(self) -> int:
        return int(self.array.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


@dataclass
class VBuf:
    """A resolved vector buffer: one flat array and per-rank (count, displacement) in elements."""

    array: AnyArray
    dtype: np.dtype
    counts: list[int]
    displs: list[int]
    memory: str = "host"

    def part(self, i: int) -> AnyArray:
        return self.array[self.displs[i] : self.displs[i] + self.counts[i]]


def memory_of(arr: Any) -> str:
    """"cuda" for a DeviceArray, else "host"."""
    return "cuda" if isinstance(arr, DeviceArray) else "host"


def _is_cuda(obj: Any) -> bool:
    """True for device memory: ``__cuda_array_interface__``, a Numba (simulator) device array, or CUDA DLPack."""
    try:
        if hasattr(obj, "__cuda_array_interface__") or getattr(obj, "__cuda_ndarray__", False) is True:
            return True
    except Exception:  # noqa: BLE001 - torch raises RuntimeError for a tensor that requires grad
        return True
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is not None:
        try:
            return int(dev()[0]) in _DLPACK_CUDA
        except Exception:
            return False
    return False


def _interface(obj: Any, what: str, op: str) -> dict:
    """The object's CUDA array interface (a Numba simulator array answers with its host array's interface)."""
    try:
        if getattr(obj, "__cuda_ndarray__", False) is True and isinstance(getattr(obj, "_ary", None), np.ndarray):
            return obj._ary.__array_interface__  # numba's simulator: "device" memory is a NumPy array
        if not hasattr(obj, "__cuda_array_interface__"):  # DLPack only: CuPy can turn it into an exporter
            try:
                import cupy  # type: ignore[import-not-found]
            except ImportError:
                raise InvalidArgumentError(
                    f"{what} of type {type(obj).__name__} is a CUDA buffer with DLPack only; pycoll reads device memory "
                    "through __cuda_array_interface__ (CuPy, Numba and PyTorch export it): wrap it, e.g. "
                    "cupy.from_dlpack(buf)", op=op) from None
            return _interface(cupy.from_dlpack(obj), what, op)
        return dict(obj.__cuda_array_interface__)
    except InvalidArgumentError:
        raise
    except Exception as exc:  # noqa: BLE001 - exporters fail in their own ways (torch: RuntimeError for grad tensors)
        raise InvalidArgumentError(
            f"{what} of type {type(obj).__name__} could not be read as a CUDA array ({type(exc).__name__}: {exc})", op=op
        ) from None


def _device_array(obj: Any, what: str, op: str) -> DeviceArray:
    """A DeviceArray over a CUDA object's whole buffer; InvalidArgumentError for masked or strided memory."""
    iface = _interface(obj, what, op)
    if iface.get("mask") is not None:
        raise InvalidArgumentError(f"{what} is a masked CUDA array", op=op)
    try:
        dtype = np.dtype(iface["typestr"])
        shape = tuple(int(x) for x in iface["shape"])
        ptr, readonly = iface["data"]
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{what}: malformed __cuda_array_interface__ ({exc})", op=op) from None
    if dtype.hasobject:
        raise InvalidArgumentError(f"{what}: dtype {dtype} holds Python objects, not data", op=op)
    size = int(np.prod(shape, dtype=np.int64)) if shape else 1
    strides = iface.get("strides")
    if strides is not None and size > 1 and not _contiguous(shape, tuple(int(x) for x in strides), dtype.itemsize):
        raise InvalidArgumentError(
            f"{what} is a non-contiguous CUDA array (shape {shape}, strides {tuple(strides)}); pass a contiguous one "
            "(e.g. .copy() or ascontiguousarray)", op=op)
    return DeviceArray(obj, int(ptr or 0), 0, size, dtype, bool(readonly))


def _contiguous(shape: tuple, strides: tuple, itemsize: int) -> bool:
    """C or Fortran order without gaps (dimensions of length 1 may have any stride)."""
    for order in (shape, shape[::-1]):
        st = strides if order is shape else strides[::-1]
        want, ok = itemsize, True
        for n, s in zip(reversed(order), reversed(st)):
            if n != 1 and s != want:
                ok = False
                break
            want *= n
        if ok:
            return True
    return False


def _as_flat_array(obj: Any, what: str, op: str) -> AnyArray:
    """A 1-D view of the object's memory (a DeviceArray for CUDA memory), no copy; InvalidArgumentError otherwise."""
    if type(obj) is np.ndarray:  # the common case: host memory, no protocol to ask
        if obj.ndim == 1 and obj.flags.c_contiguous:
            return obj
        if not (obj.flags.c_contiguous or obj.flags.f_contiguous):
            raise InvalidArgumentError(f"{what} is not contiguous (shape {obj.shape}, strides {obj.strides})", op=op)
        return obj.reshape(-1, order="A")
    if _is_cuda(obj):
        return _device_array(obj, what, op)
    if isinstance(obj, np.ndarray):
        arr = obj.view(np.ndarray)  # a subclass (np.matrix stays 2-D when flattened) as a plain array
    elif not hasattr(obj, "__array_interface__") and hasattr(obj, "__dlpack__"):
        # pycoll.dlpack borrows the capsule; np.from_dlpack would consume it (crashes with some producers)
        return dlpack.host_array(obj, what, op)
    elif hasattr(obj, "__array_interface__"):
        try:
            arr = np.asarray(obj)
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


def _reinterpret(arr: AnyArray, dtype: np.dtype, what: str, op: str) -> AnyArray:
    if arr.dtype == dtype:
        return arr
    if isinstance(arr, DeviceArray):
        if arr.nbytes % dtype.itemsize:
            raise InvalidArgumentError(f"{what}: {arr.nbytes} bytes are not a whole number of {dtype.name} elements", op=op)
        return arr.view(dtype)
    if arr.dtype.hasobject:  # references, not data: never reinterpreted (NumPy would raise TypeError)
        raise InvalidArgumentError(f"{what}: dtype {arr.dtype} holds Python objects, not data", op=op)
    if arr.nbytes % dtype.itemsize:
        raise InvalidArgumentError(
            f"{what}: {arr.nbytes} bytes are not a whole number of {dtype.name} elements", op=op
        )
    return arr.view(np.uint8).view(dtype) if arr.size else np.empty(0, dtype)


def _dtype_of(spec: Any, what: str, op: str) -> np.dtype:
    """The dtype a spec names; only element types pycoll supports (no strings, subarrays, records).

    Records (the value-index pairs) are named by their MPI datatype (``MPI.DOUBLE_INT``), never by a NumPy dtype
    or its string.
    """
    try:
        dtype = datatypes.resolve(spec)
    except (TypeError, ValueError, KeyError, SyntaxError) as exc:  # np.dtype's answers to nonsense vary
        raise InvalidArgumentError(f"{what}: {spec!r} is not a datatype ({exc})", op=op) from None
    if dtype.names is not None and not isinstance(spec, Datatype):
        raise InvalidArgumentError(f"{what}: {spec!r} is a record dtype; name such elements by their MPI datatype "
                                   "(MPI.DOUBLE_INT, ...)", op=op)
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
    named: Optional[Datatype] = None
    obj = spec
    if isinstance(spec, (list, tuple)):
        if not 1 <= len(spec) <= 3:
            raise InvalidArgumentError(f"{what}: a buffer spec has 1 to 3 items, got {len(spec)}", op=op)
        obj, rest = spec[0], list(spec[1:])
        if rest and isinstance(rest[-1], Datatype) and not rest[-1].is_named:
            derived = rest.pop()
        else:
            derived = None
            if rest and _is_datatype(rest[-1]):
                if isinstance(rest[-1], Datatype):
                    named = rest[-1]
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
        if derived is not None:
            return _parse_derived(obj, count, derived, what, op, writable, blocks)
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
    if writable and not _writable(arr):
        raise InvalidArgumentError(f"{what} is read-only", op=op)
    return Buf(arr, arr.dtype, memory_of(arr), named)


# ---- derived datatypes: a view of the user's buffer where the elements are one run, else a packed copy --------

class Packed:
    """A packed copy of a datatype's elements, taken from the user's buffer; ``unpack`` writes it back there."""

    __slots__ = ("access", "raw", "array")

    def __init__(self, access: Any, raw: np.ndarray, array: np.ndarray) -> None:
        self.access, self.raw, self.array = access, raw, array

    def unpack(self) -> None:
        self.access.write(self.raw, self.array)


class Unpacking:
    """The writable packed buffers of one collective call, written back into the user's buffers once the call
    completes (the executor holds this as the call's stage, as it holds a device call's staging)."""

    def __init__(self) -> None:
        self.packed: list[Packed] = []

    def finish(self) -> None:
        for p in self.packed:
            p.unpack()

    def discard(self) -> None:
        self.packed.clear()


_collecting = threading.local()


@contextmanager
def collecting_packed() -> Iterator[Unpacking]:
    """Collect the writable packed buffers the specs parsed inside the ``with`` make (one collective's build)."""
    outer = getattr(_collecting, "current", None)
    current = _collecting.current = Unpacking()
    try:
        yield current
    finally:
        _collecting.current = outer


def _raw_bytes(obj: Any, what: str, op: str) -> np.ndarray:
    """The user's buffer as flat bytes (host memory only: derived datatypes are laid out with NumPy)."""
    arr = _as_flat_array(obj, what, op)
    if isinstance(arr, DeviceArray):
        raise InvalidArgumentError(f"{what}: derived datatypes take host buffers; pass device memory with a named "
                                   "datatype", op=op)
    if arr.dtype.hasobject:
        raise InvalidArgumentError(f"{what}: dtype {arr.dtype} holds Python objects, not data", op=op)
    return arr.view(np.uint8) if arr.size else np.empty(0, np.uint8)


def _layout_of(datatype: Datatype, what: str, op: str) -> Any:
    try:
        return datatype._live(what)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(err.cause, op=op) from None


def _with_access(raw: np.ndarray, layout: Any, access: Any, datatype: Datatype, what: str, op: str,
                 writable: bool) -> Buf:
    """The Buf of a message's elements: a view where they are one run, else a packed copy (written back on finish)."""
    if writable and not raw.flags.writeable:
        raise InvalidArgumentError(f"{what} is read-only", op=op)
    _check_supported(layout.base, what, op)
    flat, is_view = access.read(raw)
    packed = None
    if not is_view:
        packed = Packed(access, raw, flat)
        if writable:
            current = getattr(_collecting, "current", None)
            if current is not None:
                current.packed.append(packed)
    return Buf(flat, layout.base, "host", datatype, layout.elements, packed)


def _parse_derived(obj: Any, count: Optional[int], datatype: Datatype, what: str, op: str, writable: bool,
                   blocks: int) -> Buf:
    """``[buf, count, derived]``: ``count`` (per block) elements of a derived datatype, flattened to its element type."""
    layout = _layout_of(datatype, what, op)
    raw = _raw_bytes(obj, what, op)
    if count is None:
        if layout.extent <= 0:
            raise InvalidArgumentError(f"{what}: cannot infer a count from a datatype of extent {layout.extent}", op=op)
        if raw.size % layout.extent or (raw.size // layout.extent) % blocks:
            raise InvalidArgumentError(
                f"{what}: {raw.size} bytes are not a whole number of {blocks if blocks > 1 else ''} datatype elements "
                f"of extent {layout.extent}".replace("  ", " "), op=op)
        count = raw.size // layout.extent // blocks
    elif count < 0:
        raise InvalidArgumentError(f"{what}: count {count} is negative", op=op)
    try:
        access = layout.access(count * blocks, raw.size)
    except ValueError as exc:
        raise InvalidArgumentError(f"{what}: {count * blocks} elements of the datatype do not fit the buffer ({exc})",
                                   op=op) from None
    return _with_access(raw, layout, access, datatype, what, op, writable)


def _parse_derived_vector(obj: Any, counts_spec: Any, displs_spec: Any, datatype: Datatype, what: str, op: str,
                          size: int, writable: bool) -> VBuf:
    """``[buf, counts, displs, derived]``: blocks of derived elements, flattened (counts and displacements scaled)."""
    if counts_spec is None:  # [buf, derived]: the buffer's elements split evenly over the ranks
        whole = _parse_derived(obj, None, datatype, what, op, writable, size)
        each = whole.count // size
        return VBuf(whole.array, whole.dtype, [each] * size, [i * each for i in range(size)])
    layout = _layout_of(datatype, what, op)
    raw = _raw_bytes(obj, what, op)
    counts = _int_list(counts_spec, size, "counts", what, op)
    displs = (_int_list(displs_spec, size, "displs", what, op) if displs_spec is not None
              else [int(x) for x in np.concatenate(([0], np.cumsum(counts)[:-1]))] if size else [])
    if any(c < 0 or d < 0 for c, d in zip(counts, displs)):
        raise InvalidArgumentError(f"{what}: counts and displacements must be non-negative ({counts}, {displs})", op=op)
    if writable:
        _check_disjoint(counts, displs, what, op)
    k = layout.elements
    if layout.dense and layout.lb >= 0:  # element j is elements j*k .. (j+1)*k-1 of the buffer from lb: a view
        if writable and not raw.flags.writeable:
            raise InvalidArgumentError(f"{what} is read-only", op=op)
        _check_supported(layout.base, what, op)
        isz = layout.base.itemsize
        room = max(raw.size - layout.lb, 0) // layout.extent
        for i, (c, d) in enumerate(zip(counts, displs)):
            if d + c > room:
                raise InvalidArgumentError(
                    f"{what}: rank {i}'s block (count {c}, displacement {d}) does not fit in {room} datatype elements",
                    op=op)
        flat = raw[layout.lb:layout.lb + room * k * isz].view(layout.base)
        return VBuf(flat, layout.base, [c * k for c in counts], [d * k for d in displs])
    elements = np.concatenate([np.arange(d, d + c, dtype=np.int64) for c, d in zip(counts, displs)] or
                              [np.zeros(0, np.int64)])
    try:
        access = layout.access_elements(elements, raw.size)
    except ValueError as exc:
        raise InvalidArgumentError(f"{what}: the blocks of the datatype do not fit the buffer ({exc})", op=op) from None
    buf = _with_access(raw, layout, access, datatype, what, op, writable)
    packed_displs = [int(x) for x in np.concatenate(([0], np.cumsum(counts)[:-1]))] if size else []
    return VBuf(buf.array, buf.dtype, [c * k for c in counts], [d * k for d in packed_displs])


def parse_vector(spec: Any, what: str, op: str, size: int, *, writable: bool = False) -> VBuf:
    """Resolve ``[buf, counts]``, ``[buf, counts, displs]``, ``[buf, counts, displs, dtype]``."""
    if not isinstance(spec, (list, tuple)) or len(spec) < 2:
        base = parse(spec, what, op, writable=writable)
        if base.count % size:
            raise InvalidArgumentError(
                f"{what}: without counts the {base.count} elements must split evenly over {size} ranks", op=op
            )
        each = base.count // size
        return VBuf(base.array, base.dtype, [each] * size, [i * each for i in range(size)], base.memory)
    items = list(spec)
    derived = items.pop() if isinstance(items[-1], Datatype) and not items[-1].is_named else None
    dtype = _dtype_of(items.pop(), what, op) if derived is None and _is_datatype(items[-1]) else None
    obj = items[0]
    counts_spec: Any = items[1] if len(items) > 1 else None
    displs_spec: Any = items[2] if len(items) > 2 else None
    if isinstance(counts_spec, tuple) and len(counts_spec) == 2 and displs_spec is None:
        # mpi4py reads a 2-tuple here as (counts, displs), always: (3, 4) is count 3 with displacement stride 4.
        counts_spec, displs_spec = counts_spec
    if len(items) > 3:
        raise InvalidArgumentError(f"{what}: could not read vector spec", op=op)
    if derived is not None:
        return _parse_derived_vector(obj, counts_spec, displs_spec, derived, what, op, size, writable)
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
        if not _writable(arr):
            raise InvalidArgumentError(f"{what} is read-only", op=op)
        _check_disjoint(counts, displs, what, op)
    return VBuf(arr, arr.dtype, counts, displs, memory_of(arr))


def _writable(arr: AnyArray) -> bool:
    return not arr.readonly if isinstance(arr, DeviceArray) else bool(arr.flags.writeable)


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


def overlaps(a: AnyArray, b: AnyArray) -> bool:
    """True if two arrays may share memory (bounds check; cheap); host and device memory never overlap."""
    if a.size == 0 or b.size == 0:
        return False
    if isinstance(a, DeviceArray) or isinstance(b, DeviceArray):
        if not (isinstance(a, DeviceArray) and isinstance(b, DeviceArray)):
            return False
        return a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes
    return bool(np.may_share_memory(a, b))


# ---- point-to-point: host buffers as flat bytes, resolved once per call shape -------------------------
_BYTES = np.dtype(np.uint8)
_P2P_CACHE: dict = {}  # (id(obj), type of count, count, datatype) -> (weak reference to obj, shape, dtype, writable, bytes view)
_P2P_CACHE_MAX = 256


class _Supported(dict):
    """dtype -> None if pycoll supports it (else the lookup says 1); filled on first sight of each dtype."""

    def __missing__(self, dtype: np.dtype) -> Optional[int]:
        try:
            datatypes.from_numpy(dtype)
        except KeyError:
            return 1
        self[dtype] = None
        return None


_OK_DTYPES = _Supported()


_NAMED: frozenset = frozenset()  # the predefined datatypes (filled on first use: the table is built at import)


def _contiguous_bytes(arr: np.ndarray, count: Any, datatype: Any, writable: bool) -> Optional[np.ndarray]:
    """``[arr, count, datatype]`` (count None: the whole array) as flat bytes when that needs no conversion: a
    C-contiguous array of exactly the predefined datatype's dtype, a count that fits; else None and the full parse
    decides (and words any error)."""
    global _NAMED
    if not _NAMED:
        _NAMED = frozenset(datatypes.DATATYPES.values())
    if not isinstance(datatype, Datatype) or datatype not in _NAMED or arr.dtype != datatype.dtype or not arr.flags.c_contiguous:
        return None
    if writable and not arr.flags.writeable:
        return None
    flat = arr.reshape(-1) if arr.ndim != 1 else arr
    if count is not None:
        if type(count) is not int or not 0 <= count <= flat.shape[0]:
            return None
        flat = flat[:count]
    return flat.view(_BYTES)


def parse_bytes(spec: Any, what: str, op: str, writable: bool = False) -> Optional[np.ndarray]:
    """A host buffer spec as a flat uint8 array over the user's memory; None for device memory.

    The result of a spec ``[obj, count, datatype]`` or ``[obj, datatype]`` is remembered per (object, count,
    datatype) while the object lives, and checked against the object's shape and dtype on every use, so a
    repeated call costs a dictionary lookup. A bare contiguous NumPy array needs no cache.
    """
    t = type(spec)
    if t is np.ndarray:
        if spec.flags.c_contiguous and (not writable or spec.flags.writeable) and _OK_DTYPES[spec.dtype] is None:
            return spec.reshape(-1).view(_BYTES) if spec.dtype is not _BYTES or spec.ndim != 1 else spec
    elif t is list or t is tuple:
        n = len(spec)
        if n == 3 or n == 2:
            obj = spec[0]
            count = spec[1]  # with its type: True == 1 == 1.0 as keys, but only the int is a valid count
            key = (id(obj), type(count), count, spec[2] if n == 3 else None)
            try:
                hit = _P2P_CACHE.get(key)
            except TypeError:  # an unhashable count (mpi4py's (count, displ) list): the full parse
                hit = None
            if (hit is not None and hit[0]() is obj and obj.shape == hit[1] and obj.dtype is hit[2]
                    and (not writable or obj.flags.writeable)):  # made read-only since: the full parse says so
                return hit[4]
            if type(obj) is np.ndarray:  # a view made for this call (a halo's slice): no cache hit, a short check
                out = _contiguous_bytes(obj, spec[1] if n == 3 else None, spec[-1], writable)
                if out is not None:
                    return out
            b = parse(spec, what, op, writable=writable)
            if b.memory != "host":
                return None
            if b.packed is not None:  # a copy of a derived datatype's elements: never cached
                return _packed_bytes(b, what, op, writable)
            out = b.array.view(_BYTES)  # type: ignore[union-attr]
            if type(obj) is np.ndarray:
                try:
                    ref = weakref.ref(obj)
                    hash(key)
                except TypeError:
                    return out
                if len(_P2P_CACHE) >= _P2P_CACHE_MAX:
                    _P2P_CACHE.clear()
                _P2P_CACHE[key] = (ref, obj.shape, obj.dtype, bool(obj.flags.writeable), out)
            return out
    b = parse(spec, what, op, writable=writable)
    if b.packed is not None:
        return _packed_bytes(b, what, op, writable)
    return b.array.view(_BYTES) if b.memory == "host" else None  # type: ignore[union-attr]


def _packed_bytes(b: Buf, what: str, op: str, writable: bool) -> np.ndarray:
    """A send's packed copy of a non-contiguous derived datatype's elements; a receive into one is refused (its
    elements would need unpacking when it completes, which point-to-point calls do not do yet)."""
    if writable:
        raise InvalidArgumentError(f"{what}: point-to-point receives take derived datatypes only where their elements "
                                   "are one contiguous run", op=op)
    return b.array.view(_BYTES)  # type: ignore[union-attr]


def address(obj: Any) -> int:
    """The address of a buffer's first byte (``MPI.Get_address``): host or device memory; 0 for None (MPI.BOTTOM)."""
    if obj is None:
        return 0
    arr = _as_flat_array(obj, "location", "Get_address")
    if isinstance(arr, DeviceArray):
        return arr.ptr
    return int(arr.__array_interface__["data"][0])
