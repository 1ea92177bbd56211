"""Mismatch matrix: ranks disagree on the collective, count, dtype, op or root; each case on a fresh Dup.

Every rank records per case the error class it raised (or none) in OUT/mismatch<rank>.json. Rank ``odd``
(the last rank) makes the different call; ``small`` cases stay in the arena's slots, ``large`` ones take
the chunked algorithms.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pycoll import MPI, errors  # noqa: E402


def cases(p: int, odd: bool):
    """(name, function of comm) pairs; ``odd`` selects the disagreeing rank's variant."""
    out = []
    for size, n in (("small", 64), ("large", 1 << 16)):
        a32, b32 = np.ones(n, np.float32), np.empty(n, np.float32)

        def allreduce(c, a=a32, b=b32):
            c.Allreduce(a, b, op=MPI.SUM)

        def allgather(c, n=n):
            c.Allgather(np.ones(n // p or 1, np.float32), np.empty((n // p or 1) * p, np.float32))

        def bcast(c, a=a32, root=0):
            c.Bcast(a, root=root)

        def reduce(c, a=a32, b=b32, root=0):
            c.Reduce(a, b, op=MPI.SUM, root=root)

        out += [
            (f"{size} allreduce vs allgather", allgather if odd else allreduce),
            (f"{size} allreduce vs bcast", (lambda c: bcast(c)) if odd else allreduce),
            (f"{size} allreduce vs reduce", (lambda c: reduce(c)) if odd else allreduce),
            (f"{size} allreduce vs barrier", (lambda c: c.Barrier()) if odd else allreduce),
            (f"{size} count", (lambda c, n=n: c.Allreduce(np.ones(n + 1, np.float32), np.empty(n + 1, np.float32))) if odd else allreduce),
            (f"{size} dtype float32 vs int32", (lambda c, n=n: c.Allreduce(np.ones(n, np.int32), np.empty(n, np.int32))) if odd else allreduce),
            (f"{size} dtype same bytes", (lambda c, n=n: c.Allreduce(np.ones(n // 2, np.float64), np.empty(n // 2, np.float64))) if odd else allreduce),
            (f"{size} op sum vs max", (lambda c: c.Allreduce(a32, b32, op=MPI.MAX)) if odd else allreduce),
            (f"{size} bcast root", (lambda c: bcast(c, root=1)) if odd else (lambda c: bcast(c, root=0))),
            (f"{size} reduce root", (lambda c: reduce(c, root=1)) if odd else (lambda c: reduce(c, root=0))),
        ]
    return out


def main() -> int:
    out_dir = sys.argv[1]
    world = MPI.COMM_WORLD
    p, r = world.size, world.rank
    results = []
    for name, fn in cases(p, r == p - 1):
        c = world.Dup()
        c.timeout = float(os.environ.get("MISMATCH_TIMEOUT", "3"))
        t0 = time.monotonic()
        nxt = None
        try:
            fn(c)
            got = None
        except errors.PycollError as exc:
            got = {"class": type(exc).__name__, "mro": [k.__name__ for k in type(exc).__mro__], "msg": str(exc)}
        if got is None:  # this rank's part completed: the next call on the communicator must not pass silently
            try:
                c.Barrier()
                nxt = "completed"
            except errors.PycollError as exc:
                nxt = type(exc).__name__
        results.append({"case": name, "error": got, "next": nxt, "s": round(time.monotonic() - t0, 3)})
        world.Barrier()  # the world is never broken: only the Dup is
        try:
            c.Free()
        except errors.PycollError:  # a broken communicator cannot be freed collectively; it is dropped
            pass
    with open(os.path.join(out_dir, f"mismatch{r}.json"), "w") as fh:
        json.dump(results, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
