"""Repeated calls on the same arrays (planned calls, the compiled arena path) checked against NumPy each time."""

from __future__ import annotations

import os

import numpy as np

from . import COUNTS, case, reduce_ref, sentinel, tolerance


def _compiled_on(comm) -> bool:
    gate = getattr(comm, "_compiled", None)
    return bool(gate is not None and gate.kernels)


def _repeat_allreduce(ctx, comm, tag: str) -> None:
    MPI = ctx.MPI
    for op, dt in ctx.pairs():
        for count in COUNTS:
            for inplace in (False, True):
                send, recv = np.empty(count, dt), sentinel(dt, count)
                for k in range(2):  # new values each time: a stale or cached result fails
                    inputs = [ctx.data(dt, count, r, tag, k, op=op) for r in range(ctx.size)]
                    expected = reduce_ref(op, inputs, dt)
                    rtol, atol = tolerance(op, dt)
                    send[...] = inputs[ctx.rank]
                    lab = f"{tag} Allreduce op={op} dtype={np.dtype(dt).name} count={count} {'in' if inplace else 'out-of'}-place call {k}"
                    if inplace:
                        comm.Allreduce(MPI.IN_PLACE, send, op=ctx.op(op))
                        ctx.check(lab, send, expected, rtol, atol)
                    else:
                        comm.Allreduce(send, recv, op=ctx.op(op))
                        ctx.check(lab, recv, expected, rtol, atol)
                        ctx.check(lab + " (sendbuf unchanged)", send, inputs[ctx.rank])
    for _ in range(4):
        comm.Barrier()


@case
def case_allreduce_repeated(ctx):
    """Every op x dtype x count, two calls on the same arrays with new values, in and out of place.

    Run twice on fresh communicators: every rank alike, then with rank 0 held to the Python path
    (PYCOLL_ARENA_JIT=0 on that rank only), so both forms of the arena protocol meet. Records whether
    each communicator ran compiled.
    """
    same = ctx.comm.Dup()
    _repeat_allreduce(ctx, same, "same")
    ctx.record("compiled_same", _compiled_on(same))
    saved = os.environ.get("PYCOLL_ARENA_JIT")
    if ctx.rank == 0:
        os.environ["PYCOLL_ARENA_JIT"] = "0"
    try:
        mixed = ctx.comm.Dup()
        _repeat_allreduce(ctx, mixed, "mixed")
    finally:
        if saved is None:
            os.environ.pop("PYCOLL_ARENA_JIT", None)
        else:
            os.environ["PYCOLL_ARENA_JIT"] = saved
    ctx.record("compiled_mixed", _compiled_on(mixed))
    same.Free()
    mixed.Free()


@case
def case_allreduce_repeated_mismatch(ctx):
    """Planned calls that disagree across ranks (count 4 on rank 0, count 5 elsewhere) raise MismatchError
    on every rank, naming both calls; later calls on that communicator say why it is broken."""
    if ctx.impl != "pycoll" or ctx.size < 2:
        ctx.skip("needs pycoll and 2 ranks")
    from pycoll.errors import CommunicatorBrokenError, MismatchError, RemoteError

    comm = ctx.comm.Dup()
    a4, b4 = np.ones(4, np.float32), np.zeros(4, np.float32)
    a5, b5 = np.ones(5, np.float32), np.zeros(5, np.float32)
    for _ in range(3):  # plans (and the compiled path) for both calls, on every rank
        comm.Allreduce(a4, b4)
        comm.Allreduce(a5, b5)
    ctx.check("agreed count 4", b4, np.full(4, ctx.size, np.float32))
    b4[...] = 0
    b5[...] = 0
    # A rank whose spin ended before the others posted may hear of the mismatch from the rank that found it.
    exc = ctx.raises("count 4 against count 5", (MismatchError, RemoteError), comm.Allreduce, *((a4, b4) if ctx.rank == 0 else (a5, b5)))
    if exc is not None:
        text = str(exc)
        ctx.expect("count=4" in text and "count=5" in text and ("MismatchError" in text or isinstance(exc, MismatchError)),
                   "the error names both calls", got=text)
    ctx.check("no result written", b4 if ctx.rank == 0 else b5, np.zeros(4 if ctx.rank == 0 else 5, np.float32))
    ctx.record("compiled", _compiled_on(comm))
    exc = ctx.raises("a later call", CommunicatorBrokenError, comm.Barrier)
    if exc is not None:
        ctx.expect("called allreduce(count=" in str(exc), "the broken communicator names the mismatch", got=str(exc))
    ctx.comm.Barrier()  # other communicators are unaffected


@case
def case_bcast_repeated(ctx):
    """Every root, several dtypes and counts (up to many pipeline chunks), two calls on the same array with
    new values: planned Bcast calls (and the inline staged path) deliver the root's data each time."""
    comm = ctx.comm.Dup()
    for dt in (np.float32, np.int8, np.complex128, np.uint64):
        for count in (0, 1, 7, 1000, 20001):
            for root in range(ctx.size):
                buf = np.empty(count, dt)
                for k in range(2):
                    expected = ctx.data(dt, count, root, "bcast", k)
                    buf[...] = expected if ctx.rank == root else sentinel(dt, count)
                    comm.Bcast(buf, root=root)
                    ctx.check(f"Bcast dtype={np.dtype(dt).name} count={count} root={root} call {k}", buf, expected)
    ctx.record("compiled", _compiled_on(comm))
    ctx.record("inline", getattr(getattr(comm, "_compiled", None), "inline", 0))
    comm.Free()


