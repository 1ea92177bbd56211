"""An own block copied into the result while the sockets wait, against after the exchange, in one job: calls
alternate between the two (``HostMemory.plain`` answering False sends the copy back to Python, after the exchange
in C), each timed from a barrier; the slowest rank's median of each.

    pycoll run -n 2 --hosts 2 [--link-rate 10gbit] -- python perf/own_block_ab.py [--call allgather|alltoall]
        [--sizes 1M,4M,16M] [--calls 40] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from pycoll import MPI
from pycoll.memory import HOST
from pycoll.config import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--call", choices=("allgather", "alltoall"), default="allgather")
    parser.add_argument("--sizes", default="1M,4M,16M", help="bytes of the result (Allgather) or of a rank's input")
    parser.add_argument("--calls", type=int, default=40, help="timed calls, half each way, after 2 untimed")
    parser.add_argument("--json", help="append one line per size here (rank 0)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    real = HOST.plain
    for total in (parse_size(s) for s in args.sizes.split(",")):
        count = total // 4 // size  # float32 elements of one rank's block
        if args.call == "allgather":
            send = np.full(count, rank + 1, np.float32)
            recv = np.zeros(count * size, np.float32)
            expected = np.repeat(np.arange(1, size + 1, dtype=np.float32), count)

            def call() -> None:
                comm.Allgather([send, MPI.FLOAT], [recv, MPI.FLOAT])
        else:
            send = np.repeat(np.arange(size, dtype=np.float32) + 100 * rank, count)
            recv = np.zeros(count * size, np.float32)
            expected = np.repeat(100 * np.arange(size, dtype=np.float32) + rank, count)

            def call() -> None:
                comm.Alltoall([send, MPI.FLOAT], [recv, MPI.FLOAT])
        times: dict[str, list[float]] = {"in the exchange": [], "after it": []}
        for i in range(args.calls + 2):
            mode = "in the exchange" if i % 2 == 0 else "after it"
            HOST.plain = real if mode == "in the exchange" else (lambda dst, src: False)
            recv[:] = 0
            comm.Barrier()
            t0 = time.perf_counter()
            call()
            elapsed = time.perf_counter() - t0
            if not np.array_equal(recv, expected):
                raise SystemExit(f"rank {rank}: wrong result ({mode}, {total} B)")
            if i >= 2:
                times[mode].append(elapsed)
        HOST.plain = real
        medians = {k: float(np.median(v)) for k, v in times.items()}
        got = comm.gather(medians, root=0)
        if rank == 0:
            slowest = {k: max(g[k] for g in got) for k in medians}
            each = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in slowest.items())
            ratio = slowest["in the exchange"] / slowest["after it"]
            print(f"{args.call} {total} B, {size} ranks: {each} ({ratio:.2f}x)", flush=True)
            if args.json:
                with open(args.json, "a") as out:
                    out.write(json.dumps({"call": args.call, "bytes": total, "ranks": size,
                                          **{k.replace(" ", "_") + "_ms": v * 1e3 for k, v in slowest.items()}}) + "\n")


if __name__ == "__main__":
    main()
