"""Two ranks, usually on two hosts: medians of a ping-pong, of an Allreduce back to back and of an Allreduce started
right after a Barrier, at one size, buffer-spec calls on reused arrays (rank 0's clock; one way for the ping-pong).

    pycoll run -n 2 --hosts 2 -- python perf/host_pair_loops.py --bytes 1M [--iters 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from pycoll import MPI
from pycoll.config import parse_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", default="1M", help="message size (default 1M)")
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    if comm.size != 2:
        raise SystemExit("host_pair_loops runs on exactly 2 ranks")
    n = parse_size(args.bytes) // 4
    a, b = np.ones(n, np.float32), np.empty(n, np.float32)
    peer = 1 - comm.rank

    def pingpong() -> None:
        if comm.rank == 0:
            comm.Send([a, MPI.FLOAT], peer)
            comm.Recv([b, MPI.FLOAT], peer)
        else:
            comm.Recv([b, MPI.FLOAT], peer)
            comm.Send([b, MPI.FLOAT], peer)

    def allreduce() -> None:
        comm.Allreduce([a, MPI.FLOAT], [b, MPI.FLOAT])

    def timed(fn, barrier: bool) -> float:
        for _ in range(5):
            fn()
        times = []
        comm.Barrier()
        for _ in range(args.iters):
            if barrier:
                comm.Barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    rows = [("ping-pong, one way, after a Barrier", timed(pingpong, True) / 2),
            ("Allreduce, back to back", timed(allreduce, False)),
            ("Allreduce, after a Barrier", timed(allreduce, True))]
    if comm.rank == 0:
        for label, us in rows:
            print(f"{n * 4} B  {label}: {us:.1f} µs")


if __name__ == "__main__":
    main()
