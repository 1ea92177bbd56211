"""Programs whose calls change length: a new length's plan made from a checked one (``Plan.resizable``) gives the
same results and errors as a plan made from scratch, and plans the cache lets go leave no cyclic garbage."""

from __future__ import annotations

import gc

import numpy as np

from . import case, sentinel

_LENGTHS = (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610)


def _resizing_calls(ctx, comm, n, k):
    """One call of every collective with a length of its own (``n``), on fresh arrays, each checked against NumPy."""
    MPI, r, p = ctx.MPI, ctx.rank, ctx.size
    dt = np.float64 if k % 2 else np.int32
    T = MPI.DOUBLE if dt is np.float64 else MPI.INT32_T
    ins = [np.arange(n, dtype=dt) * (q + 1) + k for q in range(p)]
    total = sum(ins)
    send, out = ins[r].copy(), sentinel(dt, n)
    comm.Allreduce([send, T], [out, T], op=MPI.SUM)
    ctx.check(f"Allreduce spec n={n}", out, total)
    out = sentinel(dt, n)
    comm.Allreduce([send, n, T], [out, n, T], op=MPI.SUM)  # mpi4py's explicit count, the whole array
    ctx.check(f"Allreduce spec with a count n={n}", out, total)
    longer = sentinel(dt, n + 2)  # a count short of the array: the rest untouched
    comm.Allreduce([send, n, T], [longer, n, T], op=MPI.SUM)
    ctx.check(f"Allreduce spec with a count short of the array n={n}", longer,
              np.concatenate([total, sentinel(dt, n + 2)[n:]]))
    out = sentinel(dt, n)
    comm.Allreduce(send, out, op=MPI.MAX)
    ctx.check(f"Allreduce bare MAX n={n}", out, ins[-1] if n else out)
    whole = ins[r].copy()
    comm.Allreduce(MPI.IN_PLACE, [whole, T], op=MPI.SUM)
    ctx.check(f"Allreduce in place n={n}", whole, total)
    root = k % p
    out = sentinel(dt, n)
    comm.Reduce([send, T], [out, T] if r == root else None, op=MPI.SUM, root=root)
    if r == root:
        ctx.check(f"Reduce root={root} n={n}", out, total)
    buf = ins[root].copy() if r == root else sentinel(dt, n)
    comm.Bcast([buf, T], root=root)
    ctx.check(f"Bcast root={root} n={n}", buf, ins[root])
    out = sentinel(dt, n)
    comm.Scan([send, T], [out, T], op=MPI.SUM)
    ctx.check(f"Scan n={n}", out, sum(ins[:r + 1]))
    out = sentinel(dt, n)
    comm.Exscan([send, T], [out, T], op=MPI.SUM)
    if r:
        ctx.check(f"Exscan n={n}", out, sum(ins[:r]))
    ctx.check(f"sendbuf unchanged n={n}", send, ins[r])
    blocks = [np.arange(n * p, dtype=dt) * (q + 2) - k for q in range(p)]  # rank q's p blocks of n
    out = sentinel(dt, n * p)
    comm.Allgather([send, T], [out, T])
    ctx.check(f"Allgather n={n}", out, np.concatenate(ins))
    out = sentinel(dt, n * p)
    comm.Allgather([send, n, T], [out, n, T])  # a recvbuf spec's count is per block
    ctx.check(f"Allgather spec with a count n={n}", out, np.concatenate(ins))
    out = sentinel(dt, n * p)
    comm.Alltoall([blocks[r], T], [out, T])
    ctx.check(f"Alltoall n={n}", out, np.concatenate([b[r * n:(r + 1) * n] for b in blocks]))
    part = sentinel(dt, n)
    comm.Reduce_scatter_block([blocks[r], T], [part, T], op=MPI.SUM)
    ctx.check(f"Reduce_scatter_block n={n}", part, sum(blocks)[r * n:(r + 1) * n])
    whole = blocks[r].copy()
    comm.Reduce_scatter_block(MPI.IN_PLACE, [whole, T], op=MPI.SUM)
    ctx.check(f"Reduce_scatter_block in place n={n}", whole[:n], sum(blocks)[r * n:(r + 1) * n])
    out = sentinel(dt, n * p)
    comm.Gather([send, T], [out, T] if r == root else None, root=root)
    if r == root:
        ctx.check(f"Gather root={root} n={n}", out, np.concatenate(ins))
    part = sentinel(dt, n)
    comm.Scatter([blocks[root], T] if r == root else None, [part, T], root=root)
    ctx.check(f"Scatter root={root} n={n}", part, blocks[root][r * n:(r + 1) * n])


