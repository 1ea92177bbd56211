"""`pycoll simulate`: the time, algbw and busbw every algorithm is predicted to take, size by size, on a topology.

The predictions come from the cost model that selection uses (``pycoll.algorithms.cost``), built from the
topology by ``CostModel.from_topology``: every registered algorithm of the collective that accepts the layout,
at every size from -b to -e, plus the one selection would pick. Cost functions are closed forms, so thousands of
ranks take seconds. The output is `pycoll perf`'s JSON (peers ``sim`` for the pick and ``sim[NAME]`` for each
algorithm, ``meta.simulated = true``), which `pycoll plot` draws. docs/simulator.md describes the model and how
its predictions compare with published NCCL figures and with pycoll's own sweeps.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
from typing import Any, Optional, Sequence

import numpy as np

from ..algorithms.base import Call, Layout
from ..algorithms.cost import CostModel
from ..algorithms.registry import ALGORITHMS
from ..algorithms import cost as cost_model
from ..algorithms.registry import Algorithm
from ..topology import files as topology_files
from ..topology import fixtures
from ..topology.model import Device, Topology
from . import metrics, report
from .options import DTYPES, ITEMSIZE, _dtype, _np_list, _positive, _size

# Collectives with cost functions and an nccl-tests bus factor (alltoall's algorithm has no cost function).
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")
# Algorithms that work through one host's shared-memory arena on host buffers: they never serve device memory.
HOST_MEMORY_MODULES = frozenset({"pycoll.algorithms.shared", "pycoll.algorithms.staged"})
FIXTURES = fixtures.DIR  # the topology fixtures shipped with pycoll


def host_memory_only(algo: Algorithm) -> bool:
    """True for the arena algorithms, which move host buffers through one host's shared memory."""
    return getattr(algo.run, "__module__", "") in HOST_MEMORY_MODULES


def load_topology(spec: str) -> Topology:
    """A topology file (pycoll JSON or NCCL XML), or the name of a fixture in ``pycoll/topology/fixtures``."""
    if os.path.isfile(spec):
        return topology_files.load(spec)
    name = spec if spec.endswith((".json", ".xml")) else f"{spec}.json"
    path = os.path.join(FIXTURES, name)
    if os.path.isfile(path):
        return topology_files.load(path)
    raise FileNotFoundError(f"no topology file {spec!r}, and no fixture {name!r} in {FIXTURES}")


def default_kind(topo: Topology) -> str:
    """GPU ranks where the topology has GPUs, else CPU ranks."""
    return "gpu" if any(h.gpus for h in topo.hosts) else "cpu"


def slots(topo: Topology, kind: str, per_host: int = 0) -> int:
    """How many ranks ``Topology.place`` fits on the topology."""
    if kind == "gpu":
        return sum(min(len(h.gpus), per_host or len(h.gpus)) for h in topo.hosts)
    return sum(per_host or h.cores or 1 for h in topo.hosts)


def widen(topo: Topology, ranks: int, kind: str, per_host: int = 0) -> Topology:
    """The topology itself, or, when one host is too small for ``ranks``, enough copies of it (``Topology.cluster``)."""
    room = slots(topo, kind, per_host)
    if len(topo.hosts) != 1 or ranks <= room or room == 0:
        return topo
    return Topology.cluster(topo, math.ceil(ranks / room), name=f"{topo.hosts[0].name or 'node'}-")


def _probe(coll: str, dtype: np.dtype, count: int, nranks: int) -> Call:
    """A call of the right size without memory: a zero-stride view reports the nbytes of its full length."""
    split = coll in metrics.SPLIT
    view = np.broadcast_to(np.zeros(1, dtype), (count * nranks if split else count,))
    return Call(coll, dtype, send=view, recv=view, counts=[count] * nranks if split else [])


def _record(peer: str, algo: str, used: str, coll: str, layout: Layout, nbytes: int, count: int, dtype: str,
            seconds: float) -> dict[str, Any]:
    t_us = seconds * 1e6
    return {
        "peer": peer, "algo": algo, "algo_used": used, "hosts": layout.hosts, "link_rate": None,
        "collective": coll, "nranks": layout.size, "bytes": nbytes, "count": count, "dtype": dtype,
        "op": "sum" if coll in metrics.REDUCING else "none", "root": 0 if coll in metrics.ROOTED else -1,
        "inplace": False, "time_us": round(t_us, 3),
        "algbw_GBps": round(metrics.algbw(nbytes, t_us), 4),
        "busbw_GBps": round(metrics.busbw(coll, layout.size, nbytes, t_us), 4),
        "wrong": 0, "iters": 0, "simulated": True,
    }


