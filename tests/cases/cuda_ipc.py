"""Allreduce on device buffers through CUDA IPC (one-shot and two-shot), checked against NumPy.

Run with NUMBA_ENABLE_CUDASIM=1 (the IPC buffers are then shared-memory files: pycoll/cuda/ipc.py) or on a GPU,
and with PYCOLL_IPC_BYTES=4K (tests/test_cuda_ipc.py): small first slots, a growth, and a call past the limit.
"""

from __future__ import annotations

import os

import numpy as np

from . import case, reduce_ref, sentinel, tolerance
from .device import _cuda, _dtype, _host, _to_device

ALGOS = ("ipc_oneshot", "ipc_twoshot")
# (op, dtype) pairs: every op family the kernels have, float16 and bfloat16 among the dtypes
PAIRS = (("SUM", "float32"), ("SUM", "float16"), ("PROD", "int32"), ("MAX", "float16"), ("MIN", "int64"),
         ("AVG", "float32"), ("SUM", "bfloat16"), ("BXOR", "uint8"), ("MIN", "float64"))
COUNTS = (0, 1, 7, 37)  # odd counts: two-shot blocks of unequal size (and empty blocks for count 1)


def _force(algo):
    """Force ``algo`` for allreduce on this rank (every rank calls this alike); returns the previous setting."""
    old = os.environ.get("PYCOLL_ALGO")
    os.environ["PYCOLL_ALGO"] = f"allreduce:{algo}"
    return old


def _restore(old):
    if old is None:
        os.environ.pop("PYCOLL_ALGO", None)
    else:
        os.environ["PYCOLL_ALGO"] = old


def _chosen():
    from pycoll.algorithms import last_choice

    return last_choice.algorithm


def _allreduce(ctx, cuda, op, name, count, inplace, stream, salt=""):
    """One device Allreduce; returns (result on the host, expected, sendbuf afterwards or None)."""
    comm, MPI = ctx.comm, ctx.MPI
    dt = _dtype(name)
    inputs = [ctx.data(dt, count, r, salt, op=op) for r in range(ctx.size)]
    expected = reduce_ref(op, inputs, dt)
    send, send_spec = _to_device(cuda, inputs[ctx.rank])
    if inplace:
        comm.Allreduce(MPI.IN_PLACE, send_spec, op=ctx.op(op), stream=stream)
        return _host(send, dt), expected, None, inputs[ctx.rank]
    recv, recv_spec = _to_device(cuda, sentinel(dt, count))
    comm.Allreduce(send_spec, recv_spec, op=ctx.op(op), stream=stream)
    return _host(recv, dt), expected, _host(send, dt), inputs[ctx.rank]


@case
def case_allreduce(ctx):
    """Both algorithms forced: every pair, odd and zero counts, in and out of place, with and without a stream."""
    cuda = _cuda(ctx)
    i = 0
    for algo in ALGOS:
        old = _force(algo)
        try:
            for op, name in PAIRS:
                for count in COUNTS:
                    inplace = bool(i % 2)
                    stream = cuda.stream() if i % 3 == 0 else None
                    i += 1
                    lab = f"{algo} {op} {name} count={count} {'in' if inplace else 'out-of'}-place stream={stream is not None}"
                    got, want, send_after, mine = _allreduce(ctx, cuda, op, name, count, inplace, stream)
                    rtol, atol = tolerance(op, _dtype(name))
                    ctx.check(lab, got, want, rtol=rtol, atol=atol)
                    if send_after is not None:
                        ctx.check(lab + " (sendbuf unchanged)", send_after, mine)
                    ctx.check_equal(lab + " ran on IPC", _chosen(), algo)
        finally:
            _restore(old)
    state = ctx.comm._ipc
    ctx.check_equal("IPC buffers set up", state.status, "ready")
    # the first call mapped every peer once; the same generation served every later call
    ctx.record("ipc", {"generation": state.generation, "opened": state.cache.opened, "mapped": len(state.cache),
                       "slot": state.arena.slot_bytes, "backend": state.backend.name})


