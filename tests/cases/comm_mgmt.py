"""Communicator management: Split (colors, keys, UNDEFINED), Dup, Free, and collectives on sub-communicators."""

from __future__ import annotations

import numpy as np

from . import case, reduce_ref


def _split_members(n, color_of, key_of):
    """The expected groups: color -> world ranks ordered by (key, world rank)."""
    groups = {}
    for q in range(n):
        c = color_of(q)
        if c is None:
            continue
        groups.setdefault(c, []).append(q)
    return {c: sorted(m, key=lambda q: (key_of(q), q)) for c, m in groups.items()}


@case
def case_split_parity(ctx):
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    sub = comm.Split(r % 2, key=0)
    members = _split_members(n, lambda q: q % 2, lambda q: 0)[r % 2]
    ctx.check_equal("Split size", sub.Get_size(), len(members))
    ctx.check_equal("Split rank", sub.Get_rank(), members.index(r))
    ctx.check_equal("Split .rank/.size properties", (sub.rank, sub.size), (sub.Get_rank(), sub.Get_size()))
    ins = {q: ctx.data(np.float64, 257, q) for q in members}
    out = np.zeros(257)
    sub.Allreduce(ins[r], out, op=MPI.SUM)
    ctx.check("Allreduce on Split", out, reduce_ref("SUM", [ins[q] for q in members], np.float64))
    got = sub.allgather(r)
    ctx.check_equal("allgather on Split gives world ranks in sub order", got, members)
    root_data = ctx.data(np.int32, 10, members[-1])
    buf = root_data.copy() if r == members[-1] else np.zeros(10, np.int32)
    sub.Bcast(buf, root=len(members) - 1)
    ctx.check("Bcast on Split from last sub rank", buf, root_data)
    sub.Barrier()
    sub.Free()