@case
def case_resized_plans(ctx):
    """Every length of each collective after its first is planned from the first (or runs on its size span's fast
    path, with no plan of its own), right; a user-defined op's calls are planned from scratch."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll's plans")
    comm = ctx.comm.Dup()
    MPI = ctx.MPI
    for k, n in enumerate(_LENGTHS):
        _resizing_calls(ctx, comm, n, k)
    x = comm._x
    bases = [b for b, _ in x.cache.resizable.values()]
    derived = [p for p in x.plans.values() if p not in bases and any(
        (p.send is not None and p.send is b.send) or (p.recv is not None and p.recv is b.recv) for b in bases)]
    ctx.record("bases", sorted({b.label for b in bases}))
    ctx.record("derived", len(derived) + _span_calls(comm))  # a plan of its own, or its span's fast path

    def halves(invec, inoutvec, datatype):  # a user-defined op: b = (a + b) / 2 elementwise
        a, b = np.frombuffer(invec, np.float64), np.frombuffer(inoutvec, np.float64)
        b[...] = (a + b) / 2

    op = MPI.Op.Create(halves, commute=True)
    try:
        for n in (3, 4, 9):
            send, out = np.full(n, float(ctx.rank), np.float64), sentinel(np.float64, n)
            comm.Allreduce([send, MPI.DOUBLE], [out, MPI.DOUBLE], op=op)
            ctx.expect(bool(np.all(out >= 0) and np.all(out <= ctx.size - 1)), f"user op Allreduce n={n}",
                       "a mean of the ranks' values lies between them", got=out.tolist())
    finally:
        op.Free()
    ctx.record("user_op_bases", sum(1 for b, _ in x.cache.resizable.values() if b.template.op is not None
                                    and not b.template.op.is_predefined))
    comm.Free()


@case
def case_resized_plan_errors(ctx):
    """With a plan to resize from, the calls its checks would refuse are still refused, naming the call, their
    buffers untouched, the communicator usable."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll error semantics")
    from pycoll import errors

    comm, MPI = ctx.comm.Dup(), ctx.MPI
    for n in (4, 6):  # the bases
        a, b = np.ones(n, np.float32), np.empty(n, np.float32)
        comm.Allreduce([a, MPI.FLOAT], [b, MPI.FLOAT], op=MPI.SUM)
        comm.Bcast([b, MPI.FLOAT], root=0)

    def bad(label, opname, fn, bufs):
        before = [x.copy() for x in bufs]
        exc = ctx.raises(label, errors.InvalidArgumentError, fn)
        if exc is not None:
            ctx.expect(opname in (exc.op or ""), label + ": .op", f".op does not name {opname}", got=exc.op)
        for i, (x, x0) in enumerate(zip(bufs, before)):
            ctx.check(f"{label}: buffer {i} unchanged", x, x0)
        out = np.empty(3, np.float32)
        comm.Allreduce([np.ones(3, np.float32), MPI.FLOAT], [out, MPI.FLOAT], op=MPI.SUM)
        ctx.check(f"{label}: usable afterwards", out, np.full(3, ctx.size, np.float32))

    a, short = np.arange(9, dtype=np.float32), sentinel(np.float32, 8)
    bad("Allreduce recvbuf one shorter", "Allreduce",
        lambda: comm.Allreduce([a, MPI.FLOAT], [short, MPI.FLOAT], op=MPI.SUM), [a, short])
    same = np.arange(9, dtype=np.float32)
    bad("Allreduce sendbuf is recvbuf", "Allreduce",
        lambda: comm.Allreduce([same, MPI.FLOAT], [same, MPI.FLOAT], op=MPI.SUM), [same])
    for n in (1, 2):  # a base of each: one block of n per rank
        comm.Alltoall([np.ones(n * ctx.size, np.float32), MPI.FLOAT], [np.empty(n * ctx.size, np.float32), MPI.FLOAT])
    odd, into = np.ones(ctx.size + 1, np.float32), sentinel(np.float32, ctx.size + 1)
    bad("Alltoall of a length that does not split into blocks", "Alltoall",
        lambda: comm.Alltoall([odd, MPI.FLOAT], [into, MPI.FLOAT]), [odd, into])
    for n in (3, 5):  # bases with explicit counts
        comm.Allreduce([np.ones(n, np.float32), n, MPI.FLOAT], [np.empty(n, np.float32), n, MPI.FLOAT], op=MPI.SUM)
    past, into = np.ones(9, np.float32), sentinel(np.float32, 9)
    bad("Allreduce count past the buffer", "Allreduce",
        lambda: comm.Allreduce([past, 10, MPI.FLOAT], [into, 10, MPI.FLOAT], op=MPI.SUM), [past, into])
    frozen, c = sentinel(np.float32, 9), np.arange(9, dtype=np.float32)
    frozen.flags.writeable = False
    bad("Allreduce into a read-only recvbuf", "Allreduce",
        lambda: comm.Allreduce([c, MPI.FLOAT], [frozen, MPI.FLOAT], op=MPI.SUM), [c, frozen])
    comm.Free()


