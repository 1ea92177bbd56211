"""Rank-side test cases: a registry, the per-rank context that records mismatches, and NumPy reference helpers."""

from __future__ import annotations

import fnmatch
import importlib
import os
import pkgutil
import traceback
import zlib
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

try:  # bfloat16 is optional on the reference side; pycoll supports it
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - the venv has ml_dtypes
    ml_dtypes = None
    BFLOAT16 = None

# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------

CASES: Dict[str, Callable] = {}
_LOADED = False

#: modules holding cases; the case id is "<module>.<function name without a leading case_>"
MODULES = (
    "reduce",
    "repeated",
    "movement",
    "vector_zero",
    "nonblocking",
    "large",
    "specs",
    "objects",
    "p2p",
    "comm_mgmt",
    "comm_groups",
    "errors",
    "topology",
    "device",
    "cuda_ipc",
    "scan",
    "shapes",
    "resized",
    "user_ops",
    "alltoallw",
    "reproducible",
    "placement",
)


def case(fn: Callable) -> Callable:
    """Register ``fn(ctx)`` as a case named ``<module>.<name>``."""
    module = fn.__module__.rsplit(".", 1)[-1]
    name = fn.__name__
    if name.startswith("case_"):
        name = name[len("case_"):]
    cid = f"{module}.{name}"
    if cid in CASES:
        raise ValueError(f"case {cid} registered twice")
    fn.case_id = cid
    CASES[cid] = fn
    return fn


def load_all() -> Dict[str, Callable]:
    """Import every case module once and return the registry (ids in definition order)."""
    global _LOADED
    if not _LOADED:
        for mod in MODULES:
            importlib.import_module(f"{__name__}.{mod}")
        _LOADED = True
    return CASES


def resolve(patterns: Sequence[str]) -> List[str]:
    """Expand case ids and fnmatch patterns (``reduce.*``) to ids, keeping order and dropping repeats."""
    load_all()
    out: List[str] = []
    for pat in patterns:
        hits = [cid for cid in CASES if fnmatch.fnmatchcase(cid, pat)]
        if not hits:
            raise KeyError(f"no case matches {pat!r}; known: {', '.join(CASES)}")
        for cid in hits:
            if cid not in out:
                out.append(cid)
    return out


# --------------------------------------------------------------------------------------------
# dtypes and ops
# --------------------------------------------------------------------------------------------

INT_DTYPES = [np.dtype(t) for t in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")]
FLOAT_DTYPES = [np.dtype("float16")] + ([BFLOAT16] if BFLOAT16 is not None else []) + [
    np.dtype("float32"),
    np.dtype("float64"),
]
COMPLEX_DTYPES = [np.dtype("complex64"), np.dtype("complex128")]
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES + COMPLEX_DTYPES

OPS = ("SUM", "PROD", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR")

#: counts every collective runs over; the 2**20+3 count lives in the ``large`` module (see there)
COUNTS = (0, 1, 7, 1000)
LARGE = 2**20 + 3

#: MPI datatype name for each dtype, as used in explicit buffer specs
MPI_TYPE_NAMES = {
    "float32": "FLOAT",
    "float64": "DOUBLE",
    "int8": "INT8_T",
    "int16": "INT16_T",
    "int32": "INT32_T",
    "int64": "INT64_T",
    "uint8": "UINT8_T",
    "uint16": "UINT16_T",
    "uint32": "UINT32_T",
    "uint64": "UINT64_T",
    "complex64": "C_FLOAT_COMPLEX",
    "complex128": "C_DOUBLE_COMPLEX",
}


def dname(dt: np.dtype) -> str:
    return np.dtype(dt).name


def is_int(dt) -> bool:
    return np.dtype(dt) in INT_DTYPES


def is_complex(dt) -> bool:
    return np.dtype(dt).kind == "c"


def is_float(dt) -> bool:
    return not is_int(dt) and not is_complex(dt)


def op_valid(op: str, dt) -> bool:
    """pycoll's (and MPI's) op/dtype rules: AVG floats+complex, bitwise ints only, MIN/MAX not complex."""
    if op in ("BAND", "BOR", "BXOR"):
        return is_int(dt)
    if op == "AVG":
        return not is_int(dt)
    if op in ("MIN", "MAX"):
        return not is_complex(dt)
    return True


def valid_pairs(ops=OPS, dtypes=None):
    """Every valid (op, dtype) pair, ops outer."""
    dtypes = ALL_DTYPES if dtypes is None else dtypes
    return [(op, dt) for op in ops for dt in dtypes if op_valid(op, dt)]


# --------------------------------------------------------------------------------------------
# deterministic data
# --------------------------------------------------------------------------------------------


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0xFFFFFFFF


def make_data(dt, count: int, rank: int, *salt, op: str = "SUM") -> np.ndarray:
    """Rank-dependent data, identical on every rank that asks for it, exact under the op.

    Small integers keep SUM and PROD exact even in float16/bfloat16 for up to 5 ranks;
    bitwise ops get full-range integers.
    """
    dt = np.dtype(dt)
    rng = np.random.default_rng(seed_of(dname(dt), count, rank, op, *salt))
    if op in ("BAND", "BOR", "BXOR"):
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=count, dtype=dt, endpoint=True)
    if op == "PROD":
        # |product of 5| <= 32 (real) / <= 8**2.5 (complex): exact and no overflow anywhere
        choices = np.array([1, 2], np.int64) if dt.kind == "u" else np.array([-1, 1, 2], np.int64)
        vals = rng.choice(choices, size=count)
        if is_complex(dt):
            im = rng.choice(np.array([-1, 0, 1]), size=count)
            return (vals + 1j * im).astype(dt)
        return vals.astype(dt)
    lo, hi = (0, 9) if dt.kind == "u" else (-4, 5)
    vals = rng.integers(lo, hi, size=count)
    if is_complex(dt):
        return (vals + 1j * rng.integers(-4, 5, size=count)).astype(dt)
    return vals.astype(dt)


def wide(dt):
    """The exact wide type NumPy references are computed in."""
    dt = np.dtype(dt)
    if is_complex(dt):
        return np.complex128
    if is_int(dt):
        return np.uint64 if dt.kind == "u" else np.int64
    return np.float64


def reduce_ref(op: str, arrays: Sequence[np.ndarray], dt) -> np.ndarray:
    """The reduction of ``arrays`` under ``op`` in ``dt`` (exact for make_data inputs; AVG rounded once)."""
    dt = np.dtype(dt)
    if op in ("BAND", "BOR", "BXOR"):
        fn = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op]
        return fn.reduce(np.stack(arrays), axis=0).astype(dt)
    stack = np.stack([np.asarray(a).astype(wide(dt)) for a in arrays]) if len(arrays) else None
    if op == "SUM":
        res = stack.sum(axis=0)
    elif op == "PROD":
        res = stack.prod(axis=0)
    elif op == "MIN":
        res = stack.min(axis=0)
    elif op == "MAX":
        res = stack.max(axis=0)
    elif op == "AVG":
        res = stack.sum(axis=0) / len(arrays)
    else:  # pragma: no cover
        raise ValueError(op)
    return res.astype(dt)


