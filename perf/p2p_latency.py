"""Point-to-point on 2 ranks of one host: ping-pong one-way latency and windowed bandwidth, pycoll against mpi4py + MPICH.

Usage: python perf/p2p_latency.py [--sizes 8,4K,64K,1M,4M] [--window 64] [--reps 7] [--peers mpi,pycoll] [--json OUT]

Runs the same worker under `mpiexec -n 2` (mpi4py) and `pycoll run -n 2` (pycoll), one after the other, and prints
medians. Calls are written as programs write them: `comm.Send([buf, n, MPI.BYTE], 1, tag)`, `Recv` the same,
`Isend` windows completed with `MPI.Request.Waitall`, plus a `Sendrecv` exchange and ping-pong on fresh arrays.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = "8,4K,64K,1M,4M"


def _size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper()
    return int(t[:-1]) * mult[t[-1]] if t[-1] in mult else int(t)


def _label(n: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def worker(impl: str, sizes: list[int], window: int, reps: int) -> None:
    """One rank of the benchmark; rank 0 prints one JSON line."""
    import numpy as np

    if impl == "mpi":
        from mpi4py import MPI
    else:
        from pycoll import MPI
    comm = MPI.COMM_WORLD
    rank, peer = comm.Get_rank(), 1 - comm.Get_rank()
    out: dict = {"impl": impl, "pingpong_us": {}, "fresh_us": {}, "sendrecv_us": {}, "bw_GBps": {}}
    for n in sizes:
        buf = np.zeros(max(n, 1), np.uint8)
        iters = max(20, min(2000, (64 << 20) // max(n, 1) // 4))
        lat, fresh, sr, bw = [], [], [], []
        for rep in range(reps + 1):  # the first repetition warms up
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                if rank == 0:
                    comm.Send([buf, n, MPI.BYTE], peer, 1)
                    comm.Recv([buf, n, MPI.BYTE], peer, 1)
                else:
                    comm.Recv([buf, n, MPI.BYTE], peer, 1)
                    comm.Send([buf, n, MPI.BYTE], peer, 1)
            t = (time.perf_counter() - t0) / iters / 2
            # fresh arrays every iteration, as programs that allocate per message do
            fi = max(10, iters // 4)
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(fi):
                a = np.empty(n, np.uint8)
                if rank == 0:
                    comm.Send(a, peer, 2)
                    comm.Recv(a, peer, 2)
                else:
                    comm.Recv(a, peer, 2)
                    comm.Send(a, peer, 2)
            tf = (time.perf_counter() - t0) / fi / 2
            # halo-style exchange: both send and receive at once
            rb = np.empty(max(n, 1), np.uint8)
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(fi):
                comm.Sendrecv([buf, n, MPI.BYTE], peer, 3, [rb, n, MPI.BYTE], peer, 3)
            ts = (time.perf_counter() - t0) / fi
            # windowed bandwidth: `window` Isends in flight, then Waitall; a 1-byte ack closes the round
            bufs = [np.zeros(max(n, 1), np.uint8) for _ in range(window)] if n <= (1 << 20) else [buf] * window
            rounds = max(2, min(50, (256 << 20) // max(n * window, 1)))
            ack = np.zeros(1, np.uint8)
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(rounds):
                if rank == 0:
                    MPI.Request.Waitall([comm.Isend([b, n, MPI.BYTE], peer, 4) for b in bufs])
                    comm.Recv([ack, 1, MPI.BYTE], peer, 5)
                else:
                    MPI.Request.Waitall([comm.Irecv([b, n, MPI.BYTE], peer, 4) for b in bufs])
                    comm.Send([ack, 1, MPI.BYTE], peer, 5)
            tb = time.perf_counter() - t0
            if rep:
                lat.append(t * 1e6)
                fresh.append(tf * 1e6)
                sr.append(ts * 1e6)
                bw.append(n * window * rounds / tb / 1e9)
        key = _label(n)
        out["pingpong_us"][key] = _median(lat)
        out["fresh_us"][key] = _median(fresh)
        out["sendrecv_us"][key] = _median(sr)
        out["bw_GBps"][key] = _median(bw)
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def run_peer(impl: str, args: argparse.Namespace) -> dict:
    me = [sys.executable, os.path.abspath(__file__), "--worker", impl, "--sizes", args.sizes, "--window", str(args.window),
          "--reps", str(args.reps)]
    launcher = ["mpiexec", "-n", "2"] if impl == "mpi" else ["pycoll", "run", "-n", "2", "--"]
    proc = subprocess.run(launcher + me, capture_output=True, text=True, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{impl} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=SIZES)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--peers", default="mpi,pycoll")
    p.add_argument("--json")
    p.add_argument("--worker", choices=["mpi", "pycoll"])
    args = p.parse_args()
    sizes = [_size(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(args.worker, sizes, args.window, args.reps)
        return 0
    results = {impl: run_peer(impl, args) for impl in args.peers.split(",")}
    peers = list(results)
    metrics = [("pingpong_us", "ping-pong one-way (us)"), ("fresh_us", "ping-pong, fresh arrays (us)"),
               ("sendrecv_us", "Sendrecv exchange (us)"), ("bw_GBps", f"bandwidth, {args.window} Isends + Waitall (GB/s)")]
    for key, title in metrics:
        print(f"\n{title}")
        print(f"{'size':>6} " + " ".join(f"{p:>10}" for p in peers) + ("   pycoll/mpi" if len(peers) == 2 else ""))
        for s in sizes:
            lab = _label(s)
            vals = [results[p][key][lab] for p in peers]
            ratio = f"   {results['pycoll'][key][lab] / results['mpi'][key][lab]:10.2f}" if set(peers) == {"mpi", "pycoll"} else ""
            print(f"{lab:>6} " + " ".join(f"{v:10.2f}" for v in vals) + ratio)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