@case
def case_dropped_plans_leave_no_cycles(ctx):
    """A program of ever new lengths, past the plan cache: the plans let go are freed at once (no object left for
    the cyclic collector), whatever paths their calls took."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll's plans")
    comm = ctx.comm.Dup()
    for k, n in enumerate(range(1, 8)):  # every path's first plans and the kernels, outside the count
        _resizing_calls(ctx, comm, n, k)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for k, n in enumerate(range(8, 28)):  # 20 lengths of 18 calls: past the cache's 64 plans
            _resizing_calls(ctx, comm, n, k)
            a = np.ones(n * ctx.size, np.float32)
            b = np.empty(n * ctx.size, np.float32)
            each = [n] * ctx.size  # a vector call: planned from scratch
            comm.Alltoallv([a, each, ctx.MPI.FLOAT], [b, each, ctx.MPI.FLOAT])
            comm.Allgather([a[:n], ctx.MPI.FLOAT], [b, ctx.MPI.FLOAT])
            ctx.check(f"Allgather of a view n={n}", b, np.ones(n * ctx.size, np.float32))
        gc.collect()
        kinds: dict[str, int] = {}
        for o in gc.garbage:
            kinds[type(o).__name__] = kinds.get(type(o).__name__, 0) + 1
        ctx.record("garbage", kinds)
        ctx.record("plans", len(comm._x.plans))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    comm.Free()


def _span_calls(comm) -> int:
    """Calls of a new shape that ran on their size span's fast path, on ``comm`` and the host and leaders'
    communicators its composed calls run on."""
    x = comm._x
    subs = [x] + ([s._x for s in (x.composed.host_comm, x.composed.leaders) if s is not None]
                  if x.composed is not None else [])
    return sum(s.span_calls for s in subs)


# float32 lengths inside two size spans (256-319 and 320-383 bytes), out of order and some again
_SPANNED_LENGTHS = (64, 65, 79, 66, 70, 64, 80, 95, 81, 88, 70, 79)


@case
def case_span_plans(ctx):
    """Calls whose lengths change inside a size span run on the span's fast path, with no plan of their own, right:
    Allreduce, Reduce, Bcast, Allgather, Reduce_scatter_block and Alltoall (on one host through the arena's slots,
    between two hosts through the socket, across hosts as composed calls), and on one host the slots' Scan and
    Gather."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll's plans")
    comm, MPI, r, p = ctx.comm.Dup(), ctx.MPI, ctx.rank, ctx.size
    T = MPI.FLOAT
    for k, n in enumerate(_SPANNED_LENGTHS):
        ins = [np.arange(n, dtype=np.float32) * (q + 1) - k for q in range(p)]
        send, out = ins[r].copy(), sentinel(np.float32, n)
        comm.Allreduce([send, T], [out, T], op=MPI.SUM)
        ctx.check(f"Allreduce n={n}", out, sum(ins))
        out = sentinel(np.float32, n)
        comm.Allreduce([send, T], [out, T], op=MPI.MAX)
        ctx.check(f"Allreduce MAX n={n}", out, ins[-1] if k >= 0 and n else out)
        out = sentinel(np.float32, n)
        comm.Reduce([send, T], [out, T] if r == p - 1 else None, op=MPI.SUM, root=p - 1)
        if r == p - 1:
            ctx.check(f"Reduce n={n}", out, sum(ins))
        buf = ins[0].copy() if r == 0 else sentinel(np.float32, n)
        comm.Bcast([buf, T], root=0)
        ctx.check(f"Bcast n={n}", buf, ins[0])
        longer, twice = sentinel(np.float32, 2 * n), np.concatenate([send, send])
        comm.Allreduce([twice, n, T], [longer, n, T], op=MPI.SUM)  # a count short of its array: a view, never spanned
        ctx.check(f"Allreduce of half the array n={n}", longer, np.concatenate([sum(ins), sentinel(np.float32, n)]))
        if len(set(comm._layout.host_of)) == 1:  # one host: the slots' other collectives
            out = sentinel(np.float32, n)
            comm.Scan([send, T], [out, T], op=MPI.SUM)
            ctx.check(f"Scan n={n}", out, sum(ins[:r + 1]))
            out = sentinel(np.float32, n * p)
            comm.Gather([send, T], [out, T] if r == 0 else None, root=0)
            if r == 0:
                ctx.check(f"Gather n={n}", out, np.concatenate(ins))
            _in_place_span_calls(ctx, comm, n, k, ins)
        # the block collectives (across hosts: between two hosts through the socket, else composed by host)
        out = sentinel(np.float32, n * p)
        comm.Allgather([send, T], [out, T])
        ctx.check(f"Allgather n={n}", out, np.concatenate(ins))
        out = np.concatenate([sentinel(np.float32, n * r), ins[r], sentinel(np.float32, n * (p - r - 1))])
        comm.Allgather(MPI.IN_PLACE, [out, T])
        ctx.check(f"Allgather in place n={n}", out, np.concatenate(ins))
        blocks = [np.arange(n * p, dtype=np.float32) * (q + 2) - k for q in range(p)]  # rank q's p blocks of n
        part = sentinel(np.float32, n)
        comm.Reduce_scatter_block([blocks[r], T], [part, T], op=MPI.SUM)  # its counts' hash in the signature
        ctx.check(f"Reduce_scatter_block n={n}", part, sum(blocks)[r * n:(r + 1) * n])
        out = sentinel(np.float32, n * p)
        comm.Alltoall([blocks[r], T], [out, T])  # a table of block places ahead of the blocks
        ctx.check(f"Alltoall n={n}", out, np.concatenate([b[r * n:(r + 1) * n] for b in blocks]))
        ctx.check(f"sendbuf unchanged n={n}", send, ins[r])
        ctx.check(f"blocks unchanged n={n}", blocks[r], np.arange(n * p, dtype=np.float32) * (r + 2) - k)
    ctx.record("span_calls", _span_calls(comm))
    ctx.record("plans", len(comm._x.plans))
    planned: dict[str, int] = {}
    for label, _ in comm._x.plans:  # the calls that made a plan of their own, by collective
        planned[label] = planned.get(label, 0) + 1
    ctx.record("planned", planned)
    comm.Free()


