"""Where the CPU of a size span's first call goes: a program whose Allreduce (or Bcast) grows by one float a call, each
rank's CPU time (thread time) for the calls that open a new size span against the others, split by the steps that
choose and plan (each wrapped here and timed inclusively), and the program's first call split the same way.

    pycoll run -n 4 --hosts 2 python perf/new_span_cost.py [--coll allreduce|bcast] [--calls 400]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import numpy as np

from pycoll import MPI, executor
from pycoll.algorithms import registry, slots
from pycoll.algorithms.registry import size_span
from pycoll.transport import arena

STEPS = collections.defaultdict(float)  # step -> CPU seconds, inclusive


def timed(owner, name: str, label: str) -> None:
    """Wrap ``owner.name`` so that its CPU time adds to STEPS[label]."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            STEPS[label] += time.thread_time() - t0

    setattr(owner, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coll", choices=("allreduce", "bcast"), default="allreduce")
    p.add_argument("--calls", type=int, default=400)
    a = p.parse_args()
    timed(registry, "ranked", "rankings")
    timed(registry, "span_choice", "span choices (with their rankings)")
    timed(executor.Executor, "_first_as_planned", "first call as planned")
    timed(executor.Executor, "_choose", "plan's choice")
    timed(slots.Prepared, "__init__", "slots program")
    timed(arena.HostArena, "__init__", "arena set-up")
    comm, F = MPI.COMM_WORLD, MPI.FLOAT

    def call(n: int) -> None:
        if a.coll == "bcast":
            buf = np.ones(n, np.float32) if comm.rank == 0 else np.empty(n, np.float32)
            comm.Bcast([buf, F], 0)
        else:
            comm.Allreduce([np.ones(n, np.float32), F], [np.empty(n, np.float32), F])

    t0 = time.thread_time()
    call(2)
    first = (time.thread_time() - t0, dict(STEPS))
    seen, new, other, parts = {size_span(8)}, [], [], collections.defaultdict(float)
    for n in range(3, a.calls + 3):
        span, before = size_span(4 * n), dict(STEPS)
        t0 = time.thread_time()
        call(n)
        cpu = time.thread_time() - t0
        if span in seen:
            other.append(cpu)
            continue
        seen.add(span)
        new.append(cpu)
        for k, v in STEPS.items():
            parts[k] += v - before.get(k, 0.0)
    rows = comm.gather((first, statistics.median(new), statistics.median(other), len(new),
                        {k: v / len(new) for k, v in parts.items()}), root=0)
    if comm.rank == 0:
        print(f"{a.coll}, {comm.size} ranks, sizes growing by one float; CPU (thread time) in us")
        for r, ((t_first, s_first), t_new, t_other, spans, split) in enumerate(rows):
            print(f"rank {r}: first call {t_first * 1e6:.0f} ({', '.join(f'{k} {v * 1e6:.0f}' for k, v in s_first.items())})")
            print(f"        a new span's first call {t_new * 1e6:.0f} (median of {spans}), other calls {t_other * 1e6:.1f};"
                  f" a new span's steps: {', '.join(f'{k} {v * 1e6:.0f}' for k, v in sorted(split.items(), key=lambda kv: -kv[1]))}")


if __name__ == "__main__":
    main()
