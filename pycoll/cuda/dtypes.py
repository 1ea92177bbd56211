"""How each pycoll dtype is stored, accumulated and divided on a CUDA device; importable without numba.cuda."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import datatypes as _datatypes
from .. import ops as _ops
from ..datatypes import BFLOAT16

# Families share one kernel body; the names appear in cache keys and error messages.
INT, BOOL, F16, BF16, FLOAT, COMPLEX = "int", "bool", "f16", "bf16", "float", "complex"

MAX_SRCS = 32  # reduce_many sources per launch (each is a kernel parameter; see kernels.py)


@dataclass(frozen=True)
class Layout:
    """A dtype as the kernels see it: ``storage`` is the array dtype they index, ``acc`` the type they compute in."""

    dtype: np.dtype  # the logical element type
    storage: np.dtype  # bfloat16 -> uint16, bool -> uint8, else the dtype itself
    acc: np.dtype  # float16/bfloat16 -> float32, narrow ints -> 32 bits, else the dtype itself
    family: str


def _acc_int(dt: np.dtype) -> np.dtype:
    if dt.itemsize == 8:
        return dt
    return np.dtype(np.int32 if dt.kind == "i" else np.uint32)


_LAYOUTS: dict[np.dtype, Layout] = {}
for _t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64):
    _d = np.dtype(_t)
    _LAYOUTS[_d] = Layout(_d, _d, _acc_int(_d), INT)
_LAYOUTS[np.dtype(np.bool_)] = Layout(np.dtype(np.bool_), np.dtype(np.uint8), np.dtype(np.uint32), BOOL)
_LAYOUTS[np.dtype(np.float16)] = Layout(np.dtype(np.float16), np.dtype(np.float16), np.dtype(np.float32), F16)
if BFLOAT16 is not None:
    _LAYOUTS[BFLOAT16] = Layout(BFLOAT16, np.dtype(np.uint16), np.dtype(np.float32), BF16)
for _t in (np.float32, np.float64):
    _d = np.dtype(_t)
    _LAYOUTS[_d] = Layout(_d, _d, _d, FLOAT)
for _t in (np.complex64, np.complex128):
    _d = np.dtype(_t)
    _LAYOUTS[_d] = Layout(_d, _d, _d, COMPLEX)

DTYPES: tuple[np.dtype, ...] = tuple(_LAYOUTS)


def layout(dtype: Any) -> Layout:
    """The Layout of a dtype (or MPI Datatype) the kernels handle; TypeError for others (long double has no device type)."""
    dt = _datatypes.resolve(dtype)
    try:
        return _LAYOUTS[dt]
    except KeyError:
        raise TypeError(f"the CUDA kernels have no {dt.name} (supported: {', '.join(d.name for d in DTYPES)})") from None


def check(op: Any, dtype: Any) -> str | None:
    """None if the kernels can reduce ``dtype`` with ``op``, else why not (pycoll's own op rules, then the device's)."""
    op = _ops.resolve(op)
    dt = _datatypes.resolve(dtype)
    why = op.check(dt)
    if why is not None:
        return why
    if dt not in _LAYOUTS:
        return f"the CUDA kernels have no {dt.name}"
    return None


def pairs() -> list[tuple[_ops.Op, np.dtype]]:
    """Every (op, dtype) the kernels reduce, in a stable order."""
    return [(op, dt) for op in _ops.OPS.values() for dt in DTYPES if check(op, dt) is None]


def divisor_arg(dtype: Any, divisor: float, wide: bool) -> np.generic:
    """The scalar a kernel divides by, typed as the kernel expects.

    Pairwise kernels and ``scale`` divide as pycoll's host backend does, ``x / dtype.type(divisor)``, so the divisor is
    first rounded to the dtype (257 is 256 in bfloat16). The n-ary kernels (``wide``) divide the float32 accumulator
    by float32(divisor). Complex kernels take the reciprocal: NumPy divides by ``p + 0j`` as ``x * (1 / p)``.
    """
    lay = layout(dtype)
    if lay.family in (F16, BF16):
        return np.float32(divisor) if wide else np.float32(lay.dtype.type(divisor))
    if lay.family == FLOAT:
        return lay.dtype.type(divisor)
    if lay.family == COMPLEX:
        part = np.float32 if lay.dtype == np.complex64 else np.float64
        return part(1) / part(divisor)
    raise TypeError(f"{lay.dtype.name} cannot be averaged (pycoll's AVG takes float and complex dtypes)")