def tolerance(op: str, dt):
    """(rtol, atol) for comparing a result of ``op`` in ``dt``: exact except AVG."""
    if op != "AVG":
        return 0.0, 0.0
    dt = np.dtype(dt)
    if dt == np.float16 or (BFLOAT16 is not None and dt == BFLOAT16):
        return 2e-2, 2e-2
    if dt in (np.float32, np.complex64):
        return 1e-5, 1e-5
    return 1e-12, 1e-12


class Env:
    """Environment variables set alike on every rank for the body of a ``with`` (None: unset), then restored:
    pycoll reads its knobs (PYCOLL_ALGO, ...) at every call."""

    def __init__(self, **values: Optional[str]) -> None:
        self.values = values

    def __enter__(self) -> "Env":
        self.saved = {k: os.environ.get(k) for k in self.values}
        for k, v in self.values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        return self

    def __exit__(self, *exc: object) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def sentinel(dt, count: int) -> np.ndarray:
    """A fill value that no case produces (marks elements that must stay untouched)."""
    dt = np.dtype(dt)
    if is_int(dt):
        return np.full(count, 99 if dt.itemsize == 1 and dt.kind == "i" else 77, dt)
    return np.full(count, -77, dt)


# --------------------------------------------------------------------------------------------
# the per-rank context
# --------------------------------------------------------------------------------------------


class SkipCase(Exception):
    """Raised by ctx.skip(): the case does not apply (too few ranks, API absent)."""


def _fmt(v) -> str:
    try:
        if isinstance(v, np.generic):
            v = v.item()
    except Exception:  # pragma: no cover
        pass
    s = repr(v)
    return s if len(s) <= 200 else s[:200] + "..."


