"""Ranks on other hosts that the scheduler put on one CPU (their binding moved after start-up, as a launcher that
does not bind leaves them): their waits on the socket find it out from what their yields show, spin briefly while it
holds, and spin in full again once the ranks run apart; the results stay right throughout."""

from __future__ import annotations

import os
import time

import numpy as np

from . import case


def _calls(ctx, comm, label: str, count: int) -> None:
    """Small Allreduces, each rank coming 30 µs late to every other call (so that each waits for the other in
    turn: a rank whose peer's frame is always in first has no wait to learn from)."""
    MPI, p, r = ctx.MPI, ctx.size, ctx.rank
    send = np.full(2, r + 1, np.float32)
    for i in range(count):
        if i % p == r:
            until = time.perf_counter() + 30e-6
            while time.perf_counter() < until:
                pass
        out = np.zeros(2, np.float32)
        comm.Allreduce([send, MPI.FLOAT], [out, MPI.FLOAT], op=MPI.SUM)
        if i % 50 == 0 and not ctx.check(f"Allreduce {label} #{i}", out, np.full(2, p * (p + 1) / 2, np.float32)):
            return


@case
def case_peer_on_this_cpu(ctx):
    """Two ranks on two hosts, each on a CPU of its own, then both on one, then apart again: ``Engine.cpu_shared``
    after each stretch of small Allreduces (False, True, False)."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll's waits")
    cpus = sorted(os.sched_getaffinity(0)) if ctx.size == 2 else []
    allowed = sorted(set().union(*ctx.comm.allgather(cpus)))
    if ctx.size != 2 or len(allowed) < 2:
        ctx.skip("needs 2 ranks and 2 CPUs to place them on")
    comm, engine = ctx.comm.Dup(), ctx.comm._engine
    if engine.oversubscribed:
        ctx.skip("the ranks outnumber the cores: every wait spins briefly already")
    seen = []
    try:
        for label, cpu in (("apart", allowed[ctx.rank]), ("on one CPU", allowed[0]), ("apart again", allowed[ctx.rank])):
            os.sched_setaffinity(0, {cpu})
            comm.Barrier()
            _calls(ctx, comm, label, 300)
            seen.append(engine.cpu_shared)
            comm.Barrier()
    finally:
        os.sched_setaffinity(0, set(cpus))
    ctx.record("cpu_shared", seen)
