"""Parsing of mpi4py buffer specs (buf, [buf, count], [buf, count, dtype], [buf, counts, displs, dtype]), host or CUDA."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .datatypes import Datatype
from .errors import InvalidArgumentError
from .arrays import (
    Buf,
    VBuf,
    as_flat_array,
    check_disjoint,
    check_supported,
    dtype_of,
    int_list,
    is_datatype,
    is_int,
    is_writable,
    memory_of,
    reinterpret,
)
from .derived_buffers import parse_derived, parse_derived_vector


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


# named datatypes that passed the full checks, by their dtype: a spec naming one over an array of that dtype needs
# none of them again (``_plain``)
_CHECKED_NAMED: dict[Datatype, np.dtype] = {}


def _plain(spec: Any, writable: bool, blocks: int) -> Optional[Buf]:
    """The Buf of the usual spec, ``[arr, T]`` with a one-dimensional C-ordered NumPy array whose dtype the named
    datatype ``T`` is, whole, writable where it must be; None for anything else (the full parse then checks it)."""
    if type(spec) is not list and type(spec) is not tuple or len(spec) != 2 or blocks != 1:
        return None
    arr, named = spec
    if type(arr) is not np.ndarray or type(named) is not Datatype:
        return None
    dtype = _CHECKED_NAMED.get(named)
    if dtype is None or arr.dtype != dtype or arr.ndim != 1:
        return None
    flags = arr.flags
    if not flags.c_contiguous or (writable and not flags.writeable):
        return None
    return Buf(arr, dtype, "host", named)


def parse(spec: Any, what: str, op: str, *, writable: bool = False, blocks: int = 1) -> Buf:
    """Resolve ``buf``, ``[buf, count]``, ``[buf, dtype]`` or ``[buf, count, dtype]``.

    With ``blocks`` > 1 (one block per rank, as in Allgather's recvbuf) an explicit count is per
    block, and without one the buffer must split evenly into blocks, as in mpi4py.
    """
    quick = _plain(spec, writable, blocks)
    if quick is not None:
        return quick
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
            if rest and is_datatype(rest[-1]):
                if isinstance(rest[-1], Datatype):
                    named = rest[-1]
                dtype = dtype_of(rest.pop(), what, op)
        if rest:
            c = rest.pop()
            if isinstance(c, (tuple, list)) and len(c) == 2:  # mpi4py's (count, displ)
                c, displ = c
                if not (displ is None or (is_int(displ) and displ == 0)):
                    raise InvalidArgumentError(f"{what}: a displacement ({displ!r}) is only allowed in vector specs", op=op)
            if not is_int(c):
                raise InvalidArgumentError(f"{what}: count must be an integer, got {c!r}", op=op)
            count = int(c)
        if rest:
            raise InvalidArgumentError(f"{what}: could not read buffer spec {spec!r}", op=op)
        if derived is not None:
            return parse_derived(obj, count, derived, what, op, writable, blocks)
    arr = as_flat_array(obj, what, op)
    if dtype is not None:
        arr = reinterpret(arr, dtype, what, op)
    check_supported(arr.dtype, what, op)
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
    if writable and not is_writable(arr):
        raise InvalidArgumentError(f"{what} is read-only", op=op)
    if named is not None and named.is_named and named.dtype == arr.dtype and named not in _CHECKED_NAMED:
        _CHECKED_NAMED[named] = arr.dtype
    return Buf(arr, arr.dtype, memory_of(arr), named)


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
    dtype = dtype_of(items.pop(), what, op) if derived is None and is_datatype(items[-1]) else None
    obj = items[0]
    counts_spec: Any = items[1] if len(items) > 1 else None
    displs_spec: Any = items[2] if len(items) > 2 else None
    if isinstance(counts_spec, tuple) and len(counts_spec) == 2 and displs_spec is None:
        # mpi4py reads a 2-tuple here as (counts, displs), always: (3, 4) is count 3 with displacement stride 4.
        counts_spec, displs_spec = counts_spec
    if len(items) > 3:
        raise InvalidArgumentError(f"{what}: could not read vector spec", op=op)
    if derived is not None:
        return parse_derived_vector(obj, counts_spec, displs_spec, derived, what, op, size, writable)
    arr = as_flat_array(obj, what, op)
    if dtype is not None:
        arr = reinterpret(arr, dtype, what, op)
    check_supported(arr.dtype, what, op)
    counts = int_list(counts_spec, size, "counts", what, op)
    if displs_spec is None:
        displs = [int(x) for x in np.concatenate(([0], np.cumsum(counts)[:-1]))] if size else []
    else:
        displs = int_list(displs_spec, size, "displs", what, op)
    for i, (c, d) in enumerate(zip(counts, displs)):
        if c < 0 or d < 0 or d + c > arr.shape[0]:
            raise InvalidArgumentError(
                f"{what}: rank {i}'s block (count {c}, displacement {d}) does not fit in {arr.shape[0]} elements",
                op=op,
            )
    if writable:
        if not is_writable(arr):
            raise InvalidArgumentError(f"{what} is read-only", op=op)
        check_disjoint(counts, displs, what, op)
    return VBuf(arr, arr.dtype, counts, displs, memory_of(arr))
