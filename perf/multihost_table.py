"""Side-by-side tables of `pycoll perf --hosts` sweeps: pycoll against MPICH and gloo per call, size and placement,
with the bytes each put on the links over the fewest the call needs, and issue 29's targets checked."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

KIB, MIB = 1 << 10, 1 << 20


def human(n: int) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def target(ranks_per_host: int, nbytes: int) -> Optional[tuple[str, float]]:
    """(label, the most pycoll / MPICH may be) at one point; None where no target applies (between 64 KiB and
    1 MiB)."""
    small = nbytes <= 64 * KIB
    if ranks_per_host == 1:
        return ("<=1.5x", 1.5) if small else ("<=1.1x", 1.1) if nbytes >= MIB else None
    return ("<=2x", 2.0) if small else ("<=1x", 1.0) if nbytes >= MIB else None


def rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (collective, ranks, size): each peer's time and link ratio."""
    points: dict[tuple, dict[str, Any]] = {}
    for r in records:
        if "time_us" not in r or r.get("inplace"):
            continue
        key = (r["collective"], r["nranks"], r["bytes"])
        row = points.setdefault(key, {"collective": r["collective"], "nranks": r["nranks"], "bytes": r["bytes"],
                                      "hosts": r.get("hosts", 1)})
        row[r["peer"]] = r["time_us"]
        if r.get("link_min_bytes"):
            row[f"{r['peer']}_link"] = r["link_bytes"] / r["link_min_bytes"]
    return [points[k] for k in sorted(points)]


def table(path: Path) -> tuple[str, int, int]:
    """The markdown of one sweep file, and (targets met, targets checked)."""
    data = json.loads(path.read_text())
    rate = next((r.get("link_rate") for r in data["records"] if "link_rate" in r), None) or "unshaped"
    lines = [f"### {path.stem}: links {rate}", "",
             "| call | ranks | size | MPICH µs | gloo µs | pycoll µs | pycoll/MPICH | target | link/min pycoll | "
             "link/min MPICH |", "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    met = checked = 0
    for row in rows(data["records"]):
        mpi, gloo, pyc = row.get("mpi"), row.get("gloo"), row.get("pycoll")
        ratio = pyc / mpi if pyc and mpi else None
        per_host = row["nranks"] // max(row["hosts"], 1)
        goal = target(per_host, row["bytes"]) if row["collective"] != "pingpong" or row["nranks"] == 2 else None
        verdict = ""
        if goal and ratio is not None:
            checked += 1
            ok = ratio <= goal[1]
            met += ok
            verdict = f"{goal[0]} {'pass' if ok else 'FAIL'}"
        cell = lambda v: f"{v:.1f}" if v is not None else "-"  # noqa: E731
        link = lambda k: f"{row[k]:.2f}" if k in row else "-"  # noqa: E731
        lines.append(f"| {row['collective']} | {row['nranks']} | {human(row['bytes'])} | {cell(mpi)} | {cell(gloo)} | "
                     f"{cell(pyc)} | {f'{ratio:.2f}' if ratio else '-'} | {verdict} | {link('pycoll_link')} | "
                     f"{link('mpi_link')} |")
    lines += ["", f"{met}/{checked} targets met.", ""]
    return "\n".join(lines), met, checked


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path, help="JSON files written by pycoll perf --hosts ... --json")
    ns = p.parse_args(argv)
    total_met = total = 0
    for f in ns.files:
        text, met, checked = table(f)
        total_met, total = total_met + met, total + checked
        print(text)
    print(f"All files: {total_met}/{total} targets met.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
