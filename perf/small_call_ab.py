"""Two trees (or pycoll and MPICH) alternating over rounds of `perf/small_call_loops.py` on namespace hosts: per call
and mode, each side's median over the rounds and their ratio. The VM's speed moves in phases of minutes, so only
figures from alternating jobs are compared.

    python perf/small_call_ab.py --a /tmp/old --b . --rounds 8 [--np 4 --hosts 2] [--out DIR]
    python perf/small_call_ab.py --a mpich --b . --rounds 4      # `mpich`: mpi4py on MPICH, same namespaces
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def job(side: str, args: argparse.Namespace, out: str) -> None:
    prog = [sys.executable, os.path.join(HERE, "small_call_loops.py"), "--calls", args.calls, "--bytes", str(args.bytes),
            "--iters", str(args.iters), "--json", out]
    env = dict(os.environ)
    if side == "mpich":
        cmd = [sys.executable, "-m", "pycoll.perf.mpi_hosts", "-n", str(args.np), "--hosts", str(args.hosts), "--",
               *prog, "--mpi4py"]
    else:
        env["PYTHONPATH"] = os.path.abspath(side)
        cmd = [sys.executable, "-m", "pycoll", "run", "-n", str(args.np), "--hosts", str(args.hosts), "--", *prog]
    # from the tree itself: `python -m` puts the working folder first on the path, so the launcher is the tree's too
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, cwd=None if side == "mpich" else side)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="a tree's root (PYTHONPATH), or mpich")
    ap.add_argument("--b", required=True, help="the other tree's root, or mpich")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--calls", default="allreduce,reduce,barrier,bcast")
    ap.add_argument("--bytes", type=int, default=8)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", help="folder for each job's rows (a.jsonl, b.jsonl) and the table (table.txt)")
    args = ap.parse_args()
    folder = args.out or tempfile.mkdtemp(prefix="small-call-ab-")
    os.makedirs(folder, exist_ok=True)
    files = {s: os.path.join(folder, f"{s}.jsonl") for s in ("a", "b")}
    for f in files.values():
        open(f, "w").close()
    for _ in range(args.rounds):
        for s in ("a", "b"):
            job(getattr(args, s), args, files[s])
    seen: dict = collections.defaultdict(lambda: {"a": [], "b": []})
    for s, f in files.items():
        with open(f) as fh:
            for line in fh:
                r = json.loads(line)
                seen[(r["call"], r["mode"])][s].append(r["slowest_us"])
    lines = [f"# a = {args.a}, b = {args.b}: {args.np} ranks on {args.hosts} hosts, {args.bytes} B, {args.rounds} rounds "
             "alternating; slowest rank's µs, median over rounds (each round's figure after the bar)"]
    for (call, mode), v in sorted(seen.items()):
        ma, mb = statistics.median(v["a"]), statistics.median(v["b"])
        lines.append(f"{call:9s} {mode:14s} a {ma:7.1f}  b {mb:7.1f}  b/a {mb / ma:4.2f}  | a "
                     + " ".join(f"{x:.0f}" for x in v["a"]) + " | b " + " ".join(f"{x:.0f}" for x in v["b"]))
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(folder, "table.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
