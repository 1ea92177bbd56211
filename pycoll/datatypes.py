"""MPI datatype names (MPI.FLOAT, MPI.DOUBLE, ...) mapped to NumPy dtypes, with bfloat16 from ml_dtypes."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

try:  # NumPy has no bfloat16; ml_dtypes supplies one that ufuncs understand.
    import ml_dtypes

    BFLOAT16: Optional[np.dtype] = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a core dependency
    BFLOAT16 = None


class Datatype:
    """A named element type, as used in mpi4py buffer specs: ``[buf, count, MPI.DOUBLE]``."""

    __slots__ = ("name", "dtype", "code")

    def __init__(self, name: str, dtype: Optional[np.dtype], code: int) -> None:
        self.name = name
        self.dtype = dtype
        self.code = code  # small integer that travels in message headers

    def Get_name(self) -> str:  # noqa: N802 - mpi4py name
        return self.name

    def Get_size(self) -> int:  # noqa: N802 - mpi4py name
        return 0 if self.dtype is None else self.dtype.itemsize

    @property
    def size(self) -> int:
        return self.Get_size()

    def __repr__(self) -> str:
        return f"<pycoll.MPI.{self.name}>"


# Canonical element types, one code each. Codes are part of the wire format: append only.
_CANONICAL: list[tuple[str, Any]] = [
    ("BYTE", np.uint8),
    ("INT8_T", np.int8),
    ("INT16_T", np.int16),
    ("INT32_T", np.int32),
    ("INT64_T", np.int64),
    ("UINT8_T", np.uint8),
    ("UINT16_T", np.uint16),
    ("UINT32_T", np.uint32),
    ("UINT64_T", np.uint64),
    ("FLOAT16", np.float16),
    ("FLOAT", np.float32),
    ("DOUBLE", np.float64),
    ("C_FLOAT_COMPLEX", np.complex64),
    ("C_DOUBLE_COMPLEX", np.complex128),
    ("BFLOAT16", BFLOAT16),
    ("C_BOOL", np.bool_),
    ("LONG_DOUBLE", np.longdouble),
]

DATATYPES: dict[str, Datatype] = {}
for _code, (_name, _dt) in enumerate(_CANONICAL, start=1):
    DATATYPES[_name] = Datatype(_name, None if _dt is None else np.dtype(_dt), _code)

# C-style and Fortran-style aliases that mpi4py users write.
_ALIASES = {
    "CHAR": "INT8_T",
    "SIGNED_CHAR": "INT8_T",
    "UNSIGNED_CHAR": "UINT8_T",
    "SHORT": "INT16_T",
    "UNSIGNED_SHORT": "UINT16_T",
    "INT": "INT32_T",
    "UNSIGNED": "UINT32_T",
    "UNSIGNED_INT": "UINT32_T",
    "LONG": "INT64_T",
    "UNSIGNED_LONG": "UINT64_T",
    "LONG_LONG": "INT64_T",
    "LONG_LONG_INT": "INT64_T",
    "UNSIGNED_LONG_LONG": "UINT64_T",
    "INTEGER": "INT32_T",
    "REAL": "FLOAT",
    "DOUBLE_PRECISION": "DOUBLE",
    "COMPLEX": "C_FLOAT_COMPLEX",
    "DOUBLE_COMPLEX": "C_DOUBLE_COMPLEX",
    "C_COMPLEX": "C_FLOAT_COMPLEX",
    "CXX_FLOAT_COMPLEX": "C_FLOAT_COMPLEX",
    "CXX_DOUBLE_COMPLEX": "C_DOUBLE_COMPLEX",
    "BOOL": "C_BOOL",
    "CXX_BOOL": "C_BOOL",
    "HALF": "FLOAT16",
}
for _alias, _target in _ALIASES.items():
    DATATYPES[_alias] = DATATYPES[_target]

BYTE = DATATYPES["BYTE"]
_BY_CODE = {dt.code: dt for dt in DATATYPES.values()}
_BY_DTYPE: dict[np.dtype, Datatype] = {}
for _name, _ in reversed(_CANONICAL):  # BYTE loses to UINT8_T for uint8 arrays
    _d = DATATYPES[_name]
    if _d.dtype is not None and _name != "BYTE":
        _BY_DTYPE[_d.dtype] = _d

# Buffer-protocol format characters (struct module) to dtypes, for bytearray/array.array/memoryview.
_FORMAT_TO_DTYPE = {"B": np.uint8, "b": np.int8, "c": np.uint8}


def from_numpy(dtype: np.dtype) -> Datatype:
    """The Datatype of a NumPy dtype; raises KeyError if pycoll has none."""
    return _BY_DTYPE[np.dtype(dtype)]


def from_code(code: int) -> Datatype:
    return _BY_CODE[code]


def resolve(spec: Any) -> np.dtype:
    """A NumPy dtype from a Datatype, a dtype, a type or a type string."""
    if isinstance(spec, Datatype):
        if spec.dtype is None:
            raise TypeError(f"{spec.name} is not available (install ml_dtypes)")
        return spec.dtype
    return np.dtype(spec)


def format_dtype(fmt: str) -> np.dtype:
    """The dtype a buffer-protocol format string describes."""
    fmt = fmt.lstrip("@=<>!")
    if fmt in _FORMAT_TO_DTYPE:
        return np.dtype(_FORMAT_TO_DTYPE[fmt])
    return np.dtype(fmt)
