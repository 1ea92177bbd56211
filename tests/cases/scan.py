"""Prefix reductions (Scan, Exscan, their I-forms and object forms) checked bit for bit against NumPy left folds."""

from __future__ import annotations

import functools
import os

import numpy as np

from . import COUNTS, Env, case, dname, op_valid, seed_of, sentinel

DTYPES = [np.dtype(t) for t in ("float32", "float64", "int32", "int64", "uint8", "complex128")]
OPS = ("SUM", "PROD", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR")
UFUNCS = {"SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum, "AVG": np.add,
          "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}
ALGOS = ("linear", "doubling", "staged")


def _inputs(ctx, op, dt, count):
    """Every rank's input. Floats get random values, whose sums and products round: only a left fold in rank
    order gives the reference's bits. Integers get the shared exact data."""
    if dt.kind in "fc" and op in ("SUM", "PROD", "AVG", "MIN", "MAX"):
        out = []
        for r in range(ctx.size):
            rng = np.random.default_rng(seed_of(ctx.case_id, dname(dt), count, r, op))
            x = rng.standard_normal(count)
            if dt.kind == "c":
                x = x + 1j * rng.standard_normal(count)
            out.append(x.astype(dt))
        return out
    return [ctx.data(dt, count, r, op=op) for r in range(ctx.size)]


def prefix(op, xs, k, dt):
    """``functools.reduce(ufunc, xs[:k])`` in ``dt``; AVG divides by k as pycoll does (None for k == 0)."""
    if k == 0:
        return None
    res = functools.reduce(UFUNCS[op], xs[:k])
    if op == "AVG":
        res = np.divide(res, dt.type(k))
    return np.asarray(res, dt)


def _tol(ctx, op, dt):
    """Exact for pycoll; MPI libraries may reassociate float sums and products (recursive doubling)."""
    if ctx.impl == "pycoll" or dt.kind not in "fc":
        return 0.0, 0.0
    return (1e-4, 1e-4) if dt == np.float32 else (1e-10, 1e-10)


def _pairs(ctx):
    return [(op, dt) for op in OPS for dt in DTYPES if op_valid(op, dt) and ctx.supports(op, dt)]


def _Forced(algo, chunk="1K"):  # noqa: N802 - used as a context manager, like the class it was
    """PYCOLL_ALGO (and a small PYCOLL_CHUNK_SIZE, so the chain pipelines) for scan and exscan, set alike on every rank
    for the body of a ``with``; ``None`` leaves selection to the cost model."""
    return Env(PYCOLL_ALGO=f"scan:{algo},exscan:{algo}" if algo else None, PYCOLL_CHUNK_SIZE=chunk if algo else None,
               PYCOLL_ARENA_PIPE_CHUNK=chunk if algo == "staged" else None)


def _chosen(ctx):
    if ctx.impl != "pycoll":
        return None
    from pycoll.algorithms import last_choice

    return last_choice.algorithm


def _run_matrix(ctx, exclusive, algo, pairs=None, counts=COUNTS, chunk="1K"):
    """Scan or Exscan over every pair x count, in place and out of place, under ``algo`` (None: selection)."""
    comm, MPI, r = ctx.comm, ctx.MPI, ctx.rank
    name = "Exscan" if exclusive else "Scan"
    fn = comm.Exscan if exclusive else comm.Scan
    k = r if exclusive else r + 1
    with _Forced(algo, chunk):
        for op, dt in pairs or _pairs(ctx):
            for count in counts:
                xs = _inputs(ctx, op, dt, count)
                expected = prefix(op, xs, k, dt)
                rtol, atol = _tol(ctx, op, dt)
                for inplace in (False, True):
                    lab = f"{name} algo={algo or 'auto'} op={op} dtype={dt.name} count={count} " + (
                        "in-place" if inplace else "out-of-place")
                    mine = xs[r].copy()
                    if inplace:
                        fn(MPI.IN_PLACE, mine, op=ctx.op(op))
                        got, untouched = mine, xs[r]
                    else:
                        got, untouched = sentinel(dt, count), sentinel(dt, count)
                        fn(mine, got, op=ctx.op(op))
                        ctx.check(lab + " (sendbuf unchanged)", mine, xs[r])
                    if algo and ctx.impl == "pycoll" and ctx.size > 1:
                        ctx.check_equal(lab + " (algorithm)", _chosen(ctx), algo)
                    if expected is not None:
                        ctx.check(lab, got, expected, rtol, atol)
                    elif ctx.impl == "pycoll":  # Exscan at rank 0: MPI leaves recvbuf undefined; pycoll leaves it alone
                        ctx.check(lab + " (rank 0 recvbuf untouched)", got, untouched)


@case
def case_scan(ctx):
    """Scan: every valid op x dtype x count, in place and out of place, chosen by the cost model."""
    _run_matrix(ctx, False, None)


@case
def case_exscan(ctx):
    """Exscan: as Scan; rank 0's recvbuf must stay as it was."""
    _run_matrix(ctx, True, None)


def _forced(ctx, algo, chunk="1K"):
    if ctx.impl != "pycoll":
        ctx.skip("PYCOLL_ALGO is pycoll's")
    for exclusive in (False, True):
        _run_matrix(ctx, exclusive, algo, chunk=chunk)


@case
def case_forced_linear(ctx):
    """The whole matrix through the pipelined chain, in 1 KiB chunks (up to 16 per call)."""
    _forced(ctx, "linear")


@case
def case_forced_doubling(ctx):
    """The whole matrix through recursive doubling."""
    _forced(ctx, "doubling", chunk="4K")


@case
def case_forced_staged(ctx):
    """The whole matrix through the arena's chunk rings, in 1 KiB chunks per rank (PYCOLL_ARENA_PIPE_CHUNK: up to 16
    per call), compiled once the kernels are in, in NumPy before."""
    if ctx.size < 2 or os.environ.get("PYCOLL_SHM_DISABLE") == "1":
        ctx.skip("the staged algorithms need the arena of 2+ ranks")
    _forced(ctx, "staged")


@case
def case_nonblocking(ctx):
    """Iscan and Iexscan: several outstanding at once, completed out of order, under each algorithm."""
    comm, MPI, r = ctx.comm, ctx.MPI, ctx.rank
    algos = (None,) + (ALGOS if ctx.impl == "pycoll" else ())
    if ctx.size < 2 or os.environ.get("PYCOLL_SHM_DISABLE") == "1":
        algos = tuple(a for a in algos if a != "staged")  # no arena: it declines, with a warning
    for algo in algos:
        with _Forced(algo):
            for op, dt in (("SUM", np.dtype(np.float64)), ("PROD", np.dtype(np.complex128)), ("MAX", np.dtype(np.int32))):
                for count in (1, 1000):
                    xs = _inputs(ctx, op, dt, count)
                    rtol, atol = _tol(ctx, op, dt)
                    inc, exc = sentinel(dt, count), sentinel(dt, count)
                    inplace = xs[r].copy()
                    reqs = [comm.Iscan(xs[r], inc, op=ctx.op(op)), comm.Iexscan(xs[r], exc, op=ctx.op(op)),
                            comm.Iscan(MPI.IN_PLACE, inplace, op=ctx.op(op))]
                    for req in reversed(reqs):
                        req.Wait()
                    lab = f"I-forms algo={algo or 'auto'} op={op} dtype={dt.name} count={count}"
                    ctx.check(lab + " Iscan", inc, prefix(op, xs, r + 1, dt), rtol, atol)
                    ctx.check(lab + " Iscan in place", inplace, prefix(op, xs, r + 1, dt), rtol, atol)
                    if r > 0:
                        ctx.check(lab + " Iexscan", exc, prefix(op, xs, r, dt), rtol, atol)
                    elif ctx.impl == "pycoll":
                        ctx.check(lab + " Iexscan rank 0 untouched", exc, sentinel(dt, count))


@case
def case_errors(ctx):
    """Wrong arguments raise InvalidArgumentError naming the call on every rank; the communicator stays usable."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll error semantics")
    from pycoll.errors import InvalidArgumentError

    comm, MPI = ctx.comm, ctx.MPI
    f32, f64 = np.ones(4, np.float32), np.zeros(4, np.float64)
    bad = [
        ("Scan", "dtype", lambda: comm.Scan(f32, f64), "float32"),
        ("Exscan", "dtype", lambda: comm.Exscan(f32, f64), "float32"),
        ("Iscan", "dtype", lambda: comm.Iscan(f32, f64), "float32"),
        ("Iexscan", "dtype", lambda: comm.Iexscan(f32, f64), "float32"),
        ("Scan", "count", lambda: comm.Scan(np.ones(3, np.float64), f64), "elements"),
        ("Exscan", "AVG on ints", lambda: comm.Exscan(np.ones(4, np.int32), np.zeros(4, np.int32), op=MPI.AVG), "AVG"),
        ("Scan", "MIN on complex", lambda: comm.Scan(MPI.IN_PLACE, np.ones(4, np.complex128), op=MPI.MIN), "MIN"),
    ]
    for opname, what, fn, word in bad:
        lab = f"{opname} {what}"
        exc = ctx.raises(lab, InvalidArgumentError, fn)
        if exc is not None:
            ctx.expect(bool(exc.op) and exc.op.startswith(opname + " "), lab + ": .op", f".op does not name {opname}",
                       got=exc.op)
            ctx.expect(word in str(exc), lab + ": message", f"message does not mention {word}", got=str(exc))
    ctx.check("f64 recvbuf untouched", f64, np.zeros(4, np.float64))
    out = np.zeros(3, np.int64)
    comm.Scan(np.full(3, ctx.rank + 1, np.int64), out)
    ctx.check("Scan after the errors", out, np.full(3, (ctx.rank + 1) * (ctx.rank + 2) // 2, np.int64))


@case
def case_objects(ctx):
    """scan and exscan on Python objects: string concatenation shows the rank order; exscan is None at rank 0."""
    comm, MPI, r = ctx.comm, ctx.MPI, ctx.rank
    words = [f"<{q}>" for q in range(ctx.size)]
    ctx.check_equal("scan str SUM", comm.scan(words[r], op=MPI.SUM), "".join(words[: r + 1]))
    ctx.check_equal("exscan str SUM", comm.exscan(words[r], op=MPI.SUM), "".join(words[:r]) if r else None)
    ctx.check_equal("scan default op", comm.scan(r + 1), (r + 1) * (r + 2) // 2)
    ctx.check_equal("scan list SUM", comm.scan([r]), list(range(r + 1)))
    ctx.check_equal("scan MAX", comm.scan((r * 7) % 5, op=MPI.MAX), max((q * 7) % 5 for q in range(r + 1)))
    ctx.check_equal("exscan PROD", comm.exscan(r + 2, op=MPI.PROD),
                    functools.reduce(lambda a, b: a * b, range(2, r + 2)) if r else None)
    if ctx.supports("AVG"):
        ctx.check_equal("scan AVG", comm.scan(float(r), op=MPI.AVG), sum(range(r + 1)) / (r + 1))
