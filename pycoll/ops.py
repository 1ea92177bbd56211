"""Reduction operations (MPI.SUM, MPI.MAXLOC, user-defined ops, ...): which dtypes each accepts and how it combines values."""

from __future__ import annotations

import functools
import operator
import threading
import weakref
from typing import Any, Callable, Optional

import numpy as np

from . import datatypes as _datatypes
from .datatypes import BFLOAT16
from .errors import InvalidArgumentError

_INT, _FLOAT, _COMPLEX, _BOOL, _PAIR = "int", "float", "complex", "bool", "pair"


def dtype_class(dtype: np.dtype) -> str:
    """'int', 'float', 'complex', 'bool' or 'pair' (a value-index pair) for a dtype pycoll can reduce (bfloat16 is
    'float')."""
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
    if _datatypes.is_pair(dtype):
        return _PAIR
    return "other"


# How selection treats an op (``Op.order``): KERNEL ops may run anywhere, compiled kernels included; PYTHON ops
# (MAXLOC, commutative user ops) on every host algorithm, never in a kernel; ORDERED ops (non-commutative) only on
# the algorithms that combine the ranks' values in rank order.
KERNEL, PYTHON, ORDERED = 0, 1, 2

MAX_USER_OPS = 32  # user-defined ops alive at once: mpi4py's limit, kept so that programs behave alike
USER_CODE, USER_NONCOMMUTATIVE_CODE = 16, 17  # the wire codes of every user-defined op


