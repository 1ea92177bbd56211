"""A CPU DLPack producer for tests whose capsule owns the exported tensor, as mpi4py's test arrays' capsules do.

Its capsule's destructor calls the tensor's deleter if no consumer took the capsule (renamed it ``used_*``), and
then releases the DLManagedTensor in every case. A consumer that renamed the capsule and calls the deleter later
(``numpy.from_dlpack`` does) reaches released memory. To make that a certain crash rather than a chance one, the
released struct is kept but overwritten with 0xFF bytes, so its deleter pointer is an invalid address.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from typing import Any, Optional

import numpy as np

LEGACY_NAME, VERSIONED_NAME = b"dltensor", b"dltensor_versioned"
FLAG_READ_ONLY = 1


class Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", Device), ("ndim", ctypes.c_int32), ("dtype", DataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class Managed(ctypes.Structure):
    _fields_ = [("dl_tensor", Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", Deleter)]


class ManagedVersioned(ctypes.Structure):
    _fields_ = [("version", Version), ("manager_ctx", ctypes.c_void_p), ("deleter", Deleter),
                ("flags", ctypes.c_uint64), ("dl_tensor", Tensor)]


# The capsule is passed as a raw address in the destructor (its refcount is already 0): no py_object there.
_Destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_api = ctypes.pythonapi
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, _Destructor)(("PyCapsule_New", _api))
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)(("PyCapsule_GetName", _api))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_GetPointer", _api))

DELETER_CALLS: Counter = Counter()  # address of a DLManagedTensor -> times its deleter ran
_exports: dict[int, tuple] = {}  # address -> (struct, shape, strides, array): alive while its capsule is
_released: list = []  # released structs, poisoned and kept, so that a late deleter call crashes for certain


@Deleter
def _deleter(address: int) -> None:
    DELETER_CALLS[address] += 1


@_Destructor
def _capsule_destructor(capsule: int) -> None:
    name = _capsule_name(capsule)
    address = _capsule_pointer(capsule, name)
    entry = _exports.pop(address, None)
    if entry is None:
        return
    struct = entry[0]
    if name in (LEGACY_NAME, VERSIONED_NAME):  # nobody took it: the producer deletes
        struct.deleter(address)
    ctypes.memset(address, 0xFF, ctypes.sizeof(struct))
    _released.append(entry)


_TYPE_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}


class Exporter:
    """A NumPy array exported through DLPack only. ``versioned``: speaks DLPack 1.0 (``max_version``, ``copy``,
    read-only flag); else only 0.x's ``__dlpack__(stream=None)``. ``strides``: element strides to claim."""

    def __init__(self, array: np.ndarray, *, versioned: bool = False, readonly: bool = False,
                 strides: Optional[tuple] = None) -> None:
        self.array = array
        self.versioned = versioned
        self.readonly = readonly
        self.strides = strides
        self.calls: list[dict] = []  # the keyword arguments of each __dlpack__ call
        self.exported: list[int] = []  # the DLManagedTensor address of each export

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        if not self.versioned and kwargs:
            raise TypeError(f"__dlpack__() got unexpected keyword arguments {sorted(kwargs)}")
        self.calls.append(dict(kwargs, stream=stream))
        use_v1 = self.versioned and tuple(kwargs.get("max_version") or (0, 0)) >= (1, 0)
        struct = ManagedVersioned() if use_v1 else Managed()
        arr = self.array
        shape = (ctypes.c_int64 * arr.ndim)(*arr.shape)
        strides = (ctypes.c_int64 * arr.ndim)(*(self.strides or [s // arr.itemsize for s in arr.strides]))
        t = struct.dl_tensor
        t.data = arr.ctypes.data if arr.size else None
        t.device = Device(1, 0)
        t.ndim = arr.ndim
        t.dtype = DataType(_TYPE_CODES[arr.dtype.kind], arr.dtype.itemsize * 8, 1)
        t.shape = shape
        t.strides = strides
        t.byte_offset = 0
        struct.deleter = _deleter
        if use_v1:
            struct.version = Version(1, 0)
            struct.flags = FLAG_READ_ONLY if self.readonly else 0
        address = ctypes.addressof(struct)
        _exports[address] = (struct, shape, strides, arr)
        self.exported.append(address)
        return _capsule_new(address, VERSIONED_NAME if use_v1 else LEGACY_NAME, _capsule_destructor)
