"""CPU DLPack buffers read in place: the producer's capsule is borrowed for the view's lifetime, never consumed.

Why not ``numpy.from_dlpack``: it consumes the capsule (renames it ``used_dltensor``) and calls the tensor's
deleter when the array dies, which needs the producer to keep the ``DLManagedTensor`` alive after its capsule is
gone. Some producers free it with the capsule (mpi4py's test arrays, test/dlpackimpl.py, do), and NumPy then
calls a deleter in freed memory (SIGSEGV). A capsule left unrenamed stays the owner: its destructor calls the
deleter exactly once, when the last view of the memory is gone. mpi4py reads DLPack buffers the same way.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from . import datatypes
from .errors import InvalidArgumentError

CPU_DEVICE = 1  # kDLCPU
_VERSIONED_NAME = b"dltensor_versioned"  # DLPack >= 1.0
_LEGACY_NAME = b"dltensor"  # DLPack 0.x
_MAX_VERSION = (1, 0)  # the newest DLPack version this reader understands
_FLAG_READ_ONLY = 1 << 0
_FLAG_IS_COPIED = 1 << 1


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _ManagedTensor(ctypes.Structure):  # DLPack 0.x
    _fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


class _ManagedTensorVersioned(ctypes.Structure):  # DLPack 1.x
    _fields_ = [
        ("version", _Version),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _Deleter),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _Tensor),
    ]


# Prototypes of our own: setting argtypes on ctypes.pythonapi's shared function objects would change them for
# every other user in the process.
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))

# DLDataTypeCode -> NumPy kind letter; bfloat16 (code 4) is handled apart.
_KINDS = {0: "i", 1: "u", 2: "f", 5: "c", 6: "b"}
_BFLOAT = 4


class _Borrowed:
    """Holds the producer's capsule while NumPy arrays look at its memory (they keep this object as their base)."""

    __slots__ = ("capsule", "__array_interface__")

    def __init__(self, capsule: Any, address: int, nbytes: int, readonly: bool) -> None:
        self.capsule = capsule
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, readonly), "version": 3}


def _export(obj: Any, what: str, op: str) -> Any:
    """The object's capsule: asked as DLPack 1.x without a copy, then as 0.x if the producer takes no keywords."""
    try:
        try:
            return obj.__dlpack__(max_version=_MAX_VERSION, copy=False)
        except TypeError:  # a DLPack 0.x producer: __dlpack__(stream=None) only
            return obj.__dlpack__()
    except Exception as exc:  # noqa: BLE001 - producers refuse in their own ways (BufferError, RuntimeError, ...)
        raise InvalidArgumentError(
            f"{what} of type {type(obj).__name__} refused its DLPack export ({type(exc).__name__}: {exc})", op=op
        ) from None


def _numpy_dtype(dt: _DataType, what: str, op: str) -> np.dtype:
    kind, bits = _KINDS.get(dt.code), dt.bits
    if dt.lanes == 2 and kind == "f":  # a pair of floats: a complex number (how some export complex long double)
        kind, bits = "c", 2 * bits
    elif dt.lanes != 1:
        raise InvalidArgumentError(f"{what}: DLPack vector dtype ({dt.lanes} lanes of code {dt.code}) is not supported",
                                   op=op)
    if dt.code == _BFLOAT and bits == 16 and datatypes.BFLOAT16 is not None:
        return datatypes.BFLOAT16
    if kind is None or bits % 8:
        raise InvalidArgumentError(f"{what}: DLPack dtype (code {dt.code}, {dt.bits} bits) is not supported", op=op)
    try:
        return np.dtype(f"{kind}{bits // 8}")
    except TypeError:
        raise InvalidArgumentError(f"{what}: DLPack dtype (code {dt.code}, {dt.bits} bits) has no NumPy type", op=op) from None


def _is_dense(shape: list[int], strides: list[int]) -> bool:
    """C or Fortran order without gaps, in elements (dimensions of length 1 may have any stride)."""
    for dims in (range(len(shape) - 1, -1, -1), range(len(shape))):
        expect = 1
        for i in dims:
            if shape[i] != 1 and strides[i] != expect:
                break
            expect *= shape[i]
        else:
            return True
    return False


def host_array(obj: Any, what: str, op: str) -> np.ndarray:
    """A flat NumPy array over a CPU DLPack object's memory, no copy; InvalidArgumentError for what cannot be read.

    The capsule is not renamed: it stays the owner of the exported tensor, and the returned array keeps it alive.
    """
    try:
        device_type = int(obj.__dlpack_device__()[0]) if hasattr(obj, "__dlpack_device__") else CPU_DEVICE
    except Exception as exc:  # noqa: BLE001 - a producer's own failure, whatever its type
        raise InvalidArgumentError(f"{what}: __dlpack_device__ failed ({type(exc).__name__}: {exc})", op=op) from None
    if device_type != CPU_DEVICE:
        raise InvalidArgumentError(f"{what}: DLPack device type {device_type} is not CPU memory", op=op)
    capsule = _export(obj, what, op)
    readonly = False
    if _capsule_is_valid(capsule, _VERSIONED_NAME):
        managed = _ManagedTensorVersioned.from_address(_capsule_pointer(capsule, _VERSIONED_NAME))
        if managed.version.major != _MAX_VERSION[0]:
            raise InvalidArgumentError(
                f"{what}: DLPack version {managed.version.major}.{managed.version.minor} is not supported "
                f"(asked for at most {_MAX_VERSION[0]}.{_MAX_VERSION[1]})", op=op)
        if managed.flags & _FLAG_IS_COPIED:
            raise InvalidArgumentError(f"{what}: the DLPack producer exported a copy although none was allowed", op=op)
        readonly = bool(managed.flags & _FLAG_READ_ONLY)
        tensor = managed.dl_tensor
    elif _capsule_is_valid(capsule, _LEGACY_NAME):
        tensor = _ManagedTensor.from_address(_capsule_pointer(capsule, _LEGACY_NAME)).dl_tensor
    else:
        raise InvalidArgumentError(
            f"{what}: __dlpack__ of {type(obj).__name__} returned no unused DLPack capsule (got {capsule!r})", op=op)
    if tensor.device.device_type != CPU_DEVICE:
        raise InvalidArgumentError(f"{what}: the DLPack tensor is on device type {tensor.device.device_type}, not the CPU", op=op)
    dtype = _numpy_dtype(tensor.dtype, what, op)
    if tensor.ndim < 0:
        raise InvalidArgumentError(f"{what}: DLPack tensor with {tensor.ndim} dimensions", op=op)
    shape = [int(tensor.shape[i]) for i in range(tensor.ndim)]
    if any(n < 0 for n in shape):
        raise InvalidArgumentError(f"{what}: DLPack shape {shape} has a negative extent", op=op)
    size = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if tensor.strides and size > 1:  # NULL strides: C order
        strides = [int(tensor.strides[i]) for i in range(tensor.ndim)]
        if not _is_dense(shape, strides):
            raise InvalidArgumentError(
                f"{what} is a non-contiguous DLPack tensor (shape {shape}, strides {strides} elements)", op=op)
    if size == 0:
        out = np.empty(0, dtype)
        out.flags.writeable = not readonly
        return out
    address = int(tensor.data or 0) + int(tensor.byte_offset)
    holder = _Borrowed(capsule, address, size * dtype.itemsize, readonly)
    return np.asarray(holder).view(dtype)
