"""Rank-side allreduce timing loop shared by pycoll and mpi4py: same sizes, same loop, JSON line out on rank 0."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib", choices=["pycoll", "mpi"], required=True)
    parser.add_argument("--bytes", type=int, default=16 << 20)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if args.lib == "pycoll":
        from pycoll import MPI
    else:
        from mpi4py import MPI
    comm = MPI.COMM_WORLD
    count = args.bytes // 4
    send = np.ones(count, np.float32) * (comm.rank + 1)
    recv = np.empty_like(send)
    for _ in range(args.warmup):
        comm.Allreduce(send, recv, op=MPI.SUM)
    wrong = int(np.count_nonzero(recv != sum(range(1, comm.size + 1))))
    times = []
    for _ in range(args.iters):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(send, recv, op=MPI.SUM)
        times.append(time.perf_counter() - t0)
    # A collective's time is its slowest rank's time.
    med = comm.allreduce(statistics.median(times), op=MPI.MAX)
    if comm.rank == 0:
        algbw = args.bytes / med / 1e9
        busbw = algbw * 2 * (comm.size - 1) / comm.size
        print(json.dumps({"lib": args.lib, "nranks": comm.size, "bytes": args.bytes, "time_us": med * 1e6,
                          "algbw_GBps": algbw, "busbw_GBps": busbw, "wrong": wrong}))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
