"""Reproducible mode (PYCOLL_REPRODUCIBLE, Comm.reproducible): every reduction is, bit for bit, the rank-order left
fold ``((x0 op x1) op x2) ...`` of NumPy in the buffer's dtype, under every algorithm forced in turn."""

from __future__ import annotations

import functools
import os

import numpy as np

from . import BFLOAT16, LARGE, Env, case, dname, seed_of, sentinel

DTYPES = [np.dtype(t) for t in ("float16", "float32", "float64", "complex64")] + (
    [BFLOAT16] if BFLOAT16 is not None else [])
OPS = ("SUM", "PROD", "MIN", "MAX", "AVG")
UFUNCS = {"SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum, "AVG": np.add}
COUNTS = (0, 1, 7, 1000)
# Forced in turn: the ones that keep the fold, and ones that must decline in this mode (selection takes over).
ALGOS = {
    "allreduce": ("ordered", "owner", "oneshot", "cma", "staged", "ring", "rabenseifner"),
    "reduce": ("ordered", "owner", "slots", "staged", "chain", "tree"),
    "reduce_scatter": ("ordered", "owner", "slots", "cma", "staged", "ring", "halving"),
    "scan": ("linear", "doubling", "slots", "staged"),
}


def _valid(op, dt):
    return not (dt.kind == "c" and op in ("MIN", "MAX"))


def inputs(ctx, op, dt, count, salt=""):
    """Every rank's input: random values whose sums and products round differently in any other order; MIN and MAX
    meet signed zeros, whose order of comparison shows in the bits."""
    out = []
    for q in range(ctx.size):
        rng = np.random.default_rng(seed_of("reproducible", salt, op, dname(dt), count, q))
        x = rng.standard_normal(count)
        if dt.kind == "c":
            x = x + 1j * rng.standard_normal(count)
        if op in ("MIN", "MAX"):
            x[::3] = 0.0 if q % 2 else -0.0
        out.append(x.astype(dt))
    return out


def left_fold(op, xs, dt):
    """``functools.reduce(ufunc, xs)`` in ``dt``; AVG then divides once by the number of inputs."""
    res = functools.reduce(UFUNCS[op], xs)
    if op == "AVG":
        res = np.divide(res, dt.type(len(xs)))
    return np.asarray(res, dt)


def check_bits(ctx, label, got, expected):
    """Equal bit for bit (so -0.0 is not 0.0 and each NaN keeps its payload)."""
    ctx.checks += 1
    got, expected = np.asarray(got), np.asarray(expected)
    if got.dtype != expected.dtype or got.shape != expected.shape:
        ctx.fail(label, "dtype or shape differs", expected=(str(expected.dtype), expected.shape),
                 got=(str(got.dtype), got.shape))
        return
    if not got.size:
        return
    g, e = got.view(np.uint8).reshape(got.size, -1), expected.view(np.uint8).reshape(expected.size, -1)
    bad = np.flatnonzero((g != e).any(axis=1))
    if len(bad):
        i = int(bad[0])
        ctx.fail(label, f"{len(bad)} of {got.size} elements differ in their bits; first at {i}", index=i,
                 expected=expected[i], got=got[i])


def _chosen():
    from pycoll.algorithms import last_choice

    return last_choice.algorithm


def _require(ctx):
    if ctx.impl != "pycoll":
        ctx.skip("reproducible mode is pycoll's")


def _calls(ctx, coll, op, dt, count, xs):
    """(label, run) pairs for ``coll``: each ``run()`` makes one call and returns (got, expected) for this rank."""
    comm, MPI, p, r = ctx.comm, ctx.MPI, ctx.size, ctx.rank
    mpi_op = getattr(MPI, op)
    whole = left_fold(op, xs, dt) if p else None
    if coll == "allreduce":
        def out_of_place():
            got = sentinel(dt, count)
            comm.Allreduce(xs[r], got, op=mpi_op)
            return got, whole

        def in_place():
            got = xs[r].copy()
            comm.Allreduce(MPI.IN_PLACE, got, op=mpi_op)
            return got, whole

        def nonblocking():
            got = sentinel(dt, count)
            comm.Iallreduce(xs[r], got, op=mpi_op).Wait()
            return got, whole

        return [("out of place", out_of_place), ("in place", in_place), ("Iallreduce", nonblocking)]
    if coll == "reduce":
        def to(root, inplace):
            def run():
                if inplace and r == root:
                    got = xs[r].copy()
                    comm.Reduce(MPI.IN_PLACE, got, op=mpi_op, root=root)
                else:
                    got = sentinel(dt, count)
                    comm.Reduce(xs[r], got if r == root else None, op=mpi_op, root=root)
                return (got, whole) if r == root else (None, None)
            return run

        return [(f"root {root}{' in place' if ip else ''}", to(root, ip)) for root in (0, p - 1) for ip in (False, True)]
    if coll == "reduce_scatter":
        block = whole[r * count:(r + 1) * count] if whole is not None else None

        def out_of_place():
            got = sentinel(dt, count)
            comm.Reduce_scatter_block(xs[r], got, op=mpi_op)
            return got, block

        def in_place():
            buf = xs[r].copy()
            comm.Reduce_scatter_block(MPI.IN_PLACE, buf, op=mpi_op)
            return buf[:count], block

        def uneven():
            counts = [count + (q % 2) for q in range(p)]
            total = sum(counts)
            mine = xs[r][:total] if xs[r].size >= total else np.resize(xs[r], total)
            allin = [x[:total] if x.size >= total else np.resize(x, total) for x in xs]
            ref = left_fold(op, allin, dt)
            lo = sum(counts[:r])
            got = sentinel(dt, counts[r])
            comm.Reduce_scatter(mine, got, counts, op=mpi_op)
            return got, ref[lo:lo + counts[r]]

        return [("block out of place", out_of_place), ("block in place", in_place), ("uneven counts", uneven)]
    assert coll == "scan"

    def scan():
        got = sentinel(dt, count)
        comm.Scan(xs[r], got, op=mpi_op)
        return got, left_fold(op, xs[: r + 1], dt)

    def exscan():
        got = sentinel(dt, count)
        comm.Exscan(xs[r], got, op=mpi_op)
        return got, (left_fold(op, xs[:r], dt) if r else None)

    return [("Scan", scan), ("Exscan", exscan)]


def _matrix(ctx, coll, algos, counts=COUNTS, ops=OPS, dtypes=None, chunk="1K"):
    p = ctx.size
    scale = p if coll == "reduce_scatter" else 1  # a block per rank
    for algo in algos:
        forced = f"{coll}:{algo}" + (f",exscan:{algo}" if coll == "scan" else "") if algo else None
        with Env(PYCOLL_ALGO=forced, PYCOLL_CHUNK_SIZE=chunk if algo else None):
            for dt in dtypes or DTYPES:
                for op in ops:
                    if not _valid(op, dt):
                        continue
                    for count in counts:
                        xs = inputs(ctx, op, dt, count * scale)
                        for what, run in _calls(ctx, coll, op, dt, count, xs):
                            for attempt in ("first", "again"):  # the second call of a shape takes the fast paths
                                got, expected = run()
                                lab = (f"{coll} {what} algo={algo or 'auto'} ({_chosen()}) op={op} dtype={dname(dt)} "
                                       f"count={count} {attempt}")
                                if expected is not None:
                                    check_bits(ctx, lab, got, expected)
                            if algo and p > 1 and count and what not in ("Iallreduce", "Exscan"):
                                if _declines(coll, algo):
                                    ctx.expect(_chosen() != algo, f"{coll} {what} algo={algo} declined",
                                               "an algorithm that cannot keep the fold ran", got=_chosen())
                                elif algo not in _ARENA or _has_arena(ctx):
                                    ctx.check_equal(f"{coll} {what} algo={algo} was the one used", _chosen(), algo)


_ARENA = ("oneshot", "slots", "staged", "cma")  # need the shared-memory arena of one host: elsewhere they decline


def _has_arena(ctx):
    return os.environ.get("PYCOLL_SHM_DISABLE") != "1" and ctx.comm._layout.hosts == 1


def _declines(coll, algo):
    from pycoll.algorithms import ALGORITHMS

    return not ALGORITHMS[coll][algo].reproducible


def _each(ctx, coll):
    _require(ctx)
    ctx.comm.reproducible = True
    try:
        algos = (None,) + tuple(a for a in ALGOS[coll] if ctx.size > 1)
        _matrix(ctx, coll, algos)
    finally:
        ctx.comm.reproducible = None


@case
def case_allreduce(ctx):
    """Allreduce and Iallreduce, in place and out of place, under each algorithm forced in turn and by selection."""
    _each(ctx, "allreduce")


@case
def case_reduce(ctx):
    """Reduce to the first and the last rank, in place and out of place."""
    _each(ctx, "reduce")


@case
def case_reduce_scatter(ctx):
    """Reduce_scatter_block in place and out of place, and Reduce_scatter with uneven counts."""
    _each(ctx, "reduce_scatter")


@case
def case_scan(ctx):
    """Scan and Exscan (their algorithms fold left to right in every mode)."""
    _each(ctx, "scan")


@case
def case_large(ctx):
    """2**20+3 elements in many chunks: float32 and float16 sums by selection and through the owner algorithms."""
    _require(ctx)
    ctx.comm.reproducible = True
    try:
        for coll in ("allreduce", "reduce_scatter"):
            _matrix(ctx, coll, (None, "owner") if ctx.size > 1 else (None,), counts=(LARGE // ctx.size,),
                    ops=("SUM",), dtypes=[np.dtype(np.float32), np.dtype(np.float16)], chunk="256K")
    finally:
        ctx.comm.reproducible = None


@case
def case_environment(ctx):
    """PYCOLL_REPRODUCIBLE=1 alone turns the mode on for every communicator; a Dup inherits what was set on its
    parent, and False there wins over the environment."""
    _require(ctx)
    comm, MPI, r = ctx.comm, ctx.MPI, ctx.rank
    dt, op = np.dtype(np.float32), "SUM"
    xs = inputs(ctx, op, dt, 1000, "env")
    with Env(PYCOLL_REPRODUCIBLE="1", PYCOLL_ALGO="allreduce:ring"):
        ctx.check_equal("comm.reproducible follows the environment", comm.reproducible, True)
        got = np.empty(1000, dt)
        comm.Allreduce(xs[r], got, op=MPI.SUM)
        check_bits(ctx, "Allreduce under PYCOLL_REPRODUCIBLE=1 with ring forced", got, left_fold(op, xs, dt))
        if ctx.size > 1:
            ctx.expect(_chosen() != "ring", "ring declined", "a reproducible call ran the ring", got=_chosen())
        dup = comm.Dup()
        try:
            dup.reproducible = False
            ctx.check_equal("False on a communicator wins over the environment", dup.reproducible, False)
            child = dup.Dup()
            ctx.check_equal("a Dup inherits what its parent set", child.reproducible, False)
            child.Free()
        finally:
            dup.Free()
    ctx.check_equal("without the environment word the mode is off", comm.reproducible, False)


@case
def case_interleaved(ctx):
    """The same folds on a communicator whose rank order alternates between the hosts (Split with keys that
    interleave them): the fold follows the communicator's ranks, not where they sit."""
    _require(ctx)
    world, r, p = ctx.comm, ctx.rank, ctx.size
    key = (r % 2) * ((p + 1) // 2) + r // 2
    comm = world.Split(0, key)
    saved = ctx.comm, ctx.rank, ctx.size
    ctx.comm, ctx.rank, ctx.size = comm, comm.rank, comm.size
    comm.reproducible = True
    try:
        ctx.check_equal("interleaved rank order", comm.rank, key)
        for coll in ("allreduce", "reduce", "reduce_scatter"):
            _matrix(ctx, coll, (None, "owner", "ordered") if p > 1 else (None,), counts=(0, 7, 1000),
                    ops=("SUM", "MIN", "AVG"), dtypes=[np.dtype(np.float32), np.dtype(np.float16)])
    finally:
        ctx.comm, ctx.rank, ctx.size = saved
        comm.Free()