class Op:
    """A reduction: a NumPy ufunc (or a callable with its ``f(a, b, out=)`` form), plus the Python form for objects.

    ``Op()`` is a handle equal to OP_NULL, ``Op(op)`` another handle to ``op`` (equal to it), and
    ``Op.Create(function, commute)`` a user-defined op, as in mpi4py.
    """

    __slots__ = ("name", "code", "ufunc", "classes", "pyfunc", "averages", "commutative", "kernel", "order", "handle",
                 "_user", "__weakref__")

    def __new__(cls, op: Optional["Op"] = None) -> "Op":
        src = OP_NULL if op is None else op
        if not isinstance(src, Op):
            raise TypeError(f"expecting an Op, got {type(op).__name__}")
        return _OpRef._of(src)

    @classmethod
    def _make(cls, name: str, code: int, ufunc: Any, classes: Optional[tuple[str, ...]], pyfunc: Callable[[Any, Any], Any],
              averages: bool = False, commutative: bool = True, kernel: bool = False, handle: Optional[int] = None,
              user: Optional["_UserFunction"] = None) -> "Op":
        self = object.__new__(Op)
        self.name = name
        self.code = code  # travels in message headers
        self.ufunc = ufunc  # ufunc(a, b, out=None): out = a op b, elementwise
        self.classes = classes  # dtype classes it reduces (None: any dtype, as a user-defined op)
        self.pyfunc = pyfunc
        self.averages = averages  # SUM, then divide by the number of ranks
        self.commutative = commutative
        self.kernel = kernel  # the compiled arena kernels and the CUDA kernels implement it
        self.order = KERNEL if kernel else (PYTHON if commutative else ORDERED)
        self.handle = code if handle is None else handle
        self._user = user
        return self

    # ---- what it reduces ---------------------------------------------------------------------------
    def check(self, dtype: np.dtype) -> Optional[str]:
        """None if this op can reduce ``dtype``, else the reason it cannot."""
        if self.classes is None:
            return None if self.code else "MPI.OP_NULL is not a reduction (or the op was freed)"
        cls = dtype_class(dtype)
        if cls not in self.classes:
            if not self.classes:
                return f"op {self.name} is for one-sided accumulate calls, not for reductions"
            if self.classes == (_PAIR,):
                return (f"op {self.name} needs a value-index pair datatype (MPI.FLOAT_INT, DOUBLE_INT, LONG_INT, INT_INT, "
                        f"SHORT_INT or LONG_DOUBLE_INT), got {_dtype_name(dtype)}")
            allowed = " or ".join(self.classes)
            return f"op {self.name} needs a {allowed} dtype, got {_dtype_name(dtype)}"
        return None

    def bind(self, datatype: Any, dtype: np.dtype, elements: int = 1) -> tuple["Op", Optional[np.dtype]]:
        """(the op a call of ``datatype`` runs, the dtype its arrays must be seen as, or None as they are).

        A user-defined op is bound to the call's datatype (its function gets it); where that datatype spans
        ``elements`` > 1 elements of ``dtype``, the arrays are seen as opaque elements of the datatype's size, so
        that no algorithm cuts one in two.
        """
        if self._user is None:
            return self, None
        if datatype is None:
            datatype = _datatypes.from_numpy(dtype)
        return self._user.bound(self, datatype), (np.dtype((np.void, dtype.itemsize * elements)) if elements > 1 else None)

    def reduce_objects(self, values: list[Any]) -> Any:
        """Combine Python objects in rank order (the lowercase ``allreduce``)."""
        result = functools.reduce(self, values)
        if self.averages:
            result = result / len(values)
        return result

    def __call__(self, x: Any, y: Any) -> Any:
        """``x op y`` on Python objects, as mpi4py's ``op(x, y)`` (a user-defined op: ``function(x, y, None)``)."""
        if self.code == 0:
            raise ValueError("cannot call MPI.OP_NULL")
        return self.pyfunc(x, y)

    # ---- mpi4py's Op API ---------------------------------------------------------------------------
    @classmethod
    def Create(cls, function: Callable[[Any, Any, Any], Any], commute: bool = False) -> "Op":  # noqa: N802
        """A user-defined op: ``function(invec, inoutvec, datatype)`` sets inoutvec = invec op inoutvec.

        On buffers the vectors are byte buffers (``np.frombuffer(invec, dtype)`` reads them) of whole elements of
        the call's datatype; on objects (``comm.allreduce(obj, op)``, ``op(x, y)``) the function gets the two
        objects and ``None`` and returns the result. A non-commutative op combines the ranks' values in rank
        order; a commutative one in any order.
        """
        if not callable(function):
            raise TypeError(f"Op.Create needs a callable, got {type(function).__name__}")
        return _UserFunction.create(function, bool(commute))

    def Free(self) -> None:  # noqa: N802
        """Free a user-defined op (it becomes null); predefined ops cannot be freed."""
        if self._user is None:
            raise InvalidArgumentError(f"Op.Free: {self!r} is {'null' if self.code == 0 else 'predefined'} and cannot be freed")
        self._user.free()
        _null_out(self)

    def free(self) -> None:
        """``Free`` if the op is user-defined and live; nothing otherwise."""
        if self._user is not None:
            self.Free()

    def Is_commutative(self) -> bool:  # noqa: N802 - mpi4py name
        if self.code == 0:
            raise InvalidArgumentError("Op.Is_commutative: MPI.OP_NULL is not an operation")
        return self.commutative

    @property
    def is_commutative(self) -> bool:
        return self.Is_commutative()

    @property
    def is_predefined(self) -> bool:
        return self._user is None and self.code < USER_CODE

    def Reduce_local(self, inbuf: Any, inoutbuf: Any) -> None:  # noqa: N802
        """inoutbuf = inbuf op inoutbuf, elementwise, on this process."""
        reduce_local(self, inbuf, inoutbuf)

    def toint(self) -> int:
        """The op's integer handle (``Op.fromint`` gives the op back while it lives)."""
        return self.handle

    py2f = toint

    @classmethod
    def fromint(cls, handle: int) -> "Op":
        """The op with integer handle ``handle``, as another handle to it (which cannot be pickled)."""
        handle = int(handle)
        if handle in BY_HANDLE:
            return Op(BY_HANDLE[handle])
        ref = _USER_HANDLES.get(handle)
        op = ref() if ref is not None else None
        if op is None or op._user is None:
            raise InvalidArgumentError(f"Op.fromint: no live op has handle {handle}")
        borrowed = _OpRef._of(op)
        borrowed._user = None  # it refers to the op; only the op itself knows how to rebuild itself
        borrowed.ufunc, borrowed.classes = op.ufunc, op.classes
        return borrowed

    f2py = fromint
    fromhandle = fromint

    def __bool__(self) -> bool:
        return self.code != 0

    def __reduce__(self) -> Any:
        if self._user is not None:
            return (Op.Create, (self._user.function, self.commutative))
        if self.code in BY_CODE and BY_CODE[self.code] is self or self.code == 0:
            return (_predefined, (self.name,))
        raise ValueError("cannot pickle a user-defined op that is not the one Op.Create returned")

    def __repr__(self) -> str:
        if self._user is not None or self.code >= USER_CODE:
            return f"<pycoll.MPI.Op user-defined {self.name}>"
        return f"<pycoll.MPI.{self.name}>"


