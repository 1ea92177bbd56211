"""A small Allreduce (or Send/Recv round trip) between ranks placed by hand: both on CPU 0 (`same`), each on its own (`split`) or where the
scheduler puts them (`free`). The placement is set after the runtime counted the machine's CPUs, so the ranks wait
as on a machine with a core for each, as they do when the scheduler happens to start them on one CPU.

    PYCOLL_BIND=none pycoll run -n 2 --hosts 2 -- python perf/same_cpu_probe.py same|split|free [--iters N]
        [--call allreduce|pingpong]
    python -m pycoll.perf.mpi_hosts -n 2 --hosts 2 -- python perf/same_cpu_probe.py same --mpi4py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("placement", choices=("same", "split", "free"))
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--call", choices=("allreduce", "pingpong"), default="allreduce",
                    help="an 8 B Allreduce, or an 8 B Send/Recv round trip between the two ranks (half of it timed)")
    ap.add_argument("--mpi4py", action="store_true", help="run on an installed mpi4py (MPICH) instead of pycoll")
    args = ap.parse_args()
    if args.mpi4py:
        from mpi4py import MPI
    else:
        from pycoll import MPI
    comm = MPI.COMM_WORLD
    comm.Barrier()
    if args.placement == "same":
        os.sched_setaffinity(0, {0})
    elif args.placement == "split":
        os.sched_setaffinity(0, {comm.Get_rank() % 2})
    a = np.ones(2, np.float32)
    b = np.empty_like(a)
    r, peer = comm.Get_rank(), 1 - comm.Get_rank()

    def call() -> None:
        if args.call == "allreduce":
            comm.Allreduce([a, MPI.FLOAT], [b, MPI.FLOAT])
        elif r == 0:
            comm.Send([a, MPI.FLOAT], peer, 7)
            comm.Recv([b, MPI.FLOAT], peer, 7)
        else:
            comm.Recv([b, MPI.FLOAT], peer, 7)
            comm.Send([a, MPI.FLOAT], peer, 7)

    for _ in range(50):
        call()
    took = []
    for _ in range(args.iters):
        comm.Barrier()
        t0 = time.perf_counter()
        call()
        took.append((time.perf_counter() - t0) / (2 if args.call == "pingpong" else 1))
    every = comm.allgather(statistics.median(took) * 1e6)
    if comm.Get_rank() == 0:
        what = "Allreduce 8 B" if args.call == "allreduce" else "Send/Recv 8 B, half a round trip,"
        print(f"{'mpi4py' if args.mpi4py else 'pycoll'} {args.placement}: {what} from a Barrier, median µs by rank: "
              + " ".join(f"{x:.1f}" for x in every))


if __name__ == "__main__":
    main()
