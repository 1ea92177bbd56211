"""`pycoll plot`: PNG charts (bandwidth, latency, scaling, speed-up) from `pycoll perf` JSON files."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

if TYPE_CHECKING:  # matplotlib is imported lazily, only when `pycoll plot` runs
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall")
REDUCING = frozenset({"allreduce", "reduce_scatter", "reduce"})
PEER_ORDER = ("pycoll", "mpi", "gloo", "nccl")
PEER_STYLE = {
    "pycoll": ("tab:blue", "o"),
    "mpi": ("tab:orange", "s"),
    "gloo": ("tab:green", "^"),
    "nccl": ("tab:purple", "D"),
}
REQUIRED_FIELDS = {
    "peer": str,
    "collective": str,
    "nranks": int,
    "bytes": int,
    "dtype": str,
    "inplace": bool,
    "time_us": (int, float),
    "busbw_GBps": (int, float),
    "wrong": int,
}
LATENCY_MAX_BYTES = 64 * 1024
DPI = 150
FIGSIZE = (8.0, 5.0)

# One plotted series: (bytes, value, wrong) points sorted by size.
Points = list[tuple[int, float, bool]]
# peer -> nranks -> bytes -> record, for one collective.
Table = dict[str, dict[int, dict[int, dict[str, Any]]]]


class PlotError(Exception):
    """A missing or malformed input file, or nothing to plot."""


# ---------------------------------------------------------------- input


def _check_record(rec: Any, where: str) -> None:
    if not isinstance(rec, dict):
        raise PlotError(f"{where}: a record must be a JSON object")
    for key, kind in REQUIRED_FIELDS.items():
        value = rec.get(key)
        if value is None:
            raise PlotError(f"{where}: missing field {key!r}")
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise PlotError(f"{where}: field {key!r} has the wrong type ({type(value).__name__})")


def load_sweep(path: Path) -> dict[str, Any]:
    """Read one sweep file and check its schema; raises PlotError with a readable reason."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise PlotError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlotError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise PlotError(f"{path}: not a pycoll perf file (expected an object with a 'records' list)")
    for key in ("meta", "limits"):
        if not isinstance(data.get(key, {}), dict):
            raise PlotError(f"{path}: {key!r} must be a JSON object")
    for i, rec in enumerate(data["records"]):
        _check_record(rec, f"{path}: records[{i}]")
    return data


HOST_BOUND = "memory copy bound (this machine)"
DEVICE_BOUND = "device-to-device copy bound (cudaMemcpy)"


def _copy_bound(sweeps: list[dict[str, Any]]) -> Optional[tuple[float, str]]:
    """The copy bandwidth of the first file that has one, and its legend: host memory, or the GPU's D2D copy."""
    for sweep in sweeps:
        limits = sweep.get("limits") or {}
        value = limits.get("copy_GBps")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value), DEVICE_BOUND if limits.get("memory") == "cuda" else HOST_BOUND
    return None


def select_records(
    sweeps: list[dict[str, Any]], inplace: bool, collectives: Optional[Iterable[str]]
) -> list[dict[str, Any]]:
    """Records of the wanted placement and collectives; a later file wins a duplicate point."""
    wanted = set(collectives) if collectives else None
    chosen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for sweep in sweeps:
        for rec in sweep["records"]:
            if rec["inplace"] != inplace or (wanted is not None and rec["collective"] not in wanted):
                continue
            chosen[(rec["peer"], rec["collective"], rec["nranks"], rec["bytes"])] = rec
    return list(chosen.values())


def build_tables(records: list[dict[str, Any]]) -> dict[str, Table]:
    """collective -> peer -> nranks -> bytes -> record."""
    tables: dict[str, Table] = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for rec in records:
        tables[rec["collective"]][rec["peer"]][rec["nranks"]][rec["bytes"]] = rec
    return tables


def _peers(table: Table) -> list[str]:
    known = [p for p in PEER_ORDER if p in table]
    return known + sorted(p for p in table if p not in PEER_ORDER)


def _rank_counts(table: Table) -> list[int]:
    return sorted({n for by_n in table.values() for n in by_n})


