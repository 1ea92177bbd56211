"""Large calls between hosts under several socket write sizes (PYCOLL_TCP_PUSH_SLICE) in one job, rounds alternating:
each call's median from a Barrier, the slowest rank's, per write size (its median and range over the rounds).

    pycoll run -n 2 --hosts 2 -- python perf/push_slice_ab.py --bytes 1M --slices 0,61440,131072

The write size is switched between calls on every rank alike (each channel's ``push_slice``, which the engine's
progress and the C exchange read), so every size sees the same connections and phases.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from pycoll import MPI
from pycoll.config import parse_size
from pycoll.perf.report import append_rows


def calls(comm, nbytes: int) -> dict:
    """The calls by name on float32 buffer specs: ``nbytes`` from each rank (a ping-pong's message, an Allgather's
    block) and the whole vector of ``nbytes`` per rank for the reducing calls, Alltoall and Bcast."""
    r, p = comm.Get_rank(), comm.Get_size()
    n = max(nbytes // 4, 1)
    a, b = np.ones(n, np.float32), np.empty(n, np.float32)
    whole, out = np.ones(p * n, np.float32), np.empty(p * n, np.float32)
    F = MPI.FLOAT
    right, left = (r + 1) % p, (r - 1) % p

    def pingpong() -> None:
        if r == 0:
            comm.Send([a, F], 1, 5)
            comm.Recv([b, F], 1, 5)
        elif r == 1:
            comm.Recv([b, F], 0, 5)
            comm.Send([a, F], 0, 5)

    return {
        "pingpong": pingpong,
        "sendrecv": lambda: comm.Sendrecv([a, F], right, 0, [b, F], left, 0),
        "allgather": lambda: comm.Allgather([a, F], [out, F]),
        "allreduce": lambda: comm.Allreduce([whole, F], [out, F]),
        "reduce_scatter": lambda: comm.Reduce_scatter_block([whole, F], [b, F]),
        "alltoall": lambda: comm.Alltoall([whole, F], [out, F]),
        "bcast": lambda: comm.Bcast([whole, F], 0),
    }


def use_slice(comm, nbytes: int) -> None:
    for ch in comm._engine.channels.values():
        if hasattr(ch, "push_slice"):
            ch.push_slice = nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", default="1M", help="bytes from each rank (default 1M)")
    ap.add_argument("--slices", default="0,61440,131072", help="write sizes to compare (0: whole frames)")
    ap.add_argument("--calls", default="pingpong,sendrecv,allgather,allreduce,reduce_scatter,alltoall,bcast")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=15, help="timed calls per call, size and round")
    ap.add_argument("--json", help="append the rows to this file (rank 0)")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    nbytes = parse_size(args.bytes)
    slices = [parse_size(s) for s in args.slices.split(",")]
    table = calls(comm, nbytes)
    names = args.calls.split(",")
    times: dict = {(c, s): [] for c in names for s in slices}
    for _ in range(args.rounds):
        for s in slices:
            use_slice(comm, s)
            for c in names:
                call = table[c]
                for _ in range(3):
                    call()
                ts = []
                for _ in range(args.iters):
                    comm.Barrier()
                    t = time.perf_counter()
                    call()
                    ts.append(time.perf_counter() - t)
                times[(c, s)].append(comm.allreduce(statistics.median(ts) * 1e6, op=MPI.MAX))
    if comm.Get_rank() != 0:
        return
    rows = []
    for c in names:
        cells = []
        for s in slices:
            got = times[(c, s)]
            rows.append({"call": c, "bytes": nbytes, "ranks": comm.Get_size(), "slice": s,
                         "median_us": statistics.median(got), "rounds_us": got})
            cells.append(f"{s}: {statistics.median(got):8.1f} [{min(got):.0f}-{max(got):.0f}]")
        print(f"{c:15s} " + "  ".join(cells), flush=True)
    if args.json:
        append_rows(args.json, rows)


if __name__ == "__main__":
    main()
