"""Compiled arena calls: small Allreduce and Barrier, and the staged algorithms' chunk loops, each one Numba call.

The kernels speak the Python paths' protocols word for word (``shared.oneshot_post``/``oneshot_rest``,
the staged pipes), so a rank on the compiled path meets a rank on the Python path. Flags are read with acquire loads and written with release stores,
so the compiler can neither hoist a spin-loop read nor sink a slot write below its flag. Numba is
optional: without it, or for dtypes it does not reduce (float16, bfloat16), the Python path runs.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import numpy as np

from .. import ops as _ops
from ..config import bool_param, param
from ..transport import arena as _arena

log = logging.getLogger("pycoll")

ARENA_JIT = bool_param(
    "PYCOLL_ARENA_JIT", True, "Set to 0 to run the arena's loops (small Allreduce, Barrier, the staged chunk loops) in Python instead of compiled code (Numba)."
)

ARENA_JIT_AFTER = param(
    "PYCOLL_ARENA_JIT_AFTER", 64, int,
    "Arena calls a communicator makes in Python before it loads the compiled path (0: from the first repeated call).",
)

# Return codes of ``meet``; WAKE is or'ed in when a peer sleeps on the doorbell and needs a futex wake.
DONE, WAITING, MISMATCH, WAKE = 0, 1, 2, 4
# Dtypes the compiled reduction covers: the rest stay on the Python path.
DTYPES = frozenset(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float32, np.float64, np.complex64, np.complex128,
))



def covers(op: _ops.Op, dtype: np.dtype) -> bool:
    """Whether the kernels give NumPy's exact bits for ``op`` on ``dtype``; complex PROD is left to NumPy,
    whose vector loops may fuse its multiply-adds."""
    return dtype in DTYPES and not (dtype.kind == "c" and op is _ops.PROD)


_kernels: Any = None  # the compiled functions, once loaded
_unavailable: Optional[str] = None
_ns_per_poll = 0.0


def unavailable() -> Optional[str]:
    """None if the compiled path can run here, else why not (Numba missing or disabled)."""
    if not ARENA_JIT.get():
        return "PYCOLL_ARENA_JIT=0"
    _load()
    return _unavailable


def kernels() -> Any:
    _load()
    return _kernels


def _load() -> None:
    global _kernels, _unavailable
    if _kernels is not None or _unavailable is not None:
        return
    try:
        from . import _arena_kernels
    except ImportError as exc:
        _unavailable = f"numba is not importable ({exc})"
        log.debug("pycoll: compiled arena path off: %s", _unavailable)
        return
    _kernels = _arena_kernels


def polls_for(seconds: float) -> int:
    """How many flag polls of ``meet``'s spin take about ``seconds`` here (measured once per process)."""
    global _ns_per_poll
    if not _ns_per_poll:
        k = kernels()
        probe = np.zeros(_arena.HostArena.ctrl(1) + 64, np.uint64)  # a private copy: nobody posts in it
        bases = np.array([_arena.HostArena.ctrl(0) + 16, _arena.HostArena.ctrl(0) + 16], np.int64)
        k.spin(probe, bases, 1, 1000)  # compile or load before timing
        n = 200_000
        t0 = time.perf_counter()
        k.spin(probe, bases, 1, n)
        _ns_per_poll = max((time.perf_counter() - t0) * 1e9 / n, 0.1)
    return max(int(seconds * 1e9 / _ns_per_poll), 1)


def sig_array(words: tuple[int, int, int, int]) -> np.ndarray:
    """A call's four posted signature words, as the kernels take them."""
    return np.array(words, np.uint64)


class Prepared:
    """One planned Allreduce's kernel arguments on one arena: its signature words and views per slot parity.

    ``ok`` is False when the compiled path cannot reduce the dtype. Kept by the plan, so repeated calls skip lookups.
    """

    __slots__ = ("arena", "sig", "words", "code", "views", "ok")

    def __init__(self, arena: _arena.HostArena, sig: Any, op: _ops.Op, dtype: np.dtype, count: int) -> None:
        from .shared import sig_words

        self.arena = arena
        self.words = sig_words(sig)
        self.sig = sig_array(self.words)
        self.code = op.code
        self.ok = covers(op, dtype)
        self.views = [(slot_matrix(arena, k, count, dtype), line_bases(arena, k)) for k in (0, 1)] if self.ok else []



def line_bases(arena: _arena.HostArena, op: int) -> np.ndarray:
    """Every rank's post-line word index for operations of ``op``'s parity."""
    return np.array([arena.line(r, op) for r in range(arena.size)], np.int64)


def slot_matrix(arena: _arena.HostArena, op: int, count: int, dtype: np.dtype) -> np.ndarray:
    """All ranks' slots for ``op`` as one (ranks, count) array of ``dtype``: row r is rank r's slot."""
    return np.ndarray(
        (arena.size, count), dtype, buffer=arena.mapping, offset=arena.slot_offset(0, op),
        strides=(2 * arena.slot_bytes, dtype.itemsize),
    )


def finished(arena: _arena.HostArena, op: int, status: int, gate: Optional["Gate"] = None) -> bool:
    """Act on a kernel's status: wake sleepers if asked; True (and ``op`` marked finished) if it completed."""
    if status & WAKE:
        arena.bell.wake()
    if status & 3 == DONE:
        arena.finished = op
        if gate is not None:
            gate.inline += 1
        return True
    return False


class Gate:
    """Whether one communicator's small arena calls run compiled: after ``PYCOLL_ARENA_JIT_AFTER`` calls, if Numba loads."""

    __slots__ = ("calls", "kernels", "spin_s", "polls", "inline", "_arena", "_bases")

    def __init__(self, spin_s: float) -> None:
        self.spin_s = spin_s  # how long an inline call spins for its peers before it waits as a schedule
        self.calls = 0
        self.inline = 0  # calls a kernel finished on its own (no schedule), for tests and debugging
        self.kernels: Any = None  # the kernel module once open, False once refused
        self.polls = 0
        self._arena: Optional[_arena.HostArena] = None
        self._bases: list[np.ndarray] = []

    def bases(self, arena: _arena.HostArena, op: int) -> np.ndarray:
        """``line_bases`` for ``op``, cached for the communicator's arena."""
        if self._arena is not arena:
            self._arena, self._bases = arena, [line_bases(arena, 0), line_bases(arena, 1)]
        return self._bases[op & 1]

    def open(self) -> Any:
        """The kernel module, or None while the calls so far have not earned it (or it cannot run here)."""
        k = self.kernels
        if k is not None:
            return k or None
        self.calls += 1
        if self.calls <= ARENA_JIT_AFTER.get():
            return None
        why = unavailable()
        if why is not None:
            self.kernels = False
            return None
        self.polls = polls_for(self.spin_s)
        self.kernels = kernels()
        return self.kernels
