"""MPI datatypes: named ones (MPI.FLOAT, MPI.DOUBLE_INT, ...) mapped to NumPy dtypes (bfloat16 from ml_dtypes), and derived ones."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .errors import InvalidArgumentError
from .derived_types import DerivedTypes, rebuild
from .typemap import Layout

try:  # NumPy has no bfloat16; ml_dtypes supplies one that ufuncs understand.
    import ml_dtypes

    BFLOAT16: Optional[np.dtype] = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a core dependency
    BFLOAT16 = None


# How a datatype was made (MPI.COMBINER_*, Datatype.combiner), and the names decode() gives them.
COMBINERS = {name: code for code, name in enumerate(
    ("NAMED", "DUP", "CONTIGUOUS", "VECTOR", "HVECTOR", "INDEXED", "HINDEXED", "INDEXED_BLOCK", "HINDEXED_BLOCK",
     "STRUCT", "SUBARRAY", "DARRAY", "F90_REAL", "F90_COMPLEX", "F90_INTEGER", "RESIZED", "VALUE_INDEX"), start=1)}


class Datatype(DerivedTypes):
    """An MPI datatype, as mpi4py buffer specs use it (``[buf, count, MPI.DOUBLE]``): a named element type, a
    value-index pair (``MPI.DOUBLE_INT``) or a type derived from those (``MPI.DOUBLE.Create_vector(...)``).

    ``Datatype()`` is a null datatype and ``Datatype(dt)`` another handle to ``dt`` (equal to it), as in mpi4py.
    pycoll's own three-argument form ``Datatype(name, dtype, code)`` makes a named type.
    """

    __slots__ = ("name", "dtype", "code", "layout", "_size", "_mpi_name", "_combiner", "_params", "_old")

    def __new__(cls, *args: Any) -> "Datatype":
        if len(args) == 3:
            return cls._named(*args)
        if len(args) > 1:
            raise TypeError(f"Datatype() takes a datatype to refer to, or nothing; got {len(args)} arguments")
        src = args[0] if args else DATATYPE_NULL
        if not isinstance(src, Datatype):
            raise TypeError(f"expecting a Datatype, got {type(src).__name__}")
        return _DatatypeRef._of(src)

    @classmethod
    def _named(cls, name: str, dtype: Optional[np.dtype], code: int, size: Optional[int] = None,
               layout: Optional[Layout] = None, mpi_name: Optional[str] = None) -> "Datatype":
        self = object.__new__(Datatype)
        self.name = name
        self.dtype = dtype
        self.code = code  # small integer that travels in message headers
        if layout is None and dtype is not None:
            layout = Layout.basic(dtype)
        self.layout: Optional[Layout] = layout  # None: the null datatype (or bfloat16 without ml_dtypes)
        self._size = (dtype.itemsize if dtype is not None else 0) if size is None else size
        self._mpi_name = mpi_name or (f"MPI_{name}" if name else "")
        self._combiner, self._params, self._old = "NAMED", {}, None
        return self

    @classmethod
    def _derived(cls, old: "Datatype", layout: Layout, combiner: str, params: dict) -> "Datatype":
        base = old._base()
        self = object.__new__(Datatype)
        self.name, self.dtype, self.code = "", None, base.code
        self.layout = layout
        self._size = layout.elements * base._size
        self._mpi_name = ""
        self._combiner, self._params, self._old = combiner, params, old
        return self

    def _base(self) -> "Datatype":
        """The named type every element of this one is made of."""
        dt = self
        while dt._old is not None:
            dt = dt._old
        return dt

    def _live(self, what: str) -> Layout:
        if self.layout is None:
            why = "was freed" if self._combiner == "FREED" else "is null" if self.code == 0 else "is not available here"
            raise InvalidArgumentError(f"{what}: datatype {self.Get_name() or self.name or '(unnamed)'} {why}")
        return self.layout

    # ---- identity -------------------------------------------------------------------------------------
    def __bool__(self) -> bool:
        return self.layout is not None

    def __reduce__(self) -> Any:
        if self._combiner == "NAMED":
            return (_named_type, (self.name,))
        if self.layout is None:
            raise ValueError(f"cannot pickle {self!r}: it was freed")
        return (rebuild, (self._old, self._combiner, self._params))

    def __repr__(self) -> str:
        if self._combiner == "NAMED":
            return f"<pycoll.MPI.{self.name}>"
        return f"<pycoll.MPI.Datatype {self._combiner.lower()} of {self._base().name}>"

    # ---- sizes and bounds -----------------------------------------------------------------------------
    def Get_size(self) -> int:  # noqa: N802 - mpi4py name
        """Bytes of data in one element (padding not counted)."""
        self._live("Datatype.Get_size")
        return self._size

    def Get_extent(self) -> tuple[int, int]:  # noqa: N802
        """(lb, extent): where an element starts and how far apart consecutive elements lie, in bytes."""
        lay = self._live("Datatype.Get_extent")
        return lay.lb, lay.extent

    def Get_true_extent(self) -> tuple[int, int]:  # noqa: N802
        """(true lb, true extent): the bytes one element really touches."""
        lay = self._live("Datatype.Get_true_extent")
        return lay.true_lb, lay.true_ub - lay.true_lb

    size = property(Get_size, doc="Bytes of data in one element.")
    extent = property(lambda self: self.Get_extent()[1], doc="Distance between consecutive elements, in bytes.")
    lb = property(lambda self: self.Get_extent()[0], doc="Lower bound, in bytes.")
    ub = property(lambda self: sum(self.Get_extent()), doc="Upper bound (lb + extent), in bytes.")
    true_lb = property(lambda self: self.Get_true_extent()[0], doc="Lowest byte an element touches.")
    true_extent = property(lambda self: self.Get_true_extent()[1], doc="Bytes from true_lb to the end of the data.")
    true_ub = property(lambda self: sum(self.Get_true_extent()), doc="One past the highest byte an element touches.")

    # ---- names and life -------------------------------------------------------------------------------
    def Get_name(self) -> str:  # noqa: N802 - mpi4py name
        return self._mpi_name

    def Set_name(self, name: str) -> None:  # noqa: N802
        self._mpi_name = str(name)

    @property
    def is_named(self) -> bool:
        return self._combiner == "NAMED"

    # ---- type codes (mpi4py's tocode/fromcode, typestr, typechar) -----------------------------------------
    def tocode(self) -> str:
        """The character code of a named element type ("d" for DOUBLE); ValueError for pairs and derived types."""
        code = self.typechar
        if not code or code == "V" or self.dtype is None or self.dtype.kind not in "biufc":
            raise ValueError(f"cannot map {self!r} to a character code")
        return code

    @classmethod
    def fromcode(cls, code: str) -> "Datatype":
        """The named type of a character code or NumPy type string ("i", "d", "f8", "c16", ...)."""
        if code == "c":
            return DATATYPES["CHAR"]
        try:
            dtype = np.dtype(code)
            if dtype.kind not in "biufc":
                raise TypeError(code)
            return from_numpy(dtype)
        except (TypeError, ValueError, KeyError, SyntaxError):
            raise ValueError(f"cannot map {code!r} to a datatype") from None

    @property
    def typestr(self) -> str:
        """The NumPy type string of one element ("f8"; "V16" for pairs and derived types; "" for the null type)."""
        if self.layout is None:
            return ""
        if self.dtype is not None and self.dtype.kind in "biufc":
            return self.dtype.str[1:]
        return f"V{self.layout.extent}"

    @property
    def typechar(self) -> str:
        """The NumPy character code of one element ("d"; "V" for pairs and derived types; "" for the null type)."""
        if self.layout is None:
            return ""
        if self.dtype is not None and self.dtype.kind in "biufc":
            return self.dtype.char
        return "V"

    @property
    def is_predefined(self) -> bool:
        return self._combiner == "NAMED"

    @property
    def combiner(self) -> int:
        """How the type was made: MPI.COMBINER_NAMED, COMBINER_VECTOR, ... (``decode`` gives the name)."""
        self._live("Datatype.combiner")
        return COMBINERS[self._combiner]

    def decode(self) -> tuple["Datatype", str, dict]:
        """(the type it was made from, the constructor's name, its arguments), as mpi4py's; a named type gives
        (itself, "NAMED", {}). The type it was made from comes as a handle of its own (freeing it frees nothing else)."""
        self._live("Datatype.decode")
        if self._combiner == "NAMED":
            return self, "NAMED", {}
        assert self._old is not None
        return self._old._handle(), self._combiner, {k: list(v) if isinstance(v, list) else v for k, v in self._params.items()}

    def Get_envelope(self) -> tuple[int, int, int, int, int]:  # noqa: N802
        """(integers, addresses, large counts, datatypes, combiner): the sizes of ``Get_contents``'s lists."""
        i, a, c, d = self._contents(handles=False)
        return len(i), len(a), len(c), len(d), self.combiner

    def Get_contents(self) -> tuple[list[int], list[int], list[int], list["Datatype"]]:  # noqa: N802
        """(integers, addresses, large counts, datatypes): the constructor's arguments in MPI's layout."""
        return self._contents(handles=True)

    envelope = property(Get_envelope)
    contents = property(Get_contents)

    def _contents(self, handles: bool) -> tuple[list[int], list[int], list[int], list["Datatype"]]:
        self._live("Datatype.Get_contents")
        kind, p = self._combiner, self._params
        if kind == "NAMED":
            return [], [], [], []
        ints: list[int]
        addrs: list[int] = []
        if kind == "CONTIGUOUS":
            ints = [p["count"]]
        elif kind == "VECTOR":
            ints = [p["count"], p["blocklength"], p["stride"]]
        elif kind == "HVECTOR":
            ints, addrs = [p["count"], p["blocklength"]], [p["stride"]]
        elif kind == "INDEXED":
            ints = [len(p["blocklengths"]), *p["blocklengths"], *p["displacements"]]
        elif kind == "HINDEXED":
            ints, addrs = [len(p["blocklengths"]), *p["blocklengths"]], list(p["displacements"])
        elif kind == "INDEXED_BLOCK":
            ints = [len(p["displacements"]), p["blocklength"], *p["displacements"]]
        elif kind == "HINDEXED_BLOCK":
            ints, addrs = [len(p["displacements"]), p["blocklength"]], list(p["displacements"])
        elif kind == "SUBARRAY":
            ints = [len(p["sizes"]), *p["sizes"], *p["subsizes"], *p["starts"], p["order"]]
        elif kind == "RESIZED":
            ints, addrs = [], [p["lb"], p["extent"]]
        elif kind == "STRUCT":
            ints, addrs = [len(p["blocklengths"]), *p["blocklengths"]], list(p["displacements"])
            return ints, addrs, [], [t._handle() if handles else t for t in p["datatypes"]]
        else:  # DUP
            ints = []
        assert self._old is not None
        return ints, addrs, [], [self._old._handle() if handles else self._old]

    def _handle(self) -> "Datatype":
        """A handle of its own to this type, as MPI's get_contents hands out: a named type is itself; a derived one
        a copy that can be freed alone."""
        if self._combiner == "NAMED":
            return self
        other = Datatype._derived(self._old, self._live("Datatype.Get_contents"), self._combiner, dict(self._params))
        other._mpi_name = self._mpi_name
        return other

    def Commit(self) -> "Datatype":  # noqa: N802
        """Nothing to do in pycoll (layouts are ready once made); returns the type, as mpi4py does."""
        self._live("Datatype.Commit")
        return self

    def Free(self) -> None:  # noqa: N802
        """Release a derived type; predefined ones cannot be freed."""
        if self._combiner == "NAMED":
            raise InvalidArgumentError(f"Datatype.Free: {self.Get_name() or self.name} is predefined and cannot be freed")
        self._live("Datatype.Free")
        self.layout, self._combiner = None, "FREED"

    def free(self) -> None:
        """``Free`` for a derived type that is still live; nothing for predefined or freed ones."""
        if self._combiner not in ("NAMED", "FREED"):
            self.Free()

    @classmethod
    def Get_value_index(cls, value: "Datatype", index: "Datatype") -> "Datatype":  # noqa: N802
        """The value-index pair type of ``value`` and ``index`` (MPI.INT): DOUBLE_INT for DOUBLE, ...; else DATATYPE_NULL."""
        for dt in (value, index):
            if not isinstance(dt, Datatype) or not dt:
                raise InvalidArgumentError("Datatype.Get_value_index: the value and index types must be valid datatypes")
        if index != DATATYPES["INT"]:
            return DATATYPE_NULL
        return _VALUE_INDEX.get(value.dtype, DATATYPE_NULL) if value.is_named else DATATYPE_NULL


class _DatatypeRef(Datatype):
    """Another handle to a datatype (``MPI.Datatype(dt)``): equal to it, and hashed alike."""

    __slots__ = ("_target",)

    @classmethod
    def _of(cls, src: Datatype) -> "Datatype":
        target = getattr(src, "_target", src)
        self = object.__new__(_DatatypeRef)
        for slot in Datatype.__slots__:
            object.__setattr__(self, slot, getattr(target, slot))
        self._target = target
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Datatype):
            return NotImplemented
        return self._target is getattr(other, "_target", other)

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash(self._target)

    def __reduce__(self) -> Any:
        return (Datatype, (self._target,))

    def Free(self) -> None:  # noqa: N802
        self._target.Free()
        self.layout, self._combiner = None, "FREED"


