"""Checks issue 5's host-buffer targets on `pycoll perf` sweeps: pycoll against MPICH (`mpi`) and Gloo, same run.

Usage: python perf/host_targets.py SWEEP.json [MORE.json ...]

Targets (float32, out of place, each time the median of the sweep):
- allreduce, 2 ranks, 1 MiB - 256 MiB: busbw >= 1.5 x MPICH and >= 2 x Gloo;
- allreduce, 2 ranks, 64 MiB: busbw >= 70 % of the memory bound (traffic model below);
- allreduce, 4 ranks, >= 1 MiB: busbw >= 1.2 x MPICH and >= 1.2 x Gloo;
- allreduce, 2 ranks, 8 B - 4 KiB: time <= 2 x MPICH and <= Gloo / 10;
- reduce_scatter, allgather, broadcast, 2 ranks, >= 1 MiB: busbw >= MPICH.

Memory bound of a single-host allreduce of n bytes on p ranks, each with private input and output buffers:
every rank must read the p inputs of its own 1/p block (n bytes), write its whole output (n bytes) and read
the other ranks' reduced blocks ((p-1)/p n bytes). That is (2 + (p-1)/p) n bytes of traffic per rank, and a
copy of c bytes is 2c bytes of traffic, so at the copy bandwidth B measured in the same run (one process,
np.copyto of 64 MiB) the time is at least (1 + (p-1)/(2p)) n / B: busbw <= 2(p-1)/p x B / (1 + (p-1)/(2p)).
For p = 2 that is 0.8 B. It assumes each rank's traffic runs at one core's copy rate while the others run.

Allgather through shared memory (no process can map another's private buffer; the kernel's cross-memory
copy is slower here) has a bound of the same kind, printed for evidence beside the targets: each rank reads
its own block once (n/p), writes it to shared memory and to its output (2n/p), then reads the others' blocks
from shared memory and writes them out (2(p-1)/p n): (3/p + 2(p-1)/p) n bytes, so busbw <= 2(p-1) B / (2p + 1),
0.4 B at 2 ranks. MPICH's shared-memory path moves at least as much.

Exit code 0 when every target is met, 1 when one is missed, 2 when the files lack a peer or a size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

MiB = 1 << 20


def memory_bound(copy_gbps: float, p: int) -> float:
    """The busbw bound (GB/s) of a p-rank single-host allreduce at copy bandwidth ``copy_gbps`` (see module doc)."""
    return 2 * (p - 1) / p * copy_gbps / (1 + (p - 1) / (2 * p))


def load(paths: list[str]) -> tuple[dict[tuple, dict[str, Any]], Optional[float]]:
    """Records by (peer, collective, ranks, bytes), out of place, each with the copy bandwidth of its own sweep
    (``_copy_GBps``), and the copy bandwidth of the first file."""
    table: dict[tuple, dict[str, Any]] = {}
    copy = None
    for path in paths:
        data = json.loads(Path(path).read_text())
        own = (data.get("limits") or {}).get("copy_GBps")
        copy = copy or own
        for rec in data.get("records", []):
            if "error" in rec or rec.get("inplace") or rec.get("wrong"):
                continue
            rec["_copy_GBps"] = own
            table[(rec["peer"], rec["collective"], rec["nranks"], rec["bytes"])] = rec
    return table, copy


def _size(n: int) -> str:
    for unit, div in (("M", MiB), ("K", 1024)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def check(table: dict[tuple, dict[str, Any]], copy: Optional[float]) -> tuple[list[str], int, int]:
    lines, passed, failed = [], 0, 0
    header = f"{'target':44} {'size':>6} {'pycoll':>9} {'peer':>9} {'ratio':>6} {'need':>6}  check"

    def row(name: str, size: int, mine: float, theirs: float, need: float, higher_better: bool = True) -> None:
        nonlocal passed, failed
        ratio = mine / theirs if higher_better else theirs / mine
        ok = ratio >= need
        passed, failed = passed + ok, failed + (not ok)
        lines.append(f"{name:44} {_size(size):>6} {mine:9.3f} {theirs:9.3f} {ratio:6.2f} {need:6.2f}  {'PASS' if ok else 'MISS'}")

    def get(peer: str, coll: str, p: int, size: int) -> Optional[dict[str, Any]]:
        return table.get((peer, coll, p, size))

    sizes = sorted({k[3] for k in table})
    lines.append(header)
    lines.append("-" * len(header))
    for p, lo, hi, peers in ((2, MiB, 256 * MiB, (("mpi", 1.5), ("gloo", 2.0))), (4, MiB, 1 << 40, (("mpi", 1.2), ("gloo", 1.2)))):
        for size in sizes:
            mine = get("pycoll", "allreduce", p, size)
            if not (lo <= size <= hi) or mine is None:
                continue
            for peer, need in peers:
                theirs = get(peer, "allreduce", p, size)
                if theirs is not None:
                    row(f"allreduce np={p} busbw GB/s vs {peer}", size, mine["busbw_GBps"], theirs["busbw_GBps"], need)
    for size in sizes:
        mine = get("pycoll", "allreduce", 2, size)
        if mine is None or size > 4096:
            continue
        for peer, need in (("mpi", 0.5), ("gloo", 10.0)):
            theirs = get(peer, "allreduce", 2, size)
            if theirs is not None:  # ratio = peer time / pycoll time
                row(f"allreduce np=2 time us vs {peer}", size, mine["time_us"], theirs["time_us"], need, higher_better=False)
    for coll in ("reduce_scatter", "allgather", "broadcast"):
        for size in sizes:
            mine, theirs = get("pycoll", coll, 2, size), get("mpi", coll, 2, size)
            if size >= MiB and mine is not None and theirs is not None:
                row(f"{coll} np=2 busbw GB/s vs mpi", size, mine["busbw_GBps"], theirs["busbw_GBps"], 1.0)
    mine = get("pycoll", "allreduce", 2, 64 * MiB)
    copy = (mine or {}).get("_copy_GBps") or copy  # the bound of the run that measured the point
    if mine is not None and copy:
        bound = memory_bound(copy, 2)
        row(f"allreduce np=2 busbw vs memory bound (copy {copy:.2f})", 64 * MiB, mine["busbw_GBps"], bound, 0.7)
    lines.append("")
    lines.append("# evidence, not targets: allgather np=2 busbw against its shared-memory bound 0.4 B (module doc)")
    for size in sizes:
        for peer in ("pycoll", "mpi"):
            rec = get(peer, "allgather", 2, size)
            if rec is None or size < 16 * MiB or not rec.get("_copy_GBps"):
                continue
            bound = allgather_bound(rec["_copy_GBps"], 2)
            lines.append(f"{'allgather np=2 ' + peer + ' / bound':44} {_size(size):>6} {rec['busbw_GBps']:9.3f} {bound:9.3f} "
                         f"{rec['busbw_GBps'] / bound:6.2f}")
    return lines, passed, failed


def allgather_bound(copy_gbps: float, p: int) -> float:
    """The busbw bound (GB/s) of a p-rank allgather through shared memory at copy bandwidth ``copy_gbps``."""
    return 2 * (p - 1) * copy_gbps / (2 * p + 1)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweeps", nargs="+")
    args = ap.parse_args(argv)
    table, copy = load(args.sweeps)
    lines, passed, failed = check(table, copy)
    print("\n".join(lines))
    print(f"\n# {passed} met, {failed} missed")
    if passed + failed == 0:
        return 2
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
