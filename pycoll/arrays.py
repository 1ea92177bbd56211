"""The arrays behind buffer specs: host and CUDA arrays recognized (NumPy, ``__cuda_array_interface__``, DLPack,
memoryviews), flat typed views of them, the resolved buffers that parsing returns (Buf, VBuf), and the argument
checks that every parser shares."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np

from . import datatypes, dlpack
from .datatypes import Datatype
from .errors import InvalidArgumentError

if TYPE_CHECKING:
    from .derived_buffers import Packed


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


def is_cuda(obj: Any) -> bool:
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


def cuda_interface(obj: Any, what: str, op: str) -> dict:
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
            return cuda_interface(cupy.from_dlpack(obj), what, op)
        return dict(obj.__cuda_array_interface__)
    except InvalidArgumentError:
        raise
    except Exception as exc:  # noqa: BLE001 - exporters fail in their own ways (torch: RuntimeError for grad tensors)
        raise InvalidArgumentError(
            f"{what} of type {type(obj).__name__} could not be read as a CUDA array ({type(exc).__name__}: {exc})", op=op
        ) from None


def device_array(obj: Any, what: str, op: str) -> DeviceArray:
    """A DeviceArray over a CUDA object's whole buffer; InvalidArgumentError for masked or strided memory."""
    iface = cuda_interface(obj, what, op)
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
    if strides is not None and size > 1 and not is_contiguous(shape, tuple(int(x) for x in strides), dtype.itemsize):
        raise InvalidArgumentError(
            f"{what} is a non-contiguous CUDA array (shape {shape}, strides {tuple(strides)}); pass a contiguous one "
            "(e.g. .copy() or ascontiguousarray)", op=op)
    return DeviceArray(obj, int(ptr or 0), 0, size, dtype, bool(readonly))


def is_contiguous(shape: tuple, strides: tuple, itemsize: int) -> bool:
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


def as_flat_array(obj: Any, what: str, op: str) -> AnyArray:
    """A 1-D view of the object's memory (a DeviceArray for CUDA memory), no copy; InvalidArgumentError otherwise."""
    if type(obj) is np.ndarray:  # the common case: host memory, no protocol to ask
        if obj.ndim == 1 and obj.flags.c_contiguous:
            return obj
        if not (obj.flags.c_contiguous or obj.flags.f_contiguous):
            raise InvalidArgumentError(f"{what} is not contiguous (shape {obj.shape}, strides {obj.strides})", op=op)
        return obj.reshape(-1, order="A")
    if is_cuda(obj):
        return device_array(obj, what, op)
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
        return memoryview_array(mv, what, op)
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        raise InvalidArgumentError(f"{what} is not contiguous (shape {arr.shape}, strides {arr.strides})", op=op)
    return arr.reshape(-1, order="A")


def memoryview_array(mv: memoryview, what: str, op: str) -> np.ndarray:
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


def reinterpret(arr: AnyArray, dtype: np.dtype, what: str, op: str) -> AnyArray:
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


def dtype_of(spec: Any, what: str, op: str) -> np.dtype:
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
    check_supported(dtype, what, op)
    return dtype


def check_supported(dtype: np.dtype, what: str, op: str) -> None:
    try:
        datatypes.from_numpy(dtype)
    except KeyError:
        raise InvalidArgumentError(f"{what}: dtype {dtype} is not supported", op=op) from None


def is_datatype(x: Any) -> bool:
    return isinstance(x, (Datatype, np.dtype, type, str))


def is_writable(arr: AnyArray) -> bool:
    return not arr.readonly if isinstance(arr, DeviceArray) else bool(arr.flags.writeable)


def is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def int_list(seq: Any, size: int, name: str, what: str, op: str) -> list[int]:
    """Per-rank integers; one integer means the same count for every rank, or a stride of displacements (mpi4py)."""
    if is_int(seq):
        return [int(seq) * i for i in range(size)] if name == "displs" else [int(seq)] * size
    try:
        values = list(seq)
    except TypeError:
        raise InvalidArgumentError(f"{what}: {name} must be a sequence of integers, got {seq!r}", op=op) from None
    if not all(is_int(x) for x in values):  # int() would accept 1.5 or "3"
        raise InvalidArgumentError(f"{what}: {name} must be integers, got {values!r}", op=op)
    if len(values) != size:
        raise InvalidArgumentError(f"{what}: {name} has {len(values)} entries for {size} ranks", op=op)
    return [int(x) for x in values]


def check_disjoint(counts: list[int], displs: list[int], what: str, op: str) -> None:
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
