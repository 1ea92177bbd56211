"""torch all_reduce on the "pycoll" backend beside pycoll's own Allreduce on NumPy arrays, in the same processes.

Every rank runs, for each size: first calls of that size, ``--first-trials`` each (default 6), by torch all_reduce on
a fresh tensor (each on its own torch group, the default group among them) and by ``Allreduce(IN_PLACE, array)`` on
a fresh NumPy array (each on its own duplicate of the group's communicator, so no call finds another's plans), in
pairs, torch first in every other pair and NumPy first in the rest; then the medians of warm torch all_reduce calls and of ``comm.Allreduce(IN_PLACE, array)`` on the
tensor's memory, the two alternating call by call; and torch all_reduce on a group of torch's own no-op
backend ("fake", from the wheel's test package), timed on its own, which times torch's dispatch alone: the part of
every torch all_reduce that no backend can take away. Times are the slowest rank's; a first call is the median of its trials (one first call moves
1.5x from trial to trial on a shared host).
Run it under the launcher, alone on the machine:

    flock /tmp/pycoll-bench.lock pycoll run -n 2 -- python perf/torch_allreduce.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

import pycoll.torch
from pycoll import MPI

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _no_op_group() -> object:
    """A group of torch's no-op backend (its C++ ``FakeProcessGroup``), or None where this torch has none."""
    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend
        return dist.new_group(backend="fake")
    except (ImportError, RuntimeError, ValueError):
        return None


def _medians_us(fns, iters: int) -> list[float]:
    """The median time of each of ``fns``, their calls alternating (so a drift of the machine meets them alike)."""
    for fn in fns:
        for _ in range(3):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, kept in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            kept.append(time.perf_counter() - t0)
    return [statistics.median(kept) * 1e6 for kept in times]


def _slowest(value: float) -> float:
    out = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--first-trials", type=int, default=6, help="first calls of each size, each side (default 6)")
    args = ap.parse_args()
    dist.init_process_group("pycoll")
    comm = dist.group.WORLD.comm  # the pycoll communicator under the torch group
    # first calls of a size: each on a torch group or a NumPy communicator with no plans for it yet, in pairs whose
    # order alternates (the first of a size in the process also pays for what the process sets up)
    trials = max(1, args.first_trials)
    everyone = list(range(dist.get_world_size()))
    groups = [dist.group.WORLD] + [dist.new_group(everyone) for _ in range(trials - 1)]
    twins = [comm.Dup() for _ in range(trials)]
    for group, twin in zip(groups, twins):  # each one set up by a call that is not timed, as the default group is
        dist.barrier(group=group)
        twin.Barrier()
    no_op = _no_op_group()
    rows = []
    for nbytes in SIZES:
        n = nbytes // 4
        iters = 200 if nbytes <= (64 << 10) else 40 if nbytes <= (4 << 20) else 15

        def first_torch(group: object) -> float:
            fresh = torch.ones(n)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(fresh, group=group)
            return _slowest((time.perf_counter() - t0) * 1e6)

        def first_numpy(twin: object) -> float:
            fresh = np.ones(n, np.float32)
            dist.barrier()
            t0 = time.perf_counter()
            twin.Allreduce(MPI.IN_PLACE, fresh)
            return _slowest((time.perf_counter() - t0) * 1e6)

        firsts, own_firsts = [], []
        for k, (group, twin) in enumerate(zip(groups, twins)):
            if k % 2:
                own_firsts.append(first_numpy(twin))
                firsts.append(first_torch(group))
            else:
                firsts.append(first_torch(group))
                own_firsts.append(first_numpy(twin))
        first, own_first = statistics.median(firsts), statistics.median(own_firsts)
        t = torch.ones(n)
        arr = t.numpy()
        dist.barrier()
        warm, own = map(_slowest, _medians_us([lambda: dist.all_reduce(t), lambda: comm.Allreduce(MPI.IN_PLACE, arr)],
                                              iters))
        # alone, not between the two: a no-op call right after a large pycoll call waits for the GIL meanwhile
        dispatch = None
        if no_op is not None:
            dispatch = _slowest(_medians_us([lambda: dist.all_reduce(t, group=no_op)], 200)[0])
        rows.append({"bytes": nbytes, "numpy_us": own, "torch_us": warm, "torch_first_us": first,
                     "numpy_first_us": own_first, "torch_firsts_us": firsts,
                     "numpy_firsts_us": own_firsts, "ratio": warm / own, "first_ratio": first / own_first,
                     "dispatch_us": dispatch, "floor_ratio": None if dispatch is None else (own + dispatch) / own})
    huge_pages = pycoll.torch.huge_page_tensors()
    if dist.get_rank() == 0:
        print(f"# torch all_reduce on pycoll against pycoll Allreduce on NumPy, {dist.get_world_size()} ranks, float32 sum")
        print("| size | NumPy Allreduce µs | torch all_reduce µs | ratio | torch's dispatch alone µs | least ratio "
              "| first call of the size: NumPy µs | torch µs | ratio |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            floor = (f"{r['dispatch_us']:.1f} | {r['floor_ratio']:.2f}" if r["dispatch_us"] is not None else "- | -")
            print(f"| {r['bytes'] >> 10} KiB | {r['numpy_us']:.1f} | {r['torch_us']:.1f} | {r['ratio']:.2f} | "
                  f"{floor} | {r['numpy_first_us']:.0f} | {r['torch_first_us']:.0f} | {r['first_ratio']:.2f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": dist.get_world_size(), "torch": torch.__version__, "huge_page_tensors": huge_pages, "rows": rows}, f, indent=1)
    for twin in twins:
        twin.Free()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
