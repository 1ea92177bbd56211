"""Checks a `pycoll perf --algos` sweep: is pycoll's automatic choice within 10% of the best forced algorithm?

Usage: python perf/algo_selection.py SWEEP.json [MORE.json ...] [--tolerance 1.10] [--mode out|in|both]
                                     [--hier-min-bytes 1M] [--same-algo-passes]

Per (collective, ranks, hosts, link rate, size, mode) it compares the automatic `pycoll` time with the fastest
forced run (`pycoll[NAME]` records), and PASSes when auto <= tolerance x best. Where the record says auto ran
that same algorithm (`algo_used`) the verdict is marked so; --same-algo-passes passes those. For allreduce on more than
one host it also checks that `hierarchical` beats `ring` at sizes >= --hier-min-bytes. Forced records whose
`algo_used` shows that the algorithm declined (pycoll fell back) are left out. Exit code: 0 when every check
passes, 1 when one fails, 2 when the files hold nothing to compare.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

Key = tuple[str, int, int, Optional[str], int, bool]  # collective, nranks, hosts, link rate, bytes, inplace


@dataclass
class Row:
    """Auto against the best forced algorithm at one point."""

    key: Key
    auto_us: float
    auto_pick: Optional[str]
    best: str
    best_us: float
    tolerance: float
    same_passes: bool = False

    @property
    def ratio(self) -> float:
        return self.auto_us / self.best_us if self.best_us > 0 else float("inf")

    @property
    def same(self) -> bool:
        """Auto ran the best algorithm itself: the gap is noise or the automatic path's own overhead."""
        return self.auto_pick == self.best

    @property
    def ok(self) -> bool:
        return self.auto_us <= self.tolerance * self.best_us or (self.same and self.same_passes)


@dataclass
class HierRow:
    """hierarchical against ring for one multi-host allreduce point."""

    key: Key
    ring_us: float
    hier_us: float

    @property
    def ok(self) -> bool:
        return self.hier_us < self.ring_us


def _key(rec: dict[str, Any]) -> Key:
    return (rec["collective"], int(rec["nranks"]), int(rec.get("hosts") or 1), rec.get("link_rate"),
            int(rec["bytes"]), bool(rec["inplace"]))


def forced_name(rec: dict[str, Any]) -> Optional[str]:
    """The algorithm a pycoll record was forced to (None for the automatic run and other peers)."""
    peer = str(rec.get("peer", ""))
    algo = rec.get("algo")
    if algo and algo != "auto" and peer.startswith("pycoll"):
        return str(algo)
    if peer.startswith("pycoll[") and peer.endswith("]"):
        return peer[len("pycoll["):-1]
    return None


def is_auto(rec: dict[str, Any]) -> bool:
    return rec.get("peer") == "pycoll" and rec.get("algo") in (None, "auto")


def load(paths: Iterable[str]) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        records += [r for r in data.get("records", []) if isinstance(r, dict) and "error" not in r]
    return records


Record = dict[str, Any]


def split(records: list[Record], modes: set[bool]) -> tuple[dict[Key, Record], dict[Key, dict[str, Record]]]:
    """(key -> auto record, key -> {algorithm -> forced record}); a later record wins a duplicate."""
    auto: dict[Key, dict[str, Any]] = {}
    forced: dict[Key, dict[str, dict[str, Any]]] = {}
    for rec in records:
        if bool(rec["inplace"]) not in modes:
            continue
        name = forced_name(rec)
        if name is not None:
            used = rec.get("algo_used")
            if used and used != name:  # it declined and pycoll fell back: not a measurement of `name`
                continue
            forced.setdefault(_key(rec), {})[name] = rec
        elif is_auto(rec):
            auto[_key(rec)] = rec
    return auto, forced


def compare(records: list[Record], tolerance: float = 1.10, modes: Iterable[bool] = (False, True),
            same_passes: bool = False) -> list[Row]:
    auto, forced = split(records, set(modes))
    rows = []
    for key in sorted(set(auto) & set(forced), key=lambda k: (k[0], k[1], k[2], str(k[3]), k[5], k[4])):
        best, rec = min(forced[key].items(), key=lambda kv: kv[1]["time_us"])
        rows.append(Row(key, float(auto[key]["time_us"]), auto[key].get("algo_used"), best, float(rec["time_us"]),
                        tolerance, same_passes))
    return rows


