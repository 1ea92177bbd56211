"""Compiled arena calls: small collectives, Barrier, and the staged algorithms' chunk loops, each one kernel call.

The kernels are the ahead-of-time build (``pycoll.native``, made at install or by ``pycoll warmup``), ready at a
job's first call. Without a build that matches the sources (or with ``PYCOLL_KERNELS=jit``) they are Numba's JIT:
they load in a background thread of lowered priority from Numba's disk cache, started by a communicator's 8th
repeated call that could run compiled or by point-to-point traffic, and calls run on the Python path until their
signatures are in. The eager point-to-point kernels (``pycoll.p2p_kernels``) load first.

The kernels speak the Python paths' protocols word for word (``shared.oneshot_post``/``oneshot_rest``,
the staged pipes), so a rank on the compiled path meets a rank on the Python path. Flags are read with acquire loads and written with release stores,
so the compiler can neither hoist a spin-loop read nor sink a slot write below its flag. Numba is
optional: without it, or for dtypes it does not reduce (float16, bfloat16), the Python path runs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from .. import native
from .. import ops as _ops
from ..config import bool_param, param
from ..transport import arena as _arena
from . import cost

log = logging.getLogger("pycoll")

ARENA_JIT = bool_param(
    "PYCOLL_ARENA_JIT", True, "Set to 0 to run the arena's loops (small Allreduce, Barrier, the staged chunk loops) in Python instead of compiled code (Numba)."
)

ARENA_JIT_AFTER = param(
    "PYCOLL_ARENA_JIT_AFTER", 0, int,
    "Arena calls a communicator makes in Python before it uses the compiled path, once loaded (default 0).",
)
ARENA_JIT_NICE = param(
    "PYCOLL_ARENA_JIT_NICE", 10, int,
    "Nice value of the thread that loads the compiled kernels in the background (default 10). Higher starves it "
    "while the ranks spin (at 19 a busy point-to-point loop waited 4-5 s for it, at 0 0.75 s, at 10 1.2-1.4 s); "
    "lower lets it take the cores and the interpreter lock from the calls it serves.",
)
ARENA_JIT_LOAD = param(
    "PYCOLL_ARENA_JIT_LOAD", "background", str,
    "How the compiled kernels load: `background` (a low-priority thread started by the 8th repeated call that could "
    "run compiled; calls run in Python until every kernel is in, so none waits) or `now` (each single-host "
    "communicator's creation waits for them).",
)

# Return codes of ``meet``; WAKE is or'ed in when a peer sleeps on the doorbell and needs a futex wake.
DONE, WAITING, MISMATCH, WAKE = 0, 1, 2, 4
UNPOSTED = 16  # with WAITING, from the slots kernels: nothing packed or posted (peers not done with the call two back)


def _sched_yield_address() -> int:
    """libc's sched_yield, which the kernels call by address while ranks outnumber cores (0: none here)."""
    import ctypes

    try:
        return int(ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value or 0)
    except (AttributeError, OSError):
        return 0


SCHED_YIELD = _sched_yield_address()
ARENA_FAMILIES = ("arena", "staged")  # the ahead-of-time families of this module's kernels
YIELDS = 200  # sched_yield rounds a kernel spends waiting for late peers while ranks outnumber cores
# The cma kernel besides: LEFT (this rank is done, peers still use its memory), FAILED (or'ed in: a
# cross-memory copy failed).
LEFT, FAILED = 3, 8
# Dtypes the compiled reduction covers: the rest stay on the Python path.
DTYPES = frozenset(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float32, np.float64, np.complex64, np.complex128,
))


_LOAD_AFTER_CALLS = 8  # calls that could run compiled before one starts the background load


def covers(op: _ops.Op, dtype: np.dtype) -> bool:
    """Whether the kernels give NumPy's exact bits for ``op`` on ``dtype``; complex PROD is left to NumPy,
    whose vector loops may fuse its multiply-adds. Ops the kernels do not know (MAXLOC, user-defined) never run
    there, nor do the value-index pairs."""
    return op.kernel and dtype in DTYPES and not (dtype.kind == "c" and op is _ops.PROD)


