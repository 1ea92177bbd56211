"""Reduction collectives over every valid op x dtype x count {0,1,7,1000}, in place and out of place."""

from __future__ import annotations

import numpy as np

from . import COUNTS, case, reduce_ref, sentinel, tolerance


def _label(name, op, dt, count, inplace, root=None):
    s = f"{name} op={op} dtype={np.dtype(dt).name} count={count} {'in-place' if inplace else 'out-of-place'}"
    return s if root is None else s + f" root={root}"


@case
def case_allreduce(ctx):
    comm, MPI = ctx.comm, ctx.MPI
    for op, dt in ctx.pairs():
        for count in COUNTS:
            inputs = [ctx.data(dt, count, r, op=op) for r in range(ctx.size)]
            expected = reduce_ref(op, inputs, dt)
            rtol, atol = tolerance(op, dt)
            for inplace in (False, True):
                lab = _label("Allreduce", op, dt, count, inplace)
                mine = inputs[ctx.rank].copy()
                if inplace:
                    comm.Allreduce(MPI.IN_PLACE, mine, op=ctx.op(op))
                    ctx.check(lab, mine, expected, rtol, atol)
                else:
                    recv = sentinel(dt, count)
                    comm.Allreduce(mine, recv, op=ctx.op(op))
                    ctx.check(lab, recv, expected, rtol, atol)
                    ctx.check(lab + " (sendbuf unchanged)", mine, inputs[ctx.rank])


