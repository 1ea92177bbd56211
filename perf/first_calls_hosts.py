"""First calls of a program across virtual hosts: the first, second and slowest of a program's first calls.

Usage: python perf/first_calls_hosts.py [--np 4] [--hosts 2] [--jobs 5] [--coll allreduce] [--bytes 8]
       [--calls 300] [--new-counts | --cycle K] [--peers pycoll,mpi] [--env PYCOLL_SMP_BYTES=0 ...] [--json F]
       python perf/first_calls_hosts.py --table F [F ...]

Each job is a fresh program on `--hosts` network namespaces (`pycoll run -n NP --hosts H` for pycoll; MPICH's
hydra through `python -m pycoll.perf.mpi_hosts` for mpi, its traffic on the same links) that makes `--calls`
buffer-spec calls (`[a, MPI.FLOAT]`) of `--bytes` bytes each on arrays made fresh before every call (the receive
array untouched, as `np.empty` gives it: its first touch is timed, as in a program), and reports the slowest rank's
time for each. Every peer and --env setting (pycoll's) runs --jobs jobs, alternating, and the medians over the jobs
are printed. With --new-counts, every call has a count of its own (one element more than the call before), each made
twice (for the block collectives, one element more per rank's block): the medians of a new shape's first call and of
its second are reported too, as a program whose sizes vary sees them (and in the --json file the 90th percentile
of the first calls: the first call of a new size span, ``registry.size_span``, costs a choice of algorithm). Needs
root (network namespaces). With --cycle K the counts cycle through K lengths instead (each call the next): the
median is then that of calls whose lengths came before, as in a program that buckets its sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

COLLECTIVES = ("allreduce", "allgather", "bcast", "alltoall", "reduce_scatter")

PROGRAM = r"""
import json, os, sys, time
import numpy as np
if os.environ.get("FIRST_CALLS_PEER") == "mpi":
    from mpi4py import MPI
else:
    from pycoll import MPI