def _series(points: dict[int, dict[str, Any]], field: str, max_bytes: Optional[int] = None) -> Points:
    return [
        (size, float(rec[field]), rec["wrong"] > 0)
        for size, rec in sorted(points.items())
        if max_bytes is None or size <= max_bytes
    ]


# ---------------------------------------------------------------- labels


def human_bytes(n: float) -> str:
    """1024 -> '1K', 65536 -> '64K', 1048576 -> '1M'."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.3g}{unit}"
    return f"{n:.0f}"


def _describe(coll: str, table: Table) -> str:
    """'float, sum' style summary of the dtypes (and ops, for reductions) in a collective's records."""
    recs = [rec for by_n in table.values() for by_size in by_n.values() for rec in by_size.values()]
    parts = ["/".join(sorted({str(r["dtype"]) for r in recs}))]
    if coll in REDUCING:
        ops = sorted({str(r["op"]) for r in recs if r.get("op")})
        parts += ["/".join(ops)] if ops else []
    parts.append("in-place" if any(r["inplace"] for r in recs) else "out-of-place")
    if any(r.get("device") == "cuda" for r in recs):
        parts.append("CUDA buffers")
    return ", ".join(parts)


def _title(coll: str, nranks: Optional[int], what: str, desc: str) -> str:
    ranks = f", {nranks} ranks" if nranks is not None else ""
    return f"{coll}{ranks} ({desc}): {what}"


# ---------------------------------------------------------------- drawing


def _new_figure() -> "Figure":
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    fig.add_subplot()
    return fig


def _style_axes(ax: "Axes", title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=12)
    ax.set_xlabel(xlabel, fontsize=11)
    ax.set_ylabel(ylabel, fontsize=11)
    ax.tick_params(labelsize=10)
    ax.grid(True, which="major", alpha=0.4)
    ax.grid(True, which="minor", alpha=0.15)


