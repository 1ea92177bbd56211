"""Buffer specs: [buf, count], [buf, MPI.TYPE], [buf, count, TYPE], vector specs, bytearray / array.array / memoryview."""

from __future__ import annotations

import array

import numpy as np

from . import BFLOAT16, MPI_TYPE_NAMES, case, reduce_ref, sentinel


@case
def case_explicit_count(ctx):
    """[buf, count] uses only the first count elements; the rest of recvbuf stays untouched."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    ins = [ctx.data(np.float64, 20, q) for q in range(n)]
    exp = reduce_ref("SUM", [a[:5] for a in ins], np.float64)
    recv = sentinel(np.float64, 20)
    comm.Allreduce([ins[r], 5], [recv, 5], op=MPI.SUM)
    ctx.check("Allreduce [buf, 5]", recv[:5], exp)
    ctx.check("Allreduce [buf, 5] tail untouched", recv[5:], sentinel(np.float64, 15))

    buf = ins[r].copy()
    comm.Allreduce(MPI.IN_PLACE, [buf, 5, MPI.DOUBLE], op=MPI.SUM)
    ctx.check("Allreduce IN_PLACE [buf, 5, DOUBLE]", buf[:5], exp)
    ctx.check("Allreduce IN_PLACE [buf, 5, DOUBLE] tail", buf[5:], ins[r][5:])

    data = ctx.data(np.int32, 10, 0)
    buf = data.copy() if r == 0 else sentinel(np.int32, 10)
    comm.Bcast([buf, 4], root=0)
    exp_b = sentinel(np.int32, 10)
    exp_b[:4] = data[:4]
    ctx.check("Bcast [buf, 4]", buf, data if r == 0 else exp_b)


@case
def case_allgather_explicit_count(ctx):
    """In a collective's recv spec [buf, count, TYPE] the count is per rank (mpi4py), not the total."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    parts = [ctx.data(np.int64, 3, q) for q in range(n)]
    recv = sentinel(np.int64, 3 * n + 4)
    comm.Allgather([parts[r], 3, MPI.INT64_T], [recv, 3, MPI.INT64_T])
    ctx.check("Allgather [buf, 3, INT64_T]", recv[:3 * n], np.concatenate(parts))
    ctx.check("Allgather recv tail untouched", recv[3 * n:], sentinel(np.int64, 4))


@case
def case_explicit_datatype(ctx):
    """[buf, MPI.TYPE] and [buf, count, MPI.TYPE] for every dtype that has an MPI name."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    for dname_, tname in MPI_TYPE_NAMES.items():
        if not hasattr(MPI, tname):
            ctx.note(f"MPI.{tname} missing")
            continue
        mtype = getattr(MPI, tname)
        dt = np.dtype(dname_)
        ins = [ctx.data(dt, 13, q) for q in range(n)]
        exp = reduce_ref("SUM", ins, dt)
        recv = sentinel(dt, 13)
        comm.Allreduce([ins[r], mtype], [recv, mtype], op=MPI.SUM)
        ctx.check(f"Allreduce [buf, MPI.{tname}]", recv, exp)
        recv = sentinel(dt, 13)
        comm.Allreduce([ins[r], 13, mtype], [recv, 13, mtype], op=MPI.SUM)
        ctx.check(f"Allreduce [buf, 13, MPI.{tname}]", recv, exp)
    # C-name aliases (and pycoll's half-precision names)
    aliases = [("INT", np.int32), ("SHORT", np.int16), ("LONG", np.int64), ("DOUBLE", np.float64)]
    if ctx.impl == "pycoll":
        aliases += [("FLOAT16", np.float16)] + ([("BFLOAT16", BFLOAT16)] if BFLOAT16 is not None else [])
    for tname, dt in aliases:
        if not hasattr(MPI, tname):
            ctx.note(f"MPI.{tname} missing")
            continue
        ins = [ctx.data(dt, 4, q) for q in range(n)]
        recv = sentinel(dt, 4)
        comm.Allreduce([ins[r], getattr(MPI, tname)], [recv, getattr(MPI, tname)], op=MPI.SUM)
        ctx.check(f"Allreduce [buf, MPI.{tname}]", recv, reduce_ref("SUM", ins, dt))


@case
def case_vector_spec_with_type(ctx):
    """[buf, counts, displs, TYPE] for Allgatherv / Gatherv / Scatterv."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    counts = [q + 1 for q in range(n)]
    displs = [sum(counts[:q]) + q for q in range(n)]  # one-element gaps
    total = displs[-1] + counts[-1]
    parts = [ctx.data(np.float32, counts[q], q) for q in range(n)]
    exp = sentinel(np.float32, total)
    for q in range(n):
        exp[displs[q]:displs[q] + counts[q]] = parts[q]
    recv = sentinel(np.float32, total)
    comm.Allgatherv([parts[r], MPI.FLOAT], [recv, counts, displs, MPI.FLOAT])
    ctx.check("Allgatherv [buf, counts, displs, FLOAT]", recv, exp)
    root = n // 2
    recv = sentinel(np.float32, total) if r == root else None
    comm.Gatherv([parts[r], counts[r], MPI.FLOAT], [recv, counts, displs, MPI.FLOAT] if r == root else None, root=root)
    if r == root:
        ctx.check("Gatherv [buf, counts, displs, FLOAT]", recv, exp)
    out = sentinel(np.float32, counts[r])
    comm.Scatterv([exp, counts, displs, MPI.FLOAT] if r == root else None, [out, MPI.FLOAT], root=root)
    ctx.check("Scatterv [buf, counts, displs, FLOAT]", out, parts[r])


