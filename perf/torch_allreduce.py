"""torch all_reduce on the "pycoll" backend beside pycoll's own Allreduce on NumPy arrays, in the same processes.

Every rank runs, for each size: first calls of that size, twice each, by torch all_reduce on a fresh tensor (on the
default group, then on a second group) and by ``Allreduce(IN_PLACE, array)`` on a fresh NumPy array (each on its own
duplicate of the group's communicator, so neither finds the other's plans), torch first in one pair and NumPy first
in the other; then the medians of warm torch all_reduce calls and of ``comm.Allreduce(IN_PLACE, array)`` on the
tensor's memory, the two alternating call by call; and torch all_reduce on a group of torch's own no-op
backend ("fake", from the wheel's test package), timed on its own, which times torch's dispatch alone: the part of
every torch all_reduce that no backend can take away. Times are the slowest rank's; first calls are the mean of the two.
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

import pycoll.torch  # noqa: F401
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
    args = ap.parse_args()
    dist.init_process_group("pycoll")
    comm = dist.group.WORLD.comm  # the pycoll communicator under the torch group
    # first calls of a size, twice each: a torch group and a NumPy communicator with no plans yet, torch first in one
    # pair and NumPy first in the other (the first of a size in the process also pays for what the process sets up)
    groups = [dist.group.WORLD, dist.new_group(list(range(dist.get_world_size())))]
    twins = [comm.Dup(), comm.Dup()]
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

        first_a, own_a = first_torch(groups[0]), first_numpy(twins[0])
        own_b, first_b = first_numpy(twins[1]), first_torch(groups[1])
        first, own_first = (first_a + first_b) / 2, (own_a + own_b) / 2
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
                     "numpy_first_us": own_first, "ratio": warm / own, "first_ratio": first / own_first,
                     "dispatch_us": dispatch, "floor_ratio": None if dispatch is None else (own + dispatch) / own})
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
                json.dump({"ranks": dist.get_world_size(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    for twin in twins:
        twin.Free()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