def _named_type(name: str) -> Datatype:
    """A predefined datatype by its pycoll name (how they unpickle: as the same object)."""
    return DATATYPE_NULL if name == "DATATYPE_NULL" else DATATYPES[name]


DATATYPE_NULL = Datatype._named("DATATYPE_NULL", None, 0)


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
    DATATYPES[_name] = Datatype._named(_name, None if _dt is None else np.dtype(_dt), _code)


def _pair(value: Any) -> np.dtype:
    """The C struct {value; int} as a NumPy dtype (fields f0, f1; aligned, padded as the C compiler pads it)."""
    return np.dtype([("f0", value), ("f1", np.intc)], align=True)


# MAXLOC/MINLOC's value-index pairs, after the element types: codes 18.. (append only).
_PAIRS = [
    ("FLOAT_INT", np.float32, "MPI_FLOAT_INT"),
    ("DOUBLE_INT", np.float64, "MPI_DOUBLE_INT"),
    ("LONG_INT", np.int64, "MPI_LONG_INT"),
    ("INT_INT", np.intc, "MPI_2INT"),
    ("SHORT_INT", np.int16, "MPI_SHORT_INT"),
    ("LONG_DOUBLE_INT", np.longdouble, "MPI_LONG_DOUBLE_INT"),
]
PAIR_DTYPES: dict[np.dtype, Datatype] = {}
for _code, (_name, _value, _mpi) in enumerate(_PAIRS, start=len(_CANONICAL) + 1):
    _dt = _pair(_value)
    _sizes = [_dt.fields[f][0].itemsize for f in ("f0", "f1")]
    _true_ub = max(_dt.fields[f][1] + _dt.fields[f][0].itemsize for f in ("f0", "f1"))
    DATATYPES[_name] = PAIR_DTYPES[_dt] = Datatype._named(
        _name, _dt, _code, size=sum(_sizes), layout=Layout.basic(_dt, 0, _true_ub), mpi_name=_mpi)
