"""What one ranking of the algorithms costs: ``registry.ranked`` for the small collectives on the layouts a composed
call across hosts ranks on (its leaders', its hosts' and the whole), at sizes of new size spans, on the model in force
(the built-in one unless PYCOLL_TUNE_FILE names another) with the machine's cores or ``--cores``. A program whose sizes
grow pays one such ranking per new size span and communicator, on the critical path of that span's first call.

    python perf/ranking_cost.py [--cores 0] [--rounds 200]    # PYTHONPATH=OLD for another tree, side by side
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from pycoll import ops
from pycoll.algorithms import Layout, cost, registry

LAYOUTS = {"4 ranks, 2 hosts": (0, 0, 1, 1), "2 ranks, 2 hosts": (0, 1), "2 ranks, 1 host": (0, 0)}
COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall")
SIZES = (1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584)  # the first sizes of successive size spans


def median_us(coll: str, host_of: tuple[int, ...], model: cost.CostModel, rounds: int) -> float:
    """The median time of one ranking over ``rounds`` rounds of SIZES, uncached (``ranked``, as a new span's)."""
    layout = Layout(host_of)
    op = ops.SUM if coll in ("allreduce", "reduce", "reduce_scatter") else None
    calls = [registry._probe((coll, n, op, 0, False, False), n) for n in SIZES]
    times = []
    for _ in range(rounds):
        for call in calls:
            t0 = time.perf_counter()
            registry.ranked(call, layout, model)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cores", type=int, default=0, help="the model's cores a host (0: this machine's, as a program "
                   "started without the runtime; a job's runtime sets its count)")
    p.add_argument("--rounds", type=int, default=200)
    a = p.parse_args()
    model = dataclasses.replace(cost.current(), cores=a.cores)
    print(f"one ranking, median us ({model.source}, cores={a.cores or 'machine'}, {a.rounds} rounds of {len(SIZES)} sizes)")
    print(f"{'layout':18s}" + "".join(f"{c:>15s}" for c in COLLECTIVES))
    for name, host_of in LAYOUTS.items():
        row = [median_us(c, host_of, model, a.rounds) for c in COLLECTIVES]
        print(f"{name:18s}" + "".join(f"{t:15.1f}" for t in row))


if __name__ == "__main__":
    main()
