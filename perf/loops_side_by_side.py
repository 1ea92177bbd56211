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
    ap.add_argument("--us", action="store_true", help="cells in microseconds with one decimal (default: ms, two)")
    args = ap.parse_args()
    columns = [c.split("=", 1) for c in args.columns]
    unit, scale, digits = ("µs", 1.0, 1) if args.us else ("ms", 1000.0, 2)
    cells: dict = collections.defaultdict(list)
    for label, path in columns:
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                cells[(row["call"], row["bytes"], row.get("ranks", 0), row["mode"], label)].append(
                    row["slowest_us"] / scale)
    keys = sorted({k[:4] for k in cells})
    ranked = len({k[2] for k in keys}) > 1  # a ranks column where the files hold several rank counts
    print("| call, size |" + (" ranks |" if ranked else "") + " mode | "
          + " | ".join(f"{label} {unit}" for label, _ in columns) + " |")
    print("|---|" + ("---:|" if ranked else "") + "---|" + "---|" * len(columns))
    for call, nbytes, ranks, mode in keys:
        row = [", ".join(f"{v:.{digits}f}" for v in cells[(call, nbytes, ranks, mode, label)]) or "-"
               for label, _ in columns]
        print(f"| {call} {human(nbytes)} |" + (f" {ranks} |" if ranked else "") + f" {mode} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
