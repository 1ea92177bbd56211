"""Calls as mpi4py programs write them, repeated: buffer specs, fresh arrays and views, every collective, checked
each time against NumPy; the executor must plan each call shape once and reuse it whatever the buffer's address."""

from __future__ import annotations

import numpy as np

from . import case, reduce_ref, sentinel, tolerance

_ROUNDS = 3  # calls per shape: the first checks and plans, the rest rebind the plan onto new buffers
_DTYPES = (np.float32, np.uint8, np.complex128)
_COUNTS = (0, 1, 7, 300)


def _mpi_type(MPI, dt):
    return {np.float32: MPI.FLOAT, np.int64: MPI.INT64_T, np.uint8: MPI.BYTE, np.complex128: MPI.C_DOUBLE_COMPLEX,
            np.float64: MPI.DOUBLE}[dt]


def _wrap(ctx, arr, style, k, blocks=1):
    """``arr`` as a buffer argument of the given style: a spec (its count per block, as mpi4py reads it, on odd
    calls), a bare array, or a view into a larger array."""
    MPI = ctx.MPI
    if style == "spec":
        kind = _mpi_type(MPI, arr.dtype.type)
        return [arr, arr.size // blocks, kind] if k % 2 else [arr, kind]
    return arr


def _fresh(dt, count, style, k):
    """A new array for each call; ``view`` styles slice it out of a bigger one at a moving offset."""
    if style != "view":
        return np.empty(count, dt)
    big = np.empty(count + 3, dt)
    return big[k % 3:k % 3 + count]


def _label(name, dt, count, style, k, extra=""):
    return f"{name} dtype={np.dtype(dt).name} count={count} {style} call {k}{extra}"


@case
def case_shapes(ctx):
    """Every collective, four calls per shape on fresh buffers (spec, bare, view), in and out of place."""
    comm = ctx.comm.Dup()
    MPI, n, r = ctx.MPI, ctx.size, ctx.rank
    for style in ("spec", "bare", "view"):
        for dt in _DTYPES:
            for count in _COUNTS:
                for k in range(_ROUNDS):
                    parts = [ctx.data(dt, count, q, "shapes", style, k) for q in range(n)]
                    w = lambda a, blocks=1: _wrap(ctx, a, style, k, blocks)  # noqa: E731
                    root = k % n
                    # Bcast
                    buf = _fresh(dt, count, style, k)
                    buf[...] = parts[root] if r == root else sentinel(dt, count)
                    comm.Bcast(w(buf), root=root)
                    ctx.check(_label("Bcast", dt, count, style, k), buf, parts[root])
                    # Allgather, out of place and in place
                    send = _fresh(dt, count, style, k)
                    send[...] = parts[r]
                    recv = _fresh(dt, count * n, style, k)
                    recv[...] = sentinel(dt, count * n)
                    comm.Allgather(w(send), w(recv, n))
                    ctx.check(_label("Allgather", dt, count, style, k), recv, np.concatenate(parts))
                    recv[...] = sentinel(dt, count * n)
                    recv[r * count:(r + 1) * count] = parts[r]
                    comm.Allgather(MPI.IN_PLACE, w(recv, n))
                    ctx.check(_label("Allgather", dt, count, style, k, " in place"), recv, np.concatenate(parts))
                    # Gather and Scatter
                    recv = _fresh(dt, count * n, style, k) if r == root else None
                    if recv is not None:
                        recv[...] = sentinel(dt, count * n)
                    comm.Gather(w(send), w(recv, n) if recv is not None else None, root=root)
                    if r == root:
                        ctx.check(_label("Gather", dt, count, style, k), recv, np.concatenate(parts))
                    full = np.concatenate(parts)
                    out = _fresh(dt, count, style, k)
                    out[...] = sentinel(dt, count)
                    comm.Scatter(w(full.copy(), n) if r == root else None, w(out), root=root)
                    ctx.check(_label("Scatter", dt, count, style, k), out, parts[0][:0] if not count else full[r * count:(r + 1) * count])
                    # Alltoall: block q of rank r's send goes to rank q
                    blocks = [ctx.data(dt, count, q, r, "a2a", k) for q in range(n)]
                    a2a = _fresh(dt, count * n, style, k)
                    a2a[...] = np.concatenate(blocks) if count else a2a
                    got = _fresh(dt, count * n, style, k)
                    got[...] = sentinel(dt, count * n)
                    comm.Alltoall(w(a2a, n), w(got, n))
                    want = np.concatenate([ctx.data(dt, count, r, q, "a2a", k) for q in range(n)]) if count else got[:0]
                    ctx.check(_label("Alltoall", dt, count, style, k), got, want)
                    comm.Barrier()
    ctx.record("plans", len(comm._x.plans))
    comm.Free()


@case
def case_shapes_reductions(ctx):
    """Reduce, Allreduce, Reduce_scatter_block, Scan and Exscan, four calls per shape on fresh buffers."""
    comm = ctx.comm.Dup()
    MPI, n, r = ctx.MPI, ctx.size, ctx.rank
    for style in ("spec", "bare", "view"):
        for dt in (np.float32, np.int64):
            for op in ("SUM", "PROD"):
                for count in _COUNTS:
                    rtol, atol = tolerance(op, dt)
                    for k in range(_ROUNDS):
                        w = lambda a, blocks=1: _wrap(ctx, a, style, k, blocks)  # noqa: E731
                        root = (k + 1) % n
                        ins = [ctx.data(dt, count * n, q, "red", style, k, op=op) for q in range(n)]
                        send = _fresh(dt, count * n, style, k)
                        send[...] = ins[r]
                        lab = lambda name, extra="": _label(name, dt, count, style, k, f" op={op}{extra}")  # noqa: E731
                        out = _fresh(dt, count * n, style, k)
                        out[...] = sentinel(dt, count * n)
                        comm.Allreduce(w(send), w(out), op=ctx.op(op))
                        ctx.check(lab("Allreduce"), out, reduce_ref(op, ins, dt), rtol, atol)
                        out[...] = sentinel(dt, count * n)
                        comm.Reduce(w(send), w(out) if r == root else None, op=ctx.op(op), root=root)
                        if r == root:
                            ctx.check(lab("Reduce"), out, reduce_ref(op, ins, dt), rtol, atol)
                        part = _fresh(dt, count, style, k)
                        part[...] = sentinel(dt, count)
                        comm.Reduce_scatter_block(w(send, n), w(part), op=ctx.op(op))
                        want = reduce_ref(op, ins, dt)[r * count:(r + 1) * count]
                        ctx.check(lab("Reduce_scatter_block"), part, want, rtol, atol)
                        whole = _fresh(dt, count * n, style, k)  # in place: a spec's count is per block
                        whole[...] = ins[r]
                        comm.Reduce_scatter_block(MPI.IN_PLACE, w(whole, n), op=ctx.op(op))
                        ctx.check(lab("Reduce_scatter_block", " in place"), whole[:count], want, rtol, atol)
                        out[...] = sentinel(dt, count * n)
                        comm.Scan(w(send), w(out), op=ctx.op(op))
                        ctx.check(lab("Scan"), out, reduce_ref(op, ins[:r + 1], dt), rtol, atol)
                        out[...] = sentinel(dt, count * n)
                        comm.Exscan(w(send), w(out), op=ctx.op(op))
                        if r > 0:
                            ctx.check(lab("Exscan"), out, reduce_ref(op, ins[:r], dt), rtol, atol)
                        ctx.check(lab("sendbuf unchanged"), send, ins[r])
    ctx.record("plans", len(comm._x.plans))
    comm.Free()


@case
def case_shapes_planned_once(ctx):
    """A hundred Allreduce and Bcast calls on fresh arrays, spec and bare, take two plans each (one per spelling)
    and, on two or more ranks of one host once the kernels are in, run inline."""
    from pycoll.algorithms import arena_jit

    comm = ctx.comm.Dup()
    MPI = ctx.MPI
    arena_jit.warm_up()  # this case counts inline calls: do not leave that to the background load's timing
    for k in range(100):
        x = np.full(16, ctx.rank + k, np.float32)
        y = np.empty(16, np.float32)
        comm.Allreduce([x, MPI.FLOAT], [y, MPI.FLOAT], op=MPI.SUM)
        ctx.check(f"Allreduce spec call {k}", y, np.full(16, sum(range(ctx.size)) + ctx.size * k, np.float32))
        comm.Allreduce(x, y)
        b = np.full(8, k if ctx.rank == 0 else -1, np.int64)
        comm.Bcast([b, MPI.INT64_T], root=0)
        ctx.check(f"Bcast spec call {k}", b, np.full(8, k, np.int64))
    ctx.record("plans", len(comm._x.plans))
    ctx.record("inline", comm._x.gate.inline)
    comm.Free()


@case
def case_shapes_prebuilt_kernels(ctx):
    """With the ahead-of-time build, the kernels are there before the first call: the first calls already run
    compiled (inline), right, and Numba is never imported."""
    import sys

    from pycoll.algorithms import arena_jit

    comm = ctx.comm.Dup()
    MPI = ctx.MPI
    ctx.record("ready_at_start", arena_jit.ready())
    x, y = np.ones(4, np.float64), np.zeros(4, np.float64)
    before = comm._x.gate.inline
    for k in range(1, 21):
        x[...] = ctx.rank + k
        comm.Allreduce([x, MPI.DOUBLE], [y, MPI.DOUBLE], op=MPI.SUM)
        ctx.check(f"Allreduce call {k}", y, np.full(4, sum(range(ctx.size)) + ctx.size * k, np.float64))
    ctx.record("inline_of_first_20", comm._x.gate.inline - before)
    ctx.record("numba_imported", "numba" in sys.modules)
    comm.Free()


@case
def case_shapes_background_load(ctx):
    """Without any warm-up call, a repeated call starts the kernels loading in the background while calls go on in
    NumPy (checked each time); once loaded, later calls run compiled."""
    import time

    from pycoll.algorithms import arena_jit

    comm = ctx.comm.Dup()
    MPI = ctx.MPI
    x, y = np.ones(4, np.float64), np.zeros(4, np.float64)
    ctx.record("loaded_at_start", arena_jit.ready())
    deadline = time.monotonic() + 120
    k = 0
    while True:  # every rank leaves the loop at the same call: rank 0 decides, the others follow its word
        k += 1
        x[...] = ctx.rank + k
        comm.Allreduce([x, MPI.DOUBLE], [y, MPI.DOUBLE], op=MPI.SUM)
        ctx.check(f"Allreduce call {k}", y, np.full(4, sum(range(ctx.size)) + ctx.size * k, np.float64))
        flag = np.array([arena_jit.ready() or time.monotonic() > deadline], np.uint8)
        comm.Allreduce(MPI.IN_PLACE, [flag, MPI.BYTE], op=MPI.LAND)
        if flag[0]:
            break
    ctx.record("loaded", arena_jit.ready())
    before = comm._x.gate.inline
    for j in range(200):
        comm.Allreduce([x, MPI.DOUBLE], [y, MPI.DOUBLE], op=MPI.SUM)
    ctx.record("inline_after_load", comm._x.gate.inline - before)
    comm.Free()
