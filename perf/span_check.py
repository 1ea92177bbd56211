"""Check selection by size span against the exact choice: for every span below a limit on a grid of layouts, links
and cores, where ``registry.span_choice`` gives one algorithm for the span, compare it with the model's choice at
every size inside (spans of up to 64 sizes) or at ``--samples`` random ones, and count the differences.

    python perf/span_check.py [--limit-log2 19] [--from-log2 0] [--samples 40] [--topology FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reprice_sweep import job_model  # noqa: E402

from pycoll import ops  # noqa: E402
from pycoll.algorithms import ALGORITHMS, Call, CostModel, Layout  # noqa: E402
from pycoll.algorithms import registry  # noqa: E402

REDUCING = ("allreduce", "reduce", "reduce_scatter", "scan", "exscan")
LAYOUTS = [Layout.flat(p) for p in (2, 3, 4, 5, 8)] + [Layout(t) for t in [
    (0, 1), (0, 0, 1, 1), (0, 1, 2), (0, 0, 0, 1, 1, 1), (0, 0, 1, 1, 2, 2), (0, 0, 0, 0, 1, 1, 1, 1), (0, 0, 1)]]


def probe(coll: str, n: int, op) -> Call:
    return Call(coll, np.dtype(np.uint8), op=op if coll in REDUCING else None, total=n)


def exact(model: CostModel, coll: str, n: int, lay: Layout, op) -> str:
    options = registry.ranked(probe(coll, n, op), lay, model)
    return registry._cheapest(options, coll, lay).name


def spans(first: int, last: int) -> list[tuple[int, int]]:
    out, n = [], 1 << first
    while n < (1 << last):
        lo, hi = registry.size_span(n)
        out.append((lo, hi))
        n = hi + 1
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-log2", type=int, default=0)
    parser.add_argument("--limit-log2", type=int, default=19)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--topology", default=str(Path(__file__).resolve().parent
                                                  / "results/multihost/model-one-way-folds/topology.json"))
    args = parser.parse_args()
    rng = random.Random(1)
    links = [("built-in", None, None), ("10gbit", "10gbit", None), ("1gbit", "1gbit", None),
             ("unshaped", None, args.topology)]
    registry.SPAN_LIMIT = 1 << 62  # check every span asked for, past the limit selection uses too
    spanned = checked = differ = 0
    for lay in LAYOUTS:
        for name, rate, topo in links:
            if lay.hosts == 1 and name != "built-in":
                continue
            for cores in (1, 2):
                base = (job_model({"nranks": lay.size, "hosts": lay.hosts, "link_rate": rate}, topo)
                        if lay.hosts > 1 else CostModel())
                model = dataclasses.replace(base, cores=cores)
                for coll in ALGORITHMS:
                    if coll == "barrier":
                        continue
                    for op in ((ops.SUM, ops.MAX) if coll in REDUCING else (None,)):
                        for lo, hi in spans(args.from_log2, args.limit_log2):
                            if lo == hi:
                                continue
                            chosen = registry.span_choice(probe(coll, lo, op), lay, model)
                            if chosen is None:
                                continue
                            spanned += 1
                            inner = range(lo, hi + 1) if hi - lo < 64 else rng.sample(range(lo, hi + 1), args.samples)
                            for n in inner:
                                checked += 1
                                there = exact(model, coll, n, lay, op)
                                if there != chosen.name:
                                    differ += 1
                                    print(f"differs: {name} cores={cores} hosts={lay.host_of} {coll} {n} B: span "
                                          f"{chosen.name}, exact {there}")
    print(f"{spanned} spans with one choice, {checked} sizes checked, {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
