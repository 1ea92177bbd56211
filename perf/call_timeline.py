"""When each rank leaves a Barrier and then a small blocking call, measured from the first rank out of the Barrier
(medians over the iterations; the clocks are one machine's, so namespace hosts compare), with each rank's context
switches and CPU time per iteration, under pycoll or mpi4py.

    pycoll run -n 4 --hosts 2 -- python perf/call_timeline.py [--call reduce] [--bytes 8]
    python -m pycoll.perf.mpi_hosts -n 4 --hosts 2 -- python perf/call_timeline.py --mpi4py
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from small_call_loops import call_table  # perf/, first on the path of `python perf/call_timeline.py`


def _switches() -> tuple[int, int]:
    with open("/proc/self/status") as f:
        d = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
    return int(d["voluntary_ctxt_switches"]), int(d["nonvoluntary_ctxt_switches"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--call", default="reduce", help="one of perf/small_call_loops.py's calls")
    ap.add_argument("--bytes", type=int, default=8, help="message size (float32 elements, default 8 B)")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--mpi4py", action="store_true", help="run on an installed mpi4py (MPICH) instead of pycoll")
    args = ap.parse_args()
    if args.mpi4py:
        from mpi4py import MPI
    else:
        from pycoll import MPI
    comm = MPI.COMM_WORLD
    call, nbytes = call_table(comm, MPI, args.bytes)[args.call]
    for _ in range(20):
        comm.Barrier()
        call()
    clock = time.perf_counter
    marks = np.zeros((args.iters, 2))
    switches0, cpu0 = _switches(), time.process_time()
    for i in range(args.iters):
        comm.Barrier()
        t_barrier = clock()
        call()
        marks[i] = (t_barrier, clock())
    switches1, cpu1 = _switches(), time.process_time()
    per_iter = ((switches1[0] - switches0[0]) / args.iters, (switches1[1] - switches0[1]) / args.iters,
                (cpu1 - cpu0) / args.iters * 1e6)
    every = comm.gather((marks, per_iter), 0)
    if comm.Get_rank() != 0:
        return
    t = np.array([m for m, _ in every]) * 1e6  # [rank, iteration, (left the barrier, left the call)]
    first = t[:, :, 0].min(axis=0)  # the first rank out of each iteration's barrier
    t -= first[None, :, None]
    print(f"{'mpi4py' if args.mpi4py else 'pycoll'} {args.call} {nbytes} B, {comm.Get_size()} ranks, {args.iters} "
          "iterations; µs from the first rank out of the barrier (medians)")
    for r, (_, (vol, invol, cpu)) in enumerate(every):
        print(f"  rank {r}: left the barrier {np.median(t[r, :, 0]):6.1f}  left the call {np.median(t[r, :, 1]):6.1f}"
              f"  (the call {np.median(t[r, :, 1] - t[r, :, 0]):6.1f});  per iteration: {vol:.1f} voluntary and"
              f" {invol:.1f} other switches, {cpu:.1f} µs of CPU")
    own = t[:, :, 1] - t[:, :, 0]  # each rank's call from its own exit, as `pycoll perf` times it
    print(f"  slowest rank's own call per iteration (`pycoll perf`'s figure): {np.median(own.max(axis=0)):.1f}"
          f" (rank {np.bincount(own.argmax(axis=0)).argmax()} most often); an iteration (the Barrier and the call)"
          f" {np.median(np.diff(first)):.1f}")


if __name__ == "__main__":
    main()