def _in_place_span_calls(ctx, comm, n, k, ins):
    """The slots' calls in place at length ``n``, each against NumPy (a span's program reads and writes one buffer)."""
    MPI, r, p = ctx.MPI, ctx.rank, ctx.size
    T, root = MPI.FLOAT, k % p
    whole = ins[r].copy()
    comm.Allreduce(MPI.IN_PLACE, [whole, T], op=MPI.SUM)
    ctx.check(f"Allreduce in place n={n}", whole, sum(ins))
    whole = ins[r].copy()
    comm.Reduce(MPI.IN_PLACE if r == root else [whole, T], [whole, T] if r == root else None, op=MPI.MAX, root=root)
    if r == root:
        ctx.check(f"Reduce in place root={root} n={n}", whole, np.maximum.reduce(ins))
    whole = ins[r].copy()
    comm.Scan(MPI.IN_PLACE, [whole, T], op=MPI.SUM)
    ctx.check(f"Scan in place n={n}", whole, sum(ins[:r + 1]))
    out = np.concatenate([sentinel(np.float32, n * r), ins[r], sentinel(np.float32, n * (p - r - 1))])
    comm.Gather(MPI.IN_PLACE if r == root else [ins[r], T], [out, T] if r == root else None, root=root)
    if r == root:
        ctx.check(f"Gather in place root={root} n={n}", out, np.concatenate(ins))
    blocks = [np.arange(n * p, dtype=np.float32) * (q + 3) + k for q in range(p)]
    whole = blocks[r].copy()
    comm.Reduce_scatter_block(MPI.IN_PLACE, [whole, T], op=MPI.SUM)
    ctx.check(f"Reduce_scatter_block in place n={n}", whole[:n], sum(blocks)[r * n:(r + 1) * n])
    whole = blocks[r].copy()
    comm.Alltoall(MPI.IN_PLACE, [whole, T])
    ctx.check(f"Alltoall in place n={n}", whole, np.concatenate([b[r * n:(r + 1) * n] for b in blocks]))


