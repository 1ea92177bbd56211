"""Point-to-point buffer specs resolved once: flat bytes per array by its identity (kept alive, within bounds) and
their length per array shape (a fresh array or view each call is found by its shape and never held)."""

from __future__ import annotations

import ctypes
import functools
import importlib
from typing import Any, Optional

import numpy as np

from .config import str_param
from .memory import DATA_FIELD, host_address

CALL_KEY = str_param(
    "PYCOLL_CALL_KEY", "auto",
    "How a collective call's shape key (the key of its cached plan) and a point-to-point call's buffer specs are "
    "looked up on every call, and how an eager Send, Isend or Irecv between ranks of one host moves its frame: "
    "`auto`, in C where `pycoll/_callkey.c` was compiled at install (about 0.2 µs a key against 1.1-1.6 µs, "
    "0.1-0.2 µs a spec against 0.2-0.6, an Irecv of a message already there 0.4-0.8 µs against 1.6-2.4), else in "
    "Python; `python`: always in Python. Read when pycoll is imported.",
)


_word_at = ctypes.c_size_t.from_address

# Resolved buffer specs by id(arr): (arr, count or None, datatype or None, arr's dtype then, flat bytes over it, their
# address, their length). An entry holds its array (so its id names nobody else while it is there); the entries and
# the bytes of the arrays they keep alive (their bases, each counted once) are bounded: past a bound, all are dropped.
_SPECS: dict = {}
_SPECS_MAX = 256
_PINNED_MAX = 256 << 20
_pinned: dict = {}  # id(base array) -> its bytes


def _spec_parts(buf: Any) -> Optional[tuple]:
    """(spec type, array, count or None, datatype or None) of ``[arr, count, datatype]`` (an int count),
    ``[arr, datatype]`` or a bare array; None for any other argument (resolved in full on every call)."""
    t = type(buf)
    if t is list or t is tuple:
        n = len(buf)
        if n == 3:
            obj, count, datatype = buf
            return (t, obj, count, datatype) if type(count) is int else None
        if n == 2:
            return t, buf[0], None, buf[1]
        return None
    if t is np.ndarray:
        return t, buf, None, None
    return None


def cached_spec_python(buf: Any, writable: bool) -> Optional[tuple]:
    """The cached resolution of a buffer spec: by the array's identity if it is still right for it (same object,
    count, datatype and dtype; writable for a receive), else by its shape (a fresh array or view per call, as
    programs pass them: what the call is, not which object); None if neither knows it. The entry's flat bytes
    (``flat_bytes_of``) are made only if asked for. ``cached_spec`` is its C form (``pycoll/_callkey.c``) where that
    was compiled: each spec of a small call spends its time here (0.1-0.2 µs in C, 0.2-0.6 in Python)."""
    t = type(buf)
    if t is list or t is tuple:
        n = len(buf)
        if n == 3:
            obj, count, datatype = buf
            if type(count) is not int:
                return None
        elif n == 2:
            obj, datatype = buf
            count = None
        else:
            return None
    elif t is np.ndarray:
        obj, count, datatype = buf, None, None
    else:
        return None
    if type(obj) is not np.ndarray:
        return None
    e = _SPECS.get(id(obj))
    if (e is not None and e[0] is obj and e[1] == count and e[2] is datatype and obj.dtype is e[3]
            and (not writable or obj.flags.writeable)):
        return e
    f = obj.flags
    if not f.c_contiguous:
        return None
    try:
        nbytes = _SHAPES.get((t, obj.shape, obj.dtype, f.writeable, count, datatype, writable))
    except TypeError:  # an unhashable datatype argument
        return None
    if nbytes is None:
        return None
    addr = (_word_at(id(obj) + DATA_FIELD).value if DATA_FIELD >= 0 else host_address(obj)) if nbytes else 0
    return (obj, count, datatype, obj.dtype, None, addr, nbytes)


def flat_bytes_of(e: tuple) -> np.ndarray:
    """An entry's flat bytes: kept where the full parse made them, else viewed over its array now."""
    got = e[4]
    if got is None:
        got = e[0].reshape(-1).view(_UINT8)[:e[6]]
    return got