_kernels: Any = None  # the compiled functions, once loaded
_unavailable: Optional[str] = None
_ns_per_poll = 0.0
_warm = threading.Event()  # set once every kernel signature is loaded (or compiled) and the poll rate measured
_p2p_warm = threading.Event()  # set once the point-to-point kernels are (they load first)
_loader: Optional[threading.Thread] = None
_loader_lock = threading.RLock()


def unavailable() -> Optional[str]:
    """None if the compiled path can run here, else why not (Numba missing or disabled)."""
    if not ARENA_JIT.get():
        return "PYCOLL_ARENA_JIT=0"
    if native.load_together(ARENA_FAMILIES) is not None:
        return None
    _load()
    return _unavailable


def kernels() -> Any:
    """The arena kernels: the ahead-of-time build where one matches, else Numba's (possibly still loading)."""
    built = native.load_together(ARENA_FAMILIES)
    if built is not None:
        return built
    _load()
    return _kernels


def pick(kern: Any, name: str, dtype: Any = None, checked: bool = False) -> Any:
    """Kernel ``name`` of ``kern`` (the ahead-of-time set or Numba's module) for buffers of ``dtype``: unless
    ``checked``, the bare compiled export, for callers whose buffers were checked when their plan was made (the
    right dtype, one dimension, C order); ``checked``, one that refuses others (TypeError), as Numba's dispatcher
    does."""
    if isinstance(kern, native.KernelSet):
        return kern.fast(name, dtype) if checked else kern.raw(name, dtype)
    return getattr(kern, name)


def prebuilt() -> bool:
    """Whether both kernel families run from the ahead-of-time build (nothing to load in the background)."""
    return ARENA_JIT.get() and native.load_together(ARENA_FAMILIES) is not None and native.load("p2p") is not None


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


def warm_up() -> Optional[str]:
    """Load (from Numba's disk cache, else compile) every kernel signature the arena paths call, now; None, or why
    the compiled path cannot run here. ``pycoll warmup`` runs this at install time so no job ever compiles."""
    with _loader_lock:  # one load per process, whichever thread asks first; the others wait for it
        return _warm_up_locked()


def _warm_up_locked() -> Optional[str]:
    if _warm.is_set():
        return _unavailable
    _check_stop()
    why = unavailable() if ARENA_JIT.get() else "PYCOLL_ARENA_JIT=0"
    if why is None and prebuilt():
        polls_for(0.0)
    elif why is None:
        _load()
        if _unavailable is not None:
            _warm.set()
            return _unavailable
        import warnings

        from . import _arena_signatures

        with warnings.catch_warnings():  # Numba's internal pedantic IR checks, not faults of these kernels
            warnings.filterwarnings("ignore", message="variable .* is not in scope")
            from .. import p2p_kernels  # noqa: F401  # few and small: first, so point-to-point goes compiled soonest

            _p2p_warm.set()
            _arena_signatures.load_all(_kernels, _check_stop)
        polls_for(0.0)
    _warm.set()
    return why


def load_in_background() -> None:
    """Start loading the kernels in a thread (once per process); calls run in Python until it finishes.

    At interpreter exit the thread is told to stop after the signature in hand and is waited for: LLVM must not be
    loading code while the interpreter tears itself (and LLVM's globals) down.
    """
    global _loader
    if _warm.is_set() or not ARENA_JIT.get():
        return
    if _loader is None:
        try:
            threading._register_atexit(_stop_loading)  # type: ignore[attr-defined]  # before threads are joined
        except (AttributeError, RuntimeError):  # no such hook, or the interpreter is already exiting: load nothing
            return
        _loader = threading.Thread(target=_load_quietly, name="pycoll-kernels", daemon=False)
        _loader.start()


class _Stopped(Exception):
    """The interpreter is exiting: the background load stops between two signatures."""


_stopping = threading.Event()


def _stop_loading() -> None:
    _stopping.set()
    if _loader is not None:
        _loader.join()


def _check_stop() -> None:
    if _stopping.is_set():
        raise _Stopped()


