"""Small blocking calls in loops, under pycoll or mpi4py: each call's median time from a Barrier and its mean back
to back, on every rank, with the slowest rank's figure (one line per call and mode, as JSON with --json).

    pycoll run -n 4 --hosts 2 -- python perf/small_call_loops.py [--calls reduce,allreduce,bcast,barrier] [--bytes 8]
    python -m pycoll.perf.mpi_hosts -n 4 --hosts 2 -- python perf/small_call_loops.py --mpi4py
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import numpy as np

from pycoll.perf.report import append_rows


def call_table(comm, MPI, nbytes: int) -> dict:
    """The small calls by name, each as (function, its size in bytes), on float32 buffer specs of ``nbytes`` as
    `pycoll perf` sizes them: the whole vector (reduce, allreduce, bcast), a rank's whole input (reduce_scatter,
    alltoall), the whole output (allgather), rounded down to whole blocks of at least one element."""
    p, me = comm.Get_size(), comm.Get_rank()
    across = (me + p // 2) % p  # the rank half the ranks away: on another host where hosts hold blocks of ranks
    n = max(nbytes // 4, 1)
    a, b = np.ones(n, np.float32), np.empty(n, np.float32)
    whole = max(n // p, 1) * p  # p blocks of at least one element
    x, y = np.ones(whole, np.float32), np.empty(whole, np.float32)
    block = whole // p
    F = MPI.FLOAT
    return {
        "reduce": (lambda: comm.Reduce([a, F], [b, F], op=MPI.SUM, root=0), 4 * n),
        "allreduce": (lambda: comm.Allreduce([a, F], [b, F]), 4 * n),
        "bcast": (lambda: comm.Bcast([a, F], root=0), 4 * n),
        "barrier": (comm.Barrier, 4 * n),
        "reduce_scatter": (lambda: comm.Reduce_scatter_block([x, F], [y[:block], F], op=MPI.SUM), 4 * whole),
        "alltoall": (lambda: comm.Alltoall([x, F], [y, F]), 4 * whole),
        "allgather": (lambda: comm.Allgather([x[:block], F], [y, F]), 4 * whole),
        # a Bcast followed by an Allreduce (a one-sided call, then one that meets every rank), as one step
        "bcast_allreduce": (lambda: (comm.Bcast([a, F], root=0), comm.Allreduce([a, F], [b, F])), 4 * n),
        # nccl-tests' sendrecv: to the next rank, from the one before
        "sendrecv": (lambda: comm.Sendrecv([a, F], (me + 1) % p, 7, [b, F], (me - 1) % p, 7), 4 * n),
        # a halo exchange's form: Irecv, Isend, Waitall with the rank across
        "exchange": (lambda: MPI.Request.Waitall([comm.Irecv([b, F], across, 8), comm.Isend([a, F], across, 8)]), 4 * n),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", default="reduce,allreduce,bcast,barrier",
                    help="comma-separated: reduce, allreduce, bcast, barrier, reduce_scatter, alltoall, allgather, sendrecv, "
                         "exchange, bcast_allreduce (the two one after the other)")
    ap.add_argument("--bytes", type=int, default=8, help="message size (float32 elements, default 8 B)")
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--mpi4py", action="store_true", help="run on an installed mpi4py (MPICH) instead of pycoll")
    ap.add_argument("--json", help="append the rows to this file (rank 0)")
    ap.add_argument("--cpu", action="store_true",
                    help="also each rank's CPU time per call back to back (user and system ms, getrusage), in the JSON "
                         "row as cpu_ms")
    ap.add_argument("--each", action="store_true",
                    help="also time every call back to back on its own: the slowest rank's time of each call, in the "
                         "JSON row as each_us (the mean stays the loop's)")
    args = ap.parse_args()
    if args.mpi4py:
        from mpi4py import MPI
    else:
        from pycoll import MPI
    comm = MPI.COMM_WORLD
    calls = call_table(comm, MPI, args.bytes)
    rows = []
    for name in args.calls.split(","):
        fn, nbytes = calls[name]
        for mode in ("from a barrier", "back to back"):
            for _ in range(5):
                fn()
            comm.Barrier()
            each = cpu = None
            if mode == "back to back":
                stamps = [0.0] * (args.iters + 1)
                used = resource.getrusage(resource.RUSAGE_SELF)
                t0 = stamps[0] = time.perf_counter()
                for i in range(args.iters):
                    fn()
                    if args.each:
                        stamps[i + 1] = time.perf_counter()
                mine = (time.perf_counter() - t0) / args.iters * 1e6
                if args.cpu:
                    now = resource.getrusage(resource.RUSAGE_SELF)
                    cpu = comm.allgather([round((now.ru_utime - used.ru_utime) / args.iters * 1e3, 3),
                                          round((now.ru_stime - used.ru_stime) / args.iters * 1e3, 3)])
                if args.each:
                    own = [(b - a) * 1e6 for a, b in zip(stamps, stamps[1:])]
                    each = [max(c) for c in zip(*comm.allgather(own))]
            else:
                times = []
                for _ in range(args.iters):
                    comm.Barrier()
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                mine = statistics.median(times) * 1e6
            every = comm.allgather(mine)
            rows.append({"call": name, "mode": mode, "bytes": nbytes, "ranks": comm.Get_size(), "slowest_us": max(every),
                         "rank_us": every, "impl": "mpi4py" if args.mpi4py else "pycoll"})
            if each is not None:
                rows[-1]["each_us"] = each
            if cpu is not None:
                rows[-1]["cpu_ms"] = cpu
    if comm.Get_rank() == 0:
        for r in rows:
            print(f"{r['call']:14s} {r['mode']:14s} slowest {r['slowest_us']:7.1f} µs  ranks "
                  + " ".join(f"{x:6.1f}" for x in r["rank_us"]))
            if "cpu_ms" in r:
                print("  CPU ms a call, user/system by rank: " + " ".join(f"{u:.2f}/{k:.2f}" for u, k in r["cpu_ms"]))
            if "each_us" in r:
                print("  each call, slowest rank (µs): " + " ".join(f"{x:.0f}" for x in r["each_us"]))
        if args.json:
            append_rows(args.json, rows)


if __name__ == "__main__":
    main()
