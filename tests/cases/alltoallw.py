"""Alltoallw and Ialltoallw cases: per-peer datatypes and byte displacements, checked byte for byte against NumPy."""

from __future__ import annotations

import numpy as np

from . import case

# the datatype of the block between sender j and receiver i: KINDS[(i + j) % len(KINDS)]
KINDS = [("INT32_T", np.int32), ("DOUBLE", np.float64), ("INT16_T", np.int16), ("C_FLOAT_COMPLEX", np.complex64),
         ("UINT8_T", np.uint8)]
FILL = 0xAB


def _count(src, dst, salt):
    """Elements from src to dst: zero for some pairs (every third), up to 4 otherwise."""
    return (src + 2 * dst + salt) % 4


def _values(src, dst, salt):
    dt = KINDS[(src + dst) % len(KINDS)][1]
    return (np.arange(_count(src, dst, salt)) + 100 * src + 10 * dst + salt).astype(dt)


def _layout(sizes, gap=3):
    """Byte displacements placing the blocks in reverse rank order with ``gap`` unused bytes between them."""
    displs = [0] * len(sizes)
    pos = gap
    for q in reversed(range(len(sizes))):
        displs[q] = pos
        pos += sizes[q] + gap
    return displs, pos


def _spec(MPI, buf, counts, displs, types, form):
    if form == 0:
        return [buf, counts, displs, types]
    return [buf, (counts, displs), types]


def _sides(ctx, salt):
    """This rank's send side (bytes, counts, displs, types) and receive side, and the receive buffer expected."""
    MPI, n, r = ctx.MPI, ctx.size, ctx.rank
    out = [_values(r, i, salt) for i in range(n)]
    sdispls, stotal = _layout([a.nbytes for a in out])
    sbuf = np.zeros(stotal, np.uint8)
    for a, d in zip(out, sdispls):
        sbuf[d:d + a.nbytes] = a.view(np.uint8)
    stypes = [getattr(MPI, KINDS[(r + i) % len(KINDS)][0]) for i in range(n)]
    inc = [_values(j, r, salt) for j in range(n)]
    rdispls, rtotal = _layout([a.nbytes for a in inc], gap=5)
    expected = np.full(rtotal, FILL, np.uint8)
    for a, d in zip(inc, rdispls):
        expected[d:d + a.nbytes] = a.view(np.uint8)
    rtypes = [getattr(MPI, KINDS[(j + r) % len(KINDS)][0]) for j in range(n)]
    send = (sbuf, [a.size for a in out], sdispls, stypes)
    recv = ([a.size for a in inc], rdispls, rtypes, rtotal)
    return send, recv, expected


@case
def case_mixed(ctx):
    """Mixed datatypes, zero counts, gaps and reverse order, blocking and nonblocking, both spec forms."""
    comm, MPI = ctx.comm, ctx.MPI
    for salt in range(3):
        for nonblocking in (False, True):
            send, (rc, rd, rt, rtotal), expected = _sides(ctx, salt)
            rbuf = np.full(rtotal, FILL, np.uint8)
            smsg = _spec(MPI, send[0], *send[1:], salt % 2)
            rmsg = _spec(MPI, rbuf, rc, rd, rt, (salt + 1) % 2)
            if nonblocking:
                comm.Ialltoallw(smsg, rmsg).Wait()
            else:
                comm.Alltoallw(smsg, rmsg)
            ctx.check(f"{'Ialltoallw' if nonblocking else 'Alltoallw'} salt={salt}", rbuf, expected)


@case
def case_typed_buffers(ctx):
    """Typed NumPy buffers (not bytes): displacements are still in bytes (16 per block of two int64)."""
    comm, MPI, n, r = ctx.comm, ctx.MPI, ctx.size, ctx.rank
    sbuf = np.arange(2 * n, dtype=np.int64) + 1000 * r
    rview = np.full(2 * n, -1, np.int64)
    comm.Alltoallw([sbuf, [2] * n, [16 * i for i in range(n)], [MPI.INT64_T] * n],
                   [rview, [2] * n, [16 * j for j in range(n)], [MPI.INT64_T] * n])
    expected = np.concatenate([np.arange(2 * r, 2 * r + 2, dtype=np.int64) + 1000 * j for j in range(n)])
    ctx.check("Alltoallw int64", rview, expected)