def prepare_first_calls(host_ranks: Optional[int]) -> None:
    """Do in a thread, once per process, what a job's first calls would otherwise do: read the
    CPU's cache size for the cost model and, where ``host_ranks`` ranks share this host (None: not known yet; a
    later call may say), load the ahead-of-time kernels and measure the poll rate. The runtime starts it while its
    rendezvous waits for the job's ranks. It keeps the rank's priority: a first call that finds it loading waits for
    it (``native``'s lock), and a lowered one could then be starved by the peers' spins (a few ms of work, where
    Numba's JIT takes seconds). Where no build matches the sources Numba's JIT keeps its own later start
    (``load_in_background``)."""
    work: list[Callable[[], Any]] = []
    if "cache" not in _prepared:
        _prepared.add("cache")
        work.append(cost.last_level_cache)
    if (host_ranks or 0) > 1 and "kernels" not in _prepared:  # (``prebuilt`` says no, quickly, where they are off)
        _prepared.add("kernels")
        work.append(_load_built)
    if work:
        threading.Thread(target=_prepare_quietly, args=(work,), name="pycoll-first-calls", daemon=False).start()


_prepared: set[str] = set()


def _load_built() -> None:
    if prebuilt():
        polls_for(0.0)


def _prepare_quietly(work: list[Callable[[], Any]]) -> None:
    for step in work:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - the first call does it again and says why
            log.debug("pycoll: preparing the first calls (%s) failed: %s", getattr(step, "__name__", step), exc)


def _load_quietly() -> None:
    try:  # a lowered CPU priority for this thread alone (Linux, PYCOLL_ARENA_JIT_NICE): the ranks come first
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ARENA_JIT_NICE.get())
    except (AttributeError, OSError):
        pass
    try:
        warm_up()
    except _Stopped:
        return
    except Exception as exc:  # noqa: BLE001 - a failed load leaves the Python path on; say why once
        global _unavailable
        _unavailable = f"loading the kernels failed ({type(exc).__name__}: {exc})"
        log.warning("pycoll: compiled arena path off: %s", _unavailable)
        _warm.set()


def ready() -> bool:
    """Whether the kernels are loaded (never waits)."""
    if prebuilt():
        return True
    return _warm.is_set() and _kernels is not None and _unavailable is None


def p2p_kernels(start: bool = True) -> Any:
    """The eager point-to-point kernels (``pycoll.p2p_kernels``) once loaded, None while they load (or, unless
    ``start``, before anything started their load; ``start`` starts it in the background), False where they cannot
    run. Never waits."""
    if not ARENA_JIT.get():
        return False
    built = native.load("p2p")
    if built is not None:
        return built
    if _p2p_warm.is_set():
        from .. import p2p_kernels

        return p2p_kernels
    if not _warm.is_set():
        if start:
            load_in_background()
        return None
    return False  # the load ended without them


def polls_for(seconds: float) -> int:
    """How many flag polls of ``meet``'s spin take about ``seconds`` here (measured once per process)."""
    global _ns_per_poll
    if not _ns_per_poll:
        k = kernels()
        probe = np.zeros(_arena.HostArena.ctrl(1) + 64, np.uint64)  # a private copy: nobody posts in it
        bases = np.array([_arena.HostArena.ctrl(0) + 16, _arena.HostArena.ctrl(0) + 16], np.int64)
        k.spin(probe, bases, 1, 1000)  # compile or load before timing
        n, best = 5_000, float("inf")
        for _ in range(3):  # the fastest of three: a round the scheduler interrupted reads slow
            t0 = time.perf_counter()
            k.spin(probe, bases, 1, n)
            best = min(best, time.perf_counter() - t0)
        _ns_per_poll = max(best * 1e9 / n, 0.1)
    return max(int(seconds * 1e9 / _ns_per_poll), 1)


def sig_words(sig: Any) -> tuple[int, int, int, int]:
    """A call's signature (``p2p_protocol.Sig``) as the four words it posts on the arena: kind, dtype and op packed in one."""
    return (sig.kind | (sig.dtype << 8) | (sig.op << 16), sig.root, sig.count, sig.vhash)


def sig_array(words: tuple[int, int, int, int]) -> np.ndarray:
    """A call's four posted signature words, as the kernels take them, and the fourth again (word 4): the kernels
    that take a call number fold it into word 3 from there."""
    return np.array(list(words) + [words[3]], np.uint64)


