"""Nonblocking collectives: several outstanding, completed out of order, polled with Test, mixed with blocking calls."""

from __future__ import annotations

import time

import numpy as np

from . import case, reduce_ref, sentinel


def _poll(ctx, req, label, limit=120.0):
    """Test() until true; Test must return a bool."""
    deadline = time.monotonic() + limit
    polls = 0
    while True:
        done = req.Test()
        polls += 1
        if not isinstance(done, (bool, np.bool_)):
            ctx.fail(label, f"Request.Test() returned {type(done).__name__}, expected bool")
            req.Wait()
            return
        if done:
            return polls
        if time.monotonic() > deadline:
            ctx.fail(label, f"Request.Test() still false after {limit} s")
            req.Wait()
            return polls
        time.sleep(0.0005)


@case
def case_iallreduce_out_of_order(ctx):
    """Five Iallreduce outstanding (different dtypes/ops/sizes), waited in reverse order."""
    comm, MPI = ctx.comm, ctx.MPI
    specs = [
        ("SUM", np.float32, 1000),
        ("MAX", np.int64, 7),
        ("PROD", np.float64, 33),
        ("SUM", np.int8, 0),
        ("BXOR", np.uint32, 4099),
    ]
    reqs, outs, exps, ins = [], [], [], []
    for op, dt, count in specs:
        inputs = [ctx.data(dt, count, q, op=op) for q in range(ctx.size)]
        exps.append(reduce_ref(op, inputs, dt))
        mine = inputs[ctx.rank].copy()
        ins.append((mine, inputs[ctx.rank]))
        out = sentinel(dt, count)
        outs.append(out)
        reqs.append(comm.Iallreduce(mine, out, op=ctx.op(op)))
    for k in reversed(range(len(reqs))):
        reqs[k].Wait()
    for k, (op, dt, count) in enumerate(specs):
        ctx.check(f"Iallreduce #{k} op={op} dtype={np.dtype(dt).name} count={count}", outs[k], exps[k])
        ctx.check(f"Iallreduce #{k} sendbuf unchanged", ins[k][0], ins[k][1])
    # in place
    inputs = [ctx.data(np.float64, 500, q, "ip") for q in range(ctx.size)]
    buf = inputs[ctx.rank].copy()
    req = comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    req.Wait()
    ctx.check("Iallreduce in-place", buf, reduce_ref("SUM", inputs, np.float64))


