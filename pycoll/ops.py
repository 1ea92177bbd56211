"""Reduction operations (MPI.SUM, MPI.MAX, ...): which dtypes each accepts and how it combines values."""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Optional

import numpy as np

from .datatypes import BFLOAT16

_INT, _FLOAT, _COMPLEX, _BOOL = "int", "float", "complex", "bool"


def dtype_class(dtype: np.dtype) -> str:
    """'int', 'float', 'complex' or 'bool' for a dtype pycoll can reduce (bfloat16 is 'float')."""
    if BFLOAT16 is not None and dtype == BFLOAT16:
        return _FLOAT
    kind = dtype.kind
    if kind in "iu":
        return _INT
    if kind == "f":
        return _FLOAT
    if kind == "c":
        return _COMPLEX
    if kind == "b":
        return _BOOL
    return "other"


class Op:
    """A reduction: a NumPy ufunc applied elementwise with ``out=``, plus the Python form for objects."""

    __slots__ = ("name", "code", "ufunc", "classes", "pyfunc", "averages")

    def __init__(
        self,
        name: str,
        code: int,
        ufunc: Optional[np.ufunc],
        classes: tuple[str, ...],
        pyfunc: Callable[[Any, Any], Any],
        averages: bool = False,
    ) -> None:
        self.name = name
        self.code = code  # travels in message headers
        self.ufunc = ufunc
        self.classes = classes
        self.pyfunc = pyfunc
        self.averages = averages  # SUM, then divide by the number of ranks

    def check(self, dtype: np.dtype) -> Optional[str]:
        """None if this op can reduce ``dtype``, else the reason it cannot."""
        cls = dtype_class(dtype)
        if cls not in self.classes:
            allowed = " or ".join(self.classes)
            return f"op {self.name} needs a {allowed} dtype, got {dtype.name}"
        return None

    def reduce_objects(self, values: list[Any]) -> Any:
        """Combine Python objects in rank order (the lowercase ``allreduce``)."""
        result = functools.reduce(self.pyfunc, values)
        if self.averages:
            result = result / len(values)
        return result

    def __call__(self, a: Any, b: Any) -> Any:
        return self.pyfunc(a, b)

    def Is_commutative(self) -> bool:  # noqa: N802 - mpi4py name
        return True

    def __repr__(self) -> str:
        return f"<pycoll.MPI.{self.name}>"


_NUMERIC = (_INT, _FLOAT, _COMPLEX)
_ORDERED = (_INT, _FLOAT)
_BITS = (_INT, _BOOL)

SUM = Op("SUM", 1, np.add, _NUMERIC, operator.add)
PROD = Op("PROD", 2, np.multiply, _NUMERIC, operator.mul)
MIN = Op("MIN", 3, np.minimum, _ORDERED, min)
MAX = Op("MAX", 4, np.maximum, _ORDERED, max)
AVG = Op("AVG", 5, np.add, (_FLOAT, _COMPLEX), operator.add, averages=True)
BAND = Op("BAND", 6, np.bitwise_and, _BITS, operator.and_)
BOR = Op("BOR", 7, np.bitwise_or, _BITS, operator.or_)
BXOR = Op("BXOR", 8, np.bitwise_xor, _BITS, operator.xor)
LAND = Op("LAND", 9, np.logical_and, _BITS, lambda a, b: bool(a) and bool(b))
LOR = Op("LOR", 10, np.logical_or, _BITS, lambda a, b: bool(a) or bool(b))
LXOR = Op("LXOR", 11, np.logical_xor, _BITS, lambda a, b: bool(a) != bool(b))

OPS: dict[str, Op] = {op.name: op for op in (SUM, PROD, MIN, MAX, AVG, BAND, BOR, BXOR, LAND, LOR, LXOR)}
BY_CODE: dict[int, Op] = {op.code: op for op in OPS.values()}


def resolve(op: Any) -> Op:
    """An Op from an Op, a name such as ``"sum"``, or raise TypeError."""
    if isinstance(op, Op):
        return op
    if isinstance(op, str) and op.upper() in OPS:
        return OPS[op.upper()]
    raise TypeError(f"{op!r} is not a pycoll reduction op (expected one of {', '.join(OPS)})")
