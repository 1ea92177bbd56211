"""`pycoll perf` jobs with the ranks bound to CPUs by `pycoll run` (PYCOLL_BIND=auto) and left to the scheduler
(none), alternating: each point's median and range over the jobs, and how many jobs read it at over 3x its
median. A job's rows go to DIR/jobs/MODE-NN.json.

    python perf/bind_ab.py --dir DIR --jobs 30 [-- pycoll perf's arguments, default: --np 2 --hosts 2 -C allreduce,broadcast -b 8 -e 64 -f 8]
    python perf/bind_ab.py --dir DIR --summary     # the table again from DIR/jobs
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys

DEFAULT = ["--np", "2", "--hosts", "2", "-C", "allreduce,broadcast", "-b", "8", "-e", "64", "-f", "8"]
MODES = ("auto", "none")


def summary(folder: str) -> str:
    lines = []
    for mode in MODES:
        points: dict = {}
        for f in sorted(glob.glob(os.path.join(folder, "jobs", f"{mode}-*.json"))):
            with open(f) as fh:
                for r in json.load(fh)["records"]:
                    points.setdefault((r["collective"], r["nranks"], r["bytes"]), []).append(r["time_us"])
        for (coll, n, nbytes), v in points.items():
            mid = statistics.median(v)
            lines.append(f"{mode:5s} {coll:14s} {n} ranks {nbytes:7d} B  jobs {len(v):3d}  median {mid:8.1f} µs  "
                         f"range {min(v):8.1f}-{max(v):8.1f}  over 3x the median: {sum(x > 3 * mid for x in v)}")
    lines += _pairs(folder)
    return "\n".join(lines)


def _pairs(folder: str) -> list[str]:
    """Each point's bound time over the unbound time of the job that followed it: the median, and how often the
    bound job was faster (the VM's speed moves in spells, which alternating pairs share)."""
    ratios: dict = {}
    i = 1
    while all(os.path.exists(os.path.join(folder, "jobs", f"{m}-{i:02d}.json")) for m in MODES):
        rows = []
        for mode in MODES:
            with open(os.path.join(folder, "jobs", f"{mode}-{i:02d}.json")) as fh:
                rows.append(json.load(fh)["records"])
        for bound, free in zip(*rows):
            key = (bound["collective"], bound["nranks"], bound["bytes"])
            ratios.setdefault(key, []).append(bound["time_us"] / free["time_us"])
        i += 1
    return [f"{coll:14s} {n} ranks {nbytes:7d} B  bound / unbound, job by job: median {statistics.median(r):.3f}, "
            f"bound faster in {sum(x < 1 for x in r)} of {len(r)}" for (coll, n, nbytes), r in ratios.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--jobs", type=int, default=20, help="jobs of each mode")
    ap.add_argument("--summary", action="store_true", help="only print the table of DIR/jobs")
    ap.add_argument("perf_args", nargs="*", help="pycoll perf's arguments (after --)")
    args = ap.parse_args()
    if not args.summary:
        os.makedirs(os.path.join(args.dir, "jobs"), exist_ok=True)
        for i in range(1, args.jobs + 1):
            for mode in MODES:
                out = os.path.join(args.dir, "jobs", f"{mode}-{i:02d}.json")
                cmd = [sys.executable, "-m", "pycoll", "perf", *(args.perf_args or DEFAULT), "--peers", "pycoll",
                       "--inplace", "out", "--no-progress", "--json", out]
                subprocess.run(cmd, env={**os.environ, "PYCOLL_BIND": mode}, check=True, stdout=subprocess.DEVNULL)
    print(summary(args.dir))


if __name__ == "__main__":
    main()