@case
def case_test_polling(ctx):
    """Test() polled until true on each nonblocking kind; Wait after completion is harmless."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    inputs = [ctx.data(np.float32, 20000, q) for q in range(n)]
    out = np.zeros(20000, np.float32)
    req = comm.Iallreduce(inputs[r], out, op=MPI.SUM)
    _poll(ctx, req, "Iallreduce Test")
    ctx.check("Iallreduce (polled)", out, reduce_ref("SUM", inputs, np.float32))
    req.Wait()  # waiting on a completed request returns at once

    req = comm.Ibarrier()
    _poll(ctx, req, "Ibarrier Test")

    data = ctx.data(np.int16, 3000, n - 1)
    buf = data.copy() if r == n - 1 else np.zeros(3000, np.int16)
    req = comm.Ibcast(buf, root=n - 1)
    _poll(ctx, req, "Ibcast Test")
    ctx.check("Ibcast (polled)", buf, data)

    parts = [ctx.data(np.uint8, 1001, q) for q in range(n)]
    recv = np.zeros(1001 * n, np.uint8)
    req = comm.Iallgather(parts[r], recv)
    _poll(ctx, req, "Iallgather Test")
    ctx.check("Iallgather (polled)", recv, np.concatenate(parts))

    inputs = [ctx.data(np.complex64, 50 * n, q) for q in range(n)]
    recv = np.zeros(50, np.complex64)
    req = comm.Ireduce_scatter_block(inputs[r], recv, op=MPI.SUM)
    _poll(ctx, req, "Ireduce_scatter_block Test")
    ctx.check("Ireduce_scatter_block (polled)", recv, reduce_ref("SUM", inputs, np.complex64)[50 * r:50 * r + 50])


@case
def case_mixed_kinds_waitall(ctx):
    """One of each nonblocking kind outstanding at once, finished with Request.Waitall."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    a_in = [ctx.data(np.float64, 777, q) for q in range(n)]
    a_out = np.zeros(777, np.float64)
    b_data = ctx.data(np.int32, 513, 0)
    b_buf = b_data.copy() if r == 0 else np.zeros(513, np.int32)
    c_parts = [ctx.data(np.float16, 9, q) for q in range(n)]
    c_out = np.zeros(9 * n, np.float16)
    d_in = [ctx.data(np.int64, 11 * n, q, op="MIN") for q in range(n)]
    d_out = np.zeros(11, np.int64)
    reqs = [
        comm.Iallreduce(a_in[r], a_out, op=MPI.SUM),
        comm.Ibcast(b_buf, root=0),
        comm.Iallgather(c_parts[r], c_out),
        comm.Ireduce_scatter_block(d_in[r], d_out, op=MPI.MIN),
        comm.Ibarrier(),
    ]
    res = MPI.Request.Waitall(reqs)
    ctx.expect(res is None or isinstance(res, (list, tuple, bool)), "Waitall return", f"odd return {res!r}")
    ctx.check("Waitall: Iallreduce", a_out, reduce_ref("SUM", a_in, np.float64))
    ctx.check("Waitall: Ibcast", b_buf, b_data)
    ctx.check("Waitall: Iallgather", c_out, np.concatenate(c_parts))
    ctx.check("Waitall: Ireduce_scatter_block", d_out, reduce_ref("MIN", d_in, np.int64)[11 * r:11 * r + 11])


@case
def case_testall(ctx):
    """Request.Testall polled until true."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    ins = [[ctx.data(np.int32, 100 + k, q, k) for q in range(n)] for k in range(4)]
    outs = [np.zeros(100 + k, np.int32) for k in range(4)]
    reqs = [comm.Iallreduce(ins[k][r], outs[k], op=MPI.SUM) for k in range(4)]
    deadline = time.monotonic() + 120
    while True:
        flag = MPI.Request.Testall(reqs)
        if isinstance(flag, tuple):  # mpi4py-style (flag, statuses) is tolerated
            flag = flag[0]
        if flag:
            break
        if time.monotonic() > deadline:
            ctx.fail("Testall", "still false after 120 s")
            MPI.Request.Waitall(reqs)
            break
        time.sleep(0.0005)
    for k in range(4):
        ctx.check(f"Testall: Iallreduce #{k}", outs[k], reduce_ref("SUM", ins[k], np.int32))


@case
def case_interleaved_with_blocking(ctx):
    """Nonblocking collectives outstanding while blocking collectives run (same order on all ranks)."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    x = [ctx.data(np.float32, 4096, q, "x") for q in range(n)]
    y = [ctx.data(np.float32, 4096, q, "y") for q in range(n)]
    z = [ctx.data(np.int64, 50, q, "z") for q in range(n)]
    xo = np.zeros(4096, np.float32)
    yo = np.zeros(4096, np.float32)
    zo = np.zeros(50 * n, np.int64)
    r1 = comm.Iallreduce(x[r], xo, op=MPI.SUM)
    comm.Allreduce(y[r], yo, op=MPI.SUM)  # blocking one issued after r1, completes first
    r2 = comm.Iallgather(z[r], zo)
    comm.Barrier()
    bb = np.arange(10, dtype=np.float64) * (r + 1)
    comm.Bcast(bb, root=n - 1)
    r2.Wait()
    r1.Wait()
    ctx.check("interleaved: Iallreduce", xo, reduce_ref("SUM", x, np.float32))
    ctx.check("interleaved: Allreduce", yo, reduce_ref("SUM", y, np.float32))
    ctx.check("interleaved: Iallgather", zo, np.concatenate(z))
    ctx.check("interleaved: Bcast", bb, np.arange(10, dtype=np.float64) * n)


