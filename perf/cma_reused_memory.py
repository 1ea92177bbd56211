"""Does the memory under a user's buffer change a cross-memory collective's speed? A 2-rank in-place Allgather of
1 MiB blocks (cross-memory attach) timed on a buffer from NumPy's allocator and on a fresh shared anonymous mapping
(Python's mmap(-1)), before and after a window of 1 MiB point-to-point receives into a 16 MiB array that is then
freed; then on fresh mappings with rank 1's buffer skewed by 0, 16, 64 and 2048 bytes.

glibc raises its mmap threshold to the size of a freed mapped chunk (up to 32 MiB), so after the window a 2 MiB
array comes from the heap (brk) instead of a mapping of its own. Run under pycoll:

    pycoll run -n 2 -- python perf/cma_reused_memory.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import mmap
import time

import numpy as np

from pycoll import MPI

BLOCK = 1 << 18  # float32 elements per rank: 1 MiB
WINDOW = 16  # receives in flight, into one array of WINDOW blocks (16 MiB)


def region(addr: int) -> str:
    """What /proc/self/maps names the mapping that holds ``addr`` (the heap, or an anonymous mapping), and where
    ``addr`` falls in its 64-byte cache line."""
    name = "?"
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                name = fields[5] if len(fields) > 5 else "anonymous"
                break
    return f"{name} +{addr % 64}"


def allgather_us(comm, outs: np.ndarray, calls: int) -> float:
    """Median µs per in-place Allgather over 5 batches (slowest rank's), after 5 untimed calls; checks the result."""
    r, n, F = comm.Get_rank(), BLOCK, MPI.FLOAT
    outs[:] = 0
    outs[r * n:(r + 1) * n] = r + 1
    call = lambda: comm.Allgather(MPI.IN_PLACE, [outs, n, F])  # noqa: E731
    for _ in range(5):
        call()
    if not ((outs[:n] == 1).all() and (outs[n:] == 2).all()):
        raise SystemExit(f"rank {r}: wrong Allgather result")
    batches = []
    for _ in range(5):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        batches.append((time.perf_counter() - t0) / calls * 1e6)
    slowest = np.array(batches)
    comm.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
    return float(np.median(slowest))


def window_of_receives(comm, reps: int) -> None:
    """``reps`` windows of WINDOW 1 MiB messages from rank 0 into one 16 MiB array on rank 1, then freed."""
    r, n, F = comm.Get_rank(), BLOCK, MPI.FLOAT
    src = np.ones(n, np.float32)
    slots = np.zeros(WINDOW * n, np.float32) if r == 1 else None
    for _ in range(reps):
        if r == 0:
            reqs = [comm.Isend([src, n, F], 1, 1) for _ in range(WINDOW)]
        else:
            reqs = [comm.Irecv([slots[i * n:(i + 1) * n], n, F], 0, 1) for i in range(WINDOW)]
        MPI.Request.Waitall(reqs)
    del slots


def measure(comm, label: str, calls: int) -> list[dict]:
    rows = []
    heap = np.zeros(2 * BLOCK, np.float32)
    rows.append({"when": label, "buffer": "np.zeros", "region": region(heap.ctypes.data),
                 "us": allgather_us(comm, heap, calls)})
    del heap
    m = mmap.mmap(-1, 8 * BLOCK)
    fresh = np.frombuffer(m, np.float32)
    rows.append({"when": label, "buffer": "shared mapping", "region": region(fresh.ctypes.data),
                 "us": allgather_us(comm, fresh, calls)})
    del fresh
    m.close()
    return rows


def misaligned(comm, calls: int) -> list[dict]:
    """The same Allgather on fresh shared mappings, rank 1's buffer starting ``skew`` bytes into its mapping: what
    matters is whether the two ranks' buffers sit at the same offset within a 64-byte cache line."""
    rows = []
    for skew in (0, 16, 64, 2048):
        mine = skew if comm.Get_rank() == 1 else 0
        m = mmap.mmap(-1, 8 * BLOCK + 4096)
        buf = np.frombuffer(m, np.uint8)[mine:mine + 8 * BLOCK].view(np.float32)
        rows.append({"when": f"rank 1 at +{skew} B", "buffer": "shared mapping", "region": region(buf.ctypes.data),
                     "us": allgather_us(comm, buf, calls)})
        del buf
        m.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300, help="Allgathers per timed batch")
    ap.add_argument("--reps", type=int, default=20, help="windows of receives between the two measurements")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        raise SystemExit("run on 2 ranks")
    rows = measure(comm, "before the window", args.calls)
    window_of_receives(comm, args.reps)
    rows += measure(comm, "after the window", args.calls)
    rows += misaligned(comm, args.calls)
    regions = comm.gather([r["region"] for r in rows], root=0)
    if comm.Get_rank() == 0:
        for i, row in enumerate(rows):
            row["region"] = " / ".join(g[i] for g in regions)  # rank 0's / rank 1's
            print(f"{row['when']:<18} {row['buffer']:<14} {row['us']:8.1f} us  ({row['region']})", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f, indent=1)


if __name__ == "__main__":
    main()