@case
def case_derived(ctx):
    """A strided vector datatype on the receive side (every other element), a contiguous one on the send side."""
    comm, MPI, n, r = ctx.comm, ctx.MPI, ctx.size, ctx.rank
    pair = MPI.INT32_T.Create_contiguous(2).Commit()
    every_other = MPI.INT32_T.Create_vector(2, 1, 2).Commit()
    try:
        sbuf = (np.arange(2 * n) + 10 * r).astype(np.int32)
        rbuf = np.full(4 * n, -1, np.int32)
        for nonblocking in (False, True):
            rbuf[:] = -1
            smsg = [sbuf, [1] * n, [8 * i for i in range(n)], [pair] * n]
            rmsg = [rbuf, [1] * n, [16 * j for j in range(n)], [every_other] * n]
            if nonblocking:
                comm.Ialltoallw(smsg, rmsg).Wait()
            else:
                comm.Alltoallw(smsg, rmsg)
            expected = np.full(4 * n, -1, np.int32)
            for j in range(n):
                expected[4 * j] = 10 * j + 2 * r
                expected[4 * j + 2] = 10 * j + 2 * r + 1
            ctx.check(f"{'I' if nonblocking else ''}Alltoallw vector recv", rbuf, expected)
    finally:
        pair.Free()
        every_other.Free()


@case
def case_in_place(ctx):
    """MPI.IN_PLACE: each rank's block for rank i is replaced by rank i's block for it (mixed types, gaps)."""
    comm, MPI, n, r = ctx.comm, ctx.MPI, ctx.size, ctx.rank
    # the block between r and i has the same count and type both ways: symmetric in (r, i)
    blocks = [(np.arange((r + i) % 3) + 100 * r + 10 * i).astype(KINDS[(r + i) % len(KINDS)][1]) for i in range(n)]
    displs, total = _layout([b.nbytes for b in blocks])
    buf = np.full(total, FILL, np.uint8)
    for b, d in zip(blocks, displs):
        buf[d:d + b.nbytes] = b.view(np.uint8)
    expected = np.full(total, FILL, np.uint8)
    for i, d in enumerate(displs):
        theirs = (np.arange((r + i) % 3) + 100 * i + 10 * r).astype(KINDS[(r + i) % len(KINDS)][1])
        expected[d:d + theirs.nbytes] = theirs.view(np.uint8)
    types = [getattr(MPI, KINDS[(r + i) % len(KINDS)][0]) for i in range(n)]
    for nonblocking in (False, True):
        work = buf.copy()
        msg = [work, [b.size for b in blocks], displs, types]
        if nonblocking:
            comm.Ialltoallw(MPI.IN_PLACE, msg).Wait()
        else:
            comm.Alltoallw(MPI.IN_PLACE, msg)
        ctx.check(f"{'I' if nonblocking else ''}Alltoallw in place", work, expected)


@case
def case_errors(ctx):
    """Wrong arguments raise typed errors naming the op and rank, on every rank, and the comm stays usable."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll's error classes")
    from pycoll import errors

    comm, MPI, n, r = ctx.comm, ctx.MPI, ctx.size, ctx.rank
    sbuf, rbuf = np.zeros(n, np.int32), np.zeros(n, np.int64)
    # sizes that differ between a sender's block (4 bytes) and the receiver's (8 bytes): every rank sees it
    exc = ctx.raises("size mismatch", errors.MismatchError, comm.Alltoallw,
                     [sbuf, [1] * n, [4 * i for i in range(n)], [MPI.INT32_T] * n],
                     [rbuf, [1] * n, [8 * j for j in range(n)], [MPI.INT64_T] * n])
    if exc is not None:
        ctx.expect("Alltoallw" in str(exc.op) and exc.rank == r and "bytes" in exc.cause, "mismatch names op/rank/cause",
                   got=str(exc))
    # a counts list of the wrong length on rank 0 only: it raises InvalidArgumentError, the others RemoteError
    counts = [1] * (n + 1) if r == 0 else [1] * n
    want = errors.InvalidArgumentError if r == 0 else errors.RemoteError
    exc = ctx.raises("bad counts length", want, comm.Ialltoallw,
                     [sbuf, counts, [4 * i for i in range(n)], [MPI.INT32_T] * n],
                     [sbuf.copy(), [1] * n, [4 * j for j in range(n)], [MPI.INT32_T] * n])
    if exc is not None:
        ctx.expect("Ialltoallw" in str(exc.op) and exc.rank == r, "bad length names op/rank", got=str(exc))
        if r == 0:
            ctx.expect("counts" in exc.cause, "bad length cause", got=exc.cause)
        else:
            ctx.expect(0 in exc.peers, "peer named", got=exc.peers)
    # a block past the end of the buffer
    ctx.raises("block past the end", errors.InvalidArgumentError, comm.Alltoallw,
               [sbuf, [2] * n, [4 * i for i in range(n)], [MPI.INT32_T] * n],
               [np.zeros(2 * n, np.int32), [2] * n, [8 * j for j in range(n)], [MPI.INT32_T] * n])
    # the comm still works
    rb = np.full(n, -1, np.int32)
    comm.Alltoallw([np.arange(n, dtype=np.int32) + 10 * r, [1] * n, [4 * i for i in range(n)], [MPI.INT32_T] * n],
                   [rb, [1] * n, [4 * j for j in range(n)], [MPI.INT32_T] * n])
    ctx.check("Alltoallw after errors", rb, (np.arange(n) * 10 + r).astype(np.int32))