_next = len(_CANONICAL) + len(_PAIRS) + 1
# Raw bytes: what a user-defined op reduces when its datatype's elements are not one element type.
DATATYPES["PACKED"] = Datatype._named("PACKED", np.dtype("V1"), _next)
_VALUE_INDEX = {np.dtype(v): DATATYPES[n] for n, v, _ in _PAIRS if n != "INT_INT"}
_VALUE_INDEX[np.dtype(np.intc)] = DATATYPES["INT_INT"]

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
    "FLOAT16_T": "FLOAT16",
    "FLOAT32_T": "FLOAT",
    "FLOAT64_T": "DOUBLE",
    "BFLOAT16_T": "BFLOAT16",
    "WCHAR": "INT32_T",
    "TWOINT": "INT_INT",
    "AINT": "INT64_T",
    "OFFSET": "INT64_T",
    "COUNT": "INT64_T",
    "INTEGER1": "INT8_T",
    "INTEGER2": "INT16_T",
    "INTEGER4": "INT32_T",
    "INTEGER8": "INT64_T",
    "REAL2": "FLOAT16",
    "REAL4": "FLOAT",
    "REAL8": "DOUBLE",
    "COMPLEX8": "C_FLOAT_COMPLEX",
    "COMPLEX16": "C_DOUBLE_COMPLEX",
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
for _name in [n for n, _, _ in _PAIRS] + ["PACKED"]:
    _BY_DTYPE[DATATYPES[_name].dtype] = DATATYPES[_name]

