"""mpi4py's Status: what a receive or probe found, its MPICH memory layout, and MPI.UNDEFINED."""

from __future__ import annotations

from typing import Any, Iterator, Optional

from . import datatypes
from .errors import InvalidArgumentError
from .p2p_protocol import ANY_SOURCE, ANY_TAG

UNDEFINED = -32766  # MPI.UNDEFINED (MPICH's value): no index, no rank, no color


def type_size(datatype: Any, op: str) -> int:
    """Bytes per element of ``datatype`` (None: bytes)."""
    if datatype is None:
        return 1
    get_size = getattr(datatype, "Get_size", None)
    try:
        return int(get_size()) if get_size is not None else datatypes.resolve(datatype).itemsize
    except (TypeError, ValueError, KeyError) as exc:
        raise InvalidArgumentError(f"{datatype!r} is not a datatype ({exc})", op=op) from None


class Status:
    """What a receive or probe found: ``source``, ``tag``, size in bytes (``count``), ``error``, ``cancelled``
    (``MPI.Status``). ``Status()`` is empty (ANY_SOURCE, ANY_TAG, 0 bytes); ``Status(other)`` copies one."""

    __slots__ = ("source", "tag", "nbytes", "error", "cancelled")

    def __init__(self, status: Optional["Status"] = None) -> None:
        if status is None:
            self.source, self.tag, self.nbytes, self.error, self.cancelled = ANY_SOURCE, ANY_TAG, 0, 0, False
        elif isinstance(status, Status):
            self._fill(status)
        else:
            raise TypeError(f"Status() copies a Status; got {type(status).__name__}")

    @classmethod
    def _of(cls, source: int, tag: int, nbytes: int) -> "Status":
        st = cls.__new__(cls)
        st.source, st.tag, st.nbytes, st.error, st.cancelled = source, tag, nbytes, 0, False
        return st

    def _fill(self, other: "Status") -> None:
        self.source, self.tag, self.nbytes, self.error, self.cancelled = (
            other.source, other.tag, other.nbytes, other.error, other.cancelled)

    def Get_source(self) -> int:  # noqa: N802
        return self.source

    def Set_source(self, source: int) -> None:  # noqa: N802
        self.source = source

    def Get_tag(self) -> int:  # noqa: N802
        return self.tag

    def Set_tag(self, tag: int) -> None:  # noqa: N802
        self.tag = tag

    def Get_error(self) -> int:  # noqa: N802
        return self.error

    def Set_error(self, error: int) -> None:  # noqa: N802
        self.error = error

    def Get_count(self, datatype: Any = None) -> int:  # noqa: N802
        """Whole elements of ``datatype`` (default bytes) received; MPI.UNDEFINED if the bytes are not a whole number."""
        size = type_size(datatype, "Status.Get_count")
        if size == 0:
            return 0
        count, rest = divmod(self.nbytes, size)
        return UNDEFINED if rest else count

    def Get_elements(self, datatype: Any = None) -> int:  # noqa: N802
        return self.Get_count(datatype)

    def Set_elements(self, datatype: Any, count: int) -> None:  # noqa: N802
        """Say that ``count`` elements of ``datatype`` were received."""
        self.nbytes = int(count) * type_size(datatype, "Status.Set_elements")

    def Is_cancelled(self) -> bool:  # noqa: N802
        return bool(self.cancelled)

    def Set_cancelled(self, flag: bool) -> None:  # noqa: N802
        self.cancelled = bool(flag)

    @property
    def count(self) -> int:
        """Bytes received (``Get_elements(MPI.BYTE)``)."""
        return self.nbytes

    @count.setter
    def count(self, value: int) -> None:
        self.nbytes = int(value)

    def tomemory(self) -> "StatusWords":
        """The status as MPICH lays it out (count low, count high and cancelled, source, tag, error), writable."""
        return StatusWords(self)

    def __reduce__(self) -> Any:
        return (status_of, (self.source, self.tag, self.nbytes, self.error, self.cancelled))

    def __repr__(self) -> str:
        return f"<pycoll.MPI.Status source={self.source} tag={self.tag} count={self.nbytes} error={self.error}>"


def status_of(source: int, tag: int, nbytes: int, error: int, cancelled: bool) -> Status:
    st = Status._of(source, tag, nbytes)
    st.error, st.cancelled = error, cancelled
    return st


class StatusWords:
    """``Status.tomemory()``: five integers read from and written through to the status."""

    __slots__ = ("_st",)

    def __init__(self, st: Status) -> None:
        self._st = st

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int) -> int:
        st = self._st
        words = (st.nbytes & 0x7FFFFFFF, (st.nbytes >> 31) << 1 | int(bool(st.cancelled)), st.source, st.tag, st.error)
        return words[i]

    def __setitem__(self, i: int, value: int) -> None:
        st = self._st
        i = range(5)[i]  # negative indices; IndexError past the end
        if i == 0:
            st.nbytes = (st.nbytes & ~0x7FFFFFFF) | (int(value) & 0x7FFFFFFF)
        elif i == 1:
            st.nbytes = (st.nbytes & 0x7FFFFFFF) | (int(value) >> 1) << 31
            st.cancelled = bool(int(value) & 1)
        else:
            setattr(st, ("source", "tag", "error")[i - 2], int(value))

    def __iter__(self) -> Iterator[int]:
        return (self[i] for i in range(5))
