"""Data-movement collectives (Bcast, gathers, scatters, all-to-all, Barrier) over dtypes x counts x roots."""

from __future__ import annotations

import numpy as np

from . import COUNTS, case, sentinel


def _lab(name, dt, count, inplace=False, root=None):
    s = f"{name} dtype={np.dtype(dt).name} count={count} {'in-place' if inplace else 'out-of-place'}"
    return s if root is None else s + f" root={root}"


def vcounts(count, n):
    """Uneven per-rank counts (rank 0 gets count-1, so count 1 gives a zero-size block)."""
    return [max(0, count + q - 1) if count else 0 for q in range(n)]


def vlayout(counts, gap=2):
    """Displacements placing blocks in reverse rank order with ``gap`` unused elements between them."""
    n = len(counts)
    displs = [0] * n
    pos = gap
    for q in reversed(range(n)):
        displs[q] = pos
        pos += counts[q] + gap
    return displs, pos  # pos = total length incl. gaps


@case
def case_bcast(ctx):
    comm = ctx.comm
    i = 0
    for dt in ctx.dtypes():
        for count in COUNTS:
            # the root rotates with the dtype/count so every root sees many dtypes
            for root in sorted({i % ctx.size, (i + 1) % ctx.size}):
                data = ctx.data(dt, count, root, "bcast", i)
                buf = data.copy() if ctx.rank == root else sentinel(dt, count)
                comm.Bcast(buf, root=root)
                ctx.check(_lab("Bcast", dt, count, root=root), buf, data)
            i += 1


@case
def case_allgather(ctx):
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    for dt in ctx.dtypes():
        for count in COUNTS:
            parts = [ctx.data(dt, count, q) for q in range(n)]
            expected = np.concatenate(parts) if n else parts[0]
            mine = parts[r].copy()
            recv = sentinel(dt, count * n)
            comm.Allgather(mine, recv)
            ctx.check(_lab("Allgather", dt, count), recv, expected)
            ctx.check(_lab("Allgather", dt, count) + " (sendbuf unchanged)", mine, parts[r])
            recv = sentinel(dt, count * n)
            recv[r * count:(r + 1) * count] = parts[r]
            comm.Allgather(MPI.IN_PLACE, recv)
            ctx.check(_lab("Allgather", dt, count, True), recv, expected)


@case
def case_allgatherv(ctx):
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    for dt in ctx.dtypes():
        for count in COUNTS:
            counts = vcounts(count, n)
            displs, total = vlayout(counts)
            parts = [ctx.data(dt, counts[q], q) for q in range(n)]
            expected = sentinel(dt, total)
            for q in range(n):
                expected[displs[q]:displs[q] + counts[q]] = parts[q]
            lab = _lab("Allgatherv", dt, count) + f" counts={counts} displs={displs}"
            mine = parts[r].copy()
            recv = sentinel(dt, total)
            comm.Allgatherv(mine, ctx.vspec(recv, counts, displs))
            ctx.check(lab, recv, expected)
            ctx.check(lab + " (sendbuf unchanged)", mine, parts[r])
            # in place: this rank's block is already at its displacement
            recv = sentinel(dt, total)
            recv[displs[r]:displs[r] + counts[r]] = parts[r]
            comm.Allgatherv(MPI.IN_PLACE, ctx.vspec(recv, counts, displs))
            ctx.check(lab.replace("out-of-place", "in-place"), recv, expected)
            # contiguous layout with a tuple counts and no gaps
            cdispl = [sum(counts[:q]) for q in range(n)]
            recv = sentinel(dt, sum(counts))
            comm.Allgatherv(mine, ctx.vspec(recv, tuple(counts), tuple(cdispl)))
            ctx.check(lab + " contiguous", recv, np.concatenate(parts))