def _size_axis(ax: "Axes", sizes: Iterable[int]) -> None:
    """Log2 x axis with power-of-two ticks labelled 1K, 64K, 1M..., at most ~10 of them."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    sizes = [s for s in sizes if s > 0]
    ax.set_xscale("log", base=2)
    if not sizes:
        return
    lo, hi = math.floor(math.log2(min(sizes))), math.ceil(math.log2(max(sizes)))
    step = max(1, math.ceil((hi - lo + 1) / 10))
    ax.xaxis.set_major_locator(FixedLocator([2.0**e for e in range(lo, hi + 1, step)]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: human_bytes(x)))
    ax.xaxis.set_minor_locator(NullLocator())


def _plot_series(ax: "Axes", peer: str, points: Points, label: Optional[str] = None) -> None:
    color, marker = PEER_STYLE.get(peer, (None, "v"))
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    width = 2.2 if peer == "pycoll" else 1.5
    ax.plot(xs, ys, marker=marker, markersize=5, linewidth=width, color=color, label=label or peer)


def _mark_wrong(ax: "Axes", points: Iterable[tuple[float, float, bool]]) -> bool:
    """Red crosses over wrong results; True when there were any."""
    bad = [(x, y) for x, y, wrong in points if wrong]
    if bad:
        ax.scatter([b[0] for b in bad], [b[1] for b in bad], marker="x", s=90, linewidths=2.5,
                   color="red", zorder=5, label="_wrong")
    return bool(bad)


def _finish(fig: "Figure", ax: "Axes", path: Path, any_wrong: bool) -> Path:
    """Legend outside the axes (never over the data), then save."""
    from matplotlib.lines import Line2D

    handles, labels = ax.get_legend_handles_labels()
    if any_wrong:
        handles.append(Line2D([], [], marker="x", color="red", linestyle="none", markersize=9, mew=2.5))
        labels.append("wrong result")
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4), fontsize=10)
    fig.savefig(path, dpi=DPI)
    return path


# ---------------------------------------------------------------- the four charts


def plot_busbw(coll: str, table: Table, nranks: int, bound: Optional[tuple[float, str]], desc: str, out: Path) -> Path:
    """busbw vs message size at one rank count, one line per peer, plus the copy bound (host or device)."""
    fig = _new_figure()
    ax = fig.axes[0]
    any_wrong, sizes = False, set()
    for peer in _peers(table):
        points = _series(table[peer].get(nranks, {}), "busbw_GBps")
        if points:
            _plot_series(ax, peer, points)
            any_wrong |= _mark_wrong(ax, points)
            sizes.update(p[0] for p in points)
    if bound is not None:
        ax.axhline(bound[0], color="black", linestyle="--", linewidth=1.2, label=bound[1])
    _size_axis(ax, sizes)
    ax.set_ylim(bottom=0)
    _style_axes(ax, _title(coll, nranks, "bus bandwidth", desc), "message size (bytes)", "bus bandwidth (GB/s)")
    return _finish(fig, ax, out / f"busbw_{coll}_np{nranks}.png", any_wrong)


def plot_latency(coll: str, table: Table, nranks: int, desc: str, out: Path) -> Optional[Path]:
    """Time vs size for small messages (<= 64 KiB), log y; None when there are none."""
    fig = _new_figure()
    ax = fig.axes[0]
    any_wrong, sizes = False, set()
    for peer in _peers(table):
        points = _series(table[peer].get(nranks, {}), "time_us", LATENCY_MAX_BYTES)
        points = [p for p in points if p[1] > 0]
        if points:
            _plot_series(ax, peer, points)
            any_wrong |= _mark_wrong(ax, points)
            sizes.update(p[0] for p in points)
    if not sizes:
        return None
    _size_axis(ax, sizes)
    ax.set_yscale("log")
    _style_axes(ax, _title(coll, nranks, "small-message latency", desc), "message size (bytes)", "time (µs)")
    return _finish(fig, ax, out / f"latency_{coll}_np{nranks}.png", any_wrong)


def plot_scaling(coll: str, table: Table, desc: str, out: Path) -> Path:
    """busbw vs rank count at the largest message size measured, one line per peer."""
    fig = _new_figure()
    ax = fig.axes[0]
    size = max(s for by_n in table.values() for by_size in by_n.values() for s in by_size)
    any_wrong = False
    for peer in _peers(table):
        points = [(n, float(by_size[size]["busbw_GBps"]), by_size[size]["wrong"] > 0)
                  for n, by_size in sorted(table[peer].items()) if size in by_size]
        if points:
            _plot_series(ax, peer, points)
            any_wrong |= _mark_wrong(ax, points)
    ranks = _rank_counts(table)
    ax.set_xticks(ranks, [str(n) for n in ranks])
    ax.set_ylim(bottom=0)
    what = f"bus bandwidth at {human_bytes(size)}B vs ranks"
    _style_axes(ax, _title(coll, None, what, desc), "ranks", "bus bandwidth (GB/s)")
    return _finish(fig, ax, out / f"scaling_{coll}.png", any_wrong)


def _ratio_points(ours: dict[int, dict[str, Any]], theirs: dict[int, dict[str, Any]]) -> Points:
    """(size, peer time / pycoll time, either wrong) at the sizes both measured."""
    return [
        (size, theirs[size]["time_us"] / ours[size]["time_us"], ours[size]["wrong"] > 0 or theirs[size]["wrong"] > 0)
        for size in sorted(set(ours) & set(theirs))
        if ours[size]["time_us"] > 0
    ]


def plot_ratio(coll: str, table: Table, nranks: int, desc: str, out: Path) -> Optional[Path]:
    """pycoll's speed-up over each other peer vs size; None without pycoll or another peer."""
    ours = table.get("pycoll", {}).get(nranks)
    others = [p for p in _peers(table) if p != "pycoll" and table[p].get(nranks)]
    if not ours or not others:
        return None
    fig = _new_figure()
    ax = fig.axes[0]
    any_wrong, sizes = False, set()
    for peer in others:
        points = _ratio_points(ours, table[peer][nranks])
        if points:
            _plot_series(ax, peer, points, label=f"vs {peer}")
            any_wrong |= _mark_wrong(ax, points)
            sizes.update(p[0] for p in points)
    if not sizes:
        return None
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1.2, label="parity (1.0)")
    _size_axis(ax, sizes)
    ax.set_ylim(bottom=0)
    _style_axes(ax, _title(coll, nranks, "pycoll speed-up", desc), "message size (bytes)", "pycoll speed-up over peer (×)")
    return _finish(fig, ax, out / f"ratio_{coll}_np{nranks}.png", any_wrong)


