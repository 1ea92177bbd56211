"""Error cases (pycoll only): bad arguments, mismatched collectives, timeouts and dead peers.

Cases that break the communicator (mismatch, timeout, dead peer) must run alone in their job;
they record what each rank saw with ctx.record() so that tests/test_errors.py can judge across ranks.
"""

from __future__ import annotations

import os
import threading
import time
import traceback

import numpy as np

from . import case, sentinel


def _errors(ctx):
    if ctx.impl != "pycoll":
        ctx.skip("pycoll error semantics")
    from pycoll import errors

    return errors


def _describe(exc):
    """A JSON-able summary of an exception."""
    return {
        "class": type(exc).__name__,
        "mro": [c.__name__ for c in type(exc).__mro__],
        "op": getattr(exc, "op", None),
        "rank": getattr(exc, "rank", None),
        "peers": list(getattr(exc, "peers", ()) or ()),
        "cause": getattr(exc, "cause", None),
        "str": str(exc)[:500],
    }


def _healthy(ctx, label):
    """The next correct collective on every rank succeeds."""
    n = ctx.size
    out = np.zeros(4, np.int64)
    try:
        ctx.comm.Allreduce(np.full(4, ctx.rank + 1, np.int64), out, op=ctx.MPI.SUM)
    except Exception as exc:  # noqa: BLE001
        ctx.fail(label, f"correct Allreduce after the bad call raised {type(exc).__name__}: {exc}")
        raise
    ctx.check(label, out, np.full(4, n * (n + 1) // 2, np.int64))


def _bad(ctx, errors, label, opname, fn, bufs=(), classes=None):
    """fn() must raise InvalidArgumentError naming opname, leave bufs unchanged, and the comm usable."""
    before = [np.array(b, copy=True) for b in bufs]
    exc = ctx.raises(label, classes or errors.InvalidArgumentError, fn)
    if exc is not None and isinstance(exc, errors.PycollError):
        # a nonblocking call may name its blocking twin ("Allreduce" for Iallreduce)
        names = (opname, opname[1:].capitalize()) if opname.startswith("I") else (opname,)
        ctx.expect(bool(exc.op) and any(x in exc.op for x in names), label + ": .op", f".op does not name {opname}", got=exc.op)
        if exc.op:
            ctx.expect(exc.op in str(exc), label + ": str()", "str() does not contain .op", got=str(exc))
        ctx.expect(exc.rank in (None, ctx.rank), label + ": .rank", "wrong .rank", expected=ctx.rank, got=exc.rank)
    for k, (b, b0) in enumerate(zip(bufs, before)):
        ctx.check(f"{label}: buffer {k} unchanged", np.asarray(b), b0)
    _healthy(ctx, label + ": comm usable afterwards")


@case
def case_bad_args_allreduce(ctx):
    errors = _errors(ctx)
    comm, MPI = ctx.comm, ctx.MPI
    f32 = np.arange(10, dtype=np.float32) + ctx.rank
    f64 = sentinel(np.float64, 10)
    _bad(ctx, errors, "Allreduce float32 -> float64", "Allreduce", lambda: comm.Allreduce(f32, f64, op=MPI.SUM), [f32, f64])
    small = sentinel(np.float32, 5)
    _bad(ctx, errors, "Allreduce recvbuf too small", "Allreduce", lambda: comm.Allreduce(f32, small, op=MPI.SUM), [f32, small])
    big = np.arange(20, dtype=np.float32)
    recv = sentinel(np.float32, 10)
    _bad(ctx, errors, "Allreduce non-contiguous sendbuf", "Allreduce", lambda: comm.Allreduce(big[::2], recv, op=MPI.SUM), [big, recv])
    bigr = sentinel(np.float32, 20)
    _bad(ctx, errors, "Allreduce non-contiguous recvbuf", "Allreduce", lambda: comm.Allreduce(f32, bigr[::2], op=MPI.SUM), [f32, bigr])
    twod = sentinel(np.float32, 20).reshape(4, 5)
    _bad(ctx, errors, "Allreduce Fortran-order 2-D recvbuf slice", "Allreduce", lambda: comm.Allreduce(f32, twod[:, :2].T, op=MPI.SUM), [f32, twod])
    ro = sentinel(np.float32, 10)
    ro.setflags(write=False)
    _bad(ctx, errors, "Allreduce read-only recvbuf", "Allreduce", lambda: comm.Allreduce(f32, ro, op=MPI.SUM), [f32, ro])
    _bad(ctx, errors, "Allreduce IN_PLACE read-only buffer", "Allreduce", lambda: comm.Allreduce(MPI.IN_PLACE, ro, op=MPI.SUM), [ro])
    ro_bytes = bytes(40)
    _bad(ctx, errors, "Allreduce into bytes (read-only)", "Allreduce", lambda: comm.Allreduce(f32, ro_bytes, op=MPI.SUM), [f32], classes=(errors.InvalidArgumentError, TypeError))
    for op, dt in (("AVG", np.int32), ("AVG", np.uint8), ("BAND", np.float32), ("BOR", np.float64), ("BXOR", np.complex64),
                   ("MAX", np.complex64), ("MIN", np.complex128)):
        s = np.ones(6, dt)
        rcv = sentinel(dt, 6)
        _bad(ctx, errors, f"Allreduce op={op} dtype={np.dtype(dt).name}", "Allreduce", lambda s=s, rcv=rcv, op=op: comm.Allreduce(s, rcv, op=ctx.op(op)), [s, rcv])
    ctx.expect(MPI.Exception is errors.PycollError, "MPI.Exception", "MPI.Exception is not pycoll.errors.PycollError")
    # a read-only *send* buffer is fine
    ro_send = np.full(10, ctx.rank, np.float32)
    ro_send.setflags(write=False)
    out = np.zeros(10, np.float32)
    comm.Allreduce(ro_send, out, op=MPI.SUM)
    ctx.check("Allreduce read-only sendbuf accepted", out, np.full(10, sum(range(ctx.size)), np.float32))


@case
def case_bad_args_other(ctx):
    errors = _errors(ctx)
    comm, MPI = ctx.comm, ctx.MPI
    n, r = ctx.size, ctx.rank
    buf = np.arange(8, dtype=np.int32)
    _bad(ctx, errors, "Bcast root=size", "Bcast", lambda: comm.Bcast(buf, root=n), [buf])
    _bad(ctx, errors, "Bcast root=-1", "Bcast", lambda: comm.Bcast(buf, root=-1), [buf])
    rcv = sentinel(np.int32, 8)
    _bad(ctx, errors, "Reduce root=size+2", "Reduce", lambda: comm.Reduce(buf, rcv, op=MPI.SUM, root=n + 2), [buf, rcv])
    rcv = sentinel(np.int32, 8)
    _bad(ctx, errors, "Reduce op=AVG int32", "Reduce", lambda: comm.Reduce(buf, rcv, op=MPI.AVG, root=0), [buf, rcv])
    ag = sentinel(np.int32, 8 * n - 1)
    _bad(ctx, errors, "Allgather recvbuf too small", "Allgather", lambda: comm.Allgather(buf, ag), [buf, ag])
    agd = sentinel(np.float64, 8 * n)
    _bad(ctx, errors, "Allgather int32 -> float64", "Allgather", lambda: comm.Allgather(buf, agd), [buf, agd])
    counts = [1] * (n + 1)
    agv = sentinel(np.int32, n + 1)
    _bad(ctx, errors, "Allgatherv counts of length size+1", "Allgatherv",
         lambda: comm.Allgatherv(buf[:1], [agv, counts, list(range(n + 1))]), [buf, agv])
    send = np.arange(3 * n - 1, dtype=np.float32)
    rsb = sentinel(np.float32, 3)
    _bad(ctx, errors, "Reduce_scatter_block sendbuf too small", "Reduce_scatter_block",
         lambda: comm.Reduce_scatter_block(send, rsb, op=MPI.SUM), [send, rsb])
    send = np.arange(3 * n, dtype=np.float32)
    _bad(ctx, errors, "Reduce_scatter_block op=BAND float32", "Reduce_scatter_block",
         lambda: comm.Reduce_scatter_block(send, rsb, op=MPI.BAND), [send, rsb])
    rs = sentinel(np.float32, 3)
    _bad(ctx, errors, "Reduce_scatter recvcounts of length size+1", "Reduce_scatter",
         lambda: comm.Reduce_scatter(send, rs, [3] * (n + 1), op=MPI.SUM), [send, rs])
    _bad(ctx, errors, "Reduce_scatter recvcounts summing past sendbuf", "Reduce_scatter",
         lambda: comm.Reduce_scatter(send, rs, [3] * (n - 1) + [4], op=MPI.SUM), [send, rs])
    if n > 1:
        _bad(ctx, errors, "Reduce_scatter negative recvcount", "Reduce_scatter",
             lambda: comm.Reduce_scatter(send, rs, [4, -1] + [3] * (n - 2), op=MPI.SUM), [send, rs])
    a2a = sentinel(np.float32, 3 * n - 1)
    _bad(ctx, errors, "Alltoall recvbuf too small", "Alltoall", lambda: comm.Alltoall(send, a2a), [send, a2a])
    lst = [1.0, 2.0]
    out = sentinel(np.float64, 2)
    _bad(ctx, errors, "Allreduce of a list (not a buffer)", "Allreduce", lambda: comm.Allreduce(lst, out, op=MPI.SUM), [out],
         classes=(errors.InvalidArgumentError, TypeError))
    # nonblocking: the error comes at the call, before any request exists
    ib = np.ones(4, np.int64)
    ibo = sentinel(np.int64, 4)
    _bad(ctx, errors, "Iallreduce op=AVG int64", "Iallreduce", lambda: comm.Iallreduce(ib, ibo, op=MPI.AVG), [ib, ibo])
    _bad(ctx, errors, "Ibcast root=size", "Ibcast", lambda: comm.Ibcast(ib, root=n), [ib])
    # p2p
    _bad(ctx, errors, "Send dest=size", "Send", lambda: comm.Send(ib, dest=n, tag=0), [ib])
    _bad(ctx, errors, "Recv source=size", "Recv", lambda: comm.Recv(ibo, source=n, tag=0), [ibo])
    _bad(ctx, errors, "Send negative tag", "Send", lambda: comm.Send(ib, dest=r, tag=-5), [ib])


def _outcome(ctx, fn, bufs, label):
    """Run a call expected to fail; record the exception (or its absence); check buffers unchanged."""
    before = [np.array(b, copy=True) for b in bufs]
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        info = _describe(exc)
        from pycoll.errors import PycollError

        if not isinstance(exc, PycollError):
            info["traceback"] = traceback.format_exc()[-2000:]
    else:
        info = {"class": None}
    ctx.record("outcome", info)
    for k, (b, b0) in enumerate(zip(bufs, before)):
        ctx.check(f"{label}: buffer {k} unchanged", np.asarray(b), b0)
    return info


def _checking() -> bool:
    return os.environ.get("PYCOLL_CHECK_CALLS", "") not in ("", "0")


def _mismatch(ctx, make, inputs=lambda r, bufs: bufs[:1]):
    """make(rank) -> (fn, bufs): ranks run different calls; record each rank's outcome.

    With PYCOLL_CHECK_CALLS=1 no buffer may change and the communicator must work afterwards.
    Without it only this rank's inputs (``inputs(rank, bufs)``) must be unchanged: output areas
    may be written by peers whose part of the call matched.
    """
    _errors(ctx)
    ctx.comm.timeout = 30.0
    fn, bufs = make(ctx.rank)
    checked = bufs if _checking() else inputs(ctx.rank, bufs)
    _outcome(ctx, fn, checked, "mismatch")
    if _checking():  # every rank failed the same call before data moved: the next call works
        a, out = np.full(3, ctx.rank + 1, np.int64), np.zeros(3, np.int64)
        ctx.comm.Allreduce(a, out)
        ctx.check("communicator usable after the mismatch", out, np.full(3, ctx.size * (ctx.size + 1) // 2, np.int64))


def _allreduce_vs_allgather(ctx):
    comm, MPI = ctx.comm, ctx.MPI
    n = ctx.size

    def make(r):
        s = np.full(4, r, np.int32)
        if r == 0:
            o = sentinel(np.int32, 4)
            return (lambda: comm.Allreduce(s, o, op=MPI.SUM)), [s, o]
        o = sentinel(np.int32, 4 * n)
        return (lambda: comm.Allgather(s, o)), [s, o]

    _mismatch(ctx, make)


@case
def case_mismatch_collective(ctx):
    """Rank 0 calls Allreduce, the others Allgather (same byte count)."""
    _allreduce_vs_allgather(ctx)


@case
def case_mismatch_collective_warm(ctx):
    """As mismatch_collective, once every rank ran both calls twice: their shapes are known (two ranks across
    hosts then send straight through the socket, pycoll.paired)."""
    comm, MPI = ctx.comm, ctx.MPI
    s = np.full(4, ctx.rank, np.int32)
    for _ in range(2):
        comm.Allreduce(s, np.empty(4, np.int32), op=MPI.SUM)
        comm.Allgather(s, np.empty(4 * ctx.size, np.int32))
    _allreduce_vs_allgather(ctx)


def _alltoall_blocks(ctx, count):
    """An Alltoall of ``count`` float64 a block (past the small-frame size: across hosts, every block in one
    exchange in C, pycoll.exchanged, once the shape is known), on fresh arrays: (the call, its buffers)."""
    comm = ctx.comm
    s, o = np.full(count * ctx.size, ctx.rank, np.float64), sentinel(np.float64, count * ctx.size)
    return (lambda: comm.Alltoall(s, o)), [s, o]


@case
def case_mismatch_alltoall_warm(ctx):
    """Every rank runs an Alltoall of 64 KiB blocks twice (its shape known), then the last rank calls it with one
    element more a block: every rank raises, none hangs, the inputs intact."""
    for _ in range(2):
        call, (s, o) = _alltoall_blocks(ctx, 8192)
        call()
        ctx.check("warm Alltoall", o, np.repeat(np.arange(ctx.size, dtype=np.float64), 8192))
    _record_fast_alltoall(ctx)
    _mismatch(ctx, lambda r: _alltoall_blocks(ctx, 8193 if r == ctx.size - 1 else 8192))


def _record_fast_alltoall(ctx):
    """Whether this rank's Alltoall plan runs as one closure (pycoll.exchanged), for the test to check."""
    plans = getattr(getattr(ctx.comm, "_x", None), "plans", {})
    ctx.record("fast Alltoall", any(callable(p.fast) for (label, _), p in plans.items() if label == "Alltoall"))


@case
def case_timeout_alltoall_warm(ctx):
    """comm.timeout = 2: as timeout_allreduce, for an Alltoall of 64 KiB blocks every rank ran twice."""
    for _ in range(2):
        _alltoall_blocks(ctx, 8192)[0]()
    _record_fast_alltoall(ctx)
    _timeout_case(ctx, lambda c: _alltoall_blocks(ctx, 8192)[0](), ctx.size - 1)


def _warm_then_one_longer(ctx, make, count, times, name, record):
    """``times`` calls of ``make(ctx, count)`` on every rank (each summing every rank's ``rank + 1``; its shape then
    known), ``record(ctx)``, then the last rank calls it with one element more: every rank's outcome recorded."""
    for _ in range(times):
        call, (s, o) = make(ctx, count)
        call()
        ctx.check(f"warm {name}", o, np.full(count, ctx.size * (ctx.size + 1) / 2))
    record(ctx)
    _mismatch(ctx, lambda r: make(ctx, count + 1 if r == ctx.size - 1 else count))


def _allreduce_segments(ctx, count):
    """An Allreduce of ``count`` float64 on fresh arrays: (the call, its buffers). About 4 MiB: between two hosts of
    two ranks, with a 1 Gbit/s link given to the model, it is composed in segments (pycoll.composed_segments)."""
    comm = ctx.comm
    s, o = np.full(count, ctx.rank + 1, np.float64), sentinel(np.float64, count)
    return (lambda: comm.Allreduce(s, o)), [s, o]


def _record_segments(ctx):
    composed = getattr(getattr(ctx.comm, "_x", None), "composed", None)
    ctx.record("in segments", composed.in_segments if composed is not None else 0)


@case
def case_mismatch_allreduce_segments(ctx):
    """Every rank runs the segmented Allreduce twice, then the last rank calls it with one element more: every rank
    raises, none hangs, the inputs intact."""
    _warm_then_one_longer(ctx, _allreduce_segments, 500000, 2, "Allreduce", _record_segments)


@case
def case_mismatch_composed_leader_arrives_late(ctx):
    """Every rank runs a 5-float Allreduce twice (composed across hosts: host steps, then the leaders'), then rank 0
    calls it with 4 floats, and the second host's leader (rank 2) comes 0.5 s late: by then it has taken in the
    first host's reports (a probe), which broke its leaders' communicator. Every rank raises the mismatch, the late leader too (it
    fails its step's very call with the report, not as a communicator broken earlier), the inputs intact."""
    def make(count):
        s, o = np.full(count, ctx.rank + 1, np.float32), sentinel(np.float32, count)
        return (lambda: ctx.comm.Allreduce(s, o)), [s, o]

    for _ in range(2):
        call, (s, o) = make(5)
        call()
        ctx.check("warm Allreduce", o, np.full(5, ctx.size * (ctx.size + 1) / 2, np.float32))

    def late(r):
        call, bufs = make(4 if r == 0 else 5)
        if r == 2:  # the reports arrive meanwhile, and a probe takes them in, as a wait in an earlier step would
            return (lambda: (time.sleep(0.5), ctx.comm.Iprobe(source=ctx.MPI.ANY_SOURCE), call())), bufs
        return call, bufs

    _mismatch(ctx, late)


@case
def case_timeout_allreduce_segments(ctx):
    """comm.timeout = 2: as timeout_allreduce, for the segmented Allreduce every rank ran twice; the absent rank is
    the second host's other rank, so its leader waits in the host's step and the first host's leader on the link."""
    for _ in range(2):
        _allreduce_segments(ctx, 500000)[0]()
    _record_segments(ctx)
    _timeout_case(ctx, lambda c: _allreduce_segments(ctx, 500000)[0](), ctx.size - 1)


def _rsb_blocks(ctx, count):
    """A Reduce_scatter_block of ``count`` float64 a block on fresh arrays: (the call, its buffers). At 40 000
    (320 KiB, past a socket's staging area but within a chunk), two ranks across hosts run it, once its shape is
    known, as one exchange in C (pycoll.paired through Engine.frame_exchanger)."""
    comm = ctx.comm
    s, o = np.full(count * ctx.size, ctx.rank + 1, np.float64), sentinel(np.float64, count)
    return (lambda: comm.Reduce_scatter_block(s, o)), [s, o]


def _record_block_exchanges(ctx):
    """Whether this rank's Reduce_scatter_block runs as its plan's closure, and how many exchanges of a plan's
    blocks its engine made (for the test to check)."""
    plans = getattr(getattr(ctx.comm, "_x", None), "plans", {})
    ctx.record("fast Reduce_scatter_block",
               any(callable(p.fast) for (label, _), p in plans.items() if label == "Reduce_scatter_block"))
    ctx.record("block exchanges", getattr(getattr(ctx.comm, "_engine", None), "block_exchanges", 0))


@case
def case_mismatch_reduce_scatter_large_warm(ctx):
    """Every rank runs a Reduce_scatter_block of 320 KiB blocks three times (its shape known), then the last rank
    calls it with one element more a block: every rank raises, none hangs, the inputs intact."""
    _warm_then_one_longer(ctx, _rsb_blocks, 40_000, 3, "Reduce_scatter_block", _record_block_exchanges)


@case
def case_timeout_reduce_scatter_large_warm(ctx):
    """comm.timeout = 2: as timeout_allreduce, for a Reduce_scatter_block of 320 KiB blocks every rank ran three
    times."""
    for _ in range(3):
        _rsb_blocks(ctx, 40_000)[0]()
    _record_block_exchanges(ctx)
    _timeout_case(ctx, lambda c: _rsb_blocks(ctx, 40_000)[0](), ctx.size - 1)


@case
def case_mismatch_count(ctx):
    comm, MPI = ctx.comm, ctx.MPI

    def make(r):
        c = 1000 if r == 0 else 1001
        s, o = np.ones(c, np.float32), sentinel(np.float32, c)
        return (lambda: comm.Allreduce(s, o, op=MPI.SUM)), [s, o]

    _mismatch(ctx, make)


@case
def case_mismatch_dtype(ctx):
    comm, MPI = ctx.comm, ctx.MPI

    def make(r):
        dt = np.float64 if r == ctx.size - 1 else np.int64  # same itemsize, same count
        s, o = np.ones(64, dt), sentinel(dt, 64)
        return (lambda: comm.Allreduce(s, o, op=MPI.SUM)), [s, o]

    _mismatch(ctx, make)


@case
def case_mismatch_op(ctx):
    comm, MPI = ctx.comm, ctx.MPI

    def make(r):
        op = MPI.MAX if r == 1 % ctx.size else MPI.SUM
        s, o = np.ones(16, np.float32), sentinel(np.float32, 16)
        return (lambda: comm.Allreduce(s, o, op=op)), [s, o]

    _mismatch(ctx, make)


@case
def case_mismatch_root(ctx):
    comm = ctx.comm

    def make(r):
        root = 0 if r == 0 else 1
        b = np.full(32, r + 1, np.int16)
        return (lambda: comm.Bcast(b, root=root)), [b]

    _mismatch(ctx, make, inputs=lambda r, bufs: bufs if r in (0, 1) else [])  # the two self-declared roots


@case
def case_mismatch_reduce_root(ctx):
    comm, MPI = ctx.comm, ctx.MPI

    def make(r):
        root = ctx.size - 1 if r == 0 else 0
        s, o = np.ones(8, np.float64), sentinel(np.float64, 8)
        return (lambda: comm.Reduce(s, o, op=MPI.SUM, root=root)), [s, o]

    _mismatch(ctx, make)


@case
def case_mismatch_alltoallv_sizes(ctx):
    """Alltoallv: rank 0 sends rank 1 two elements where rank 1 expects one (each rank knows only its own counts)."""
    comm, n = ctx.comm, ctx.size

    def make(r):
        scounts = [2 if (r, q) == (0, 1) else 1 for q in range(n)]
        s, o = np.full(2 * n, r, np.float32), sentinel(np.float32, n)
        sdispls, rdispls = [2 * q for q in range(n)], list(range(n))
        return (lambda: comm.Alltoallv([s, scounts, sdispls, ctx.MPI.FLOAT], [o, [1] * n, rdispls, ctx.MPI.FLOAT])), [s, o]

    _mismatch(ctx, make)


@case
def case_mismatch_gatherv_sizes(ctx):
    """Gatherv: the last rank sends two elements where the root's counts say one."""
    comm, n = ctx.comm, ctx.size

    def make(r):
        s = np.full(2 if r == n - 1 else 1, r, np.float32)
        o = sentinel(np.float32, n) if r == 0 else None
        return (lambda: comm.Gatherv([s, ctx.MPI.FLOAT], [o, [1] * n, list(range(n)), ctx.MPI.FLOAT] if r == 0 else None, 0)), [s]

    _mismatch(ctx, make)


@case
def case_mismatch_gatherv_large(ctx):
    """Gatherv of blocks past the arena slot, which the senders write into the root's buffer: the last rank sends one
    element more than the root's counts say, the others write theirs (the root waits for them before it raises)."""
    comm, n, big = ctx.comm, ctx.size, 100_000  # 400 KB: past the slot share on 2-8 ranks

    def make(r):
        s = np.full(big + 1 if r == n - 1 else big, r, np.float32)
        o = sentinel(np.float32, n * big) if r == 0 else None
        spec = [o, [big] * n, [big * q for q in range(n)], ctx.MPI.FLOAT] if r == 0 else None
        return (lambda: comm.Gatherv([s, ctx.MPI.FLOAT], spec, 0)), [s]

    _mismatch(ctx, make)


@case
def case_mismatch_barrier_vs_bcast(ctx):
    comm = ctx.comm

    def make(r):
        if r == ctx.size - 1:
            return (lambda: comm.Barrier()), []
        b = np.full(4, r, np.int32)
        return (lambda: comm.Bcast(b, root=0)), [b]

    _mismatch(ctx, make, inputs=lambda r, bufs: bufs if r == 0 else [])  # only the root's buffer is an input


@case
def case_failure_reported_for_a_later_call(ctx):
    """A rank ahead of the others reports a mismatch in call 2 before they have made call 1 (it finished call 1 and
    found the mismatch in the next, as a Bcast root does when its sends complete): call 1 still completes on every
    rank, since it did not fail, and call 2 raises the report on every rank."""
    errors = _errors(ctx)
    if ctx.size < 2:
        ctx.skip("needs 2 ranks")
    comm, last = ctx.comm.Dup(), ctx.size - 1
    engine = comm._engine
    if ctx.rank == last:  # reports call 2 without making it (a white-box stand-in for the race)
        owner = comm._owner("Barrier #2", comm._ctx | 1, 2)
        engine.abort(owner, owner.error(errors.MismatchError, "rank 0 called barrier, this rank called bcast", [0]))
    else:
        deadline = time.monotonic() + 30
        while engine.broken(comm._ctx) is None and time.monotonic() < deadline:
            with engine.lock:
                engine.poll_reports()
            time.sleep(0.001)
        ctx.expect(engine.broken(comm._ctx) is not None, "the report arrived", "no report within 30 s")
    try:
        comm.Barrier()
    except errors.PycollError as exc:
        ctx.fail("call 1 completes", f"raised {type(exc).__name__}: {exc}")
    want = errors.MismatchError if ctx.rank != last else (errors.MismatchError, errors.CommunicatorBrokenError)
    exc = ctx.raises("call 2 raises the report", want, comm.Barrier)
    if exc is not None:
        ctx.expect("called bcast" in str(exc), "call 2's error names the calls", got=str(exc))
    ctx.comm.Barrier()  # other communicators are unaffected


def _done_flag(ctx, r):
    return os.path.join(ctx.out_dir or ".", f"errdone.{r}")


def _signal_done(ctx):
    with open(_done_flag(ctx, ctx.rank), "w") as fh:
        fh.write("done")


def _wait_for_others(ctx, ranks, limit=90.0):
    """The rank that never joins waits here until the others have finished (no fixed sleep)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if all(os.path.exists(_done_flag(ctx, q)) for q in ranks):
            return True
        time.sleep(0.05)
    return False


def _timeout_case(ctx, call, absent):
    _errors(ctx)
    comm = ctx.comm
    comm.timeout = 2.0
    ctx.check_equal("comm.timeout settable", float(comm.timeout), 2.0)
    others = [q for q in range(ctx.size) if q != absent]
    if ctx.rank == absent:
        ctx.record("outcome", {"class": "absent"})
        if not _wait_for_others(ctx, others):
            ctx.note("the other ranks did not finish within 90 s")
        return
    try:
        _outcome(ctx, lambda: call(comm), [], "timeout")
    finally:
        _signal_done(ctx)


@case
def case_timeout_allreduce(ctx):
    """comm.timeout = 2: the last rank never calls Allreduce."""
    MPI = ctx.MPI
    _timeout_case(ctx, lambda c: c.Allreduce(np.ones(100, np.float32), np.zeros(100, np.float32), op=MPI.SUM), ctx.size - 1)


@case
def case_timeout_allreduce_warm(ctx):
    """As timeout_allreduce, once every rank ran that Allreduce twice: its shape is known (two ranks across hosts
    then wait on the socket itself, pycoll.paired)."""
    MPI = ctx.MPI

    def call(c):
        c.Allreduce(np.ones(100, np.float32), np.zeros(100, np.float32), op=MPI.SUM)

    for _ in range(2):
        call(ctx.comm)
    _timeout_case(ctx, call, ctx.size - 1)


@case
def case_timeout_barrier(ctx):
    """comm.timeout = 2: rank 0 never calls Barrier."""
    _timeout_case(ctx, lambda c: c.Barrier(), 0)


@case
def case_timeout_recv(ctx):
    """comm.timeout = 2: Recv from a rank that never sends."""
    absent = ctx.size - 1
    _timeout_case(ctx, lambda c: c.Recv(np.zeros(4), source=absent, tag=3), absent)


@case
def case_timeout_wait(ctx):
    """comm.timeout = 2: Wait on an Iallreduce that the last rank never joins."""
    MPI = ctx.MPI

    def call(c):
        req = c.Iallreduce(np.ones(10), np.zeros(10), op=MPI.SUM)
        req.Wait()

    _timeout_case(ctx, call, ctx.size - 1)


@case
def case_timeout_default_from_env(ctx):
    """comm.timeout defaults to PYCOLL_TIMEOUT; Dup inherits or defaults; setting one comm leaves the other."""
    _errors(ctx)
    comm = ctx.comm
    env = float(os.environ.get("PYCOLL_TIMEOUT", "300"))
    ctx.check_equal("default comm.timeout from PYCOLL_TIMEOUT", float(comm.timeout), env)
    d = comm.Dup()
    d.timeout = 3.5
    ctx.check_equal("per-communicator timeout", float(d.timeout), 3.5)
    ctx.check_equal("parent timeout unchanged", float(comm.timeout), env)
    d.Free()


def _die_case(ctx, victim, midstream):
    _errors(ctx)
    comm, MPI = ctx.comm, ctx.MPI
    comm.timeout = 120.0  # far beyond the pytest timeout: detection must not rely on it
    for i in range(2):
        out = np.zeros(1000, np.float64)
        comm.Allreduce(np.ones(1000), out, op=MPI.SUM)
        ctx.check(f"warm-up Allreduce {i}", out, np.full(1000, float(ctx.size)))
    count = (1 << 20) if midstream else 16
    if ctx.rank == victim:
        ctx.record("outcome", {"class": "victim"})
        ctx.flush()  # write the JSON now: this process ends without cleanup
        if midstream:
            threading.Timer(0.2, lambda: os._exit(3)).start()
            while True:
                comm.Allreduce(np.ones(count, np.float32), np.zeros(count, np.float32), op=MPI.SUM)
        os._exit(3)

    def call():
        for _ in range(100000):
            comm.Allreduce(np.ones(count, np.float32), np.zeros(count, np.float32), op=MPI.SUM)

    _outcome(ctx, call, [], "dead peer")


@case
def case_dead_peer(ctx):
    """Rank 1 (or 0 alone) os._exit(3)s between collectives; the others see PeerFailureError/RemoteError."""
    _die_case(ctx, 1 % ctx.size, midstream=False)


@case
def case_dead_peer_midstream(ctx):
    """The last rank os._exit(3)s while 4 MB Allreduces are in flight."""
    _die_case(ctx, ctx.size - 1, midstream=True)


@case
def case_asymmetric_bad_arg(ctx):
    """Only rank 0 passes a bad op; it raises InvalidArgumentError, the others must not hang."""
    _errors(ctx)
    comm, MPI = ctx.comm, ctx.MPI
    comm.timeout = 10.0
    s = np.ones(8, np.int32)
    o = sentinel(np.int32, 8)
    op = MPI.AVG if ctx.rank == 0 else MPI.SUM
    _outcome(ctx, lambda: comm.Allreduce(s, o, op=op), [s, o], "asymmetric")


class _InspectionFails:
    """A buffer whose inspection raises a plain TypeError (not a pycoll error)."""

    @property
    def __array_interface__(self):
        raise TypeError("this object cannot be read")


@case
def case_foreign_error_on_one_rank_keeps_calls_in_line(ctx):
    """Rank 0's buffer raises a TypeError while its arguments are read: it gets that TypeError, the others a
    PycollError, and every later call (1-element then 0-count Gatherv, as mpi4py's tests do) still lines up."""
    _errors(ctx)
    comm, MPI, n, r = ctx.comm, ctx.MPI, ctx.size, ctx.rank
    comm.timeout = 10.0
    recv = np.zeros(n, np.float32) if r == 0 else None
    send = _InspectionFails() if r == 0 else np.ones(1, np.float32)
    _outcome(ctx, lambda: comm.Gatherv([send, MPI.FLOAT], [recv, MPI.FLOAT] if r == 0 else None, 0), [], "foreign")
    out = np.zeros(n, np.float32)
    for _ in range(10):
        comm.Gatherv([np.full(1, r, np.float32), MPI.FLOAT], [out, [1] * n, MPI.FLOAT] if r == 0 else None, 0)
        if r == 0:
            ctx.expect(bool((out == np.arange(n)).all()), "1-element Gatherv after the refusal", "wrong data", got=out.tolist())
        comm.Gatherv([np.zeros(0, np.float32), MPI.FLOAT], [out, [0] * n, MPI.FLOAT] if r == 0 else None, 0)


@case
def case_recv_truncation(ctx):
    """A message larger than the receive buffer raises (MPI_ERR_TRUNCATE); the next message still arrives."""
    errors = _errors(ctx)
    comm = ctx.comm
    n, r = ctx.size, ctx.rank
    if n < 2:
        ctx.skip("needs 2 ranks")
    comm.timeout = 20.0
    if r == 1:
        comm.Send(np.arange(100, dtype=np.float64), dest=0, tag=1)
        comm.Send(np.arange(5, dtype=np.float64), dest=0, tag=2)
    elif r == 0:
        buf = sentinel(np.float64, 10)
        exc = ctx.raises("Recv of 100 doubles into 10", errors.InvalidArgumentError, comm.Recv, buf, source=1, tag=1)
        if exc is not None:
            ctx.expect(bool(exc.op) and "Recv" in exc.op, "truncation .op", ".op does not name Recv", got=exc.op)
        b2 = np.zeros(5)
        comm.Recv(b2, source=1, tag=2)
        ctx.check("Recv after a truncated one", b2, np.arange(5, dtype=np.float64))
    _healthy(ctx, "comm usable after truncation")
