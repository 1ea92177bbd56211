"""An Allgather out of place against the same Allgather in place, alternating call by call: what the own block's copy
costs (the slowest rank's median over the calls, ms; one JSON line with --json).

    pycoll run -n 2 --hosts 2 --link-rate 10gbit -- python perf/allgather_place.py --mib 16 --iters 60
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from pycoll.perf.report import append_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=16, help="the whole output in MiB (float32)")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--json", help="append the row to this file (rank 0)")
    args = ap.parse_args()
    from pycoll import MPI

    comm = MPI.COMM_WORLD
    F, p = MPI.FLOAT, comm.Get_size()
    n = (args.mib << 20) // 4 // p * p
    mine, out = np.ones(n // p, np.float32), np.empty(n, np.float32)
    calls = {"out of place": lambda: comm.Allgather([mine, F], [out, F]),
             "in place": lambda: comm.Allgather(MPI.IN_PLACE, [out, F])}
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(args.iters + 2):  # the first two of each are warm-up
        for name, call in calls.items():
            comm.Barrier()
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    every = comm.gather(times, root=0)
    if comm.Get_rank() == 0:
        row = {"ranks": p, "mib": args.mib, "iters": args.iters}
        for name in calls:
            slowest = [max(t[name][i] for t in every) for i in range(2, args.iters + 2)]
            row[name + " ms"] = round(statistics.median(slowest) * 1e3, 3)
        print(json.dumps(row))
        if args.json:
            append_rows(args.json, [row])


if __name__ == "__main__":
    main()