@case
def case_many_outstanding(ctx):
    """32 small Iallreduce outstanding at once, waited in a shuffled (rank-independent) order."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    k = 32
    ins = [[ctx.data(np.int32, 3 + j, q, j) for q in range(n)] for j in range(k)]
    outs = [np.zeros(3 + j, np.int32) for j in range(k)]
    reqs = [comm.Iallreduce(ins[j][r], outs[j], op=MPI.SUM) for j in range(k)]
    order = np.random.default_rng(7).permutation(k)
    for j in order:
        reqs[j].Wait()
    for j in range(k):
        ctx.check(f"Iallreduce #{j} of {k}", outs[j], reduce_ref("SUM", ins[j], np.int32))


@case
def case_optional_nonblocking(ctx):
    """Ireduce, Ialltoall, Ireduce_scatter, Iallgatherv, Igather, Iscatter when pycoll has them."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    reqs, checks = [], []
    if hasattr(comm, "Ireduce"):
        ins = [ctx.data(np.float64, 300, q, "ir") for q in range(n)]
        out = np.zeros(300) if r == n - 1 else None
        reqs.append(comm.Ireduce(ins[r], out, op=MPI.MAX, root=n - 1))
        if r == n - 1:
            checks.append(("Ireduce", lambda out=out, ins=ins: (out, reduce_ref("MAX", ins, np.float64))))
    else:
        ctx.note("Ireduce not available")
    if hasattr(comm, "Ialltoall"):
        sends = [ctx.data(np.int16, 5 * n, q, "ia") for q in range(n)]
        out2 = np.zeros(5 * n, np.int16)
        reqs.append(comm.Ialltoall(sends[r], out2))
        exp2 = np.concatenate([sends[q][5 * r:5 * r + 5] for q in range(n)])
        checks.append(("Ialltoall", lambda: (out2, exp2)))
    else:
        ctx.note("Ialltoall not available")
    if hasattr(comm, "Ireduce_scatter"):
        counts = [q + 1 for q in range(n)]
        ins3 = [ctx.data(np.float32, sum(counts), q, "irs") for q in range(n)]
        out3 = np.zeros(counts[r], np.float32)
        reqs.append(comm.Ireduce_scatter(ins3[r], out3, counts, op=MPI.SUM))
        st = sum(counts[:r])
        exp3 = reduce_ref("SUM", ins3, np.float32)[st:st + counts[r]]
        checks.append(("Ireduce_scatter", lambda: (out3, exp3)))
    else:
        ctx.note("Ireduce_scatter not available")
    if hasattr(comm, "Iallgatherv"):
        counts4 = [2 * q + 1 for q in range(n)]
        displs4 = [sum(counts4[:q]) for q in range(n)]
        parts4 = [ctx.data(np.int64, counts4[q], q, "iagv") for q in range(n)]
        out4 = np.zeros(sum(counts4), np.int64)
        reqs.append(comm.Iallgatherv(parts4[r], ctx.vspec(out4, counts4, displs4)))
        checks.append(("Iallgatherv", lambda: (out4, np.concatenate(parts4))))
    else:
        ctx.note("Iallgatherv not available")
    if hasattr(comm, "Igather"):
        parts5 = [ctx.data(np.uint16, 6, q, "ig") for q in range(n)]
        out5 = np.zeros(6 * n, np.uint16) if r == 0 else None
        reqs.append(comm.Igather(parts5[r], out5, root=0))
        if r == 0:
            checks.append(("Igather", lambda: (out5, np.concatenate(parts5))))
    else:
        ctx.note("Igather not available")
    if hasattr(comm, "Iscatter"):
        full6 = ctx.data(np.float32, 4 * n, 0, "is")
        out6 = np.zeros(4, np.float32)
        reqs.append(comm.Iscatter(full6 if r == 0 else None, out6, root=0))
        checks.append(("Iscatter", lambda: (out6, full6[4 * r:4 * r + 4])))
    else:
        ctx.note("Iscatter not available")
    for req in reversed(reqs):
        req.Wait()
    for name, get in checks:
        got, exp = get()
        ctx.check(name, got, exp)
