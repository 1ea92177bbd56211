"""The rate 16 MiB crosses between two ranks by each path a collective may take (four blocking Sends, posted
receives, one blocking Send, the two-rank Bcast's one frame through C, a Sendrecv both ways at once), GB/s of
payload one way, medians of 5 (one JSON line; --json appends it to a file); and the two-rank Reduce to rank 0, whose
chunks cross one way as the Bcast's frame does and are folded at the root as they come.

    pycoll run -n 2 --hosts 2 [--link-rate 10gbit] -- python perf/host_pair_paths.py
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
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="append the row to this file (rank 0)")
    args = ap.parse_args()
    from pycoll import MPI

    comm = MPI.COMM_WORLD
    me, B = comm.Get_rank(), MPI.BYTE
    peer = 1 - me
    quarter, whole, ack = np.zeros(4 << 20, np.uint8), np.zeros(16 << 20, np.uint8), np.zeros(1, np.uint8)

    def rate(call) -> float:
        call()  # warm: connection and first-call paths
        took = []
        for _ in range(args.rounds):
            comm.Barrier()
            t0 = time.perf_counter()
            call()
            took.append(time.perf_counter() - t0)
        return round(whole.nbytes / statistics.median(took) / 1e9, 3)

    def four_blocking() -> None:  # four 4 MiB blocking Sends, then a 1-byte reply (`pycoll tune`'s stream until 2026-12-06)
        if me == 0:
            for _ in range(4):
                comm.Send([quarter, B], 1, tag=79)
            comm.Recv([ack, B], 1, tag=81)
        else:
            for _ in range(4):
                comm.Recv([quarter, B], 0, tag=79)
            comm.Send([ack, B], 0, tag=81)

    def posted() -> None:  # four 4 MiB messages posted at once, then a 1-byte reply
        if me == 0:
            MPI.Request.Waitall([comm.Isend([quarter, B], 1, tag=80) for _ in range(4)])
            comm.Recv([ack, B], 1, tag=81)
        else:
            MPI.Request.Waitall([comm.Irecv([quarter, B], 0, tag=80) for _ in range(4)])
            comm.Send([ack, B], 0, tag=81)

    def blocking() -> None:
        if me == 0:
            comm.Send([whole, B], 1, tag=82)
            comm.Recv([ack, B], 1, tag=83)
        else:
            comm.Recv([whole, B], 0, tag=82)
            comm.Send([ack, B], 0, tag=83)

    def bcast() -> None:  # closed by a reply, as the others: the root's Bcast returns once the kernel holds its bytes
        comm.Bcast([whole, B], root=0)
        if me == 0:
            comm.Recv([ack, B], 1, tag=84)
        else:
            comm.Send([ack, B], 0, tag=84)

    other = np.empty_like(whole)
    floats, folded = whole.view(np.float32), other.view(np.float32)
    row = {
        "tune's stream (4 x 4 MiB Sends)": rate(four_blocking),
        "4 x 4 MiB posted at once": rate(posted),
        "one 16 MiB Send": rate(blocking),
        "two-rank Bcast (one frame through C)": rate(bcast),
        "Sendrecv, both ways at once (each way)": rate(lambda: comm.Sendrecv([whole, B], peer, 90, [other, B], peer, 90)),
        "two-rank Reduce to rank 0 (folded as it comes)": rate(
            lambda: comm.Reduce([floats, MPI.FLOAT], [folded, MPI.FLOAT], op=MPI.SUM, root=0)),
    }
    if me == 0:
        print(json.dumps(row))
        if args.json:
            append_rows(args.json, [row])


if __name__ == "__main__":
    main()
