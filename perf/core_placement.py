"""Whether this machine's two CPUs share a cache right now, beside what two ranks on two namespace hosts move.

A virtual machine's CPUs can be moved by its hypervisor between cores that share a last-level cache and cores that
do not (another die or socket). Between ranks every byte crosses from one CPU to the other, so that placement sets
the rate of every transfer between hosts that share this machine. Each round, in turn:
- a cache line's round trip between CPU 0 and CPU 1 (two processes, one pinned to each, spinning on a shared word);
- the rate at which CPU 1 copies 4 MiB that CPU 0 has just written;
- a fresh `pycoll run -n 2 --hosts 2` job timing a 2-rank Alltoall of 16 MiB each way (median of 9 calls).

    python perf/core_placement.py --seconds 200 --json perf/results/multihost/vm-core-placement/rounds.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing import Process, shared_memory

import numpy as np
from numba import njit

from pycoll.transport.atomics import cpu_relax, load_acquire, store_seq_cst

TRIPS = 200_000
COPY_BYTES = 4 << 20
COPIES = 20

ALLTOALL_JOB = """
import time, numpy as np
from pycoll import MPI
comm = MPI.COMM_WORLD
n = 16 << 20
out, into = np.ones(2 * n, np.uint8), np.zeros(2 * n, np.uint8)
def once():
    t = time.perf_counter(); comm.Alltoall([out, MPI.BYTE], [into, MPI.BYTE]); return time.perf_counter() - t
once()
times = []
for _ in range(9):
    comm.Barrier(); times.append(once())
worst = comm.allreduce(sorted(times)[4], op=MPI.MAX)
if comm.Get_rank() == 0:
    print(n / worst / 1e9)
"""


@njit(cache=True)
def _bounce(words, first, trips):
    """Trip k: the first side writes 2k + 1 and waits for 2k + 2, which the other side writes back."""
    for k in range(trips):
        if first:
            store_seq_cst(words, 0, 2 * k + 1)
            while load_acquire(words, 0) != 2 * k + 2:
                cpu_relax()
        else:
            while load_acquire(words, 0) != 2 * k + 1:
                cpu_relax()
            store_seq_cst(words, 0, 2 * k + 2)


def _side(name: str, cpu: int, first: bool) -> None:
    """One CPU's part: the round trips (the first side times them into word 3), then the copies (the other side
    times its copies of what the first wrote into word 2)."""
    os.sched_setaffinity(0, {cpu})
    shm = shared_memory.SharedMemory(name=name)
    words = np.ndarray(8, np.uint64, buffer=shm.buf)
    data = np.ndarray(COPY_BYTES, np.uint8, buffer=shm.buf, offset=64)
    into = np.zeros(COPY_BYTES, np.uint8)
    if first:  # the clock starts once the other side is spinning
        while words[4] != 1:
            time.sleep(0)
        t = time.perf_counter()
        _bounce(words, first, TRIPS)
        words[3] = int((time.perf_counter() - t) * 1e9)
    else:
        words[4] = 1
        _bounce(words, first, TRIPS)
    for k in range(COPIES):
        if first:
            data[:] = k
            words[1] = 2 * k + 1  # the hand-over in Python: x86 keeps these stores in order
            while words[1] != 2 * k + 2:
                time.sleep(0)
        else:
            while words[1] != 2 * k + 1:
                time.sleep(0)
            t = time.perf_counter()
            np.copyto(into, data)
            words[2] += np.uint64((time.perf_counter() - t) * 1e9)
            words[1] = 2 * k + 2
    del words, data
    shm.close()


def cache_distance() -> tuple[float, float]:
    """(a cache line's round trip between CPU 0 and CPU 1 in ns, GB/s at which CPU 1 copies what CPU 0 wrote)."""
    shm = shared_memory.SharedMemory(create=True, size=64 + COPY_BYTES)
    try:
        words = np.ndarray(8, np.uint64, buffer=shm.buf)
        words[:] = 0
        _bounce(np.zeros(8, np.uint64), True, 0)  # compiled before the children fork
        sides = [Process(target=_side, args=(shm.name, cpu, cpu == 0)) for cpu in (1, 0)]
        for p in sides:
            p.start()
        for p in sides:
            p.join()
        trip_ns, copy_s = int(words[3]) / TRIPS, int(words[2]) * 1e-9
        del words
        return trip_ns, COPY_BYTES * COPIES / copy_s / 1e9
    finally:
        shm.close()
        shm.unlink()


def alltoall_rate(script: str) -> float:
    env = dict(os.environ, PYCOLL_LINK_RATE="")
    out = subprocess.run([sys.executable, "-m", "pycoll", "run", "-n", "2", "--hosts", "2", sys.executable, script],
                         env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    return float(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--near-ns", type=float, default=200.0, help="round trips below this count as a shared cache")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        print("needs CPUs 0 and 1", file=sys.stderr)
        return 2
    rounds = []
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(ALLTOALL_JOB)
    try:
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            trip, copy = cache_distance()
            rate = alltoall_rate(f.name)
            rounds.append({"time": time.strftime("%H:%M:%S"), "round_trip_ns": round(trip, 1),
                           "cross_copy_GBps": round(copy, 2), "alltoall_each_way_GBps": round(rate, 3)})
            print(json.dumps(rounds[-1]), flush=True)
    finally:
        os.unlink(f.name)
    for name, keep in (("shared cache", lambda r: r["round_trip_ns"] < args.near_ns),
                       ("no shared cache", lambda r: r["round_trip_ns"] >= args.near_ns)):
        sel = [r for r in rounds if keep(r)]
        if sel:
            rates = [r["alltoall_each_way_GBps"] for r in sel]
            print(f"{name}: {len(sel)} rounds; round trip {statistics.median(r['round_trip_ns'] for r in sel):.0f} ns, "
                  f"cross copy {statistics.median(r['cross_copy_GBps'] for r in sel):.1f} GB/s, 2-rank Alltoall "
                  f"{statistics.median(rates):.2f} GB/s each way ({min(rates):.2f}-{max(rates):.2f})")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"near_ns": args.near_ns, "rounds": rounds}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
