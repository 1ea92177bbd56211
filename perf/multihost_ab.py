"""Two trees side by side on namespace hosts: per point, pycoll's time over MPICH's in each job and the link's bytes.

Reads `RATE-after-runN.json` and `RATE-before-runN.json` (`pycoll perf --peers pycoll,mpi` sweeps, the two trees
alternating) from a folder and prints, per call and size, the algorithms each tree ran, pycoll / MPICH in every
job and the most bytes the links carried over the fewest the call needs; then each tree's geometric mean of
pycoll / MPICH and how many points were at most 1x (issue 29's target at 2 ranks per host from 1 MiB).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os

from multihost_table import human  # perf/, first on the path of `python perf/multihost_ab.py`

RATES = ("unshaped", "10gbit", "1gbit")
TREES = ("after", "before")


def _load(path: str) -> dict[tuple, dict]:
    with open(path) as f:
        return {(r["peer"], r["collective"], r["bytes"]): r for r in json.load(f)["records"]}


def table(folder: str) -> list[str]:
    lines = []
    for rate in RATES:
        jobs = {t: [_load(p) for p in sorted(glob.glob(os.path.join(folder, f"{rate}-{t}-run*.json")))] for t in TREES}
        if not all(jobs.values()):
            continue
        lines.append(f"\n{rate}: {len(jobs['after'])} job(s) a tree; algorithm, pycoll/MPICH per job, link/min")
        summary = {t: [] for t in TREES}
        for key in (k for k in jobs["after"][0] if k[0] == "pycoll"):
            cells = []
            for t in TREES:
                pairs = [(j[key], j[("mpi",) + key[1:]]) for j in jobs[t]]
                ratios = [r["time_us"] / m["time_us"] for r, m in pairs]
                summary[t] += ratios
                counted = [r["link_bytes"] / r["link_min_bytes"] for r, _ in pairs if r.get("link_min_bytes")]
                link = f"{max(counted):.2f}" if counted else "-"  # point-to-point rows count no link bytes
                algos = "/".join(sorted({r["algo_used"] or "-" for r, _ in pairs}))
                cells.append(f"{t} {algos:12s} {' '.join(f'{x:.2f}' for x in ratios):15s} {link}")
            lines.append(f"{key[1]:15s} {human(key[2]):>7s}  " + " | ".join(cells))
        for t in TREES:
            r = summary[t]
            mean = math.exp(sum(map(math.log, r)) / len(r))
            lines.append(f"{t}: geometric mean {mean:.2f}, {sum(x <= 1 for x in r)}/{len(r)} points at most 1x")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    print("\n".join(table(ap.parse_args(argv).folder)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
