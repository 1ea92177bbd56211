"""Small calls on a communicator after another communicator of the same processes failed: an 8 B Allreduce back to
back on COMM_WORLD, then a mismatched Allreduce on a Dup of it (rank 0 passes 4 elements, the others 5), caught,
then the same loop on COMM_WORLD again. The failure breaks the Dup only; the slowest rank's time a call, before
and after, and each rank's error class.

    pycoll run -n 4 [--hosts 2] python perf/calls_after_a_failure.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pycoll import MPI, errors


def loop(comm, calls: int) -> float:
    a, b = np.ones(2, np.float32), np.empty(2, np.float32)
    for _ in range(100):
        comm.Allreduce([a, MPI.FLOAT], [b, MPI.FLOAT])
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        comm.Allreduce([a, MPI.FLOAT], [b, MPI.FLOAT])
    if not (b == comm.size).all():
        raise SystemExit(f"rank {comm.rank}: wrong sum {b}")
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args()
    world = MPI.COMM_WORLD
    before = loop(world, a.calls)
    other = world.Dup()
    other.timeout = 20.0
    n = 4 if world.rank == 0 else 5
    try:
        other.Allreduce([np.ones(n, np.float32), MPI.FLOAT], [np.empty(n, np.float32), MPI.FLOAT])
        failed = "no error"
    except errors.PycollError as exc:
        failed = type(exc).__name__
    world.Barrier()
    after = loop(world, a.calls)
    got = world.gather((before, after, failed), root=0)
    if world.rank == 0:
        print(f"Allreduce 8 B back to back, the slowest rank's us a call: before the other communicator failed "
              f"{max(g[0] for g in got):.1f}, after {max(g[1] for g in got):.1f}; its errors {[g[2] for g in got]}")


if __name__ == "__main__":
    main()
