"""A markdown table of `perf/small_call_loops.py` JSON lines from several files side by side: one row per call, size
and mode, one column per file, each cell the slowest rank's figure of every job in the file, in milliseconds.

    python perf/loops_side_by_side.py "pycoll=np4-pycoll.jsonl" "MPICH=np4-mpich.jsonl"
"""

from __future__ import annotations

import argparse
import collections
import json

from multihost_table import human  # perf/, first on the path of `python perf/loops_side_by_side.py`


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("columns", nargs="+", metavar="LABEL=FILE", help="a column's heading and its JSON lines")
    args = ap.parse_args()
    columns = [c.split("=", 1) for c in args.columns]
    cells: dict = collections.defaultdict(list)
    for label, path in columns:
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                cells[(row["call"], row["bytes"], row["mode"], label)].append(row["slowest_us"] / 1000)
    keys = sorted({k[:3] for k in cells})
    print("| call, size | mode | " + " | ".join(f"{label} ms" for label, _ in columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for call, nbytes, mode in keys:
        row = [", ".join(f"{v:.2f}" for v in cells[(call, nbytes, mode, label)]) or "-" for label, _ in columns]
        print(f"| {call} {human(nbytes)} | {mode} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
