"""Console tables in nccl-tests' layout, the progress bar and the JSON writer of `pycoll perf`."""

from __future__ import annotations

import json
import sys
from typing import Any, Optional, TextIO

from pycoll.perf.metrics import REDUCING

GROUP = "{:>10} {:>8} {:>8} {:>6}"


def header(peer: str, nranks: int, coll: str, dtype: str, op: str, hosts: Optional[int] = None,
           link_rate: Optional[str] = None, device: Optional[str] = None) -> str:
    opname = op if coll in REDUCING else "none"
    where = f" on {hosts} hosts" + (f" ({link_rate} links)" if link_rate else "") if hosts else ""
    buffers = ", CUDA buffers" if device == "cuda" else ""
    return f"# peer {peer}, {nranks} ranks{where}, {coll}, dtype {dtype}, op {opname}{buffers}"


def _cell(rec: Optional[dict[str, Any]]) -> str:
    if rec is None:
        return GROUP.format("-", "-", "-", "-")
    t = rec["time_us"]
    time_s = f"{t:.1f}" if t >= 1000 else f"{t:.2f}"
    return GROUP.format(time_s, f"{rec['algbw_GBps']:.2f}", f"{rec['busbw_GBps']:.2f}", rec["wrong"])


def avg_busbw(records: list[dict[str, Any]]) -> float:
    return sum(r["busbw_GBps"] for r in records) / len(records) if records else 0.0


def _picked(row: dict[bool, dict[str, Any]]) -> str:
    """The algorithms pycoll chose at one size (its modes may differ)."""
    names = dict.fromkeys(str(r.get("algo_used")) for r in row.values() if r.get("algo_used"))
    return "/".join(names) or "-"


def _link_ratio(row: dict[bool, dict[str, Any]]) -> str:
    """Bytes on the links over the fewest the call needs, at one size (its first mode's record)."""
    rec = next(iter(row.values()))
    sent, least = rec.get("link_bytes"), rec.get("link_min_bytes")
    return f"{sent / least:.2f}" if sent is not None and least else "-"


def format_block(peer: str, nranks: int, coll: str, dtype: str, op: str, records: list[dict[str, Any]],
                 modes: list[bool], hosts: Optional[int] = None, link_rate: Optional[str] = None) -> str:
    """Header, column titles, one line per size (out-of-place then in-place groups), footer.

    Records of pycoll's automatic choice that name the algorithm used get a last column, `algo`."""
    left = "#{:>11} {:>12} {:>8} {:>6} {:>6}"
    names = {False: "out-of-place", True: "in-place"}
    width = len(GROUP.format("", "", "", ""))
    cols, units = GROUP.format("time", "algbw", "busbw", "#wrong"), GROUP.format("(us)", "(GB/s)", "(GB/s)", "")
    picks = any(r.get("algo") == "auto" and r.get("algo_used") for r in records)
    device = "cuda" if any(r.get("device") == "cuda" for r in records) else None
    links = any("link_bytes" in r for r in records)  # on virtual hosts: bytes on the links over the fewest needed
    lines = [header(peer, nranks, coll, dtype, op, hosts, link_rate, device),
             left.format("", "", "", "", "") + "".join(f"  {names[m]:^{width}}" for m in modes),
             left.format("size", "count", "type", "redop", "root") + "".join("  " + cols for _ in modes)
             + ("  link/min" if links else "") + ("  algo" if picks else ""),
             left.format("(B)", "(elements)", "", "", "") + "".join("  " + units for _ in modes)]
    by_size: dict[int, dict[bool, dict[str, Any]]] = {}
    for r in records:
        by_size.setdefault(r["bytes"], {})[r["inplace"]] = r
    for size in sorted(by_size):
        row = by_size[size]
        first = next(iter(row.values()))
        left_cells = " {:>11} {:>12} {:>8} {:>6} {:>6}".format(size, first["count"], first["dtype"], first["op"], first["root"])
        pick = f"  {_picked(row)}" if picks else ""
        link = f"  {_link_ratio(row):>8}" if links else ""
        lines.append(left_cells + "".join("  " + _cell(row.get(m)) for m in modes) + link + pick)
    lines.append(f"# Avg bus bandwidth : {avg_busbw(records):.4f}")
    return "\n".join(lines)


class Progress:
    """`\\r[#####.....] 12/48 pycoll np=2 allreduce 1M` on stderr."""

    def __init__(self, total: int, enabled: bool, stream: TextIO = sys.stderr, width: int = 20) -> None:
        self.total, self.done, self.enabled, self.stream, self.width = max(total, 1), 0, enabled, stream, width
        self._shown = False

    @staticmethod
    def line(done: int, total: int, label: str, width: int = 20) -> str:
        filled = min(width, width * done // max(total, 1))
        return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label}"

    def advance(self, label: str, steps: int = 1) -> None:
        self.done = min(self.total, self.done + steps)
        if self.enabled:
            self.stream.write("\r" + self.line(self.done, self.total, label, self.width) + "\033[K")
            self.stream.flush()
            self._shown = True

    def clear(self) -> None:
        if self.enabled and self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._shown = False


def human(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def write_json(path: str, meta: dict[str, Any], limits: dict[str, Any], records: list[dict[str, Any]]) -> None:
    with open(path, "w") as fh:
        json.dump({"meta": meta, "limits": limits, "records": records}, fh, indent=1)
        fh.write("\n")


def append_rows(path: str, rows: list[dict[str, Any]]) -> None:
    """Append ``rows`` to ``path`` as JSON lines, one a row (the perf/ scripts' --json files)."""
    with open(path, "a") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def read_json(path: str) -> dict[str, Any]:
    with open(path) as fh:
        return json.load(fh)
