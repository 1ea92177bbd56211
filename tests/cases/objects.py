"""Pickle-based lowercase methods: bcast, allgather, allreduce, gather, scatter, barrier (and reduce/alltoall if present)."""

from __future__ import annotations

import numpy as np

from . import case


def _obj(q):
    return {"rank": q, "name": f"r{q}", "list": list(range(q + 1)), "arr": np.arange(q + 2, dtype=np.int16), "t": (q, None)}


def _same(a, b):
    if set(a) != set(b):
        return False
    for k in a:
        if isinstance(a[k], np.ndarray):
            if not (isinstance(b[k], np.ndarray) and a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k])):
                return False
        elif a[k] != b[k]:
            return False
    return True


@case
def case_bcast(ctx):
    comm = ctx.comm
    for root in range(ctx.size):
        obj = _obj(root) if ctx.rank == root else None
        got = comm.bcast(obj, root=root)
        ctx.expect(_same(got, _obj(root)), f"bcast root={root}", "object differs", expected=_obj(root), got=got)
    got = comm.bcast("default-root" if ctx.rank == 0 else None)
    ctx.check_equal("bcast default root", got, "default-root")
    big = list(range(200000)) if ctx.rank == 0 else None
    got = comm.bcast(big, root=0)
    ctx.expect(got == list(range(200000)), "bcast 200k-element list", "list differs")


@case
def case_allgather(ctx):
    comm = ctx.comm
    got = comm.allgather(_obj(ctx.rank))
    ctx.check_equal("allgather length", len(got), ctx.size)
    for q in range(ctx.size):
        ctx.expect(_same(got[q], _obj(q)), f"allgather item {q}", "object differs", expected=_obj(q), got=got[q])
    ctx.check_equal("allgather None", comm.allgather(None), [None] * ctx.size)


@case
def case_allreduce(ctx):
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    ctx.check_equal("allreduce SUM int", comm.allreduce(r + 1, op=MPI.SUM), n * (n + 1) // 2)
    ctx.check_equal("allreduce default op", comm.allreduce(r + 1), n * (n + 1) // 2)
    ctx.check_equal("allreduce MAX", comm.allreduce(r * 3 % 5, op=MPI.MAX), max(q * 3 % 5 for q in range(n)))
    ctx.check_equal("allreduce MIN", comm.allreduce(r - 10, op=MPI.MIN), -10)
    prod = 1
    for q in range(n):
        prod *= q + 2
    ctx.check_equal("allreduce PROD", comm.allreduce(r + 2, op=MPI.PROD), prod)
    ctx.check_equal("allreduce SUM float", comm.allreduce(0.5 * r, op=MPI.SUM), 0.5 * sum(range(n)))
    arr = comm.allreduce(np.full(3, r, np.int64), op=MPI.SUM)
    ctx.check("allreduce SUM ndarray", np.asarray(arr), np.full(3, sum(range(n)), np.int64))


@case
def case_gather_scatter(ctx):
    comm = ctx.comm
    n, r = ctx.size, ctx.rank
    for root in range(n):
        got = comm.gather(("g", r, root), root=root)
        if r == root:
            ctx.check_equal(f"gather root={root}", got, [("g", q, root) for q in range(n)])
        else:
            ctx.check_equal(f"gather root={root} non-root gets None", got, None)
        objs = [{"to": q, "from": root} for q in range(n)] if r == root else None
        got = comm.scatter(objs, root=root)
        ctx.check_equal(f"scatter root={root}", got, {"to": r, "from": root})
    got = comm.gather(r)
    ctx.check_equal("gather default root", got, list(range(n)) if r == 0 else None)


@case
def case_barrier(ctx):
    for _ in range(3):
        ctx.check_equal("barrier returns None", ctx.comm.barrier(), None)


@case
def case_optional(ctx):
    """reduce and alltoall on objects, when present."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    if hasattr(comm, "reduce"):
        got = comm.reduce(r + 1, op=MPI.SUM, root=n - 1)
        ctx.check_equal("reduce", got, n * (n + 1) // 2 if r == n - 1 else None)
    else:
        ctx.note("reduce not available")
    if hasattr(comm, "alltoall"):
        got = comm.alltoall([(r, q) for q in range(n)])
        ctx.check_equal("alltoall", got, [(q, r) for q in range(n)])
    else:
        ctx.note("alltoall not available")


@case
def case_large_objects(ctx):
    """Multi-megabyte pickles: allgather of 1 MB bytes per rank, bcast and scatter of arrays."""
    comm = ctx.comm
    n, r = ctx.size, ctx.rank
    blob = bytes([r % 251]) * (1 << 20)
    got = comm.allgather(blob)
    ctx.check_equal("allgather 1 MB objects", [len(b) for b in got], [1 << 20] * n)
    ctx.check_equal("allgather 1 MB object contents", [b[:1] + b[-1:] for b in got], [bytes([q % 251]) * 2 for q in range(n)])
    arr = ctx.data(np.float64, 300000, 0) if r == 0 else None
    got = comm.bcast(arr, root=0)
    ctx.check("bcast of a 2.4 MB array", got, ctx.data(np.float64, 300000, 0))
    parts = [ctx.data(np.int32, 200000 + q, q) for q in range(n)] if r == n - 1 else None
    got = comm.scatter(parts, root=n - 1)
    ctx.check("scatter of large arrays", got, ctx.data(np.int32, 200000 + r, r))


@case
def case_uneven_sizes(ctx):
    """Objects whose pickles fit the first block, outgrow it on one rank only, outgrow the largest block, and shrink
    again, in every object collective, each rank checking what it got against what every rank sent."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    sizes = [8, 300, 5000, 70000, 8, 40000, 200, 1 << 17, 16]  # bytes of the big rank's payload, call by call

    def payload(q, k, to=0):  # rank q's object in call k (for rank ``to``): only rank k % n is large
        m = sizes[k] if q == k % n else 3
        return (q, k, to, bytes([(q + 7 * k + to) % 251]) * m)

    for k in range(len(sizes)):
        root = k % n
        ctx.check_equal(f"allgather #{k}", comm.allgather(payload(r, k)), [payload(q, k) for q in range(n)])
        got = comm.gather(payload(r, k), root=root)
        ctx.check_equal(f"gather #{k} root={root}", got, [payload(q, k) for q in range(n)] if r == root else None)
        other = (root + 1) % n  # the large pickle a non-root's
        got = comm.gather(payload(r, k), root=other)
        ctx.check_equal(f"gather #{k} root={other}", got, [payload(q, k) for q in range(n)] if r == other else None)
        got = comm.bcast(payload(r, k) if r == root else None, root=root)
        ctx.check_equal(f"bcast #{k} root={root}", got, payload(root, k))
        objs = [payload(root, k, q) for q in range(n)] if r == root else None
        ctx.check_equal(f"scatter #{k} root={root}", comm.scatter(objs, root=root), payload(root, k, r))
        got = comm.alltoall([payload(r, k, q) for q in range(n)])
        ctx.check_equal(f"alltoall #{k}", got, [payload(q, k, r) for q in range(n)])
        total = comm.allreduce(len(payload(r, k)[3]), op=MPI.SUM)
        ctx.check_equal(f"allreduce #{k}", total, sum(len(payload(q, k)[3]) for q in range(n)))
        got = comm.reduce([len(payload(r, k)[3])], op=MPI.SUM, root=root)
        ctx.check_equal(f"reduce #{k} root={root}", got, [len(payload(q, k)[3]) for q in range(n)] if r == root else None)