@case
def case_staged_repeated(ctx):
    """Allreduce, Reduce_scatter_block, Reduce_scatter and Allgather on the pipelined staged algorithms: three
    calls each on the same memory with new values (Allgather's send a fresh view each time), in and out of
    place, counts from 0 to many chunks. Repeats run inline, one kernel call each; records how many did."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll's own algorithms")
    MPI, p, r = ctx.MPI, ctx.size, ctx.rank
    saved = os.environ.get("PYCOLL_ALGO")
    os.environ["PYCOLL_ALGO"] = "allreduce:staged,reduce_scatter:staged,allgather:staged"
    try:
        comm = ctx.comm.Dup()
        for op, dt in ctx.pairs(ops=("SUM", "MAX"), dtypes=(np.float32, np.int64, np.complex128, np.float16)):
            for each in (0, 1, 3001):
                n = each * p
                for inplace in (False, True):
                    where = f"op={op} dtype={np.dtype(dt).name} each={each} {'in' if inplace else 'out-of'}-place"
                    send, recv, block = np.empty(n, dt), sentinel(dt, n), sentinel(dt, each)
                    gather_src = np.empty(each + 5, dt)
                    for k in range(3):
                        inputs = [ctx.data(dt, n, q, "staged", k, op=op) for q in range(p)]
                        whole = reduce_ref(op, inputs, dt)
                        send[...] = inputs[r]
                        if inplace:
                            comm.Allreduce(MPI.IN_PLACE, send, op=ctx.op(op))
                            ctx.check(f"Allreduce {where} call {k}", send, whole)
                            send[...] = inputs[r]
                            comm.Reduce_scatter_block(MPI.IN_PLACE, send, op=ctx.op(op))
                            ctx.check(f"Reduce_scatter_block {where} call {k}", send[:each], whole[r * each : (r + 1) * each])
                        else:
                            comm.Allreduce(send, recv, op=ctx.op(op))
                            ctx.check(f"Allreduce {where} call {k}", recv, whole)
                            comm.Reduce_scatter_block(send, block, op=ctx.op(op))
                            ctx.check(f"Reduce_scatter_block {where} call {k}", block, whole[r * each : (r + 1) * each])
                            ctx.check(f"sendbuf unchanged {where} call {k}", send, inputs[r])
                        counts = [each + 7 * (q % 2) for q in range(p)]
                        vin = [ctx.data(dt, sum(counts), q, "staged-v", k, op=op) for q in range(p)]
                        vwhole, lo = reduce_ref(op, vin, dt), sum(counts[:r])
                        vrecv = sentinel(dt, counts[r])
                        comm.Reduce_scatter(vin[r], vrecv, counts, op=ctx.op(op))
                        ctx.check(f"Reduce_scatter {where} call {k}", vrecv, vwhole[lo : lo + counts[r]])
                        gather_src[:each] = inputs[r][:each]
                        out = sentinel(dt, n)
                        if inplace:
                            out[r * each : (r + 1) * each] = inputs[r][:each]
                            comm.Allgather(MPI.IN_PLACE, out)
                        else:
                            comm.Allgather(gather_src[:each], out)
                        ctx.check(f"Allgather {where} call {k}", out, np.concatenate([inputs[q][:each] for q in range(p)]))
        ctx.record("compiled", _compiled_on(comm))
        ctx.record("inline", getattr(getattr(comm, "_compiled", None), "inline", 0))
        comm.Free()
    finally:
        if saved is None:
            os.environ.pop("PYCOLL_ALGO", None)
        else:
            os.environ["PYCOLL_ALGO"] = saved


@case
def case_first_call_opens_kernels(ctx):
    """A communicator's first collective (a shape not seen before, checked in full) opens the compiled kernels, so
    the shape's second call, the first to run compiled, does not stall loading them. Records whether they were
    open after one Allreduce and after one Bcast on two fresh communicators."""
    if ctx.impl != "pycoll":
        ctx.skip("needs pycoll")
    MPI = ctx.MPI
    for name, call in (("allreduce", lambda c, a, b: c.Allreduce([a, 3, MPI.FLOAT], [b, 3, MPI.FLOAT])),
                       ("bcast", lambda c, a, b: c.Bcast([a, 3, MPI.FLOAT], root=ctx.size - 1))):
        comm = ctx.comm.Dup()
        a, b = np.full(3, ctx.rank + 1, np.float32), np.zeros(3, np.float32)
        call(comm, a, b)
        ctx.record(f"open_{name}", _compiled_on(comm))
        want = np.full(3, ctx.size * (ctx.size + 1) / 2, np.float32) if name == "allreduce" else np.full(3, ctx.size, np.float32)
        ctx.check(f"first {name}", b if name == "allreduce" else a, want, 0, 0)
        comm.Free()
