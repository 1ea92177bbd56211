"""How much of a two-rank call across hosts is Python: each call back to back as it runs, the time spent inside the
C swap (``TcpChannel.swap_frame``, which holds the socket's system calls and the wait for the peer), and the call
with that swap replaced by a stub that moves nothing, so that only the interpreter's share is left.

    pycoll run -n 2 --hosts 2 -- python perf/paired_python_share.py [--calls allreduce,bcast] [--bytes 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

from small_call_loops import call_table  # perf/, first on the path of `python perf/paired_python_share.py`

from pycoll import MPI
from pycoll.p2p_protocol import frame_bytes
from pycoll.transport import tcp


def _timed_swaps(spent: list) -> None:
    """TcpChannel.swap_frame, each call's time appended to ``spent`` (ns)."""
    real = tcp.TcpChannel.swap_frame

    def timed(self, *args):
        t0 = time.perf_counter_ns()
        result = real(self, *args)
        spent.append(time.perf_counter_ns() - t0)
        return result

    tcp.TcpChannel.swap_frame = timed


def _stub(self, head_out, out, head_in, into, spin_ns, yield_ns=0, tag=None):
    """A swap that says both frames moved and moves nothing."""
    sent = -1 if out is None else frame_bytes(out.nbytes)
    return sent, self.TAKEN if into is not None else -1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", default="allreduce,bcast,reduce,reduce_scatter,allgather,alltoall,barrier")
    ap.add_argument("--bytes", type=int, default=8, help="message size (float32 elements, default 8 B)")
    ap.add_argument("--iters", type=int, default=20000)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    assert comm.Get_size() == 2, "two ranks, one on each host"
    spent: list = []
    _timed_swaps(spent)
    table = call_table(comm, MPI, args.bytes)
    rows = []
    for name in args.calls.split(","):
        call = table[name][0]
        for _ in range(500):
            call()
        comm.Barrier()
        spent.clear()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            call()
        whole = (time.perf_counter() - t0) / args.iters * 1e6
        inside = statistics.median(spent) / 1e3 if spent else 0.0
        rows.append([name, whole, inside])
    comm.Barrier()
    real = tcp.TcpChannel.swap_frame
    tcp.TcpChannel.swap_frame = _stub  # from here on no frame moves: each rank runs its calls alone
    comm._x.plans.clear()  # plans bind the swap once; made again, they take the stub
    for row in rows:
        call = table[row[0]][0]
        for _ in range(500):
            call()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            call()
        row.append((time.perf_counter() - t0) / args.iters * 1e6)
    tcp.TcpChannel.swap_frame = real
    comm._x.plans.clear()
    rows = comm.gather(rows, root=0)
    if comm.Get_rank() == 0:
        print(f"{'call':15s} {'µs a call, by rank':>22s} {'in the C swap':>16s} {'Python alone':>16s}")
        for i, row in enumerate(rows[0]):
            mine = [r[i] for r in rows]
            print(f"{row[0]:15s} " + " ".join(f"{r[1]:10.2f}" for r in mine) + "  " +
                  " ".join(f"{r[2]:7.2f}" for r in mine) + "  " + " ".join(f"{r[3]:7.2f}" for r in mine))


if __name__ == "__main__":
    main()
