"""When each rank leaves a Barrier and finishes the small call after it (a Reduce by default), on the host's shared
monotonic clock (namespace hosts share one machine's clock): the ranks' skew out of the Barrier and the call's
critical path.

    pycoll run -n 4 --hosts 2 -- python perf/barrier_exit_skew.py [--call reduce] [--bytes 8] [--iters 400]
    python -m pycoll.perf.mpi_hosts -n 4 --hosts 2 -- python perf/barrier_exit_skew.py --mpi4py
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from small_call_loops import call_table  # perf/, first on the path of `python perf/barrier_exit_skew.py`


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--call", default="reduce", help="one of perf/small_call_loops.py's calls")
    ap.add_argument("--bytes", type=int, default=8, help="message size (float32 elements, default 8 B)")
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--mpi4py", action="store_true", help="run on an installed mpi4py (MPICH) instead of pycoll")
    args = ap.parse_args()
    if args.mpi4py:
        from mpi4py import MPI
    else:
        from pycoll import MPI
    comm = MPI.COMM_WORLD
    p, iters = comm.Get_size(), args.iters
    call, _ = call_table(comm, MPI, args.bytes)[args.call]
    exits, done = np.zeros(iters), np.zeros(iters)
    for _ in range(50):
        comm.Barrier()
    for i in range(iters):
        comm.Barrier()
        exits[i] = time.monotonic()
        call()
        done[i] = time.monotonic()
    all_exits, all_done = np.zeros((p, iters)), np.zeros((p, iters))
    comm.Gather(exits, all_exits, root=0)
    comm.Gather(done, all_done, root=0)
    if comm.Get_rank() == 0:
        first = all_exits.min(axis=0)

        def medians(x: np.ndarray) -> list[float]:
            return [round(float(np.median(x[r])) * 1e6, 1) for r in range(p)]

        print("Barrier exit after the first rank's, median µs by rank:", medians(all_exits - first))
        print(f"{args.call} done after the first Barrier exit, median µs by rank:", medians(all_done - first))
        print(f"{args.call} call, median µs by rank:", medians(all_done - all_exits))


if __name__ == "__main__":
    main()
