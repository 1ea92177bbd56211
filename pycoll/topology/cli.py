"""`pycoll topo`: the device matrix (like ``nvidia-smi topo -m``), nearest NICs, absent sources, rings and trees."""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Optional, TextIO

from . import files as topology_files
from .model import LATENCY_US, Device, PathType, Topology, matrix
from .rings import comm_ring, label, ring_bottleneck, trees

LEGEND = {
    "X": "the device itself",
    "NVL": "a direct NVLink",
    "NVS": "NVLink through an NVSwitch",
    "PIX": "at most one PCIe switch",
    "PXB": "several PCIe switches, no host bridge",
    "PHB": "through a PCIe host bridge (within a socket)",
    "SYS": "across CPU sockets (the SMP interconnect)",
    "NET": "across hosts (the network)",
}


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _gbps(x: float) -> str:
    return "unknown" if x in (0, float("inf")) else f"{x:.1f}".rstrip("0").rstrip(".") + " GB/s"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def _affinity(topo: Topology, d: Device) -> tuple[str, str]:
    numa = topo.numa_of(d)
    if numa < 0:
        return "N/A", "N/A"
    cpus = next((n.cpus for n in topo.hosts[d.host].numa if n.id == numa), "")
    return cpus or "N/A", str(numa)


def report(topo: Topology, host: int = 0, np: Optional[int] = None, out: Optional[TextIO] = None) -> None:
    """Print the ``pycoll topo`` report of host ``host`` and the rings and trees of ``np`` ranks to ``out`` (stdout)."""
    h = topo.hosts[host]
    stream = out or sys.stdout
    say = lambda *a: print(*a, file=stream)  # noqa: E731
    sockets = len({n.socket for n in h.numa}) or 1
    say(f"topology: {topo.source or 'unnamed'}; {_n(len(topo.hosts), 'host')}")
    say(f"host {host}: {h.name}: {_n(h.cores, 'CPU')}, {_n(len(h.numa), 'NUMA node')} on "
        f"{_n(sockets, 'socket')}, {_n(len(h.gpus), 'GPU')}, {_n(len(h.nics), 'NIC')}")
    say()
    say("\n".join(_table(["NUMA", "socket", "CPUs", "memory"],
                         [[str(n.id), str(n.socket), n.cpus or "-", f"{n.memory_GB:g} GiB" if n.memory_GB else "?"]
                          for n in h.numa])))
    say()
    if not h.gpus:
        why = h.absent.get("nvml") or h.absent.get("gpu") or "none found"
        say(f"no GPUs on this host ({why})")
    else:
        rows = [[f"GPU{g.index}", g.bus_id or "?", g.name or "?", f"{g.memory_GB:g} GiB" if g.memory_GB else "?",
                 " ".join(f"{n.count}x{n.GBps:g} GB/s to {n.peer}" for n in g.nvlinks) or "none"] for g in h.gpus]
        say("\n".join(_table(["GPU", "bus id", "name", "memory", "NVLink"], rows)))
    if h.nics:
        say()
        rows = [[n.name, n.bus_id or "?", f"{n.speed_Gbps:g} Gb/s" if n.speed_Gbps else "unknown",
                 f"yes ({n.ib_device})" if n.rdma else "no"] for n in h.nics]
        say("\n".join(_table(["NIC", "bus id", "speed", "RDMA"], rows)))
    say()

    devices = [d for k in ("gpu", "nic") for d in topo.devices(k) if d.host == host]
    if devices:
        labels, cells = matrix(topo, host)
        rows = []
        for d, lab, row in zip(devices, labels, cells):
            cpus, numa = _affinity(topo, d)
            rows.append([lab, *row, cpus, numa])
        say("\n".join(_table(["", *labels, "CPU Affinity", "NUMA Affinity"], rows)))
        say()
        say("Legend:")
        for name, what in LEGEND.items():
            extra = f"  ({LATENCY_US[PathType[name]]:g} us a hop)" if name in PathType.__members__ else ""
            say(f"  {name:<4}= {what}{extra}")
        say()
    else:
        say("no GPUs or NICs: no device matrix")
        say()

    if h.gpus:
        say("NIC nearest each GPU:")
        for g in h.gpus:
            d = Device(host, "gpu", g.index)
            nic = topo.nearest_nic(d)
            if nic is None:
                say(f"  GPU{g.index}: none")
            else:
                p = topo.path(d, Device(host, "nic", nic.name))
                say(f"  GPU{g.index}: {nic.name} ({p.name}, {_gbps(p.GBps)}, NIC {nic.speed_Gbps:g} Gb/s"
                    f"{', RDMA' if nic.rdma else ''})")
        say()
    if h.absent:
        say("absent sources:")
        for source, why in sorted(h.absent.items()):
            say(f"  {source}: {why}")
    else:
        say("absent sources: none")
    say()

    kind = "gpu" if any(x.gpus for x in topo.hosts) else "cpu"
    total = np or (len(topo.devices("gpu")) if kind == "gpu" else sum(x.cores or 1 for x in topo.hosts))
    try:
        ranks = topo.place(total, kind)
    except ValueError as exc:
        say(f"rings and trees: {exc}")
        return
    order = comm_ring(topo, ranks)  # the ring the runtime's communicators walk
    dt = trees(topo, ranks)
    say(f"ring of {_n(total, 'rank')} on {'GPUs' if kind == 'gpu' else 'CPUs (no GPU)'}, "
        "rank(device) in ring order:")
    names = [label(topo, d, multi=len(dt.hosts) > 1) for d in ranks]
    tokens = [f"{r}({names[r]})" for r in order]
    say(textwrap.fill(" ".join(tokens), width=100, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False))
    a, b, bw, cls = ring_bottleneck(topo, ranks, order)
    if bw == float("inf"):
        say("  slowest link: none (every rank on one device)")
    else:
        say(f"  slowest link: {a}({names[a]}) > {b}({names[b]}): {cls}, {_gbps(bw)}")
    say("trees:")
    say(textwrap.indent(str(dt), "  "))


def topo_command(args: argparse.Namespace) -> int:
    """Entry point of ``pycoll topo``."""
    try:
        if args.file:
            topo = topology_files.load(args.file)
        else:
            from .discover import load_or_discover

            topo = load_or_discover()
    except (OSError, ValueError) as exc:
        print(f"pycoll topo: {exc}", file=sys.stderr)
        return 1
    if not 0 <= args.host < len(topo.hosts):
        print(f"pycoll topo: --host {args.host}: the topology has hosts 0..{len(topo.hosts) - 1}", file=sys.stderr)
        return 2
    if args.np is not None and args.np < 1:
        print("pycoll topo: --np must be at least 1", file=sys.stderr)
        return 2
    if args.dump:
        try:
            topo.dump(args.dump)
        except OSError as exc:
            print(f"pycoll topo: cannot write {args.dump}: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {args.dump}")
    report(topo, args.host, args.np)
    return 0


def add_topo_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register ``pycoll topo``."""
    p = subparsers.add_parser(
        "topo", help="show this host's topology (or a saved one): device matrix, nearest NICs, rings and trees"
    )
    p.add_argument("--file", metavar="F", help="a saved topology (pycoll JSON or NCCL XML) instead of discovering")
    p.add_argument("--dump", metavar="F", help="also write the topology to this JSON file")
    p.add_argument("--host", type=int, default=0, metavar="N", help="which host of the topology to show (default 0)")
    p.add_argument("--np", type=int, metavar="N",
                   help="ranks for the ring and trees (default: every GPU, or every CPU when there are none)")
    p.set_defaults(func=topo_command)
    return p