# What a spec resolves to by its shape, for arrays seen before in other objects (a fresh array or view per call):
# (spec type, array shape, dtype, writable flag, count, datatype, a receive's) -> the length of the flat bytes, which
# start at the array's first byte. A spec whose bytes are not a prefix of its C-ordered array is never kept here.
_SHAPES: dict = {}
_SHAPES_MAX = 1024
_UINT8 = np.dtype(np.uint8)


def _shape_key(t: type, obj: Any, count: Any, datatype: Any, writable: bool) -> Optional[tuple]:
    """The shape key of a spec over a C-ordered array; None for other kinds."""
    if type(obj) is not np.ndarray:
        return None
    f = obj.flags
    if not f.c_contiguous:
        return None
    return (t, obj.shape, obj.dtype, f.writeable, count, datatype, writable)


def _remember_shape(key: Optional[tuple], obj: np.ndarray, arr: np.ndarray, addr: int) -> None:
    """Keep the length of a spec's flat bytes ``arr`` under its shape ``key`` where they are a prefix of its array
    ``obj``'s own memory."""
    if key is None or arr.dtype != _UINT8 or not arr.flags.c_contiguous:
        return
    if arr.nbytes and (not obj.nbytes or host_address(obj) != addr):
        return
    if len(_SHAPES) >= _SHAPES_MAX:
        _SHAPES.clear()
    try:
        _SHAPES[key] = arr.nbytes
    except TypeError:
        pass


def resolve_spec(comm: Any, buf: Any, opname: str, writable: bool) -> tuple:
    """Resolve ``buf`` by the communicator's full parse (its errors are the call's) and cache the result when it
    views the array's own memory."""
    arr = comm._p2p_buf(buf, opname, writable)
    parts = _spec_parts(buf)
    t, obj, count, datatype = parts if parts is not None else (None, None, None, None)
    addr = host_address(arr) if arr.nbytes else 0
    if type(obj) is not np.ndarray or not np.may_share_memory(obj, arr):
        return (None, None, None, None, arr, addr, arr.nbytes)  # a packed copy, another kind of buffer: used once
    _remember_shape(_shape_key(t, obj, count, datatype, writable), obj, arr, addr)
    entry = (obj, count, datatype, obj.dtype, arr, addr, arr.nbytes)
    _keep(obj, entry)
    return entry


def _keep(obj: np.ndarray, entry: tuple) -> None:
    """Cache ``entry`` under ``id(obj)``, within the bounds on entries and on the bytes they keep alive."""
    root = obj
    while type(root.base) is np.ndarray:
        root = root.base
    if id(root) not in _pinned:
        if len(_SPECS) >= _SPECS_MAX or sum(_pinned.values()) + root.nbytes > _PINNED_MAX:
            _SPECS.clear()
            _pinned.clear()
        _pinned[id(root)] = root.nbytes
    elif len(_SPECS) >= _SPECS_MAX:
        _SPECS.clear()
        _pinned.clear()
        _pinned[id(root)] = root.nbytes
    _SPECS[id(obj)] = entry


def call_key_module() -> Optional[Any]:
    """``pycoll._callkey`` (the C forms of the call key and of ``cached_spec_python``), or None where it was not
    built (an install without a compiler) or PYCOLL_CALL_KEY=python says not to use it."""
    if CALL_KEY.get() == "python":
        return None
    try:  # an extension module, absent where the install had no compiler
        return importlib.import_module("pycoll._callkey")
    except ImportError:
        return None


def spec_caches() -> tuple[dict, dict]:
    """The identity and shape caches ``cached_spec`` reads, which the C eager calls (``p2p_fast.eager_gate``) read
    too."""
    return _SPECS, _SHAPES


def _compiled_cached_spec() -> Optional[Any]:
    """``cached_spec_python``'s C form over this module's two caches, or None where it was not built."""
    _callkey = call_key_module()
    if _callkey is None or not hasattr(_callkey, "cached_spec"):  # none, or an older build
        return None
    return functools.partial(_callkey.cached_spec, _SPECS, _SHAPES)


cached_spec: Any = _compiled_cached_spec() or cached_spec_python
