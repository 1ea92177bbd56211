"""MPI.Info: ordered (key, value) string hints, with INFO_NULL, INFO_ENV and the mapping methods mpi4py gives them."""

from __future__ import annotations

import os
import platform
import socket
import sys
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from .errors import InfoError, InfoKeyError, InfoNoKeyError, InfoValueError

MAX_INFO_KEY = 255  # longest key, in characters (MPICH's MPI_MAX_INFO_KEY)
MAX_INFO_VAL = 1024  # longest value, in characters (MPICH's MPI_MAX_INFO_VAL)

# MPICH's error classes of the Info calls (what their errors' Get_error_class returns)
ERR_INFO, ERR_INFO_KEY, ERR_INFO_VALUE, ERR_INFO_NOKEY = (
    InfoError.ERROR_CLASS, InfoKeyError.ERROR_CLASS, InfoValueError.ERROR_CLASS, InfoNoKeyError.ERROR_CLASS)

_ENV_KEYS = ("command", "argv", "maxprocs", "soft", "host", "arch", "wdir", "file", "thread_level")


class _Table:
    """What every reference to one info object shares (``Info(info)`` makes another reference, equal to it)."""

    __slots__ = ("_items", "readonly", "_fill")

    def __init__(self, items: Optional[dict[str, str]] = None, readonly: bool = False,
                 fill: Optional[Callable[[], dict[str, str]]] = None) -> None:
        self._items: Optional[dict[str, str]] = {} if items is None else items  # None once freed
        self.readonly = readonly
        self._fill = fill  # INFO_ENV's contents, found on first use (the runtime may start after import)

    @property
    def items(self) -> Optional[dict[str, str]]:
        if self._fill is not None:
            fill, self._fill = self._fill, None
            self._items = fill()
        return self._items

    @items.setter
    def items(self, value: Optional[dict[str, str]]) -> None:
        self._items, self._fill = value, None


def _process_argv() -> list[str]:
    """This process's command line as the C program saw it: the interpreter, then its arguments."""
    argv = list(getattr(sys, "orig_argv", []) or [])
    return argv or [sys.executable or "python", *sys.argv]


def _env_items(args: Optional[Sequence[str]]) -> dict[str, str]:
    """The keys MPI defines for INFO_ENV: how this process was started and where it runs ("soft" and "file",
    which pycoll's launcher has no notion of, are left unset)."""
    from . import runtime

    argv = list(args) if args else _process_argv()
    rt = runtime.current()
    size = rt.size if rt is not None else int(os.environ.get("PYCOLL_SIZE", "1") or 1)
    return {
        "command": argv[0],
        "argv": " ".join(argv[1:]),
        "maxprocs": str(size),
        "host": socket.gethostname(),
        "arch": platform.machine(),
        "wdir": os.getcwd(),
        "thread_level": "MPI_THREAD_SERIALIZED",  # what MPI.Query_thread answers
    }


def _check_key(key: Any, op: str) -> str:
    if not isinstance(key, str):
        raise InfoKeyError(f"an info key is a str, not {type(key).__name__}", op=op)
    if not key or len(key) > MAX_INFO_KEY:
        raise InfoKeyError(f"info key {key[:40]!r}{'...' if len(key) > 40 else ''} has {len(key)} characters "
                           f"(1 to MPI.MAX_INFO_KEY={MAX_INFO_KEY})", op=op)
    return key


def _check_value(key: str, value: Any, op: str) -> str:
    if not isinstance(value, str):
        raise InfoValueError(f"the value of info key {key!r} is a str, not {type(value).__name__}", op=op)
    if len(value) > MAX_INFO_VAL:
        raise InfoValueError(f"the value of info key {key!r} has {len(value)} characters "
                             f"(at most MPI.MAX_INFO_VAL={MAX_INFO_VAL})", op=op)
    return value


def _pairs(items: Any, op: str) -> list[tuple[str, str]]:
    """(key, value) pairs from an Info, a mapping (anything with ``keys``) or an iterable of pairs, checked."""
    if hasattr(items, "keys"):
        pairs = [(k, items[k]) for k in items.keys()]
    else:
        try:
            pairs = list(items)
        except TypeError:
            raise TypeError(f"{op}: items must be an Info, a mapping or an iterable of (key, value) pairs, "
                            f"not {type(items).__name__}") from None
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise TypeError(f"{op}: expected (key, value) pairs, got {pair!r}")
    return [(k, _check_value(_check_key(k, op), v, op)) for k, v in pairs]


