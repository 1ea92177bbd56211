"""Side-by-side tables of `pycoll perf --hosts` sweeps: pycoll against MPICH and gloo per call, size and placement,
with the bytes each put on the links over the fewest the call needs, and issue 29's targets checked; with
``--stability A.json B.json``, how far each point of one job moved in another; with ``--by-call``, one line per file:
each call's geometric mean time over the file's sizes and placements, for pycoll and MPICH, and the targets met; with
``--predictions``, pycoll's predicted time (``predicted_us``) against its measured time at every point from 1 MiB,
and how many fall within 25 % of it (issue 29's target for the cost model); with ``--choices``, a sweep run with
``--algos ... --interleave``: pycoll's own choice against the best forced algorithm at each point, and how many
are within 10 % of it (issue 29's target for the choice)."""

from __future__ import annotations

import argparse
import json
import math
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
    """One row per (collective, ranks, size): each peer's time, link ratio and the algorithm it ran."""
    points: dict[tuple, dict[str, Any]] = {}
    for r in records:
        if "time_us" not in r or r.get("inplace"):
            continue
        key = (r["collective"], r["nranks"], r["bytes"])
        row = points.setdefault(key, {"collective": r["collective"], "nranks": r["nranks"], "bytes": r["bytes"],
                                      "hosts": r.get("hosts", 1)})
        row[r["peer"]] = r["time_us"]
        row[f"{r['peer']}_algo"] = r.get("algo_used") or r.get("algo")
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


def stability(first: Path, second: Path, limit: float = 2.0) -> tuple[str, int, int]:
    """Issue 29's stability target: per peer, every point of one job against the same point of another; (markdown,
    points within ``limit``x, points compared)."""
    a = rows(json.loads(first.read_text())["records"])
    b = {(r["collective"], r["nranks"], r["bytes"]): r for r in rows(json.loads(second.read_text())["records"])}
    lines = [f"### stability: {first.stem} against {second.stem} (no point may differ more than {limit:g}x)", "",
             "| peer | points | within | worst point | worst ratio |", "|---|---:|---:|---|---:|"]
    ok_all = n_all = 0
    for peer in ("pycoll", "mpi", "gloo"):
        ratios = []
        for r in a:
            other = b.get((r["collective"], r["nranks"], r["bytes"]))
            if other and r.get(peer) and other.get(peer):
                x, y = r[peer], other[peer]
                ratios.append((max(x, y) / min(x, y), f"{r['collective']} {r['nranks']} ranks {human(r['bytes'])}"))
        if not ratios:
            continue
        ok = sum(q <= limit for q, _ in ratios)
        worst = max(ratios)
        ok_all, n_all = ok_all + (ok if peer == "pycoll" else 0), n_all + (len(ratios) if peer == "pycoll" else 0)
        lines.append(f"| {peer} | {len(ratios)} | {ok} | {worst[1]} | {worst[0]:.2f} |")
    lines += ["", f"pycoll: {ok_all}/{n_all} points within {limit:g}x between the two jobs.", ""]
    return "\n".join(lines), ok_all, n_all


def by_call(path: Path) -> str:
    """One line: per call, the geometric mean over the file's points of pycoll's and MPICH's times (points both
    ran), and the targets met."""
    points = rows(json.loads(path.read_text())["records"])
    parts = []
    for call in sorted({p["collective"] for p in points}):
        both = [p for p in points if p["collective"] == call and p.get("pycoll") and p.get("mpi")]
        if both:
            means = [math.exp(sum(math.log(p[peer]) for p in both) / len(both)) for peer in ("pycoll", "mpi")]
            parts.append(f"{call} {means[0]:.1f}/{means[1]:.1f}")
    _, met, checked = table(path)
    return f"{path.name}: {met}/{checked} targets met; pycoll/MPICH µs (geometric means): " + ", ".join(parts)


def predictions(paths: list[Path], within: float = 1.25) -> tuple[str, int, int]:
    """A table of each pycoll record from 1 MiB that carries a prediction: measured, predicted and their ratio;
    with the count within ``within`` x either way."""
    lines = ["| file | call | ranks | size | algorithm | measured µs | predicted µs | predicted / measured |",
             "|---|---|---:|---:|---|---:|---:|---:|"]
    good = total = 0
    for path in paths:
        for r in json.loads(path.read_text())["records"]:
            if r.get("peer") != "pycoll" or not r.get("predicted_us") or r["bytes"] < MIB:
                continue
            ratio = r["predicted_us"] / r["time_us"]
            ok = 1 / within <= ratio <= within
            good, total = good + ok, total + 1
            lines.append(f"| {path.name} | {r['collective']} | {r['nranks']} | {human(r['bytes'])} | {r['algo_used']} "
                         f"| {r['time_us']:.0f} | {r['predicted_us']:.0f} | {ratio:.2f}{'' if ok else ' (off)'} |")
    lines.append(f"\n{good} of {total} predictions within {round((within - 1) * 100)} % of the measured time.")
    return "\n".join(lines), good, total


def choices(paths: list[Path], within: float = 1.1) -> tuple[str, int, int]:
    """A table of each point where pycoll ran beside forced algorithms (peers ``pycoll[name]``, as ``pycoll perf
    --algos`` names them): its choice and time, the best forced one's, their ratio; with the count within
    ``within`` x of the best (a composition, which cannot be forced, may beat them all)."""
    lines = ["| file | call | ranks | hosts | size | chosen | µs | best forced | µs | chosen / best |",
             "|---|---|---:|---:|---:|---|---:|---|---:|---:|"]
    good = total = 0
    for path in paths:
        for row in rows(json.loads(path.read_text())["records"]):
            mine = row.get("pycoll")
            forced = [(t, peer) for peer, t in row.items() if peer.startswith("pycoll[") and peer.endswith("]")]
            if mine is None or not forced:
                continue
            best, peer = min(forced)
            ratio = mine / best
            ok = ratio <= within
            good, total = good + ok, total + 1
            lines.append(f"| {path.name} | {row['collective']} | {row['nranks']} | {row['hosts']} | "
                         f"{human(row['bytes'])} | {row['pycoll_algo']} | {mine:.0f} | {peer[len('pycoll['):-1]} | "
                         f"{best:.0f} | {ratio:.2f}{'' if ok else ' (off)'} |")
    lines.append(f"\n{good} of {total} choices within {round((within - 1) * 100)} % of the best forced algorithm.")
    return "\n".join(lines), good, total


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path, help="JSON files written by pycoll perf --hosts ... --json")
    p.add_argument("--stability", action="store_true",
                   help="compare two jobs of the same sweep point by point (two files) instead of tabulating")
    p.add_argument("--by-call", action="store_true", help="one summary line per file instead of its table")
    p.add_argument("--predictions", action="store_true",
                   help="pycoll's predicted against measured time from 1 MiB, and how many within 25 %%")
    p.add_argument("--choices", action="store_true",
                   help="pycoll's choice against the best forced algorithm (a sweep with --algos --interleave)")
    ns = p.parse_args(argv)
    if ns.choices:
        print(choices(ns.files)[0])
        return 0
    if ns.predictions:
        print(predictions(ns.files)[0])
        return 0
    if ns.by_call:
        for f in ns.files:
            print(by_call(f))
        return 0
    if ns.stability:
        if len(ns.files) != 2:
            p.error("--stability compares exactly two files")
        text, _, _ = stability(*ns.files)
        print(text)
        return 0
    total_met = total = 0
    for f in ns.files:
        text, met, checked = table(f)
        total_met, total = total_met + met, total + checked
        print(text)
    print(f"All files: {total_met}/{total} targets met.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