def hier_checks(records: list[Record], min_bytes: int = 1 << 20,
                modes: Iterable[bool] = (False, True)) -> list[HierRow]:
    _, forced = split(records, set(modes))
    rows = []
    for key, by_algo in sorted(forced.items(), key=lambda kv: (kv[0][1], kv[0][2], str(kv[0][3]), kv[0][5], kv[0][4])):
        coll, _, hosts, _, nbytes, _ = key
        if coll == "allreduce" and hosts > 1 and nbytes >= min_bytes and {"ring", "hierarchical"} <= set(by_algo):
            rows.append(HierRow(key, float(by_algo["ring"]["time_us"]), float(by_algo["hierarchical"]["time_us"])))
    return rows


def _size(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _us(t: float) -> str:
    return f"{t:.1f}" if t >= 1000 else f"{t:.2f}"


def _where(key: Key) -> str:
    rate = f"@{key[3]}" if key[3] else ""
    return f"{key[0]} np={key[1]} hosts={key[2]}{rate} {'in' if key[5] else 'out'}"


def _verdict(r: Row) -> str:
    if r.auto_us <= r.tolerance * r.best_us:
        return "PASS"
    if r.same:
        return f"{'PASS' if r.same_passes else 'FAIL'} (same algorithm: noise or overhead)"
    return "FAIL"


def format_rows(rows: list[Row]) -> str:
    head = (f"{'case':<34} {'size':>6} {'auto (us)':>10} {'auto pick':>12} {'best':>14} {'best (us)':>10} "
            f"{'ratio':>6}  check")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{_where(r.key):<34} {_size(r.key[4]):>6} {_us(r.auto_us):>10} {r.auto_pick or '?':>12} "
                     f"{r.best:>14} {_us(r.best_us):>10} {r.ratio:>6.2f}  {_verdict(r)}")
    return "\n".join(lines)


def format_hier(rows: list[HierRow]) -> str:
    head = f"{'case':<34} {'size':>6} {'ring (us)':>10} {'hier (us)':>10} {'speed-up':>8}  check"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{_where(r.key):<34} {_size(r.key[4]):>6} {_us(r.ring_us):>10} {_us(r.hier_us):>10} "
                     f"{r.ring_us / r.hier_us if r.hier_us else 0:>8.2f}  {'PASS' if r.ok else 'FAIL'}")
    return "\n".join(lines)


def _bytes(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", metavar="SWEEP.json")
    p.add_argument("--tolerance", type=float, default=1.10, help="auto passes when <= tolerance x best (default 1.10)")
    p.add_argument("--same-algo-passes", action="store_true",
                   help="pass a slower auto run that used the best algorithm itself (not a wrong choice)")
    p.add_argument("--mode", choices=("out", "in", "both"), default="both", help="buffer modes to check (default both)")
    p.add_argument("--hier-min-bytes", type=_bytes, default=1 << 20, metavar="SIZE",
                   help="smallest multi-host allreduce where hierarchical must beat ring (default 1M)")
    args = p.parse_args(argv)
    modes = {"out": [False], "in": [True], "both": [False, True]}[args.mode]
    try:
        records = load(args.files)
    except (OSError, ValueError) as exc:
        print(f"algo_selection: cannot read the sweep: {exc}", file=sys.stderr)
        return 2
    rows = compare(records, args.tolerance, modes, args.same_algo_passes)
    hier = hier_checks(records, args.hier_min_bytes, modes)
    if not rows and not hier:
        print("algo_selection: nothing to compare: the files need `pycoll` records next to forced `pycoll[NAME]` "
              "ones (run `pycoll perf --algos all`)", file=sys.stderr)
        return 2
    failed = [r for r in rows if not r.ok] + [h for h in hier if not h.ok]
    if rows:
        print(f"# automatic choice against the best forced algorithm (PASS: auto <= {args.tolerance:g} x best)")
        print(format_rows(rows))
    multi = any(r.key[0] == "allreduce" and r.key[2] > 1 for r in rows)
    if hier:
        print(f"\n# allreduce on several hosts, >= {_size(args.hier_min_bytes)}: hierarchical against ring "
              "(PASS: hierarchical faster)")
        print(format_hier(hier))
    elif multi:
        print("\n# allreduce on several hosts: hierarchical and ring were not both measured; that check is skipped")
    print(f"\n# {len(rows) + len(hier) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