coll, nbytes, calls, new_counts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "new"
cycle = int(sys.argv[4][5:]) if sys.argv[4].startswith("cycle") else 0
c = MPI.COMM_WORLD
times = []
for i in range(calls * (2 if new_counts else 1)):
    # new counts: each count twice in a row; a cycle: the next of its counts each call
    grow = i // 2 if new_counts else i % cycle if cycle else 0
    n = max(nbytes // 4, 1) + grow
    m = max(nbytes // 4 // c.size, 1) + grow  # a rank's block (its own count grows by one per new shape)
    if coll == "allreduce":
        a, b = np.ones(n, np.float32), np.empty(n, np.float32)
        call = lambda: c.Allreduce([a, MPI.FLOAT], [b, MPI.FLOAT])
    elif coll == "allgather":  # nbytes is the whole output (nccl-tests' size)
        a, b = np.ones(m, np.float32), np.empty(m * c.size, np.float32)
        call = lambda: c.Allgather([a, MPI.FLOAT], [b, MPI.FLOAT])
    elif coll == "reduce_scatter":  # Reduce_scatter_block; nbytes is the whole input (nccl-tests' size)
        a, b = np.ones(m * c.size, np.float32), np.empty(m, np.float32)
        call = lambda: c.Reduce_scatter_block([a, MPI.FLOAT], [b, MPI.FLOAT])
    elif coll == "alltoall":  # nbytes is a rank's whole input (nccl-tests' size)
        a, b = np.ones(m * c.size, np.float32), np.empty(m * c.size, np.float32)
        call = lambda: c.Alltoall([a, MPI.FLOAT], [b, MPI.FLOAT])
    else:
        b = np.ones(n, np.float32) if c.rank == 0 else np.empty(n, np.float32)
        call = lambda: c.Bcast([b, MPI.FLOAT], 0)
    t0 = time.perf_counter()
    call()
    times.append(time.perf_counter() - t0)
slowest = np.empty(len(times))
c.Allreduce(np.array(times), slowest, op=MPI.MAX)
if c.rank == 0:
    row = {"first_ms": slowest[0] * 1e3, "second_ms": slowest[1] * 1e3,
           "worst_after_first_ms": float(slowest[1:].max()) * 1e3, "median_us": float(np.median(slowest[1:])) * 1e6}
    if new_counts:  # the shapes after the program's first: each one's first call, and its second
        row.update(new_shape_first_us=float(np.median(slowest[2::2])) * 1e6,
                   new_shape_second_us=float(np.median(slowest[3::2])) * 1e6,
                   new_shape_first_p90_us=float(np.percentile(slowest[2::2], 90)) * 1e6)
    print("FIRST " + json.dumps(row))
"""


def one_job(peer: str, np_: int, hosts: int, env: dict[str, str], argv: list[str]) -> dict[str, float]:
    if peer == "mpi":
        cmd = [sys.executable, "-m", "pycoll.perf.mpi_hosts", "-n", str(np_), "--hosts", str(hosts), "--", *argv]
    else:
        cmd = [sys.executable, "-m", "pycoll", "run", "-n", str(np_), "--hosts", str(hosts), *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env, "FIRST_CALLS_PEER": peer})
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("FIRST ")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"{peer} job failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(line[6:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--jobs", type=int, default=5)
    p.add_argument("--coll", choices=COLLECTIVES, default="allreduce")
    p.add_argument("--bytes", type=int, default=8,
                   help="bytes a call moves (Allgather: its whole output; Alltoall: a rank's whole input)")
    p.add_argument("--calls", type=int, default=300, help="calls a program makes (at least 2); with --new-counts, shapes")
    p.add_argument("--new-counts", action="store_true", help="a new count each call, each made twice")
    p.add_argument("--cycle", type=int, default=0, metavar="K",
                   help="the counts cycle through K lengths, one element apart (lengths that come back)")
    p.add_argument("--peers", default="pycoll", help="comma-separated: pycoll, mpi (MPICH through mpi4py)")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="a pycoll setting to compare with the default")
    p.add_argument("--json", default=None, help="write every job's figures here")
    p.add_argument("--table", nargs="+", metavar="JSON", help="print a Markdown table of these --json files and exit")
    args = p.parse_args(argv)
    if args.table:
        print_table(args.table)
        return 0
    peers = args.peers.split(",")
    settings = [(peer, peer, {}) for peer in peers]
    settings += [(f"pycoll {e}", "pycoll", dict([e.split("=", 1)])) for e in args.env]
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in settings}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "first_calls.py")
        with open(script, "w") as f:
            f.write(PROGRAM)
        job_argv = [sys.executable, script, args.coll, str(args.bytes), str(max(args.calls, 2)),
                    "new" if args.new_counts else f"cycle{args.cycle}" if args.cycle else "same"]
        for _ in range(args.jobs):
            for name, peer, env in settings:
                results[name].append(one_job(peer, args.np, args.hosts, env, job_argv))
    print(f"{args.np} ranks on {args.hosts} virtual hosts, {args.coll} of {args.bytes} B, {args.calls} calls on fresh "
          f"arrays{f', counts cycling through {args.cycle}' if args.cycle else ''}; {args.jobs} jobs each, medians over "
          f"the jobs")
    shapes = f" {'new shape 1st us':>16s} {'its 2nd us':>10s}" if args.new_counts else ""
    print(f"{'peer / setting':28s} {'first ms':>9s} {'second ms':>10s} {'worst of the rest ms':>21s} {'median us':>10s}"
          + shapes)
    for name, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        shapes = f" {med['new_shape_first_us']:16.1f} {med['new_shape_second_us']:10.1f}" if args.new_counts else ""
        print(f"{name:28s} {med['first_ms']:9.2f} {med['second_ms']:10.2f} {med['worst_after_first_ms']:21.2f} "
              f"{med['median_us']:10.1f}" + shapes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"np": args.np, "hosts": args.hosts, "coll": args.coll, "bytes": args.bytes,
                       "calls": args.calls, "new_counts": args.new_counts, "cycle": args.cycle, "jobs": results}, f,
                      indent=1)
    return 0


def print_table(files: list[str]) -> None:
    """One row per --json file and side: with --new-counts, the side's medians over its jobs of a new shape's first
    call, its 90th percentile (a new size span's first calls) and the shape's second call; else of the calls after the
    first. The last column: the first side's figure over this side's."""
    for name in files:
        with open(name) as f:
            d = json.load(f)
        sides = list(d["jobs"].items())
        if not d.get("new_counts"):
            if name == files[0]:
                print("| ranks, hosts, call | side | median us | first side / this side |\n|---|---|---:|---:|")
            base = statistics.median(r["median_us"] for r in sides[0][1])
            for side, rows in sides:
                med = statistics.median(r["median_us"] for r in rows)
                print(f"| {d['np']}, {d['hosts']}, {d['coll']} | {side} | {med:.1f} | {base / med:.2f} |")
            continue
        if name == files[0]:
            print("| ranks, hosts, call | side | new shape's 1st us | 90th pct us | its 2nd us | first side / this side, "
                  "1st |\n|---|---|---:|---:|---:|---:|")
        base = statistics.median(r["new_shape_first_us"] for r in sides[0][1])
        for side, rows in sides:
            med = {k: statistics.median(r.get(k, float("nan")) for r in rows) for k in
                   ("new_shape_first_us", "new_shape_first_p90_us", "new_shape_second_us")}
            print(f"| {d['np']}, {d['hosts']}, {d['coll']} | {side} | {med['new_shape_first_us']:.1f} | "
                  f"{med['new_shape_first_p90_us']:.0f} | {med['new_shape_second_us']:.1f} | "
                  f"{base / med['new_shape_first_us']:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
