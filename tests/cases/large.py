"""The 2**20+3 element count: all ops on float32 (bitwise ops on int32) and all dtypes with SUM, plus each collective once.

The full ops x dtypes x collectives product at this count is too slow for a 2-core machine
(about 90 valid op/dtype pairs x 2 variants x several MB per call per rank), so large messages
cover the op axis on float32 and the dtype axis on SUM; every other collective runs once or twice.
"""

from __future__ import annotations

import numpy as np

from . import LARGE, OPS, case, reduce_ref, sentinel, tolerance

L = LARGE


def _pairs(ctx):
    pairs = [(op, np.dtype(np.float32)) for op in OPS if op not in ("BAND", "BOR", "BXOR")]
    pairs += [(op, np.dtype(np.int32)) for op in ("BAND", "BOR", "BXOR")]
    pairs += [("SUM", dt) for dt in ctx.dtypes() if dt != np.float32]
    return [(op, dt) for op, dt in pairs if ctx.supports(op, dt)]


@case
def case_allreduce(ctx):
    comm, MPI = ctx.comm, ctx.MPI
    for op, dt in _pairs(ctx):
        inputs = [ctx.data(dt, L, q, op=op) for q in range(ctx.size)]
        expected = reduce_ref(op, inputs, dt)
        rtol, atol = tolerance(op, dt)
        mine = inputs[ctx.rank].copy()
        out = np.empty(L, dt)
        comm.Allreduce(mine, out, op=ctx.op(op))
        lab = f"Allreduce op={op} dtype={dt.name} count={L}"
        ctx.check(lab, out, expected, rtol, atol)
        ctx.check(lab + " (sendbuf unchanged)", mine, inputs[ctx.rank])
        if dt in (np.float32, np.float16) and op == "SUM":
            comm.Allreduce(MPI.IN_PLACE, mine, op=ctx.op(op))
            ctx.check(lab + " in-place", mine, expected, rtol, atol)


@case
def case_reduce_family(ctx):
    """Reduce (root = last rank), Reduce_scatter_block and Reduce_scatter at ~2**20 elements."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    root = n - 1
    for op, dt in (("SUM", np.dtype(np.float32)), ("MAX", np.dtype(np.int64))):
        inputs = [ctx.data(dt, L, q, op=op) for q in range(n)]
        exp = reduce_ref(op, inputs, dt)
        out = sentinel(dt, L) if r == root else None
        comm.Reduce(inputs[r], out, op=ctx.op(op), root=root)
        if r == root:
            ctx.check(f"Reduce op={op} dtype={dt.name} count={L} root={root}", out, exp)
    # Reduce_scatter_block: each rank receives L elements (sendbuf n*L)
    dt = np.dtype(np.float32)
    inputs = [ctx.data(dt, n * L, q) for q in range(n)]
    exp = reduce_ref("SUM", inputs, dt)[r * L:(r + 1) * L]
    out = sentinel(dt, L)
    comm.Reduce_scatter_block(inputs[r], out, op=MPI.SUM)
    ctx.check(f"Reduce_scatter_block SUM float32 count={L}", out, exp)
    del inputs
    # Reduce_scatter with uneven counts summing to about L
    counts = [L // n + (q % 2) * 3 for q in range(n)]
    inputs = [ctx.data(np.int32, sum(counts), q, op="BXOR") for q in range(n)]
    st = sum(counts[:r])
    exp = reduce_ref("BXOR", inputs, np.int32)[st:st + counts[r]]
    out = sentinel(np.int32, counts[r])
    comm.Reduce_scatter(inputs[r], out, counts, op=MPI.BXOR)
    ctx.check(f"Reduce_scatter BXOR int32 counts={counts}", out, exp)


@case
def case_movement(ctx):
    """Bcast, Allgather(v), Gather, Scatter, Alltoall at ~2**20 elements per block."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    for dt, root in ((np.dtype(np.float64), n - 1), (np.dtype(np.uint8), 0)):
        data = ctx.data(dt, L, root, "bcast")
        buf = data.copy() if r == root else sentinel(dt, L)
        comm.Bcast(buf, root=root)
        ctx.check(f"Bcast dtype={dt.name} count={L} root={root}", buf, data)
    dt = np.dtype(np.float32)
    parts = [ctx.data(dt, L, q, "ag") for q in range(n)]
    out = sentinel(dt, n * L)
    comm.Allgather(parts[r], out)
    ctx.check(f"Allgather float32 count={L}", out, np.concatenate(parts))
    out = sentinel(dt, n * L)
    out[r * L:(r + 1) * L] = parts[r]
    comm.Allgather(MPI.IN_PLACE, out)
    ctx.check(f"Allgather float32 count={L} in-place", out, np.concatenate(parts))
    root = 1 % n
    out = sentinel(dt, n * L) if r == root else None
    comm.Gather(parts[r], out, root=root)
    if r == root:
        ctx.check(f"Gather float32 count={L} root={root}", out, np.concatenate(parts))
    full = np.concatenate(parts[::-1])
    out = sentinel(dt, L)
    comm.Scatter(full if r == root else None, out, root=root)
    ctx.check(f"Scatter float32 count={L} root={root}", out, full[r * L:(r + 1) * L])
    del parts, full
    # Allgatherv with uneven counts around L
    counts = [L - 5 * q for q in range(n)]
    displs = [sum(counts[:q]) for q in range(n)]
    parts = [ctx.data(np.int16, counts[q], q, "agv") for q in range(n)]
    out = sentinel(np.int16, sum(counts))
    comm.Allgatherv(parts[r], ctx.vspec(out, counts, displs))
    ctx.check(f"Allgatherv int16 counts={counts}", out, np.concatenate(parts))
    del parts
    # Alltoall: L float16 per block
    dt = np.dtype(np.float16)
    sends = [ctx.data(dt, n * L, q, "a2a") for q in range(n)]
    out = sentinel(dt, n * L)
    comm.Alltoall(sends[r], out)
    ctx.check(f"Alltoall float16 count={L}", out, np.concatenate([sends[q][r * L:(r + 1) * L] for q in range(n)]))


@case
def case_nonblocking_concurrent(ctx):
    """Three ~4 MB Iallreduce and an Ibcast outstanding at once, completed in reverse order."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    specs = [("SUM", np.dtype(np.float32)), ("MAX", np.dtype(np.int32)), ("BXOR", np.dtype(np.uint32))]
    ins = [[ctx.data(dt, L, q, op=op) for q in range(n)] for op, dt in specs]
    outs = [sentinel(dt, L) for _, dt in specs]
    reqs = [comm.Iallreduce(ins[k][r], outs[k], op=ctx.op(op)) for k, (op, _) in enumerate(specs)]
    root = n - 1
    data = ctx.data(np.float64, L, root, "ib")
    buf = data.copy() if r == root else sentinel(np.float64, L)
    reqs.append(comm.Ibcast(buf, root=root))
    for req in reversed(reqs):
        req.Wait()
    for k, (op, dt) in enumerate(specs):
        ctx.check(f"concurrent Iallreduce op={op} dtype={dt.name} count={L}", outs[k], reduce_ref(op, ins[k], dt))
    ctx.check(f"concurrent Ibcast float64 count={L}", buf, data)