@case
def case_reduce(ctx):
    """Every valid op x dtype; the root rotates through all ranks so every root is exercised."""
    comm, MPI = ctx.comm, ctx.MPI
    i = 0
    for op, dt in ctx.pairs():
        for count in COUNTS:
            inputs = [ctx.data(dt, count, r, op=op) for r in range(ctx.size)]
            expected = reduce_ref(op, inputs, dt)
            rtol, atol = tolerance(op, dt)
            for inplace in (False, True):
                root = (i // 2 + i % 2) % ctx.size  # every root gets both variants
                i += 1
                lab = _label("Reduce", op, dt, count, inplace, root)
                mine = inputs[ctx.rank].copy()
                if ctx.rank == root:
                    if inplace:
                        comm.Reduce(MPI.IN_PLACE, mine, op=ctx.op(op), root=root)
                        ctx.check(lab, mine, expected, rtol, atol)
                    else:
                        recv = sentinel(dt, count)
                        comm.Reduce(mine, recv, op=ctx.op(op), root=root)
                        ctx.check(lab, recv, expected, rtol, atol)
                        ctx.check(lab + " (sendbuf unchanged)", mine, inputs[ctx.rank])
                else:
                    # non-roots: recvbuf is ignored; pass None (mpi4py style) or a buffer to leave alone
                    if inplace:
                        recv = sentinel(dt, count)
                        comm.Reduce(mine, recv, op=ctx.op(op), root=root)
                        ctx.check(lab + " (non-root recvbuf untouched)", recv, sentinel(dt, count))
                    else:
                        comm.Reduce(mine, None, op=ctx.op(op), root=root)
                    ctx.check(lab + " (sendbuf unchanged)", mine, inputs[ctx.rank])


@case
def case_reduce_every_root(ctx):
    """SUM and MAX on float32/int32 at every root, counts 1 and 1000."""
    comm = ctx.comm
    for op in ("SUM", "MAX"):
        for dt in (np.float32, np.int32):
            for count in (1, 1000):
                inputs = [ctx.data(dt, count, r, op=op) for r in range(ctx.size)]
                expected = reduce_ref(op, inputs, dt)
                for root in range(ctx.size):
                    lab = _label("Reduce", op, dt, count, False, root)
                    recv = sentinel(dt, count) if ctx.rank == root else None
                    comm.Reduce(inputs[ctx.rank], recv, op=ctx.op(op), root=root)
                    if ctx.rank == root:
                        ctx.check(lab, recv, expected)


@case
def case_reduce_scatter_block(ctx):
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    for op, dt in ctx.pairs():
        for count in COUNTS:
            inputs = [ctx.data(dt, count * n, q, op=op) for q in range(n)]
            full = reduce_ref(op, inputs, dt)
            expected = full[r * count:(r + 1) * count]
            rtol, atol = tolerance(op, dt)
            for inplace in (False, True):
                lab = _label("Reduce_scatter_block", op, dt, count, inplace)
                mine = inputs[r].copy()
                if inplace:
                    comm.Reduce_scatter_block(MPI.IN_PLACE, mine, op=ctx.op(op))
                    ctx.check(lab, mine[:count], expected, rtol, atol)
                else:
                    recv = sentinel(dt, count)
                    comm.Reduce_scatter_block(mine, recv, op=ctx.op(op))
                    ctx.check(lab, recv, expected, rtol, atol)
                    ctx.check(lab + " (sendbuf unchanged)", mine, inputs[r])


def _rs_counts(count, n):
    """Uneven receive counts (some zero for small counts)."""
    return [max(0, count + q - 1) if count else 0 for q in range(n)]


@case
def case_reduce_scatter(ctx):
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    for op, dt in ctx.pairs():
        for count in COUNTS:
            counts = _rs_counts(count, n)
            total = sum(counts)
            start = sum(counts[:r])
            inputs = [ctx.data(dt, total, q, op=op) for q in range(n)]
            full = reduce_ref(op, inputs, dt)
            expected = full[start:start + counts[r]]
            rtol, atol = tolerance(op, dt)
            for inplace in (False, True):
                lab = _label("Reduce_scatter", op, dt, count, inplace) + f" recvcounts={counts}"
                mine = inputs[r].copy()
                if inplace:
                    comm.Reduce_scatter(MPI.IN_PLACE, mine, counts, op=ctx.op(op))
                    ctx.check(lab, mine[:counts[r]], expected, rtol, atol)
                else:
                    recv = sentinel(dt, counts[r])
                    comm.Reduce_scatter(mine, recv, counts, op=ctx.op(op))
                    ctx.check(lab, recv, expected, rtol, atol)
                    ctx.check(lab + " (sendbuf unchanged)", mine, inputs[r])


@case
def case_reduce_scatter_keywords(ctx):
    """Reduce_scatter with keyword arguments (recvcounts=, op=) on float64."""
    comm = ctx.comm
    n, r = ctx.size, ctx.rank
    counts = [q + 2 for q in range(n)]
    inputs = [ctx.data(np.float64, sum(counts), q) for q in range(n)]
    full = reduce_ref("SUM", inputs, np.float64)
    start = sum(counts[:r])
    recv = sentinel(np.float64, counts[r])
    comm.Reduce_scatter(inputs[r], recv, recvcounts=counts, op=ctx.MPI.SUM)
    ctx.check("Reduce_scatter keywords", recv, full[start:start + counts[r]])
    recv = sentinel(np.float64, counts[r])
    comm.Reduce_scatter(inputs[r], recv, counts)  # default op is SUM
    ctx.check("Reduce_scatter default op", recv, full[start:start + counts[r]])


@case
def case_reduce_scatter_no_counts(ctx):
    """recvcounts=None: each rank's recvbuf size is its count (mpi4py's rule)."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    for dt in (np.float64, np.int16):
        counts = [2 * q + 1 for q in range(n)]
        inputs = [ctx.data(dt, sum(counts), q) for q in range(n)]
        full = reduce_ref("SUM", inputs, dt)
        start = sum(counts[:r])
        recv = sentinel(dt, counts[r])
        comm.Reduce_scatter(inputs[r], recv, None, op=MPI.SUM)
        ctx.check(f"Reduce_scatter recvcounts=None dtype={np.dtype(dt).name}", recv, full[start:start + counts[r]])


@case
def case_default_op_is_sum(ctx):
    """Allreduce / Reduce / Reduce_scatter_block without op= sum."""
    comm = ctx.comm
    n, r = ctx.size, ctx.rank
    inputs = [ctx.data(np.int64, 5 * n, q) for q in range(n)]
    full = reduce_ref("SUM", inputs, np.int64)
    recv = np.zeros(5 * n, np.int64)
    comm.Allreduce(inputs[r], recv)
    ctx.check("Allreduce default op", recv, full)
    recv = np.zeros(5 * n, np.int64) if r == 0 else None
    comm.Reduce(inputs[r], recv)
    if r == 0:
        ctx.check("Reduce default op/root", recv, full)
    recv = np.zeros(5, np.int64)
    comm.Reduce_scatter_block(inputs[r], recv)
    ctx.check("Reduce_scatter_block default op", recv, full[5 * r:5 * r + 5])


@case
def case_multidim(ctx):
    """2-D C-contiguous arrays are reduced elementwise like flat ones."""
    comm = ctx.comm
    inputs = [ctx.data(np.float32, 60, q).reshape(6, 10) for q in range(ctx.size)]
    expected = reduce_ref("SUM", [a.reshape(-1) for a in inputs], np.float32).reshape(6, 10)
    recv = np.zeros((6, 10), np.float32)
    comm.Allreduce(inputs[ctx.rank], recv, op=ctx.MPI.SUM)
    ctx.check("Allreduce 2-D", recv, expected)


@case
def case_blocks_past_small_frames(ctx):
    """Allreduce, Reduce_scatter_block and Allgather whose blocks pass the small-frame size (16 KiB) but fit one
    chunk (float32 and int32, odd counts, SUM and MAX, in and out of place): each matches NumPy. Between two hosts
    their frames swap in C (``Steps.swap_now``); the count of frames moved so is recorded."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    engine = getattr(comm, "_engine", None)
    before = engine.frames_exchanged if engine is not None else 0
    for op, dt in (("SUM", np.dtype(np.float32)), ("MAX", np.dtype(np.int32))):
        rtol, atol = tolerance(op, dt)
        for block in (4_099, 50_001):
            inputs = [ctx.data(dt, block * n, q, op=op) for q in range(n)]
            total = reduce_ref(op, inputs, dt)
            lab = f"op={op} dtype={dt.name} block={block}"
            out = sentinel(dt, block * n)
            comm.Allreduce(inputs[r], out, op=ctx.op(op))
            ctx.check("Allreduce " + lab, out, total, rtol, atol)
            buf = inputs[r].copy()
            comm.Allreduce(MPI.IN_PLACE, buf, op=ctx.op(op))
            ctx.check("Allreduce in-place " + lab, buf, total, rtol, atol)
            mine = sentinel(dt, block)
            comm.Reduce_scatter_block(inputs[r], mine, op=ctx.op(op))
            ctx.check("Reduce_scatter_block " + lab, mine, total[r * block:(r + 1) * block], rtol, atol)
            buf = inputs[r].copy()
            comm.Reduce_scatter_block(MPI.IN_PLACE, buf, op=ctx.op(op))
            ctx.check("Reduce_scatter_block in-place " + lab, buf[:block], total[r * block:(r + 1) * block], rtol, atol)
            parts = [ctx.data(dt, block, q, "ag") for q in range(n)]
            out = sentinel(dt, block * n)
            comm.Allgather(parts[r], out)
            ctx.check("Allgather " + lab, out, np.concatenate(parts))
            out = sentinel(dt, block * n)
            out[r * block:(r + 1) * block] = parts[r]
            comm.Allgather(MPI.IN_PLACE, out)
            ctx.check("Allgather in-place " + lab, out, np.concatenate(parts))
    if engine is not None:
        ctx.record("frames exchanged", engine.frames_exchanged - before)
