"""Compare pycoll's times between two sets of `perf/host_calls.py` runs (two trees, or before and after a change).

    python perf/compare_host_calls.py --a DIR1 DIR2 --b DIR3 DIR4 [--label-a old --label-b new] > table.md

Each DIR holds a run's ``host-calls-np2.json`` (or ``-npN`` with ``--np N``). Runs of the same side are paired in
order with the other side's (A1 with B1, ...): run them alternately, so that each pair shares the machine's state.
Prints, per call and size, every run's pycoll time, each pair's B/A ratio and their geometric mean, then the
geometric mean over all rows and each run's count of targets passed.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def load(folder: str, np_: int) -> dict:
    data = json.loads((Path(folder) / f"host-calls-np{np_}.json").read_text())
    return {(r["call"], r["size"]): r for r in data["rows"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", nargs="+", required=True, help="run folders of side A")
    p.add_argument("--b", nargs="+", required=True, help="run folders of side B, paired in order with A's")
    p.add_argument("--label-a", default="A")
    p.add_argument("--label-b", default="B")
    p.add_argument("--np", type=int, default=2)
    args = p.parse_args()
    if len(args.a) != len(args.b):
        p.error("give as many runs of B as of A: they are compared in pairs")
    a = [load(f, args.np) for f in args.a]
    b = [load(f, args.np) for f in args.b]
    pairs = list(zip(a, b))
    head = [f"{args.label_a}{i + 1} µs" for i in range(len(a))] + [f"{args.label_b}{i + 1} µs" for i in range(len(b))]
    print(f"| call | size | {' | '.join(head)} | {args.label_b}/{args.label_a} per pair | geomean |")
    print("|---|---:|" + "---:|" * (len(head) + 2))
    logs = []
    for key in a[0]:
        times = [run.get(key, {}).get("pycoll_us") for run in a + b]
        if not all(isinstance(t, (int, float)) and t > 0 for t in times):
            continue
        ratios = [rb[key]["pycoll_us"] / ra[key]["pycoll_us"] for ra, rb in pairs]
        g = math.exp(sum(map(math.log, ratios)) / len(ratios))
        logs.append(math.log(g))
        size = key[1] if key[1] is not None else ""
        print(f"| {key[0]} | {size} | {' | '.join(f'{t:.1f}' for t in times)} | "
              f"{' / '.join(f'{r:.2f}' for r in ratios)} | {g:.2f} |")
    print()
    print(f"Geometric mean of {args.label_b}/{args.label_a} over {len(logs)} rows: {math.exp(sum(logs) / len(logs)):.3f}")
    for label, runs in ((args.label_a, a), (args.label_b, b)):
        passed = [sum(r.get("verdict") == "pass" for r in run.values()) for run in runs]
        print(f"Targets passed, {label}: {', '.join(f'{n} / {len(run)}' for n, run in zip(passed, runs))}")


if __name__ == "__main__":
    main()
