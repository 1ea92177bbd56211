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


def _jobs(folder: str) -> dict[str, dict[int, list[dict]]]:
    """Each mode's jobs in ``folder``/jobs: {mode: {job number: its records}}."""
    jobs: dict[str, dict[int, list[dict]]] = {mode: {} for mode in MODES}
    for mode in MODES:
        for f in sorted(glob.glob(os.path.join(folder, "jobs", f"{mode}-*.json"))):
            with open(f) as fh:
                jobs[mode][int(os.path.basename(f)[len(mode) + 1:-len(".json")])] = json.load(fh)["records"]
    return jobs


def summary(folder: str) -> str:
    jobs = _jobs(folder)
    lines = []
    for mode in MODES:
        points: dict = {}
        for i in sorted(jobs[mode]):
            for r in jobs[mode][i]:
                points.setdefault((r["collective"], r["nranks"], r["bytes"]), []).append(r["time_us"])
        for (coll, n, nbytes), v in points.items():
            mid = statistics.median(v)
            lines.append(f"{mode:5s} {coll:14s} {n} ranks {nbytes:7d} B  jobs {len(v):3d}  median {mid:8.1f} µs  "
                         f"range {min(v):8.1f}-{max(v):8.1f}  over 3x the median: {sum(x > 3 * mid for x in v)}")
    return "\n".join(lines + _pairs(jobs))


def _pairs(jobs: dict[str, dict[int, list[dict]]]) -> list[str]:
    """Each point's bound time over the unbound time of the job that followed it: the median, and how often the
    bound job was faster (the VM's speed moves in spells, which alternating pairs share)."""
    ratios: dict = {}
    bound_jobs, free_jobs = (jobs[mode] for mode in MODES)
    i = 1
    while i in bound_jobs and i in free_jobs:
        for bound, free in zip(bound_jobs[i], free_jobs[i]):
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