@case
def case_gather(ctx):
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    i = 0
    for dt in ctx.dtypes():
        for count in COUNTS:
            parts = [ctx.data(dt, count, q, i) for q in range(n)]
            expected = np.concatenate(parts)
            for inplace in (False, True):
                root = (i // 2 + i % 2) % n  # every root gets both variants
                i += 1
                lab = _lab("Gather", dt, count, inplace, root)
                mine = parts[r].copy()
                if r == root:
                    recv = sentinel(dt, count * n)
                    if inplace:
                        recv[r * count:(r + 1) * count] = parts[r]
                        comm.Gather(MPI.IN_PLACE, recv, root=root)
                    else:
                        comm.Gather(mine, recv, root=root)
                    ctx.check(lab, recv, expected)
                else:
                    comm.Gather(mine, None, root=root)
                ctx.check(lab + " (sendbuf unchanged)", mine, parts[r])


@case
def case_gatherv(ctx):
    n, r = ctx.size, ctx.rank
    i = 0
    for dt in ctx.dtypes():
        for count in COUNTS:
            root = i % n
            i += 1
            counts = vcounts(count, n)
            displs, total = vlayout(counts)
            parts = [ctx.data(dt, counts[q], q) for q in range(n)]
            lab = _lab("Gatherv", dt, count, root=root) + f" counts={counts}"
            mine = _gatherv_checked(ctx, parts, counts, displs, total, root, lab)
            ctx.check(lab + " (sendbuf unchanged)", mine, parts[r])


def _gatherv_checked(ctx, parts, counts, displs, total, root, lab):
    """One Gatherv of ``parts[rank]`` (a copy, returned), the root's result checked against ``parts``."""
    mine = parts[ctx.rank].copy()
    if ctx.rank != root:
        ctx.comm.Gatherv(mine, None, root=root)
        return mine
    recv = sentinel(mine.dtype, total)
    ctx.comm.Gatherv(mine, ctx.vspec(recv, counts, displs), root=root)
    expected = sentinel(mine.dtype, total)
    for q, part in enumerate(parts):
        expected[displs[q]:displs[q] + counts[q]] = part
    ctx.check(lab, recv, expected)
    return mine


@case
def case_scatter(ctx):
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    i = 0
    for dt in ctx.dtypes():
        for count in COUNTS:
            for inplace in (False, True):
                root = (i // 2 + i % 2) % n  # every root gets both variants
                i += 1
                full = ctx.data(dt, count * n, root, i)
                lab = _lab("Scatter", dt, count, inplace, root)
                expected = full[r * count:(r + 1) * count]
                if r == root:
                    send = full.copy()
                    if inplace:
                        comm.Scatter(send, MPI.IN_PLACE, root=root)
                        ctx.check(lab + " (root's sendbuf unchanged)", send, full)
                        continue
                    recv = sentinel(dt, count)
                    comm.Scatter(send, recv, root=root)
                    ctx.check(lab + " (sendbuf unchanged)", send, full)
                else:
                    recv = sentinel(dt, count)
                    comm.Scatter(None, recv, root=root)
                ctx.check(lab, recv, expected)


@case
def case_scatterv(ctx):
    comm = ctx.comm
    n, r = ctx.size, ctx.rank
    i = 0
    for dt in ctx.dtypes():
        for count in COUNTS:
            root = i % n
            i += 1
            counts = vcounts(count, n)
            displs, total = vlayout(counts)
            full = ctx.data(dt, total, root, i)
            lab = _lab("Scatterv", dt, count, root=root) + f" counts={counts}"
            recv = sentinel(dt, counts[r])
            if r == root:
                send = full.copy()
                comm.Scatterv(ctx.vspec(send, counts, displs), recv, root=root)
                ctx.check(lab + " (sendbuf unchanged)", send, full)
            else:
                comm.Scatterv(None, recv, root=root)
            ctx.check(lab, recv, full[displs[r]:displs[r] + counts[r]])


@case
def case_vector_back_to_back(ctx):
    """Runs of Gatherv, then of Scatterv, calls of one shape (so all but the first take the compiled path), roots
    rotating, each rank's buffers refilled every time, one rank sleeping at the start of a run. A sender whose block
    lies in its arena slot leaves before the root has read it, and may run several calls ahead: it must not overwrite
    a slot before the root has read it."""
    import time

    comm = ctx.comm
    n, r = ctx.size, ctx.rank
    dt = np.dtype(np.float32)
    for run in range(12):
        root, count, length = run % n, (3, 1000, 70_000)[run % 3], 7  # 70k floats: past the slot share
        counts = vcounts(count, n)
        displs, total = vlayout(counts)
        sleeper = root if run % 2 == 0 else (root + 1) % n
        if r == sleeper:
            time.sleep(0.005)  # the others run ahead into this run
        for i in range(length):
            parts = [ctx.data(dt, counts[q], q, run, i) for q in range(n)]
            mine = _gatherv_checked(ctx, parts, counts, displs, total, root, f"Gatherv run {run} #{i} root={root}")
            mine[:] = -1  # the sender reuses its buffer at once
        if r == sleeper:
            time.sleep(0.005)
        for i in range(length):
            full = ctx.data(dt, total, root, run, i, "scatter")
            got = sentinel(dt, counts[r])
            if r == root:
                send = full.copy()
                comm.Scatterv(ctx.vspec(send, counts, displs), got, root=root)
                send[:] = -1  # the root reuses its buffer at once
            else:
                comm.Scatterv(None, got, root=root)
            ctx.check(f"Scatterv run {run} #{i} count={count} root={root}", got, full[displs[r]:displs[r] + counts[r]])


def _alltoall_checked(ctx, sends, expected, lab):
    """This rank's row of ``sends`` through an Alltoall out of place: the result and the send buffer checked."""
    mine = sends[ctx.rank].copy()
    recv = sentinel(mine.dtype, len(expected))
    ctx.comm.Alltoall(mine, recv)
    ctx.check(lab, recv, expected)
    ctx.check(lab + " (sendbuf unchanged)", mine, sends[ctx.rank])


@case
def case_alltoall(ctx):
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    for dt in ctx.dtypes():
        for count in COUNTS:
            sends = [ctx.data(dt, count * n, q) for q in range(n)]
            expected = np.concatenate([sends[q][r * count:(r + 1) * count] for q in range(n)])
            _alltoall_checked(ctx, sends, expected, _lab("Alltoall", dt, count))
            buf = sends[r].copy()
            comm.Alltoall(MPI.IN_PLACE, buf)
            ctx.check(_lab("Alltoall", dt, count, True), buf, expected)


@case
def case_alltoallv(ctx):
    comm = ctx.comm
    ctx.require("Alltoallv")
    n, r = ctx.size, ctx.rank
    for dt in ctx.dtypes():
        for count in COUNTS:
            # rank q sends (count + q + p) % 4 * count//3 ... kept simple: c(q->p) = max(0, count + q - p)
            def c(q, p):
                return max(0, count + q - p) if count else 0

            def layout(cnts):
                displs, total = vlayout(cnts, gap=1)
                return displs, total

            scounts = [c(r, p) for p in range(n)]
            sdispls, stotal = layout(scounts)
            rcounts = [c(q, r) for q in range(n)]
            rdispls, rtotal = layout(rcounts)
            sendbufs = {}
            for q in range(n):
                qs = [c(q, p) for p in range(n)]
                qd, qt = layout(qs)
                sendbufs[q] = (ctx.data(dt, qt, q), qs, qd)
            mine = sendbufs[r][0].copy()
            expected = sentinel(dt, rtotal)
            for q in range(n):
                qbuf, qs, qd = sendbufs[q]
                expected[rdispls[q]:rdispls[q] + rcounts[q]] = qbuf[qd[r]:qd[r] + qs[r]]
            recv = sentinel(dt, rtotal)
            comm.Alltoallv(ctx.vspec(mine, scounts, sdispls), ctx.vspec(recv, rcounts, rdispls))
            lab = _lab("Alltoallv", dt, count)
            ctx.check(lab, recv, expected)
            ctx.check(lab + " (sendbuf unchanged)", mine, sendbufs[r][0])


@case
def case_barrier(ctx):
    """Barrier orders side effects: every rank's file exists once everyone left a barrier, also when one rank
    (each in turn: a leader, a rank of another host) comes 50 ms late."""
    import os
    import time

    comm = ctx.comm
    for _ in range(5):
        comm.Barrier()
    if ctx.out_dir:
        for late in range(ctx.size):
            if ctx.rank == late:
                time.sleep(0.05)
            path = os.path.join(ctx.out_dir, f"barrier.{late}.{ctx.rank}")
            with open(path, "w") as fh:
                fh.write("x")
            comm.Barrier()
            missing = [q for q in range(ctx.size)
                       if not os.path.exists(os.path.join(ctx.out_dir, f"barrier.{late}.{q}"))]
            ctx.expect(not missing, "Barrier", f"files of ranks {missing} missing after Barrier (rank {late} late)")
        comm.Barrier()


@case
def case_alltoall_large_blocks(ctx):
    """Alltoall and Alltoallv with blocks past the small-frame size (odd byte counts, some blocks empty), in and out
    of place, once with rank 1 arriving late: each matches NumPy. Records how many frames moved together in C
    (``Engine.exchange_frames``), how many of those were a host peer's (through its rings), and how many the engine
    finished after C had moved part of them, and how many exchanges ran as a plan's blocks made once."""
    import time

    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    engine = getattr(comm, "_engine", None)
    before = (engine.frames_exchanged, engine.frames_handed_on, engine.ring_frames_exchanged,
              engine.ring_frames_handed_on) if engine is not None else (0, 0, 0, 0)
    for dt, count in ((np.dtype(np.int8), 16 * 1024 + 3), (np.dtype(np.float32), 25_001), (np.dtype(np.float64), 300_001)):
        sends = [ctx.data(dt, count * n, q, "big") for q in range(n)]
        expected = np.concatenate([sends[q][r * count:(r + 1) * count] for q in range(n)])
        for late in (False, True):
            if late and r == 1:
                time.sleep(0.05)
            _alltoall_checked(ctx, sends, expected, _lab("Alltoall", dt, count) + (" rank 1 late" if late else ""))
        buf = sends[r].copy()
        comm.Alltoall(MPI.IN_PLACE, buf)
        ctx.check(_lab("Alltoall", dt, count, True), buf, expected)

        def c(q, p):  # every third pair sends nothing
            return 0 if (q + 2 * p) % 3 == 0 else count + q - p

        scounts, rcounts = [c(r, p) for p in range(n)], [c(q, r) for q in range(n)]
        sdispls, rdispls = [sum(scounts[:p]) for p in range(n)], [sum(rcounts[:q]) for q in range(n)]
        bufs = [ctx.data(dt, sum(c(q, p) for p in range(n)), q, "bigv") for q in range(n)]
        want = np.concatenate([bufs[q][sum(c(q, p) for p in range(r)):][:c(q, r)] for q in range(n)])
        recv = sentinel(dt, sum(rcounts))
        comm.Alltoallv(ctx.vspec(bufs[r].copy(), scounts, sdispls), ctx.vspec(recv, rcounts, rdispls))
        ctx.check(f"Alltoallv dtype={dt.name} counts={scounts}", recv, want)
    # rank 0 still owes the last rank most of a 16 MiB message (an Isend not yet read) as the Alltoall starts
    big = ctx.data(np.dtype(np.uint8), 16 << 20, 0, "owed")
    unwaited = engine.exchanges_unwaited if engine is not None else 0
    req = comm.Isend(big, dest=n - 1, tag=77) if r == 0 and n > 1 else None
    sends = [ctx.data(np.dtype(np.float32), 25_001 * n, q, "after") for q in range(n)]
    _alltoall_checked(ctx, sends, np.concatenate([sends[q][r * 25_001:(r + 1) * 25_001] for q in range(n)]),
                      "Alltoall count=25001 while rank 0 owes a message")
    if req is not None:
        req.Wait()
    if r == n - 1 and n > 1:
        got = np.zeros(16 << 20, np.uint8)
        comm.Recv(got, source=0, tag=77)
        ctx.check("the message owed through the Alltoall", got, big)
    if engine is not None:
        ctx.record("frames exchanged", engine.frames_exchanged - before[0])
        ctx.record("frames handed on", engine.frames_handed_on - before[1])
        ctx.record("ring frames exchanged", engine.ring_frames_exchanged - before[2])
        ctx.record("ring frames handed on", engine.ring_frames_handed_on - before[3])
        plans = comm._x.plans.items()  # whether the Alltoall shapes run as one closure (pycoll.exchanged)
        ctx.record("fast Alltoall", any(callable(p.fast) for (label, _), p in plans if label == "Alltoall"))
        ctx.record("exchanges unwaited", engine.exchanges_unwaited - unwaited)
        ctx.record("block exchanges", engine.block_exchanges)  # of a plan's blocks, made once (frame_exchanger)
        ctx.record("own blocks copied in exchanges", engine.copies_in_exchanges)  # beside them, while sockets wait