class Info:
    """An info object: string keys mapped to string values, kept in the order they were first set.

    ``Info()`` is a null info (equal to ``INFO_NULL``); ``Info(info)`` another reference to ``info``, sharing
    its contents and equal to it. ``Create`` makes a new one, ``Free`` releases it (it then equals INFO_NULL).
    Besides MPI's calls (Get returns None for a missing key), an Info acts as a mapping: ``info[key]``,
    ``len``, ``in``, iteration, ``get``, ``keys``/``values``/``items`` (lists), ``update``, ``pop``,
    ``popitem`` (the last key), ``copy``, ``clear``. On a null info the reading methods see an empty mapping
    and the writing ones raise KeyError, as in mpi4py. Bad keys or values, a null info given to an MPI call,
    or writing the read-only INFO_ENV raise ``InfoError`` and its subclasses (``InvalidArgumentError``).
    """

    __slots__ = ("_table",)
    __hash__ = None  # type: ignore[assignment]  # equality follows the shared, mutable contents

    def __init__(self, info: Optional["Info"] = None) -> None:
        if info is not None and not isinstance(info, Info):
            raise TypeError(f"Info() takes an Info to refer to, or nothing; got {type(info).__name__}")
        self._table: Optional[_Table] = info._table if info is not None and info else None

    # ---- identity ----------------------------------------------------------------------------------
    def _live(self, op: str) -> dict[str, str]:
        table = self._table
        if table is None or table.items is None:
            raise InfoError("the info is null (MPI.INFO_NULL, or freed)", op=op)
        return table.items

    def _writable(self, op: str) -> dict[str, str]:
        items = self._live(op)
        if self._table is not None and self._table.readonly:
            raise InfoError("MPI.INFO_ENV is predefined and read-only; Dup it to change a copy", op=op)
        return items

    def __bool__(self) -> bool:
        return self._table is not None and self._table.items is not None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Info):
            return NotImplemented
        if not self or not other:
            return not self and not other
        return self._table is other._table

    def __repr__(self) -> str:
        if self is INFO_NULL or self is INFO_ENV:
            return f"<pycoll.MPI.{'INFO_NULL' if self is INFO_NULL else 'INFO_ENV'}>"
        return f"<pycoll.MPI.Info {dict(self.items()) if self else 'null'}>"

    def __reduce__(self) -> Any:
        """INFO_NULL and INFO_ENV unpickle as themselves; another null info as a new null one, a reference to
        INFO_ENV as a new reference to it, any other info as a new info with the same items."""
        if self is INFO_NULL:
            return "INFO_NULL"
        if self is INFO_ENV:
            return "INFO_ENV"
        if not self:
            return (Info, ())
        if self._table is INFO_ENV._table:
            return (Info, (INFO_ENV,))
        return (_rebuild, (type(self), self.items()))

    # ---- MPI calls -----------------------------------------------------------------------------------
    @classmethod
    def Create(cls, items: Any = None) -> "Info":  # noqa: N802
        """A new info, empty or holding ``items``: an Info, a mapping, or an iterable of (key, value) pairs."""
        info = cls.__new__(cls)
        info._table = _Table(dict(_pairs(items, "Info.Create")) if items is not None else None)
        return info

    @classmethod
    def Create_env(cls, args: Optional[Sequence[str]] = None) -> "Info":  # noqa: N802
        """A new info with INFO_ENV's keys for a program started as ``args`` (a command, or a sequence of the
        command and its arguments; None or empty: this process's own command line)."""
        if isinstance(args, str):
            args = [args]
        elif args is not None:
            if not isinstance(args, (list, tuple)) or not all(isinstance(a, str) for a in args):
                raise TypeError(f"Info.Create_env: args must be a str or a sequence of str, not {args!r}")
        info = cls.__new__(cls)
        info._table = _Table(_env_items(args))
        return info

    def Free(self) -> None:  # noqa: N802
        """Release the info: this reference and every other to it become null (equal to INFO_NULL)."""
        self._live("Info.Free")
        if self._table is not None and self._table.readonly:
            raise InfoError("MPI.INFO_ENV is predefined and cannot be freed", op="Info.Free")
        self._table.items = None  # type: ignore[union-attr]
        self._table = None

    def free(self) -> None:
        """``Free`` unless null or predefined."""
        if self and not (self._table is not None and self._table.readonly):
            self.Free()

    def Dup(self) -> "Info":  # noqa: N802
        """A new info holding a copy of this one's items (not equal to it)."""
        items = self._live("Info.Dup")
        info = type(self).__new__(type(self))
        info._table = _Table(dict(items))
        return info

    def Get(self, key: str) -> Optional[str]:  # noqa: N802
        """The value of ``key``, or None if this info does not hold it."""
        items = self._live("Info.Get")
        return items.get(_check_key(key, "Info.Get"))

    def Set(self, key: str, value: str) -> None:  # noqa: N802
        """Store ``value`` under ``key`` (a key already held keeps its place in the order)."""
        items = self._writable("Info.Set")
        items[_check_key(key, "Info.Set")] = _check_value(key, value, "Info.Set")

    def Delete(self, key: str) -> None:  # noqa: N802
        """Remove ``key``; InfoNoKeyError if this info does not hold it."""
        items = self._writable("Info.Delete")
        if _check_key(key, "Info.Delete") not in items:
            raise InfoNoKeyError(f"the info holds no key {key!r}", op="Info.Delete")
        del items[key]

    def Get_nkeys(self) -> int:  # noqa: N802
        return len(self._live("Info.Get_nkeys"))

    def Get_nthkey(self, n: int) -> str:  # noqa: N802
        """The ``n``-th key (0-based), in the order keys were first set."""
        items = self._live("Info.Get_nthkey")
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < len(items):
            raise InfoKeyError(f"n={n!r} is not an index of the info's {len(items)} keys", op="Info.Get_nthkey")
        for i, key in enumerate(items):
            if i == n:
                return key
        raise AssertionError("unreachable")

    # ---- the mapping protocol ------------------------------------------------------------------------
    def _view(self) -> dict[str, str]:
        """The items, or an empty dict for a null info (the reading methods treat it as empty)."""
        return self._table.items if self else {}  # type: ignore[union-attr,return-value]

    def __len__(self) -> int:
        return len(self._view())

    def __contains__(self, key: object) -> bool:
        return key in self._view()

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __getitem__(self, key: str) -> str:
        value = self.Get(key) if self else None
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value: str) -> None:
        if not self:
            raise KeyError(key)
        self.Set(key, value)

    def __delitem__(self, key: str) -> None:
        if not self or key not in self:
            raise KeyError(key)
        self.Delete(key)

    def get(self, key: str, default: Optional[str] = None) -> Optional[str]:
        value = self.Get(key) if self else None
        return default if value is None else value

    def keys(self) -> list[str]:
        return list(self._view())

    def values(self) -> list[str]:
        return list(self._view().values())

    def items(self) -> list[tuple[str, str]]:
        return list(self._view().items())

    def update(self, items: Any = (), **kwds: str) -> None:
        """Set every (key, value) of ``items`` (an Info, a mapping or pairs), then of ``kwds``."""
        if not self:
            raise KeyError("update of a null info")
        self._writable("Info.update")
        for key, value in _pairs(items, "Info.update") + _pairs(kwds.items(), "Info.update"):
            self.Set(key, value)

    def pop(self, key: str, *default: str) -> str:
        if len(default) > 1:
            raise TypeError(f"pop expected at most 2 arguments, got {1 + len(default)}")
        value = self.Get(key) if self else None
        if value is not None:
            self.Delete(key)
            return value
        if default:
            return default[0]
        raise KeyError(key)

    def popitem(self) -> tuple[str, str]:
        """Remove and return the last (key, value)."""
        if not self or not len(self):
            raise KeyError("popitem of an empty info" if self else "popitem of a null info")
        key = self.Get_nthkey(len(self) - 1)
        value = self.Get(key)
        self.Delete(key)
        return key, value  # type: ignore[return-value]

    def copy(self) -> "Info":
        """A new info with the same items (a new null info for a null one)."""
        return self.Dup() if self else type(self)()

    def clear(self) -> None:
        """Remove every key (nothing to do on a null info)."""
        if self:
            self._writable("Info.clear").clear()


def _rebuild(cls: type, items: Iterable[tuple[str, str]]) -> Info:
    return cls.Create(list(items))


INFO_NULL = Info()
INFO_ENV = Info()
INFO_ENV._table = _Table(readonly=True, fill=lambda: _env_items(None))
