"""Soak rank: many small and some large collectives, sampling RSS, open descriptors and /dev/shm entries.

Run under a launcher, e.g. ``pycoll run -n 2 python tests/faults/soak_rank.py --small 100000 --large 1000 --out DIR``.
Each rank checks its results against NumPy as it goes and writes DIR/soak<rank>.json with its samples.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from pycoll import MPI  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def sample() -> dict:
    """RSS, open descriptors and this job's /dev/shm entries (every name carries the job id)."""
    from pycoll import runtime

    with open("/proc/self/statm") as fh:
        rss = int(fh.read().split()[1]) * PAGE
    job = runtime.current().info.job_id  # type: ignore[union-attr]
    return {"rss": rss, "fds": len(os.listdir("/proc/self/fd")), "shm": len(glob.glob(f"/dev/shm/pycoll-{glob.escape(job)}-*"))}


def small_call(comm, i: int, keep: dict) -> None:
    """One small collective; every 7th call uses fresh arrays (plans must not pile up)."""
    p, r = comm.size, comm.rank
    n = (1, 2, 16, 128, 1024)[i % 5]
    kind = i % 4
    fresh = i % 7 == 0
    key = (kind, n)
    if fresh or key not in keep:
        keep[key] = (np.empty(n * p, np.float32), np.empty(n * p, np.float32))
    a, b = keep[key]
    if kind == 0:
        a[:n] = r + 1
        comm.Allreduce(a[:n], b[:n], op=MPI.SUM)
        if b[0] != p * (p + 1) / 2:
            raise AssertionError(f"Allreduce #{i}: {b[0]}")
    elif kind == 1:
        a[:n] = i if r == i % p else -1
        comm.Bcast(a[:n], root=i % p)
        if a[0] != i:
            raise AssertionError(f"Bcast #{i}: {a[0]}")
    elif kind == 2:
        a[:n] = r
        comm.Allgather(a[:n], b)
        if b[n * (p - 1)] != p - 1:
            raise AssertionError(f"Allgather #{i}: {b[n * (p - 1)]}")
    else:
        comm.Barrier()


def large_call(comm, i: int, bufs: tuple) -> None:
    p, r = comm.size, comm.rank
    a, b = bufs
    kind = i % 3
    if kind == 0:
        a[:] = r + 1
        comm.Allreduce(a, b, op=MPI.SUM)
        ok = b[-1] == p * (p + 1) / 2
    elif kind == 1:
        m = a.size // p
        a[:m] = r
        comm.Allgather(a[:m], b[: m * p])
        ok = b[m * p - 1] == p - 1
    else:
        a[:] = 1
        m = a.size // p
        comm.Reduce_scatter_block(a[: m * p], b[:m], op=MPI.SUM)
        ok = b[m - 1] == p
    if not ok:
        raise AssertionError(f"large call {i} (kind {kind}) gave a wrong result")


def growth(samples: list[dict], warm: float = 0.2) -> dict:
    """RSS, descriptor and /dev/shm growth from the end of the warm-up (the first ``warm`` of the calls) to the end."""
    total = samples[-1]["calls"]
    base = next(s for s in samples if s["calls"] >= warm * total)
    last = samples[-1]
    return {
        "rss_bytes": last["rss"] - base["rss"],
        "rss_max_bytes": max(s["rss"] for s in samples if s["calls"] >= base["calls"]) - base["rss"],
        "fds": last["fds"] - base["fds"],
        "shm": last["shm"] - base["shm"],
        "shm_entries_at_end": last["shm"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=100_000)
    ap.add_argument("--large", type=int, default=1_000)
    ap.add_argument("--large-bytes", type=int, default=16 << 20)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    comm.Barrier()  # every rank attached: set-up segments are unlinked by now
    samples = [dict(sample(), calls=0, t=0.0)]
    start = time.monotonic()
    keep: dict = {}
    large = (np.empty(args.large_bytes // 4, np.float32), np.empty(args.large_bytes // 4, np.float32))
    total = args.small + args.large
    every = max(1, total // args.samples)
    small_per_large = max(1, args.small // max(args.large, 1))
    done_small = done_large = 0
    for k in range(total):
        if done_large < args.large and (k % (small_per_large + 1) == small_per_large or done_small >= args.small):
            large_call(comm, done_large, large)
            done_large += 1
        else:
            small_call(comm, done_small, keep)
            done_small += 1
        if (k + 1) % every == 0 or k + 1 == total:
            samples.append(dict(sample(), calls=k + 1, t=round(time.monotonic() - start, 3)))
    comm.Barrier()
    with open(os.path.join(args.out, f"soak{comm.rank}.json"), "w") as fh:
        json.dump({"rank": comm.rank, "size": comm.size, "small": done_small, "large": done_large,
                   "large_bytes": args.large_bytes, "samples": samples}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
