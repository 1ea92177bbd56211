"""Point-to-point buffers as flat host bytes, resolved once per call shape (a message is bytes on the wire), and
the address of a buffer (MPI.Get_address)."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import numpy as np

from . import datatypes
from .datatypes import Datatype
from .errors import InvalidArgumentError
from .arrays import Buf, DeviceArray, as_flat_array
from .buffers import parse


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


def contiguous_bytes(arr: np.ndarray, count: Any, datatype: Any, writable: bool) -> Optional[np.ndarray]:
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
                out = contiguous_bytes(obj, spec[1] if n == 3 else None, spec[-1], writable)
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
    arr = as_flat_array(obj, "location", "Get_address")
    if isinstance(arr, DeviceArray):
        return arr.ptr
    return int(arr.__array_interface__["data"][0])
