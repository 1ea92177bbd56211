"""A short allreduce demo: checks results against NumPy and prints an nccl-tests style table on rank 0.

Run it as ``pycoll run -n 4 python -m pycoll.demo``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import pycoll
from pycoll import MPI


def bus_factor(nranks: int) -> float:
    """nccl-tests' allreduce bus-bandwidth factor 2(n-1)/n."""
    return 2 * (nranks - 1) / nranks if nranks > 1 else 1.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-bytes", type=int, default=16 << 20, help="largest message (default 16 MiB)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per size")
    args = parser.parse_args(argv)

    comm = pycoll.init()
    rank, size = comm.rank, comm.size
    if rank == 0:
        print(f"pycoll {pycoll.__version__}: float32 allreduce (SUM), {size} ranks, out-of-place")
        print(f"{'size(B)':>12} {'count':>10} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'#wrong':>7}")
    nbytes = 4
    while nbytes <= args.max_bytes:
        count = nbytes // 4
        send = ((np.arange(count) + rank) % 13).astype(np.float32)
        recv = np.empty_like(send)
        expected = sum(((np.arange(count) + r) % 13).astype(np.float32) for r in range(size))
        comm.Allreduce(send, recv, op=MPI.SUM)  # warm-up, also checked
        wrong = int(np.count_nonzero(recv != expected))
        times = []
        for _ in range(args.iters):
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce(send, recv, op=MPI.SUM)
            times.append(time.perf_counter() - t0)
        slowest = comm.allreduce(statistics.median(times), op=MPI.MAX)
        wrong = comm.allreduce(wrong + int(np.count_nonzero(recv != expected)))
        if rank == 0:
            algbw = nbytes / slowest / 1e9
            print(
                f"{nbytes:>12} {count:>10} {slowest * 1e6:>10.1f} {algbw:>12.3f} {algbw * bus_factor(size):>12.3f} {wrong:>7}"
            )
        nbytes *= 8
    comm.Barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
