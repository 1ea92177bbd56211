"""Small blocking calls on arrays made before each call against arrays reused, alternating, under pycoll or mpi4py:
the slowest rank's median from a Barrier, µs (one JSON line per call and mode with --json).

    pycoll run -n 4 --hosts 2 -- python perf/fresh_vs_reused.py [--calls reduce,allreduce,bcast] [--count 2]
    python -m pycoll.perf.mpi_hosts -n 4 --hosts 2 -- python perf/fresh_vs_reused.py --mpi4py
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pycoll.perf.report import append_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", default="reduce,allreduce,bcast")
    ap.add_argument("--count", type=int, default=2, help="float32 elements a call (default 2: 8 B)")
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2, help="each mode this many times, alternating")
    ap.add_argument("--mpi4py", action="store_true", help="run on an installed mpi4py (MPICH) instead of pycoll")
    ap.add_argument("--json", help="append the rows to this file (rank 0)")
    args = ap.parse_args()
    if args.mpi4py:
        from mpi4py import MPI
    else:
        from pycoll import MPI
    comm, F, n = MPI.COMM_WORLD, MPI.FLOAT, args.count
    calls = {
        "reduce": lambda s, r: comm.Reduce([s, F], [r, F], op=MPI.SUM, root=0),
        "allreduce": lambda s, r: comm.Allreduce([s, F], [r, F]),
        "bcast": lambda s, r: comm.Bcast([r, F], root=0),
    }
    rows = []
    for name in args.calls.split(","):
        call = calls[name]
        for fresh in [False, True] * args.rounds:
            send, recv = np.ones(n, np.float32), np.zeros(n, np.float32)
            took = []
            for _ in range(args.iters):
                if fresh:
                    send, recv = np.ones(n, np.float32), np.zeros(n, np.float32)
                comm.Barrier()
                t0 = time.perf_counter()
                call(send, recv)
                took.append(time.perf_counter() - t0)
            slowest = max(comm.allgather(sorted(took)[len(took) // 2] * 1e6))
            rows.append({"call": name, "bytes": 4 * n, "mode": "fresh" if fresh else "reused", "ranks": comm.Get_size(),
                         "slowest_us": round(slowest, 2), "impl": "mpi4py" if args.mpi4py else "pycoll"})
            if comm.Get_rank() == 0:
                print(f"{name:10} {rows[-1]['mode']:7} {slowest:8.1f} µs", flush=True)
    if comm.Get_rank() == 0 and args.json:
        append_rows(args.json, rows)


if __name__ == "__main__":
    main()
