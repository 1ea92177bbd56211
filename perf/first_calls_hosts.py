"""First calls of a program across virtual hosts: the first, second and slowest of the first 300 small Allreduce calls.

Usage: python perf/first_calls_hosts.py [--np 4] [--hosts 2] [--jobs 5] [--env PYCOLL_SMP_BYTES=0 ...]

Each job is a fresh `pycoll run -n NP --hosts H` program that makes 300 `Allreduce([a, MPI.FLOAT], [b, MPI.FLOAT])`
calls of 8 bytes on fresh arrays and reports the slowest rank's time for each. Every --env setting (and the default)
runs --jobs jobs, alternating, and the medians over the jobs are printed. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

PROGRAM = r"""
import json, sys, time
import numpy as np
from pycoll import MPI
c = MPI.COMM_WORLD
times = []
for _ in range(300):
    a, b = np.ones(2, np.float32), np.empty(2, np.float32)
    t0 = time.perf_counter()
    c.Allreduce([a, MPI.FLOAT], [b, MPI.FLOAT])
    times.append(time.perf_counter() - t0)
slowest = np.empty(300)
c.Allreduce(np.array(times), slowest, op=MPI.MAX)
if c.rank == 0:
    print("FIRST " + json.dumps({"first_ms": slowest[0] * 1e3, "second_ms": slowest[1] * 1e3,
                                 "worst_after_first_ms": float(slowest[1:].max()) * 1e3,
                                 "median_us": float(np.median(slowest[1:])) * 1e6}))
"""


def one_job(np_: int, hosts: int, env: dict[str, str], script: str) -> dict[str, float]:
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", str(np_), "--hosts", str(hosts), sys.executable, script]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("FIRST ")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"job failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(line[6:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--jobs", type=int, default=5)
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="a setting to compare with the default")
    p.add_argument("--json", default=None, help="write every job's figures here")
    args = p.parse_args(argv)
    settings = [("default", {})] + [(e, dict([e.split("=", 1)])) for e in args.env]
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in settings}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "first_calls.py")
        with open(script, "w") as f:
            f.write(PROGRAM)
        for _ in range(args.jobs):
            for name, env in settings:
                results[name].append(one_job(args.np, args.hosts, env, script))
    print(f"{args.np} ranks on {args.hosts} virtual hosts, {args.jobs} jobs each; medians over the jobs")
    print(f"{'setting':28s} {'first ms':>9s} {'second ms':>10s} {'worst of 2-300 ms':>18s} {'median us':>10s}")
    for name, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"{name:28s} {med['first_ms']:9.1f} {med['second_ms']:10.2f} {med['worst_after_first_ms']:18.2f} "
              f"{med['median_us']:10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"np": args.np, "hosts": args.hosts, "jobs": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
