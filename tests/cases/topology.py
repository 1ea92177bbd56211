"""Cases about where ranks live: host placement as pycoll sees it, and which algorithm each collective chose."""

from __future__ import annotations

import numpy as np

from . import case


@case
def placement(ctx):
    """Record this rank's host index and the transport to every peer (pycoll only)."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll internals")
    from pycoll import runtime

    rt = runtime.current()
    ctx.record("host_of", list(ctx.comm._layout.host_of))
    ctx.record("transports", [rt.transport_of[r] for r in range(ctx.size)])


@case
def chosen_algorithms(ctx):
    """Run a 1 MiB allreduce, reduce-scatter and allgather; record the algorithm each one used."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll internals")
    from pycoll.algorithms import last_choice

    p, comm = ctx.size, ctx.comm
    n = (1 << 18) // p * p
    data = np.arange(n, dtype=np.float32) + ctx.rank
    out = np.empty(n, np.float32)
    comm.Allreduce(data, out)
    ctx.check("allreduce 1 MiB", out, p * np.arange(n, dtype=np.float32) + p * (p - 1) / 2, rtol=1e-6)
    ctx.record("allreduce", last_choice.algorithm)
    block = np.empty(n // p, np.float32)
    comm.Reduce_scatter_block(data, block)
    lo = ctx.rank * (n // p)
    ctx.check("reduce_scatter 1 MiB", block, p * np.arange(lo, lo + n // p, dtype=np.float32) + p * (p - 1) / 2, rtol=1e-6)
    ctx.record("reduce_scatter", last_choice.algorithm)
    gathered = np.empty(n, np.float32)
    comm.Allgather(data[: n // p], gathered)
    want = np.concatenate([np.arange(n // p, dtype=np.float32) + r for r in range(p)])
    ctx.check("allgather 1 MiB", gathered, want)
    ctx.record("allgather", last_choice.algorithm)


@case
def host_composition(ctx):
    """Small Allreduce and Barrier on a communicator across hosts: run on a host and a leaders' communicator
    (pycoll.composed) when some host holds several ranks; record whether they were made and their sizes."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll internals")
    comm, p = ctx.comm, ctx.size
    for count in (1, 7, 1000):
        data = np.arange(count, dtype=np.float64) * (ctx.rank + 1)
        out = np.full(count, -1.0)
        comm.Allreduce(data, out)
        ctx.check(f"allreduce {count}", out, np.arange(count, dtype=np.float64) * (p * (p + 1) / 2))
    comm.Barrier()
    big = np.ones((128 << 10) // 8)
    comm.Allreduce(big, big.copy())  # above PYCOLL_SMP_BYTES: the flat path
    composed = comm._x.composed
    made = composed is not None and composed.host_comm is not None
    ctx.record("made", made)
    if made:
        ctx.record("host_size", composed.host_comm.Get_size())
        ctx.record("leaders", composed.leaders.Get_size() if composed.leaders is not None else 0)
    sub = comm.Split(0, ctx.rank)  # a child communicator composes on its own, and Free releases its parts
    sub.Allreduce(np.ones(3), np.empty(3))
    parts = sub._x.composed
    sub.Free()
    ctx.record("child_freed", parts is None or parts.host_comm is None)
