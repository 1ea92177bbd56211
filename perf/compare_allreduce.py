"""Runs the 2-rank float32 allreduce for pycoll and mpi4py+MPICH one after the other and prints them side by side.

Usage: python perf/compare_allreduce.py [--np 2] [--bytes 16777216] [--iters 50] [--out perf/results/FILE.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(cmd: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--bytes", type=int, default=16 << 20)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    bench = [str(HERE / "allreduce_bench.py"), "--bytes", str(args.bytes), "--iters", str(args.iters)]
    rows = [run([sys.executable, "-m", "pycoll", "run", "-n", str(args.np), "--", sys.executable, *bench, "--lib", "pycoll"])]
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if mpiexec:
        rows.append(run([mpiexec, "-n", str(args.np), sys.executable, *bench, "--lib", "mpi"]))
    else:
        print("mpi: skipped (no mpiexec; pip install 'pycoll[mpi]')", file=sys.stderr)
    lines = [
        f"float32 allreduce (SUM), {args.np} ranks, {args.bytes} bytes, median of {args.iters} iterations "
        f"(slowest rank), {platform.node()} ({os.cpu_count()} cores)",
        "",
        "| peer | time (us) | algbw (GB/s) | busbw (GB/s) | #wrong |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['lib']} | {r['time_us']:.0f} | {r['algbw_GBps']:.2f} | {r['busbw_GBps']:.2f} | {r['wrong']} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        cmd = "python perf/compare_allreduce.py " + " ".join(sys.argv[1:])
        args.out.write_text(f"# Allreduce: pycoll next to mpi4py + MPICH\n\nCommand: `{cmd}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