class _OpRef(Op):
    """Another handle to an op (``MPI.Op(op)``, ``Op.fromint``): equal to it and hashed alike."""

    __slots__ = ("_target",)

    @classmethod
    def _of(cls, src: Op) -> "Op":
        target = getattr(src, "_target", src)
        self = object.__new__(_OpRef)
        for slot in Op.__slots__[:-1]:
            object.__setattr__(self, slot, getattr(target, slot))
        self._target = target
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Op):
            return NotImplemented
        return self._target is getattr(other, "_target", other)

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash(self._target)

    def __reduce__(self) -> Any:
        if self._user is None and self.code >= USER_CODE:
            raise ValueError("cannot pickle a user-defined op known only by its handle (Op.fromint)")
        return (Op, (self._target,))

    def Free(self) -> None:  # noqa: N802
        if self._user is None and self.code >= USER_CODE:
            raise InvalidArgumentError("Op.Free: free the op Op.Create returned, not a handle made from its integer")
        self._target.Free()
        _null_out(self)


def _null_out(op: Op) -> None:
    """Make ``op`` a null handle (what a freed op is)."""
    op.code, op.classes, op._user, op.commutative, op.name = 0, None, None, True, "OP_NULL"
    op.ufunc, op.pyfunc = _null_ufunc, _null_pyfunc


def _null_ufunc(a: Any, b: Any, out: Any = None) -> Any:
    raise InvalidArgumentError("MPI.OP_NULL is not a reduction")


def _null_pyfunc(x: Any, y: Any) -> Any:
    raise ValueError("cannot call MPI.OP_NULL")


def _dtype_name(dtype: np.dtype) -> str:
    try:
        return _datatypes.from_numpy(dtype).name
    except KeyError:
        return str(dtype)


# ---- user-defined ops ----------------------------------------------------------------------------------------

_USER_SLOTS: list[Optional["weakref.ref[_UserFunction]"]] = [None] * MAX_USER_OPS
_USER_HANDLES: "dict[int, weakref.ref[Op]]" = {}
_USER_LOCK = threading.Lock()
_next_handle = [0x40000000]


class _UserFunction:
    """What ``Op.Create`` registered: the function, its slot among the ``MAX_USER_OPS``, and its per-datatype forms.

    The slot is free again once the op is freed or garbage-collected.
    """

    __slots__ = ("function", "commute", "slot", "handle", "_bound", "__weakref__")

    def __init__(self, function: Callable, commute: bool, slot: int, handle: int) -> None:
        self.function, self.commute, self.slot, self.handle = function, commute, slot, handle
        self._bound: dict = {}

    @staticmethod
    def create(function: Callable, commute: bool) -> Op:
        with _USER_LOCK:
            slot = next((i for i, ref in enumerate(_USER_SLOTS) if ref is None or ref() is None), -1)
            if slot < 0:
                raise RuntimeError(f"cannot create more than {MAX_USER_OPS} user-defined reduction operations at once "
                                   "(Free some)")
            _next_handle[0] += 1
            user = _UserFunction(function, commute, slot, _next_handle[0])
            _USER_SLOTS[slot] = weakref.ref(user)
        name = getattr(function, "__qualname__", None) or type(function).__name__
        code = USER_CODE if commute else USER_NONCOMMUTATIVE_CODE
        op = Op._make(name, code, None, None, lambda x, y: function(x, y, None), commutative=commute,
                      handle=user.handle, user=user)
        op.ufunc = _UserReduction(function, None)
        _USER_HANDLES[user.handle] = weakref.ref(op)
        return op

    def bound(self, op: Op, datatype: Any) -> Op:
        """The op as a call of ``datatype`` runs it: its function gets that datatype (one per datatype, kept)."""
        hit = self._bound.get(datatype)
        if hit is None:
            hit = Op._make(op.name, op.code, _UserReduction(self.function, datatype), None, op.pyfunc,
                           commutative=self.commute, handle=self.handle)
            if len(self._bound) > 64:
                self._bound.clear()
            self._bound[datatype] = hit
        return hit

    def free(self) -> None:
        with _USER_LOCK:
            if _USER_SLOTS[self.slot] is not None and _USER_SLOTS[self.slot]() is self:
                _USER_SLOTS[self.slot] = None
        _USER_HANDLES.pop(self.handle, None)
        self._bound.clear()