class Prepared:
    """One planned Allreduce's kernel arguments on one arena: its signature words and views per slot parity.

    ``ok`` is False when the compiled path cannot reduce the dtype. Kept by the plan, so repeated calls skip lookups.
    """

    __slots__ = ("arena", "sig", "words", "code", "views", "ok", "kernel", "raw")

    def __init__(self, arena: _arena.HostArena, sig: Any, op: _ops.Op, dtype: np.dtype, count: int,
                 kern: Any = None) -> None:
        self.arena = arena
        self.words = sig_words(sig)
        self.sig = sig_array(self.words)
        self.code = op.code
        self.ok = covers(op, dtype)
        rows = slot_array(arena, dtype) if self.ok else None  # every slot index: the kernel picks the call's
        self.views = [(rows, line_bases(arena, k)) for k in range(_arena.DEPTH)] if self.ok else []
        ok = self.ok and kern is not None
        self.kernel = pick(kern, "allreduce", dtype, checked=True) if ok else None  # checks the user buffers
        self.raw = pick(kern, "allreduce", dtype) if ok else None  # trusts them (the plan checked them)


def line_bases(arena: _arena.HostArena, op: int) -> np.ndarray:
    """Every rank's post-line word index for operations of ``op``'s parity (made once per arena and parity: a new
    call shape's plan takes it again; never written)."""
    return arena.kept(("line bases", op % _arena.DEPTH),
                      lambda: np.array([arena.line(r, op) for r in range(arena.size)], np.int64))


def every_line_base(arena: _arena.HostArena) -> np.ndarray:
    """``line_bases`` of every parity, one row each (made once per arena; never written)."""
    return arena.kept(("line bases", "every"),
                      lambda: np.array([line_bases(arena, k) for k in range(_arena.DEPTH)], np.int64))


def slot_array(arena: _arena.HostArena, dtype: np.dtype) -> np.ndarray:
    """Every rank's slots as one C-contiguous (ranks, DEPTH, slot) array of ``dtype`` (made once per arena and
    dtype)."""
    return arena.kept(("slot array", dtype), lambda: np.ndarray(
        (arena.size, _arena.DEPTH, arena.slot_bytes // dtype.itemsize), dtype, buffer=arena.mapping,
        offset=arena.slot_offset(0, 0)))


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

    __slots__ = ("calls", "kernels", "spin_s", "polls", "yields", "yield_fn", "inline", "_arena", "_bases")

    def __init__(self, spin_s: float, yields: int = 0) -> None:
        self.spin_s = spin_s  # how long an inline call spins for its peers before it waits as a schedule
        # then, where ranks outnumber cores, how many times it gives the core away (sched_yield) before it does
        self.yields = yields if SCHED_YIELD else 0
        self.yield_fn = SCHED_YIELD
        self.calls = 0
        self.inline = 0  # calls a kernel finished on its own (no schedule), for tests and debugging
        self.kernels: Any = None  # the kernel module once open, False once refused
        self.polls = 0
        self._arena: Optional[_arena.HostArena] = None
        self._bases: list[np.ndarray] = []

    def bases(self, arena: _arena.HostArena, op: int) -> np.ndarray:
        """``line_bases`` for ``op``, cached for the communicator's arena."""
        if self._arena is not arena:
            self._arena, self._bases = arena, [line_bases(arena, k) for k in range(_arena.DEPTH)]
        return self._bases[op % _arena.DEPTH]

    def open(self) -> Any:
        """The kernel module, or None while it is still loading (in the background: never waited for here), while
        the calls so far have not earned it (``PYCOLL_ARENA_JIT_AFTER``), or where it cannot run."""
        k = self.kernels
        if k is not None:
            return k or None
        self.calls += 1
        if self.calls <= ARENA_JIT_AFTER.get():
            return None
        if not ARENA_JIT.get():
            self.kernels = False
            return None
        built = native.load_together(ARENA_FAMILIES)
        if built is not None:
            self.polls = polls_for(self.spin_s)
            self.kernels = built
            return built
        if not _warm.is_set():  # the 8th call that could run compiled starts the load (a short job never does)
            if self.calls >= _LOAD_AFTER_CALLS:
                load_in_background()
            return None
        if not ready():
            self.kernels = False
            return None
        self.polls = polls_for(self.spin_s)
        self.kernels = _kernels
        return self.kernels