@case
def case_span_plan_late_peer(ctx):
    """A call on its span's fast path whose peer comes late finishes as a call of its own length (the rest runs as
    a schedule made for that length)."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll's plans")
    import time

    comm, MPI, r, p = ctx.comm.Dup(), ctx.MPI, ctx.rank, ctx.size
    T = MPI.FLOAT
    for k, n in enumerate((64, 66, 70, 75, 68, 77)):
        if r == k % p and k >= 2:
            time.sleep(0.05)  # past every spin: the others' kernels hand their calls to the schedule
        ins = [np.arange(n, dtype=np.float32) + 10 * q + k for q in range(p)]
        out = sentinel(np.float32, n)
        comm.Reduce([ins[r], T], [out, T] if r == 0 else None, op=MPI.SUM, root=0)
        if r == 0:
            ctx.check(f"Reduce after a late rank n={n}", out, sum(ins))
        buf = ins[1 % p].copy() if r == 1 % p else sentinel(np.float32, n)
        comm.Bcast([buf, T], root=1 % p)
        ctx.check(f"Bcast after a late rank n={n}", buf, ins[1 % p])
        out = sentinel(np.float32, n)
        comm.Allreduce([ins[r], T], [out, T], op=MPI.SUM)
        ctx.check(f"Allreduce after a late rank n={n}", out, sum(ins))
    ctx.record("span_calls", _span_calls(comm))
    comm.Free()


_COLLECTIVE_OF = {"Allreduce": "allreduce", "Bcast": "broadcast", "Reduce": "reduce", "Allgather": "allgather",
                  "Reduce_scatter_block": "reduce_scatter", "Alltoall": "alltoall"}


def _spanned_calls(ctx, comm, n, k):
    """One call of each of the six at length ``n`` (a rank's block of ``n`` for the block collectives), each checked."""
    MPI, r, p = ctx.MPI, ctx.rank, ctx.size
    T = MPI.FLOAT
    ins = [np.arange(n, dtype=np.float32) * (q + 1) - k for q in range(p)]
    out = sentinel(np.float32, n)
    comm.Allreduce([ins[r], T], [out, T], op=MPI.SUM)
    ctx.check(f"Allreduce n={n}", out, sum(ins))
    buf = ins[0].copy() if r == 0 else sentinel(np.float32, n)
    comm.Bcast([buf, T], root=0)
    ctx.check(f"Bcast n={n}", buf, ins[0])
    out = sentinel(np.float32, n)
    comm.Reduce([ins[r], T], [out, T] if r == p - 1 else None, op=MPI.MAX, root=p - 1)
    if r == p - 1:
        ctx.check(f"Reduce n={n}", out, np.maximum.reduce(ins))
    out = sentinel(np.float32, n * p)
    comm.Allgather([ins[r], T], [out, T])
    ctx.check(f"Allgather n={n}", out, np.concatenate(ins))
    blocks = [np.arange(n * p, dtype=np.float32) * (q + 2) + k for q in range(p)]
    part = sentinel(np.float32, n)
    comm.Reduce_scatter_block([blocks[r], T], [part, T], op=MPI.SUM)
    ctx.check(f"Reduce_scatter_block n={n}", part, sum(blocks)[r * n:(r + 1) * n])
    out = sentinel(np.float32, n * p)
    comm.Alltoall([blocks[r], T], [out, T])
    ctx.check(f"Alltoall n={n}", out, np.concatenate([b[r * n:(r + 1) * n] for b in blocks]))


@case
def case_span_plan_against_planned_peer(ctx):
    """Two ranks: one runs its calls on their spans' fast paths (each call's count, and a Reduce_scatter_block's
    counts' hash, patched into a path made for another length) while its peer, its PYCOLL_ALGO set to the very
    algorithms chosen (so its fast paths decline), plans each family's next call for that call's own length: they
    match, and give NumPy's results."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll's plans")
    if ctx.size != 2:
        ctx.skip("two ranks (a composed call would be flat on the forced rank alone)")
    import os

    comm, r = ctx.comm.Dup(), ctx.rank
    for k, n in enumerate((64, 65, 66)):  # each family's plan and its span, on both ranks
        _spanned_calls(ctx, comm, n, k)
    chosen = {}
    for (label, _), plan in comm._x.plans.items():
        if label in _COLLECTIVE_OF and plan.algo is not None:
            chosen[_COLLECTIVE_OF[label]] = plan.algo.name
    ctx.record("forced", sorted(chosen.items()))
    before, had = _span_calls(comm), os.environ.get("PYCOLL_ALGO")
    if r == 1:
        os.environ["PYCOLL_ALGO"] = ",".join(f"{c}:{a}" for c, a in sorted(chosen.items()))
    try:
        for k, n in enumerate((70, 75, 79, 68)):  # new lengths of the same spans
            _spanned_calls(ctx, comm, n, k + 3)
    finally:
        if r == 1:
            if had is None:
                os.environ.pop("PYCOLL_ALGO", None)
            else:
                os.environ["PYCOLL_ALGO"] = had
    ctx.record("span_calls", _span_calls(comm) - before)
    comm.Free()


@case
def case_span_plan_mismatch(ctx):
    """Ranks that pass different lengths of one size span, on its fast path, get a MismatchError naming the call,
    on every rank, rather than a result of the wrong length or a hang."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll error semantics")
    from pycoll import errors

    comm, MPI, r = ctx.comm.Dup(), ctx.MPI, ctx.rank
    comm.timeout = 20.0
    for n in (64, 65, 66):  # the span's fast path, made and used
        out = np.empty(n, np.float32)
        comm.Allreduce([np.ones(n, np.float32), MPI.FLOAT], [out, MPI.FLOAT], op=MPI.SUM)
    before = _span_calls(comm)
    n = 70 if r == 0 else 71
    send, out = np.ones(n, np.float32), sentinel(np.float32, n)
    exc = ctx.raises("Allreduce of 70 against 71 elements", errors.PycollError,
                     lambda: comm.Allreduce([send, MPI.FLOAT], [out, MPI.FLOAT], op=MPI.SUM))
    if exc is not None:
        ctx.expect("Allreduce" in str(exc), "the error names the call", "Allreduce not named", got=str(exc))
        ctx.expect(isinstance(exc, errors.MismatchError), "a mismatch (or a peer's report of it)", "another error class",
                   got=f"{type(exc).__name__}: {exc}")
    ctx.check("sendbuf unchanged", send, np.ones(n, np.float32))
    ctx.comm.Barrier()  # no rank leaves (and exits) before every rank had its error
    ctx.record("span_calls_before", before)
    ctx.record("mismatch", type(exc).__name__ if exc is not None else None)