def placement_of(topo: Topology, ranks: int, kind: str, per_host: int = 0) -> tuple[list[Device], Layout]:
    """Where ``ranks`` ranks run on ``topo`` and the layout selection sees (hosts numbered in order of first rank)."""
    placement = topo.place(ranks, kind, per_host)
    return placement, Layout.from_ids([str(d.host) for d in placement])


def simulate(topo: Topology, collective: str, ranks: int, sizes: Sequence[int], kind: Optional[str] = None,
             dtype: str = "float", algos: Optional[Sequence[str]] = None, *, per_host: int = 0,
             base: Optional[CostModel] = None, model: Optional[CostModel] = None) -> list[dict[str, Any]]:
    """`pycoll perf` records predicted for ``ranks`` ranks of ``kind`` on ``topo`` at each of ``sizes`` (nccl-tests sizes).

    One record per (size, algorithm that accepts the layout), peer ``sim[NAME]``, restricted to ``algos`` when
    given; and one per size for the algorithm selection picks, peer ``sim`` (algo ``auto``). Host-memory arena
    algorithms are left out for GPU ranks. ``base`` gives CPU ranks their host constants (default: the
    built-in ones); ``model`` replaces the model built from the topology altogether.
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"cannot simulate {collective!r}; choose from {', '.join(COLLECTIVES)}")
    unknown = sorted(set(algos or ()) - set(ALGORITHMS[collective]))
    if unknown:
        raise ValueError(f"{collective} has no algorithm {', '.join(unknown)}; it has {', '.join(ALGORITHMS[collective])}")
    kind = kind or default_kind(topo)
    placement, layout = placement_of(topo, ranks, kind, per_host)
    model = model or CostModel.from_topology(topo, placement, kind, base)
    try:
        name = _dtype(dtype)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None
    itemsize = ITEMSIZE[DTYPES[name]]
    np_dtype = np.dtype(f"u{itemsize}")  # only the size matters to refusals and costs
    table = [a for a in ALGORITHMS[collective].values()
             if a.cost is not None and not (kind == "gpu" and host_memory_only(a))]
    launch = model.call_us * 1e-6
    records = []
    for size in sizes:
        nbytes, count = metrics.round_size(collective, size, itemsize, ranks)
        if count == 0:
            continue
        call = _probe(collective, np_dtype, count, ranks)
        timed = [(algo.predict(model, nbytes, layout) + launch, algo) for algo in table if algo.refusal(call, layout) is None]
        if not timed:
            continue
        for seconds, algo in timed:
            if algos is None or algo.name in algos:
                records.append(_record(f"sim[{algo.name}]", algo.name, algo.name, collective, layout, nbytes, count, name, seconds))
        seconds, pick = min(timed, key=lambda pair: pair[0])  # ties: the first registered, as selection does
        records.append(_record("sim", "auto", pick.name, collective, layout, nbytes, count, name, seconds))
    return records


def describe(model: CostModel, layout: Layout) -> str:
    """One line of the link terms a model gives a layout."""
    parts = [f"intra-host {model.shm_GBps:.1f} GB/s, {model.shm_latency_us:.1f} us a step"]
    if layout.hosts > 1:
        parts.append(f"inter-host {model.net_GBps:.2f} GB/s a host, {model.net_latency_us:.1f} us a step")
    parts.append(f"reduce {model.reduce_GBps:.1f} GB/s" + (" (fused with the transfer)" if model.fused else ""))
    if model.msg_us:
        parts.append(f"{model.msg_us:.0f} us CPU a message, {model.cores or os.cpu_count()} cores a host")
    if model.call_us:
        parts.append(f"launch {model.call_us:.1f} us")
    return "; ".join(parts)


# ---- the command ---------------------------------------------------------------------------------


def sizes_of(minbytes: int, maxbytes: int, factor: int) -> list[int]:
    out, size = [], max(minbytes, 1)
    while size <= maxbytes:
        out.append(size)
        size *= factor
    return out


def command_line(args: argparse.Namespace) -> str:
    """The command, written out from its parsed options."""
    parts = ["pycoll simulate", f"--topo {args.topo}", f"--collective {args.collective}"]
    if args.nps:
        parts.append(f"--np {','.join(map(str, args.nps))}")
    parts.append(f"-b {report.human(args.minbytes)} -e {report.human(args.maxbytes)} -f {args.stepfactor} -d {args.datatype}")
    for flag, value in (("--kind", args.kind), ("--ranks-per-host", args.ranks_per_host or None), ("--algos", args.algos),
                        ("--tuning", args.tuning), ("--json", args.json)):
        if value:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def simulate_command(args: argparse.Namespace) -> int:
    """Entry point of ``pycoll simulate``."""
    try:
        topo = load_topology(args.topo)
    except (OSError, ValueError) as exc:
        print(f"pycoll simulate: {exc}", file=sys.stderr)
        return 2
    kind = args.kind or default_kind(topo)
    base = cost_model.load(args.tuning) if args.tuning else None
    algos = [a.strip() for a in args.algos.split(",") if a.strip()] if args.algos else None
    nps = args.nps or [slots(topo, kind, args.ranks_per_host)]
    sizes = sizes_of(args.minbytes, args.maxbytes, args.stepfactor)
    command = command_line(args)
    print(f"# {command}")
    records: list[dict[str, Any]] = []
    runs = []
    for n in nps:
        where = widen(topo, n, kind, args.ranks_per_host)
        try:
            placement, layout = placement_of(where, n, kind, args.ranks_per_host)
            model = CostModel.from_topology(where, placement, kind, base)
            found = simulate(where, args.collective, n, sizes, kind, args.datatype, algos,
                             per_host=args.ranks_per_host, model=model)
        except ValueError as exc:
            print(f"pycoll simulate: {exc}", file=sys.stderr)
            return 2
        copies = f" ({len(where.hosts)} copies of its host)" if where is not topo else ""
        local = sorted(set(layout.local_sizes))
        print(f"\n# topology {topo.source or args.topo}{copies}: {n} {kind} ranks on {layout.hosts} hosts, "
              f"{'/'.join(map(str, local))} a host")
        print(f"# model: {describe(model, layout)}")
        runs.append({"nranks": n, "hosts": layout.hosts, "ranks_per_host": local, "model": model.to_json()})
        by_peer: dict[str, list[dict[str, Any]]] = {}
        for rec in found:
            by_peer.setdefault(rec["peer"], []).append(rec)
        for peer in sorted(by_peer, key=lambda p: (p == "sim", p)):
            print()
            print(report.format_block(peer, n, args.collective, args.datatype, "sum", by_peer[peer], [False],
                                      hosts=layout.hosts if layout.hosts > 1 else None))
        records += found
    if args.json:
        meta = {"command": command, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "simulated": True, "topology": topo.source or args.topo, "kind": kind, "collective": args.collective,
                "hosts": max((r["hosts"] for r in runs), default=1), "link_rate": None, "algos": algos or [], "runs": runs}
        report.write_json(args.json, meta, {}, records)
        print(f"\n# wrote {len(records)} records to {args.json}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topo", required=True, metavar="FILE",
                   help="topology: a pycoll JSON or NCCL XML file, or a fixture name such as dgx-h100")
    p.add_argument("-C", "--collective", default="allreduce", choices=COLLECTIVES, help="collective (default allreduce)")
    p.add_argument("--np", dest="nps", type=_np_list, default=None, metavar="N[,N...]",
                   help="rank counts (default: every GPU, or every core, of the topology); a one-host topology is "
                        "copied onto as many hosts as the ranks need")
    p.add_argument("-b", "--minbytes", type=_size, default=1 << 10, metavar="SIZE", help="smallest size (default 1K)")
    p.add_argument("-e", "--maxbytes", type=_size, default=1 << 30, metavar="SIZE", help="largest size (default 1G)")
    p.add_argument("-f", "--stepfactor", type=_positive(2), default=2, metavar="F", help="size multiplier (default 2)")
    p.add_argument("-d", "--datatype", type=_dtype, default="float", help="element type (default float)")
    p.add_argument("--kind", choices=("gpu", "cpu"), default=None,
                   help="rank kind (default: gpu when the topology has GPUs, else cpu)")
    p.add_argument("--ranks-per-host", type=_positive(1), default=0, metavar="N",
                   help="ranks on each host (default: one per GPU, or one per core)")
    p.add_argument("--algos", default=None, metavar="NAME[,NAME...]", help="report only these algorithms (the pick is always reported)")
    p.add_argument("--tuning", default=None, metavar="FILE",
                   help="CPU ranks: take the host constants from this `pycoll tune` file instead of the built-in ones")
    p.add_argument("--json", default=None, metavar="FILE", help="write the records as `pycoll perf` JSON")


def add_simulate_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register ``pycoll simulate``."""
    p = subparsers.add_parser("simulate", help="predict every algorithm's time and bandwidth on a topology",
                              description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(p)
    p.set_defaults(func=simulate_command)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """Run ``pycoll simulate`` with ``argv`` (default: this process's arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="pycoll simulate", description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(p)
    return simulate_command(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