# ---------------------------------------------------------------- driver


def plot_collective(coll: str, table: Table, bound: Optional[tuple[float, str]], out: Path) -> list[Path]:
    """Every chart for one collective; prints a note for each one skipped."""
    desc, written = _describe(coll, table), []
    for nranks in _rank_counts(table):
        written.append(plot_busbw(coll, table, nranks, bound, desc, out))
        latency = plot_latency(coll, table, nranks, desc, out)
        if latency is None:
            print(f"note: {coll} np{nranks}: no sizes <= 64K, latency plot skipped")
        written += [latency] if latency else []
        ratio = plot_ratio(coll, table, nranks, desc, out)
        if ratio is None:
            print(f"note: {coll} np{nranks}: needs pycoll and another peer, ratio plot skipped")
        written += [ratio] if ratio else []
    if len(_rank_counts(table)) > 1:
        written.append(plot_scaling(coll, table, desc, out))
    else:
        print(f"note: {coll}: only one rank count, scaling plot skipped")
    return written


def _warn_wrong(records: list[dict[str, Any]]) -> None:
    bad = [r for r in records if r["wrong"] > 0]
    if bad:
        where = ", ".join(sorted({f"{r['peer']} {r['collective']} np{r['nranks']}" for r in bad}))
        print(f"warning: {len(bad)} record(s) with wrong results (marked with a red x): {where}", file=sys.stderr)


def make_plots(files: list[Path], out: Path, inplace: bool, collectives: Optional[list[str]]) -> list[Path]:
    """Load the files and write every chart into `out`; returns the paths written."""
    sweeps = [load_sweep(f) for f in files]
    records = select_records(sweeps, inplace, collectives)
    if not records:
        kind = "in-place" if inplace else "out-of-place"
        raise PlotError(f"no {kind} records to plot in {', '.join(map(str, files))}")
    _warn_wrong(records)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PlotError(f"{out}: cannot create the output folder ({exc.strerror or exc})") from None
    tables, bound = build_tables(records), _copy_bound(sweeps)
    ordered = [c for c in COLLECTIVES if c in tables] + sorted(c for c in tables if c not in COLLECTIVES)
    return [path for coll in ordered for path in plot_collective(coll, tables[coll], bound, out)]


def _parse_collectives(values: Optional[list[str]]) -> Optional[list[str]]:
    if not values:
        return None
    names = [name for value in values for name in value.split(",") if name]
    unknown = sorted(set(names) - set(COLLECTIVES))
    if unknown:
        raise PlotError(f"unknown collective(s) {', '.join(unknown)}; choose from {', '.join(COLLECTIVES)}")
    return names


def plot_command(args: argparse.Namespace) -> int:
    """Entry point of ``pycoll plot``."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("pycoll plot: matplotlib is not installed: pip install 'pycoll[plot]'", file=sys.stderr)
        return 2
    try:
        collectives = _parse_collectives(args.collectives)
        written = make_plots([Path(f) for f in args.files], Path(args.out), args.inplace == "in", collectives)
    except PlotError as exc:
        print(f"pycoll plot: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} file(s):")
    for path in written:
        print(f"  {path}")
    return 0


def add_plot_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register ``pycoll plot``."""
    p = subparsers.add_parser("plot", help="draw PNG charts from `pycoll perf` JSON files")
    p.add_argument("files", nargs="+", metavar="FILE.json", help="sweep result files (later files win duplicates)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the PNG files (created if needed)")
    p.add_argument("--inplace", choices=("out", "in"), default="out",
                   help="plot out-of-place (default) or in-place records")
    p.add_argument("--collectives", nargs="+", metavar="NAME",
                   help=f"only these collectives (space or comma separated): {', '.join(COLLECTIVES)}")
    p.set_defaults(func=plot_command)
    return p
