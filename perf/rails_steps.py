"""Times a composed Reduce_scatter_block by rails whole and each of its steps alone, to see where its time goes.

Run on namespace hosts: ``pycoll run -n 4 --hosts 2 python perf/rails_steps.py`` (with the job's PYCOLL_TOPO_FILE).
Each line: the whole call, one host step of a piece (and how many a call runs), the rails' step and the packing of
one host's run, the slowest rank's median over 15 calls, in microseconds.
"""

import statistics
import time

import numpy as np

from pycoll import MPI, composed


def slowest_median(comm, call, repeats: int = 15) -> float:
    times = []
    for _ in range(repeats):
        comm.Barrier()
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return max(comm.allgather(statistics.median(times))) * 1e6


def main() -> None:
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    for mib in (1, 4, 16):
        n = (mib << 20) // 4
        send, recv = np.ones(n, np.float32), np.empty(n // p, np.float32)
        whole = slowest_median(comm, lambda: comm.Reduce_scatter_block([send, MPI.FLOAT], [recv, MPI.FLOAT]))
        parts = comm._x.composed
        if parts is None or parts.column is None:
            raise SystemExit("the call was not composed by rails (needs several ranks on each of several hosts)")
        k = len(parts.groups[0])
        block = n // p
        width = composed.rail_piece_elements(block, k, 4)
        piece_in, piece_out = np.ones(k * width, np.float32), np.empty(width, np.float32)
        host = slowest_median(comm, lambda: parts.host_comm.Reduce_scatter_block(piece_in, piece_out))
        hosts = len(parts.groups)
        rail_in, rail_out = np.ones(hosts * block, np.float32), np.empty(block, np.float32)
        rail = slowest_median(comm, lambda: parts.column.Reduce_scatter_block(rail_in, rail_out))
        packed, run = np.empty(k * width, np.float32), send[:k * block].reshape(k, block)

        def pack() -> None:
            for lo in range(0, block, width):
                hi = min(lo + width, block)
                np.copyto(packed[:k * (hi - lo)].reshape(k, hi - lo), run[:, lo:hi])

        packing = slowest_median(comm, pack)
        if comm.Get_rank() == 0:
            pieces = -(-block // width)
            print(f"{mib} MiB: whole {whole:.0f}  host step {host:.0f} x {hosts * pieces}  rails {rail:.0f}  "
                  f"packing a host's run {packing:.0f}", flush=True)


if __name__ == "__main__":
    main()