# Buffer-protocol format characters (struct module) to dtypes, for bytearray/array.array/memoryview.
_FORMAT_TO_DTYPE = {"B": np.uint8, "b": np.int8, "c": np.uint8}


def from_numpy(dtype: np.dtype) -> Datatype:
    """The Datatype of a NumPy dtype; raises KeyError if pycoll has none."""
    try:
        return _BY_DTYPE[dtype]
    except (KeyError, TypeError):  # a type (np.float32) or a string: as a dtype
        return _BY_DTYPE[np.dtype(dtype)]


def code_of(dtype: np.dtype) -> int:
    """The wire code of a call's element dtype: its datatype's, or PACKED's for the opaque elements (``V16``) a
    user-defined op reduces when its datatype spans several elements."""
    try:
        return from_numpy(dtype).code
    except KeyError:
        if dtype.kind == "V" and dtype.names is None and dtype.subdtype is None:
            return DATATYPES["PACKED"].code
        raise


def is_pair(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is one of MAXLOC/MINLOC's value-index pairs."""
    return dtype in PAIR_DTYPES


def from_code(code: int) -> Datatype:
    return _BY_CODE[code]


def resolve(spec: Any) -> np.dtype:
    """A NumPy dtype from a Datatype, a dtype, a type or a type string."""
    if isinstance(spec, Datatype):
        if spec.dtype is None:
            if not spec.is_named:
                raise TypeError("a derived datatype has no single NumPy dtype")
            if spec.code == 0:
                raise TypeError("MPI.DATATYPE_NULL is not a datatype to move")
            raise TypeError(f"{spec.name} is not available (install ml_dtypes)")
        return spec.dtype
    return np.dtype(spec)


def format_dtype(fmt: str) -> np.dtype:
    """The dtype a buffer-protocol format string describes."""
    fmt = fmt.lstrip("@=<>!")
    if fmt in _FORMAT_TO_DTYPE:
        return np.dtype(_FORMAT_TO_DTYPE[fmt])
    return np.dtype(fmt)
