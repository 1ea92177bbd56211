"""Ranks on other hosts that the scheduler put on one CPU (their binding moved after start-up, as a launcher that
does not bind leaves them): their waits on the socket find it out from what their yields show, spin briefly while it
holds, and spin in full again once the ranks run apart; the results stay right throughout."""

from __future__ import annotations

import os
import time

import numpy as np

from . import case


def _late(i: int, rank: int) -> None:
    """Every other call, one rank comes 30 µs late, by turns: each then waits for the other (a rank whose peer's
    message is always in first has no wait to learn from)."""
    if i % 2 == rank:
        until = time.perf_counter() + 30e-6
        while time.perf_counter() < until:
            pass


def _calls(ctx, comm, label: str, count: int) -> None:
    MPI, p, r = ctx.MPI, ctx.size, ctx.rank
    send = np.full(2, r + 1, np.float32)
    for i in range(count):
        _late(i, r)
        out = np.zeros(2, np.float32)
        comm.Allreduce([send, MPI.FLOAT], [out, MPI.FLOAT], op=MPI.SUM)
        if i % 50 == 0 and not ctx.check(f"Allreduce {label} #{i}", out, np.full(2, p * (p + 1) / 2, np.float32)):
            return


def _round_trips(ctx, comm, label: str, count: int) -> None:
    MPI, r = ctx.MPI, ctx.rank
    peer = 1 - r
    for i in range(count):
        _late(i, r)
        got = np.zeros(2, np.int64)
        if r == 0:
            comm.Send([np.array([i, 0], np.int64), MPI.INT64_T], peer, 5)
            comm.Recv([got, MPI.INT64_T], peer, 5)
        else:
            comm.Recv([got, MPI.INT64_T], peer, 5)
            got[1] = 1
            comm.Send([got, MPI.INT64_T], peer, 5)
        if i % 50 == 0 and not ctx.check(f"Send/Recv {label} #{i}", got, np.array([i, 1], np.int64)):
            return


def _placements(ctx, run, sync) -> None:
    """``run`` apart, on one CPU, then apart again; ``Engine.cpu_shared`` after each is recorded."""
    if ctx.impl != "pycoll":
        ctx.skip("pycoll's waits")
    cpus = sorted(os.sched_getaffinity(0))
    allowed = sorted(set().union(*ctx.comm.allgather(cpus)))
    if ctx.size != 2 or len(allowed) < 2:
        ctx.skip("needs 2 ranks and 2 CPUs to place them on")
    engine = ctx.comm._engine
    if engine.oversubscribed:
        ctx.skip("the ranks outnumber the cores: every wait spins briefly already")
    seen = []
    try:
        for label, cpu in (("apart", allowed[ctx.rank]), ("on one CPU", allowed[0]), ("apart again", allowed[ctx.rank])):
            os.sched_setaffinity(0, {cpu})
            sync()
            run(label)
            seen.append(engine.cpu_shared)
            sync()
    finally:
        os.sched_setaffinity(0, set(cpus))
    ctx.record("cpu_shared", seen)


@case
def case_peer_on_this_cpu(ctx):
    """Two ranks on two hosts, each on a CPU of its own, then both on one, then apart again: ``Engine.cpu_shared``
    after each stretch of small Allreduces (False, True, False)."""
    comm = ctx.comm.Dup()
    _placements(ctx, lambda label: _calls(ctx, comm, label, 300), comm.Barrier)


@case
def case_peer_on_this_cpu_p2p(ctx):
    """The same with Send/Recv round trips alone, the stretches joined by a Sendrecv: the point-to-point waits
    find the peer's CPU out for themselves."""
    comm, MPI = ctx.comm.Dup(), ctx.MPI
    token = np.zeros(1, np.int64)

    def sync() -> None:
        peer = 1 - ctx.rank
        comm.Sendrecv([token, MPI.INT64_T], peer, 9, [token.copy(), MPI.INT64_T], peer, 9)

    _placements(ctx, lambda label: _round_trips(ctx, comm, label, 300), sync)