class OpBuffer(np.ndarray):
    """The bytes a user-defined op's function gets (as mpi4py's buffers): indexable, sliceable, and assignable
    from any buffer of the same byte length (``inoutvec[:] = array.array("i", ...)``)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, np.ndarray):
            if value.dtype != np.uint8 and value.ndim > 0:
                value = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        elif not isinstance(value, (int, np.integer)):
            try:
                value = np.frombuffer(memoryview(value).cast("B"), np.uint8)
            except TypeError:
                pass
        np.ndarray.__setitem__(self.view(np.ndarray), key, value)


def _as_bytes(arr: np.ndarray) -> OpBuffer:
    flat = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
    return flat.reshape(-1).view(np.uint8).view(OpBuffer)


class _UserReduction:
    """A user function in a ufunc's form ``f(a, b, out=None)``: out = a op b (MPI's inoutvec = invec op inoutvec)."""

    __slots__ = ("function", "datatype")

    def __init__(self, function: Callable, datatype: Any) -> None:
        self.function, self.datatype = function, datatype

    def __call__(self, a: np.ndarray, b: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        if out is None:
            out = b.copy()
        elif out is not b:
            if np.may_share_memory(out, a):  # out is a's memory: keep a's values before b lands there
                a = a.copy()
            np.copyto(out, b)
        if out.size:
            datatype = self.datatype if self.datatype is not None else _datatypes.from_numpy(out.dtype)
            target = _as_bytes(out)
            self.function(_as_bytes(a), target, datatype)
            if not np.may_share_memory(target, out):  # out was not contiguous: its bytes were a copy
                out[...] = target.view(np.ndarray).view(out.dtype).reshape(out.shape)
        return out


# ---- MAXLOC and MINLOC ---------------------------------------------------------------------------------------

class _LocReduction:
    """MAXLOC/MINLOC on value-index pairs: the better value wins; on a tie, the lower index (as MPI says)."""

    __slots__ = ("better",)

    def __init__(self, better: np.ufunc) -> None:
        self.better = better

    def __call__(self, a: np.ndarray, b: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        va, ia = a[a.dtype.names[0]], a[a.dtype.names[1]]
        vb, ib = b[b.dtype.names[0]], b[b.dtype.names[1]]
        take_b = self.better(vb, va) | ((vb == va) & (ib < ia))
        values, index = np.where(take_b, vb, va), np.where(take_b, ib, ia)
        if out is None:
            out = np.empty_like(a)
        out[out.dtype.names[0]] = values
        out[out.dtype.names[1]] = index
        return out


def _loc_objects(better: Callable[[Any, Any], bool]) -> Callable[[Any, Any], Any]:
    def combine(x: Any, y: Any) -> Any:
        u, i = x
        v, j = y
        if better(u, v):
            return u, i
        if better(v, u) or j < i:
            return v, j
        return u, i

    return combine


def _land(a: Any, b: Any) -> bool:
    return bool(a) and bool(b)


def _lor(a: Any, b: Any) -> bool:
    return bool(a) or bool(b)


def _lxor(a: Any, b: Any) -> bool:
    return bool(a) != bool(b)


_NUMERIC = (_INT, _FLOAT, _COMPLEX)
_ORDERED = (_INT, _FLOAT)
_BITS = (_INT, _BOOL)

SUM = Op._make("SUM", 1, np.add, _NUMERIC, operator.add, kernel=True)
PROD = Op._make("PROD", 2, np.multiply, _NUMERIC, operator.mul, kernel=True)
MIN = Op._make("MIN", 3, np.minimum, _ORDERED, min, kernel=True)
MAX = Op._make("MAX", 4, np.maximum, _ORDERED, max, kernel=True)
AVG = Op._make("AVG", 5, np.add, (_FLOAT, _COMPLEX), operator.add, averages=True, kernel=True)
BAND = Op._make("BAND", 6, np.bitwise_and, _BITS, operator.and_, kernel=True)
BOR = Op._make("BOR", 7, np.bitwise_or, _BITS, operator.or_, kernel=True)
BXOR = Op._make("BXOR", 8, np.bitwise_xor, _BITS, operator.xor, kernel=True)
LAND = Op._make("LAND", 9, np.logical_and, _BITS, _land, kernel=True)
LOR = Op._make("LOR", 10, np.logical_or, _BITS, _lor, kernel=True)
LXOR = Op._make("LXOR", 11, np.logical_xor, _BITS, _lxor, kernel=True)
MAXLOC = Op._make("MAXLOC", 12, _LocReduction(np.greater), (_PAIR,), _loc_objects(operator.gt))
MINLOC = Op._make("MINLOC", 13, _LocReduction(np.less), (_PAIR,), _loc_objects(operator.lt))
# For one-sided accumulate calls in MPI; reductions refuse them (as MPICH does), objects and op(x, y) take them.
REPLACE = Op._make("REPLACE", 14, None, (), lambda x, y: y, commutative=False)
NO_OP = Op._make("NO_OP", 15, None, (), lambda x, y: x, commutative=False)
OP_NULL = Op._make("OP_NULL", 0, _null_ufunc, None, _null_pyfunc)

# the arithmetic ops, which every kernel implements (host and device), by name
OPS: dict[str, Op] = {op.name: op for op in (SUM, PROD, MIN, MAX, AVG, BAND, BOR, BXOR, LAND, LOR, LXOR)}
# every predefined op but OP_NULL, by name
PREDEFINED: dict[str, Op] = {**OPS, **{op.name: op for op in (MAXLOC, MINLOC, REPLACE, NO_OP)}}
BY_HANDLE: dict[int, Op] = {op.handle: op for op in (OP_NULL, *PREDEFINED.values())}
# codes as signatures carry them (user-defined ops: one code each for the commutative and the other ones)
BY_CODE: dict[int, Op] = {op.code: op for op in PREDEFINED.values()}
BY_CODE[USER_CODE] = Op._make("user-defined (commutative)", USER_CODE, None, None, _null_pyfunc)
BY_CODE[USER_NONCOMMUTATIVE_CODE] = Op._make("user-defined", USER_NONCOMMUTATIVE_CODE, None, None, _null_pyfunc,
                                             commutative=False)


def _predefined(name: str) -> Op:
    """A predefined op by name (how they unpickle: as the same object)."""
    return OP_NULL if name == "OP_NULL" else PREDEFINED[name]


def resolve(op: Any) -> Op:
    """An Op from an Op, a name such as ``"sum"``, or raise TypeError."""
    if isinstance(op, Op):
        return op
    if isinstance(op, str) and op.upper() in PREDEFINED:
        return PREDEFINED[op.upper()]
    raise TypeError(f"{op!r} is not a pycoll reduction op (expected one of {', '.join(PREDEFINED)})")


def reduce_local(op: Any, inbuf: Any, inoutbuf: Any, opname: str = "Reduce_local", rank: Optional[int] = None) -> None:
    """inoutbuf = inbuf op inoutbuf on this process (``Op.Reduce_local``, ``Comm.Reduce_local``)."""
    from . import arrays, buffers

    def bad(cause: str) -> InvalidArgumentError:
        return InvalidArgumentError(cause, op=opname, rank=rank)

    try:
        o = resolve(op)
    except TypeError as exc:
        raise bad(str(exc)) from None
    try:
        inout = buffers.parse(inoutbuf, "inoutbuf", opname, writable=True)
        src = buffers.parse(inbuf, "inbuf", opname)
    except InvalidArgumentError as err:
        raise bad(err.cause) from None
    if inout.memory != "host" or src.memory != "host":
        raise bad("Reduce_local takes host buffers (device memory: reduce with a collective on COMM_SELF)")
    if src.dtype != inout.dtype:
        raise bad(f"inbuf holds {_dtype_name(src.dtype)} but inoutbuf holds {_dtype_name(inout.dtype)}")
    if src.count != inout.count:
        raise bad(f"inbuf has {src.count} elements, inoutbuf {inout.count}")
    reason = o.check(inout.dtype)
    if reason is None and o.averages:
        reason = "op AVG averages over ranks; a local reduction has none"
    if reason:
        raise bad(reason)
    bound, unit = o.bind(inout.datatype, inout.dtype, inout.elements)
    a, b = (src.array, inout.array) if unit is None else (src.array.view(unit), inout.array.view(unit))
    if b.size:
        if arrays.overlaps(a, b) and a is not b:
            a = a.copy()
        bound.ufunc(a, b, out=b)
    inout.finish()