@case
def case_same_bits_on_every_rank(ctx):
    """Float sums in rank order: every rank gets the very same bits (and NumPy's float32-accumulated result)."""
    cuda = _cuda(ctx)
    for algo in ALGOS:
        old = _force(algo)
        try:
            for name in ("float32", "float16"):
                dt = _dtype(name)
                rng = np.random.default_rng(7 + ctx.rank)
                mine = rng.standard_normal(29).astype(dt)
                send, spec = _to_device(cuda, mine)
                recv, rspec = _to_device(cuda, np.zeros(29, dt))
                ctx.comm.Allreduce(spec, rspec, op=ctx.MPI.SUM)
                got = _host(recv, dt)
                everyone = ctx.comm.allgather(got.tobytes())
                ctx.expect(all(b == everyone[0] for b in everyone), f"{algo} {name}: identical bits on every rank")
                alls = [np.random.default_rng(7 + r).standard_normal(29).astype(dt) for r in range(ctx.size)]
                acc = alls[0].astype(np.float32)
                for a in alls[1:]:
                    acc = acc + a.astype(np.float32)
                ctx.check(f"{algo} {name}: rank-order float32 sum", got, acc.astype(dt))
        finally:
            _restore(old)


@case
def case_growth_and_limit(ctx):
    """A call larger than the slots exchanges new handles (a new generation, old mappings closed); a call past
    PYCOLL_IPC_BYTES is staged (another algorithm is selected) and still correct."""
    cuda = _cuda(ctx)
    from pycoll.algorithms.cuda_ipc import IPC_BYTES

    state = ctx.comm._ipc
    if IPC_BYTES.get() != 4096:
        ctx.skip("needs PYCOLL_IPC_BYTES=4K")
    old = _force("ipc_twoshot")
    try:
        got, want, _, _ = _allreduce(ctx, cuda, "SUM", "float32", 5, False, None, "warm")
        ctx.check("small call", got, want)
        gen, slot = state.generation, state.arena.slot_bytes
        got, want, _, _ = _allreduce(ctx, cuda, "SUM", "float32", 300, False, None, "grow")  # 1200 bytes
        ctx.check("call that grows the slots", got, want)
        ctx.check_equal("ran on IPC after growing", _chosen(), "ipc_twoshot")
        ctx.expect(state.arena.slot_bytes >= 1200 > slot, "slots grew", got=(slot, state.arena.slot_bytes))
        ctx.check_equal("a new generation", state.generation, gen + 1)
        ctx.check_equal("mappings of the new generation", len(state.cache), ctx.size - 1)
        for q in range(ctx.size):
            if q != ctx.rank:
                ctx.expect(state.cache.lookup(q, gen) is None, f"rank {q}'s old mapping closed")
        got, want, _, _ = _allreduce(ctx, cuda, "MAX", "int32", 1100, True, None, "big")  # 4400 bytes > 4K
        ctx.check("call past PYCOLL_IPC_BYTES", got, want)
        ctx.expect(_chosen() not in ALGOS, "past the limit another algorithm runs", got=_chosen())
        got, want, _, _ = _allreduce(ctx, cuda, "SUM", "int32", 9, False, None, "after")
        ctx.check("IPC again after a staged call", got, want)
        ctx.check_equal("ran on IPC again", _chosen(), "ipc_twoshot")
    finally:
        _restore(old)


@case
def case_nonblocking(ctx):
    """Two Iallreduce on IPC in flight at once (two slots), then Waitall."""
    cuda = _cuda(ctx)
    MPI = ctx.MPI
    for algo in ALGOS:
        old = _force(algo)
        try:
            inputs = [[ctx.data(np.float32, 11, r, algo, k) for r in range(ctx.size)] for k in range(3)]
            bufs = [_to_device(cuda, inputs[k][ctx.rank])[0] for k in range(3)]
            reqs = [ctx.comm.Iallreduce(MPI.IN_PLACE, b, op=MPI.SUM) for b in bufs]
            MPI.Request.Waitall(reqs)
            for k in range(3):
                ctx.check(f"{algo} Iallreduce #{k}", bufs[k].copy_to_host(), reduce_ref("SUM", inputs[k], np.float32))
        finally:
            _restore(old)