@case
def case_split_keys_reverse(ctx):
    """key = -rank reverses the order; the sub-communicator's rank follows the key."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    sub = comm.Split(0, key=-r)
    ctx.check_equal("reverse Split rank", sub.Get_rank(), n - 1 - r)
    ctx.check_equal("reverse Split size", sub.Get_size(), n)
    parts = sub.allgather(r)
    ctx.check_equal("reverse Split allgather", parts, list(reversed(range(n))))
    mine = np.full(3, r, np.int64)
    out = np.zeros(3 * n, np.int64)
    sub.Allgather(mine, out)
    ctx.check("reverse Split Allgather", out, np.repeat(np.arange(n - 1, -1, -1, dtype=np.int64), 3))
    sub.Free()


@case
def case_split_undefined(ctx):
    """color UNDEFINED gives COMM_NULL; the others form a communicator."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    excluded = r == n - 1 and n > 1
    sub = comm.Split(MPI.UNDEFINED if excluded else 7, key=r)
    if excluded:
        ctx.expect(sub == MPI.COMM_NULL, "Split UNDEFINED", "did not return COMM_NULL", got=repr(sub))
    else:
        ctx.expect(sub != MPI.COMM_NULL, "Split color 7", "returned COMM_NULL")
        m = n - 1 if n > 1 else 1
        ctx.check_equal("Split size without the UNDEFINED rank", sub.Get_size(), m)
        out = np.zeros(4, np.int32)
        sub.Allreduce(np.full(4, r + 1, np.int32), out, op=MPI.SUM)
        ctx.check("Allreduce without the UNDEFINED rank", out, np.full(4, m * (m + 1) // 2, np.int32))
        sub.Free()
    comm.Barrier()


@case
def case_split_many_colors(ctx):
    """Three colors (some groups of one), keys descending, Reduce_scatter_block and p2p on each."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    color_of = lambda q: q % 3  # noqa: E731
    key_of = lambda q: 10 - q  # noqa: E731
    members = _split_members(n, color_of, key_of)[color_of(r)]
    sub = comm.Split(color_of(r), key_of(r))
    m, sr = len(members), members.index(r)
    ctx.check_equal("3-color Split rank", sub.Get_rank(), sr)
    ins = {q: ctx.data(np.int16, 5 * m, q, op="BOR") for q in members}
    out = np.zeros(5, np.int16)
    sub.Reduce_scatter_block(ins[r], out, op=MPI.BOR)
    ctx.check("Reduce_scatter_block on 3-color Split", out, reduce_ref("BOR", [ins[q] for q in members], np.int16)[5 * sr:5 * sr + 5])
    # ring on the sub-communicator with sub-ranks
    right, left = (sr + 1) % m, (sr - 1) % m
    inbuf = np.zeros(6, np.float32)
    req = sub.Irecv(inbuf, source=left, tag=4)
    sub.Send(np.full(6, r, np.float32), dest=right, tag=4)
    req.Wait()
    ctx.check("ring on Split uses sub ranks", inbuf, np.full(6, members[left], np.float32))
    # a wildcard receive reports the sender's rank in the sub-communicator
    if m > 1:
        if sr == 0:
            st = MPI.Status()
            buf = np.zeros(2, np.int64)
            comm_src = set()
            for _ in range(m - 1):
                sub.Recv(buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=st)
                ctx.check_equal("Split ANY_SOURCE status is a sub rank", st.Get_source(), int(buf[0]))
                ctx.check_equal("Split ANY_TAG status", st.Get_tag(), 50 + int(buf[0]))
                comm_src.add(int(buf[0]))
            ctx.check_equal("Split ANY_SOURCE senders", comm_src, set(range(1, m)))
        else:
            sub.Send(np.array([sr, r], np.int64), dest=0, tag=50 + sr)
        sub.Barrier()
    sub.Free()


@case
def case_dup(ctx):
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    dup = comm.Dup()
    ctx.check_equal("Dup rank/size", (dup.Get_rank(), dup.Get_size()), (r, n))
    ctx.expect(dup is not comm, "Dup", "Dup returned the same object")
    ins = [ctx.data(np.float32, 100, q) for q in range(n)]
    out = np.zeros(100, np.float32)
    dup.Allreduce(ins[r], out, op=MPI.SUM)
    ctx.check("Allreduce on Dup", out, reduce_ref("SUM", ins, np.float32))
    dup2 = dup.Dup()
    ctx.check_equal("Dup of Dup", dup2.allreduce(r, op=MPI.SUM), n * (n - 1) // 2)
    dup2.Free()
    dup.Free()


@case
def case_interleave_parent_child(ctx):
    """Nonblocking collectives on parent, Dup and Split outstanding at once; p2p with equal tags on each."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    dup = comm.Dup()
    sub = comm.Split(r % 2, key=r)
    members = [q for q in range(n) if q % 2 == r % 2]
    a = [ctx.data(np.float64, 5000, q, "a") for q in range(n)]
    b = [ctx.data(np.float64, 5000, q, "b") for q in range(n)]
    c = [ctx.data(np.float64, 5000, q, "c") for q in range(n)]
    ao, bo, co = np.zeros(5000), np.zeros(5000), np.zeros(5000)
    ra = comm.Iallreduce(a[r], ao, op=MPI.SUM)
    rb = dup.Iallreduce(b[r], bo, op=MPI.SUM)
    rc = sub.Iallreduce(c[r], co, op=MPI.SUM)
    # blocking collectives on each communicator while the others are outstanding
    ctx.check_equal("blocking allreduce on sub meanwhile", sub.allreduce(1, op=MPI.SUM), len(members))
    ctx.check_equal("blocking allreduce on dup meanwhile", dup.allreduce(1, op=MPI.SUM), n)
    ctx.check_equal("blocking allreduce on world meanwhile", comm.allreduce(1, op=MPI.SUM), n)
    rc.Wait()
    ra.Wait()
    rb.Wait()
    ctx.check("Iallreduce on world", ao, reduce_ref("SUM", a, np.float64))
    ctx.check("Iallreduce on dup", bo, reduce_ref("SUM", b, np.float64))
    ctx.check("Iallreduce on sub", co, reduce_ref("SUM", [c[q] for q in members], np.float64))
    # the same tag on world and dup: messages stay on their communicator
    right, left = (r + 1) % n, (r - 1) % n
    x, y = np.zeros(3, np.int32), np.zeros(3, np.int32)
    reqs = [dup.Irecv(y, source=left, tag=9), comm.Irecv(x, source=left, tag=9)]
    comm.Send(np.full(3, 1000 + r, np.int32), dest=right, tag=9)
    dup.Send(np.full(3, 2000 + r, np.int32), dest=right, tag=9)
    MPI.Request.Waitall(reqs)
    ctx.check("world p2p not matched by dup", x, np.full(3, 1000 + left, np.int32))
    ctx.check("dup p2p not matched by world", y, np.full(3, 2000 + left, np.int32))
    sub.Free()
    dup.Free()


@case
def case_nested_split(ctx):
    """Split of a Split, then a collective on each level in turn."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    half = comm.Split(int(r >= n // 2), key=0)
    quarter = half.Split(half.Get_rank() % 2, key=0)
    for _ in range(3):
        w = comm.allreduce(r, op=MPI.SUM)
        h = half.allreduce(r, op=MPI.SUM)
        q = quarter.allreduce(r, op=MPI.SUM)
    hm = [p for p in range(n) if int(p >= n // 2) == int(r >= n // 2)]
    qm = [p for i, p in enumerate(hm) if i % 2 == hm.index(r) % 2]
    ctx.check_equal("world sum", w, n * (n - 1) // 2)
    ctx.check_equal("half sum", h, sum(hm))
    ctx.check_equal("quarter sum", q, sum(qm))
    quarter.Free()
    half.Free()


@case
def case_many_dups(ctx):
    """Creating and freeing many communicators does not leak or confuse them."""
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    live = []
    for i in range(20):
        d = comm.Dup()
        ctx.check_equal(f"dup #{i} allreduce", d.allreduce(i, op=MPI.SUM), i * n)
        live.append(d)
        if i % 3 == 2:
            live.pop(0).Free()
    for d in live:
        d.Barrier()
        d.Free()


@case
def case_world_is_init(ctx):
    """pycoll.init() returns COMM_WORLD's communicator; rank/size agree."""
    comm, MPI = ctx.comm, ctx.MPI
    ctx.check_equal("rank property", comm.rank, comm.Get_rank())
    ctx.check_equal("size property", comm.size, comm.Get_size())
    if ctx.impl == "pycoll":
        import pycoll

        w = pycoll.init()
        ctx.check_equal("pycoll.init() rank", w.Get_rank(), comm.Get_rank())
        ctx.expect(w is MPI.COMM_WORLD or w == MPI.COMM_WORLD, "pycoll.init()", "is not MPI.COMM_WORLD", got=repr(w))
        ctx.check_equal("pycoll.init() twice", pycoll.init() is w or pycoll.init() == w, True)


@case
def case_use_after_free(ctx):
    """A freed communicator raises InvalidArgumentError (pycoll) / MPI.Exception (mpi4py)."""
    comm, MPI = ctx.comm, ctx.MPI
    d = comm.Dup()
    d.Barrier()
    d.Free()
    if ctx.impl == "pycoll":
        from pycoll.errors import InvalidArgumentError

        err = ctx.raises("Allreduce on freed comm", InvalidArgumentError, d.Allreduce, np.ones(2), np.zeros(2))
        if err is not None:
            ctx.expect(err.op is None or "Allreduce" in str(err.op), "freed comm error op", "op does not name Allreduce", got=err.op)
        ctx.raises("Barrier on freed comm", InvalidArgumentError, d.Barrier)
        ctx.raises("bcast on freed comm", InvalidArgumentError, d.bcast, 1)
    comm.Barrier()


@case
def case_singletons(ctx):
    """COMM_SELF and one-rank Split communicators: collectives are local copies / identities."""
    comm, MPI = ctx.comm, ctx.MPI
    r = ctx.rank
    comms = [("Split(color=rank)", comm.Split(r, key=0))]
    if hasattr(MPI, "COMM_SELF"):
        comms.append(("COMM_SELF", MPI.COMM_SELF))
    else:
        ctx.note("MPI.COMM_SELF missing")
    for name, c in comms:
        ctx.check_equal(f"{name} size/rank", (c.Get_size(), c.Get_rank()), (1, 0))
        x = ctx.data(np.float32, 1000, r)
        out = np.zeros(1000, np.float32)
        c.Allreduce(x, out, op=MPI.MAX)
        ctx.check(f"{name} Allreduce is a copy", out, x)
        ag = np.zeros(1000, np.float32)
        c.Allgather(x, ag)
        ctx.check(f"{name} Allgather is a copy", ag, x)
        b = x.copy()
        c.Bcast(b, root=0)
        ctx.check(f"{name} Bcast leaves the buffer", b, x)
        ctx.check_equal(f"{name} allgather object", c.allgather({"r": r}), [{"r": r}])
        c.Barrier()
    comms[0][1].Free()
    comm.Barrier()
