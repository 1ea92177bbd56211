"""Runs of slow calls in `perf/small_call_loops.py --each` JSON lines: when, for how long and how many calls, on the
loop's own clock (the calls' times added up), so that a stall which comes back on a timer shows as windows at
regular times.

    python perf/slow_windows.py loops.jsonl [--factor 2.5] [--gap-ms 50] [--least 10]
"""

from __future__ import annotations

import argparse
import json
import statistics


def windows(each_us: list[float], factor: float, gap_s: float, least: int) -> list[tuple[float, float, int]]:
    """(start s, length s, slow calls) of every run of at least ``least`` calls over ``factor`` times the median,
    runs less than ``gap_s`` apart joined into one."""
    median = statistics.median(each_us)
    found: list[list[float]] = []
    clock = 0.0
    for us in each_us:
        start, clock = clock, clock + us * 1e-6
        if us <= factor * median:
            continue
        if found and start - found[-1][1] < gap_s:
            found[-1][1] = clock
            found[-1][2] += 1
        else:
            found.append([start, clock, 1])
    return [(a, b - a, int(k)) for a, b, k in found if k >= least]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="JSON lines of small_call_loops.py --each")
    ap.add_argument("--factor", type=float, default=2.5, help="a call is slow above this many times the median")
    ap.add_argument("--gap-ms", type=float, default=50.0, help="slow calls closer than this belong to one window")
    ap.add_argument("--least", type=int, default=10, help="the fewest slow calls a window shows")
    args = ap.parse_args()
    for path in args.files:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for row in rows:
            each = row.get("each_us")
            if not each:
                continue
            found = windows(each, args.factor, args.gap_ms * 1e-3, args.least)
            spans = ", ".join(f"{a:.2f} s +{d * 1e3:.0f} ms ({k} calls)" for a, d, k in found) or "none"
            print(f"{path}: {row['impl']} {row['call']} {row['bytes']} B, {len(each)} calls in {sum(each) / 1e6:.1f} s, "
                  f"median {statistics.median(each):.0f} µs; windows of slow calls: {spans}")


if __name__ == "__main__":
    main()