class Ctx:
    """What a case gets: the MPI module, the world comm, and ways to record checks."""

    MAX_FAILURES_PER_CASE = 25

    def __init__(self, MPI, comm, impl: str, seed: int = 1234, out_dir: Optional[str] = None):
        self.MPI = MPI
        self.comm = comm
        self.impl = impl
        self.seed = seed
        self.out_dir = out_dir
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.case_id = "?"
        self.failures: List[dict] = []
        self.notes: List[str] = []
        self.records: Dict[str, object] = {}
        self.checks = 0
        self._case_failures = 0
        self.flush: Callable[[], None] = lambda: None  # rank_main replaces it: writes the JSON now

    # -- bookkeeping ------------------------------------------------------------------------
    def begin(self, cid: str) -> None:
        self.case_id = cid
        self._case_failures = 0

    def fail(self, label: str, message: str, index=None, expected=None, got=None) -> None:
        self._case_failures += 1
        if self._case_failures > self.MAX_FAILURES_PER_CASE:
            return
        self.failures.append(
            {
                "case": self.case_id,
                "rank": self.rank,
                "check": label,
                "message": message,
                "index": index,
                "expected": None if expected is None else _fmt(expected),
                "got": None if got is None else _fmt(got),
            }
        )

    def note(self, text: str) -> None:
        """A remark for the report (an optional API that is absent, ...), not a failure."""
        line = f"{self.case_id}: {text}"
        if line not in self.notes:
            self.notes.append(line)

    def record(self, key: str, value) -> None:
        """Store a JSON-able fact for the pytest side (cross-rank assertions)."""
        self.records[f"{self.case_id}:{key}"] = value

    def skip(self, reason: str):
        raise SkipCase(reason)

    # -- checks -----------------------------------------------------------------------------
    def expect(self, cond: bool, label: str, message: str = "condition is false", expected=None, got=None) -> bool:
        self.checks += 1
        if not cond:
            self.fail(label, message, expected=expected, got=got)
        return bool(cond)

    def check(self, label: str, got, expected, rtol: float = 0.0, atol: float = 0.0) -> bool:
        """Compare arrays: same shape and dtype, values equal (or close with rtol/atol)."""
        self.checks += 1
        got_a = np.asarray(got)
        exp_a = np.asarray(expected)
        if got_a.dtype != exp_a.dtype:
            self.fail(label, "dtype differs", expected=str(exp_a.dtype), got=str(got_a.dtype))
            return False
        if got_a.shape != exp_a.shape:
            self.fail(label, "shape differs", expected=exp_a.shape, got=got_a.shape)
            return False
        if got_a.size == 0:
            return True
        g = got_a.astype(wide(got_a.dtype)) if got_a.dtype.kind in "fcV" or got_a.dtype == BFLOAT16 else got_a
        e = exp_a.astype(wide(exp_a.dtype)) if exp_a.dtype.kind in "fcV" or exp_a.dtype == BFLOAT16 else exp_a
        if rtol or atol:
            ok = np.isclose(g, e, rtol=rtol, atol=atol)
        else:
            ok = (g == e) | ((g != g) & (e != e))
        if bool(np.all(ok)):
            return True
        bad = np.flatnonzero(~np.asarray(ok).reshape(-1))
        i = int(bad[0])
        self.fail(
            label,
            f"{bad.size} of {got_a.size} elements differ (dtype {got_a.dtype}); first at flat index {i}",
            index=i,
            expected=exp_a.reshape(-1)[i],
            got=got_a.reshape(-1)[i],
        )
        return False

    def check_equal(self, label: str, got, expected) -> bool:
        """Compare plain Python values with ==."""
        self.checks += 1
        try:
            ok = bool(got == expected)
        except Exception as exc:  # noqa: BLE001
            self.fail(label, f"comparison raised {exc!r}", expected=expected, got=got)
            return False
        if not ok:
            self.fail(label, "values differ", expected=expected, got=got)
        return ok

    def raises(self, label: str, classes, fn, *args, **kwargs):
        """Call fn; expect an exception of ``classes``; return it (or None after recording a failure)."""
        self.checks += 1
        try:
            fn(*args, **kwargs)
        except classes as exc:
            return exc
        except Exception as exc:  # noqa: BLE001
            want = ", ".join(c.__name__ for c in (classes if isinstance(classes, tuple) else (classes,)))
            self.fail(label, f"raised {type(exc).__name__} instead of {want}: {exc}\n{traceback.format_exc()}")
            return None
        want = ", ".join(c.__name__ for c in (classes if isinstance(classes, tuple) else (classes,)))
        self.fail(label, f"no exception raised (expected {want})")
        return None

    # -- helpers ----------------------------------------------------------------------------
    def op(self, name: str):
        return getattr(self.MPI, name)

    def supports(self, op: Optional[str] = None, dt=None) -> bool:
        """Whether the implementation under test handles op/dtype (mpi4py: no AVG, no bfloat16)."""
        if self.impl == "mpi4py":
            if op == "AVG":
                return False
            if dt is not None and BFLOAT16 is not None and np.dtype(dt) == BFLOAT16:
                return False
        return True

    def pairs(self, ops=OPS, dtypes=None):
        return [(op, dt) for op, dt in valid_pairs(ops, dtypes) if self.supports(op, dt)]

    def dtypes(self, dtypes=None):
        return [dt for dt in (ALL_DTYPES if dtypes is None else dtypes) if self.supports(None, dt)]

    def data(self, dt, count, rank, *salt, op="SUM"):
        return make_data(dt, count, rank, self.case_id, *salt, op=op)

    def vspec(self, buf, counts, displs, mtype=None):
        """A vector buffer spec: pycoll's documented [buf, counts, displs(, TYPE)]; mpi4py's [buf, (counts, displs)(, TYPE)]."""
        if self.impl == "mpi4py" and mtype is None:
            return [buf, (list(counts), list(displs))]
        return [buf, counts, displs] if mtype is None else [buf, counts, displs, mtype]

    def require(self, name: str, obj=None):
        """Skip (with a note) when the comm / MPI module lacks an optional API."""
        target = self.comm if obj is None else obj
        if not hasattr(target, name):
            self.note(f"{name} not available; skipped")
            self.skip(f"{name} not available")
        return getattr(target, name)