@case
def case_free(ctx):
    """A duplicated communicator sets up its own IPC buffers; Free unmaps the peers' and frees this rank's."""
    cuda = _cuda(ctx)
    dup = ctx.comm.Dup()
    old = _force("ipc_oneshot")
    try:
        x = cuda.to_device(np.full(3, ctx.rank + 1, np.int32))
        dup.Allreduce(ctx.MPI.IN_PLACE, x, op=ctx.MPI.SUM)
        n = ctx.size
        ctx.check("Allreduce on the duplicate", x.copy_to_host(), np.full(3, n * (n + 1) // 2, np.int32))
        state = dup._ipc
        ctx.check_equal("mapped peers", len(state.cache), n - 1)
        dup.Free()
        ctx.check_equal("no mapping after Free", len(state.cache), 0)
        ctx.check_equal("state after Free", state.status, "closed")
    finally:
        _restore(old)


def _broken_backend(what):
    """This process's IPC backend with ``allocate`` or ``open`` failing, as a driver would refuse."""
    from pycoll.cuda import ipc

    class Broken(type(ipc.backend())):
        def allocate(self, nbytes):
            if what == "allocate":
                raise MemoryError("no device memory (injected)")
            return super().allocate(nbytes)

        def open(self, handle):
            if what == "open":
                raise OSError("peer access refused (injected)")
            return super().open(handle)

    return Broken()


@case
def case_setup_failure_stages_everywhere(ctx):
    """One rank cannot allocate (then: cannot map a peer's buffer): every rank learns it from the vote, names the
    rank, stages its device calls from then on, and gets the right result."""
    cuda = _cuda(ctx)
    from pycoll.cuda import ipc

    old = _force("ipc_oneshot")
    try:
        for what, culprit in (("allocate", ctx.size - 1), ("open", 0)):
            dup = ctx.comm.Dup()
            if ctx.rank == culprit:
                dup._ipc.backend = _broken_backend(what)
                dup._ipc.cache = ipc.MappingCache(dup._ipc.backend)
            for k in range(2):  # the second call is staged without another exchange
                inputs = [ctx.data(np.float32, 6, r, what, k) for r in range(ctx.size)]
                x = cuda.to_device(inputs[ctx.rank])
                dup.Allreduce(ctx.MPI.IN_PLACE, x, op=ctx.MPI.SUM)
                ctx.check(f"{what}: staged result #{k}", x.copy_to_host(), reduce_ref("SUM", inputs, np.float32))
            state = dup._ipc
            ctx.check_equal(f"{what}: IPC failed on every rank", state.status, "failed")
            ctx.expect(f"rank {culprit}" in state.reason and "injected" in state.reason, f"{what}: the reason names the rank",
                       got=state.reason)
            ctx.check_equal(f"{what}: nothing left mapped", len(state.cache) if state.cache is not None else 0, 0)
            ctx.check_equal(f"{what}: no generation in force", (state.generation, state.arena), (0, None))
            dup.Free()
    finally:
        _restore(old)


@case
def case_late_peer_times_out(ctx):
    """comm.timeout = 2 after one IPC call: the last rank never joins the second; the others raise TimeoutError
    naming it, and their recvbuf keeps its contents. Runs alone in its job (the communicator breaks)."""
    cuda = _cuda(ctx)
    from .errors import _outcome, _signal_done, _wait_for_others

    comm, MPI = ctx.comm, ctx.MPI
    old = _force("ipc_oneshot")
    try:
        x = cuda.to_device(np.ones(4, np.float32))
        comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)  # the IPC buffers are set up: the wait is on the flags
        ctx.check("warm-up", x.copy_to_host(), np.full(4, ctx.size, np.float32))
        comm.timeout = 2.0
        absent = ctx.size - 1
        if ctx.rank == absent:
            ctx.record("outcome", {"class": "absent"})
            _wait_for_others(ctx, [q for q in range(ctx.size) if q != absent])
            return
        send = cuda.to_device(np.ones(4, np.float32))
        recv = cuda.to_device(np.full(4, -7, np.float32))
        try:
            _outcome(ctx, lambda: comm.Allreduce(send, recv, op=MPI.SUM), [], "late peer")
            ctx.check("recvbuf untouched", recv.copy_to_host(), np.full(4, -7, np.float32))
        finally:
            _signal_done(ctx)
    finally:
        _restore(old)


@case
def case_mismatch_is_named(ctx):
    """After one IPC call, rank 0 passes 3 elements and the others 4: the posted signatures differ, every rank
    raises MismatchError naming the call, and rank 0's input is unchanged. Runs alone in its job."""
    cuda = _cuda(ctx)
    from .errors import _outcome

    comm, MPI = ctx.comm, ctx.MPI
    old = _force("ipc_oneshot")
    try:
        x = cuda.to_device(np.ones(4, np.float32))
        comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
        ctx.check("warm-up", x.copy_to_host(), np.full(4, ctx.size, np.float32))
        comm.timeout = 20.0
        n = 3 if ctx.rank == 0 else 4
        send = cuda.to_device(np.arange(n, dtype=np.float32))
        recv = cuda.to_device(np.full(n, -7, np.float32))
        _outcome(ctx, lambda: comm.Allreduce(send, recv, op=MPI.SUM), [], "mismatch")
        ctx.check("sendbuf unchanged", send.copy_to_host(), np.arange(n, dtype=np.float32))
    finally:
        _restore(old)


@case
def case_reproducible(ctx):
    """Reproducible mode on device buffers: both IPC kernels, and host algorithms over staged buffers, give NumPy's
    rank-order left fold bit for bit (float16 and bfloat16 round every step, unlike the default wide sum); an
    algorithm that cannot keep the fold declines and selection serves the call."""
    from .reproducible import DTYPES, OPS, _valid, check_bits, inputs, left_fold

    cuda = _cuda(ctx)
    ctx.comm.reproducible = True
    try:
        for algo in (*ALGOS, "owner", "ring"):
            old = _force(algo)
            try:
                for dt in DTYPES:
                    for op in OPS:
                        if not _valid(op, dt):
                            continue
                        for k, count in enumerate((0, 1, 7, 300)):
                            xs = inputs(ctx, op, dt, count, "device")
                            want = left_fold(op, xs, dt)
                            lab = f"{algo} {op} {dt} count={count}"
                            send, spec = _to_device(cuda, xs[ctx.rank])
                            if k % 2:
                                ctx.comm.Allreduce(ctx.MPI.IN_PLACE, spec, op=ctx.op(op))
                                got = _host(send, dt)
                            else:
                                recv, rspec = _to_device(cuda, np.zeros(count, dt))
                                ctx.comm.Allreduce(spec, rspec, op=ctx.op(op))
                                got = _host(recv, dt)
                            check_bits(ctx, lab, got, want)
                            # ring declines, and so do the IPC kernels for complex products (NumPy's CPU loop fuses
                            # a multiply-add): selection then picks an algorithm that keeps the fold
                            declines = algo == "ring" or (algo in ALGOS and op == "PROD" and dt.kind == "c")
                            if count and not declines:
                                ctx.check_equal(lab + " ran as forced", _chosen(), algo)
                            elif count:
                                ctx.expect(_chosen() != algo, lab + ": declines", got=_chosen())
            finally:
                _restore(old)
        _reproducible_staged(ctx, cuda, DTYPES, check_bits, inputs, left_fold)
    finally:
        ctx.comm.reproducible = None


def _reproducible_staged(ctx, cuda, dtypes, check_bits, inputs, left_fold):
    """Reduce, Reduce_scatter_block, Scan and Exscan on device buffers (staged through host memory) in the mode."""
    comm, MPI, p, r = ctx.comm, ctx.MPI, ctx.size, ctx.rank
    for dt in dtypes:
        for op in ("SUM", "PROD"):
            xs = inputs(ctx, op, dt, 7 * p, "staged")
            lab = f"{op} {dt}"
            send, spec = _to_device(cuda, xs[r])
            recv, rspec = _to_device(cuda, np.zeros(7 * p, dt))
            comm.Reduce(spec, rspec, op=ctx.op(op), root=p - 1)
            if r == p - 1:
                check_bits(ctx, "Reduce " + lab, _host(recv, dt), left_fold(op, xs, dt))
            block, bspec = _to_device(cuda, np.zeros(7, dt))
            comm.Reduce_scatter_block(spec, bspec, op=ctx.op(op))
            check_bits(ctx, "Reduce_scatter_block " + lab, _host(block, dt),
                       left_fold(op, [x[7 * r:7 * r + 7] for x in xs], dt))
            comm.Scan(spec, rspec, op=ctx.op(op))
            check_bits(ctx, "Scan " + lab, _host(recv, dt), left_fold(op, xs[:r + 1], dt))
            if r:
                recv2, r2spec = _to_device(cuda, np.zeros(7 * p, dt))
                comm.Exscan(spec, r2spec, op=ctx.op(op))
                check_bits(ctx, "Exscan " + lab, _host(recv2, dt), left_fold(op, xs[:r], dt))
            else:
                comm.Exscan(spec, rspec, op=ctx.op(op))  # rank 0's output is undefined