@case
def case_vector_spec_mpi4py_forms(ctx):
    """mpi4py's own vector forms: [buf, (counts, displs)], [buf, (counts, displs), TYPE], [buf, counts] (packed)."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    counts = [2 * q + 1 for q in range(n)]
    displs = [sum(counts[:q]) for q in range(n)]
    parts = [ctx.data(np.int32, counts[q], q) for q in range(n)]
    exp = np.concatenate(parts)
    recv = sentinel(np.int32, sum(counts))
    comm.Allgatherv(parts[r], [recv, (counts, displs)])
    ctx.check("Allgatherv [buf, (counts, displs)]", recv, exp)
    recv = sentinel(np.int32, sum(counts))
    comm.Allgatherv(parts[r], [recv, (counts, displs), MPI.INT32_T])
    ctx.check("Allgatherv [buf, (counts, displs), INT32_T]", recv, exp)
    recv = sentinel(np.int32, sum(counts))
    comm.Allgatherv(parts[r], [recv, (counts, None)])
    ctx.check("Allgatherv [buf, (counts, None)] (packed displacements)", recv, exp)


@case
def case_bytearray(ctx):
    """bytearray buffers: Bcast, Allgather, bitwise Allreduce."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    payload = bytes(ctx.data(np.uint8, 300, 0, op="BOR"))
    buf = bytearray(payload) if r == 0 else bytearray(300)
    comm.Bcast(buf, root=0)
    ctx.check_equal("Bcast bytearray", bytes(buf), payload)

    buf = bytearray(payload) if r == 0 else bytearray(300)
    comm.Bcast([buf, MPI.BYTE], root=0)
    ctx.check_equal("Bcast [bytearray, MPI.BYTE]", bytes(buf), payload)

    if hasattr(MPI, "CHAR"):
        buf = bytearray(b"hello pycoll") if r == 0 else bytearray(12)
        comm.Bcast([buf, MPI.CHAR], root=0)
        ctx.check_equal("Bcast [bytearray, MPI.CHAR]", bytes(buf), b"hello pycoll")

    mine = bytearray([r + 1] * 5)
    recv = bytearray(5 * n)
    comm.Allgather(mine, recv)
    ctx.check_equal("Allgather bytearray", bytes(recv), b"".join(bytes([q + 1] * 5) for q in range(n)))

    ins = [ctx.data(np.uint8, 64, q, op="BOR") for q in range(n)]
    recv = bytearray(64)
    comm.Allreduce(bytearray(ins[r].tobytes()), recv, op=MPI.BOR)
    ctx.check_equal("Allreduce BOR bytearray", bytes(recv), reduce_ref("BOR", ins, np.uint8).tobytes())
    recv = bytearray(ins[r].tobytes())
    comm.Allreduce(MPI.IN_PLACE, recv, op=MPI.BXOR)
    ctx.check_equal("Allreduce BXOR bytearray in-place", bytes(recv), reduce_ref("BXOR", ins, np.uint8).tobytes())


@case
def case_array_module(ctx):
    """array.array buffers: 'd' Allreduce, 'i' Allgather, 'f' Reduce_scatter_block, 'q' Bcast."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    ins = [ctx.data(np.float64, 9, q) for q in range(n)]
    send = array.array("d", ins[r].tolist())
    recv = array.array("d", [0.0] * 9)
    comm.Allreduce(send, recv, op=MPI.SUM)
    ctx.check("Allreduce array('d')", np.frombuffer(recv, np.float64), reduce_ref("SUM", ins, np.float64))
    ctx.check("Allreduce array('d') sendbuf unchanged", np.frombuffer(send, np.float64), ins[r])

    send = array.array("i", [r * 10 + k for k in range(3)])
    recv = array.array("i", [0] * (3 * n))
    comm.Allgather(send, recv)
    ctx.check_equal("Allgather array('i')", list(recv), [q * 10 + k for q in range(n) for k in range(3)])

    ins = [ctx.data(np.float32, 4 * n, q) for q in range(n)]
    send = array.array("f", ins[r].tolist())
    recv = array.array("f", [0.0] * 4)
    comm.Reduce_scatter_block(send, recv, op=MPI.SUM)
    ctx.check(
        "Reduce_scatter_block array('f')",
        np.frombuffer(recv, np.float32),
        reduce_ref("SUM", ins, np.float32)[4 * r:4 * r + 4],
    )

    buf = array.array("q", [7, -8, 9] if r == n - 1 else [0, 0, 0])
    comm.Bcast(buf, root=n - 1)
    ctx.check_equal("Bcast array('q')", list(buf), [7, -8, 9])


@case
def case_memoryview_and_views(ctx):
    """memoryview buffers and contiguous NumPy slices."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    ins = [ctx.data(np.int32, 16, q) for q in range(n)]
    recv = np.zeros(16, np.int32)
    comm.Allreduce(memoryview(ins[r]), memoryview(recv), op=MPI.SUM)
    ctx.check("Allreduce memoryview", recv, reduce_ref("SUM", ins, np.int32))
    big = sentinel(np.int32, 40)
    comm.Allreduce(ins[r][4:12], big[10:18], op=MPI.SUM)
    exp = sentinel(np.int32, 40)
    exp[10:18] = reduce_ref("SUM", [a[4:12] for a in ins], np.int32)
    ctx.check("Allreduce into a contiguous slice", big, exp)
