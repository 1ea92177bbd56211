"""The topology model: hosts with NUMA nodes, a PCIe tree, GPUs (with NVLink) and NICs; path classes between devices; JSON.

Path classes follow NCCL's (``nvidia-smi topo -m`` names), nearest first. A path's bandwidth is its
slowest link, per direction, in GB/s; its latency is a per-class figure (see ``LATENCY_US``). The model
is plain data: discovery (``discover``) fills it from NVML and sysfs, ``nccl_xml`` imports NCCL's XML,
and ``dump``/``load`` round-trip it through JSON (``PYCOLL_TOPO_DUMP_FILE``, ``PYCOLL_TOPO_FILE``).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

FORMAT = "pycoll-topology"
VERSION = 1


class PathType(enum.IntEnum):
    """How two devices reach each other, nearest first (NCCL's classes; NVS is a hop through an NVSwitch)."""

    LOC = 0  # the same device
    NVL = 1  # direct NVLink
    NVS = 2  # NVLink through an NVSwitch
    PIX = 3  # at most one PCIe switch
    PXB = 4  # several PCIe switches, no host bridge
    PHB = 5  # through a PCIe host bridge (one CPU socket)
    SYS = 6  # across CPU sockets (the SMP interconnect)
    NET = 7  # across hosts


# Latency of one hop per class, microseconds: NVLink and PCIe figures as NCCL's tuning uses them (order of
# magnitude), the socket hop from QPI/UPI/Infinity Fabric measurements, the network one for RDMA.
LATENCY_US = {
    PathType.LOC: 0.0, PathType.NVL: 0.6, PathType.NVS: 0.8, PathType.PIX: 1.0, PathType.PXB: 1.2,
    PathType.PHB: 1.5, PathType.SYS: 2.0, PathType.NET: 5.0,
}

# PCIe data rate per lane after line coding, GB/s per direction, by GT/s.
_PCIE_LANE_GBPS = {2.5: 0.25, 5.0: 0.5, 8.0: 0.985, 16.0: 1.969, 32.0: 3.938, 64.0: 7.563}


def pcie_GBps(gts: float, width: int) -> float:
    """One PCIe link's bandwidth per direction (GB/s) from its rate (GT/s) and lane count."""
    if gts <= 0 or width <= 0:
        return 0.0
    lane = _PCIE_LANE_GBPS.get(float(gts)) or gts * (128 / 130) / 8
    return lane * width


@dataclass
class Numa:
    """A NUMA node: its CPUs (a Linux cpulist such as ``0-15,32-47``) and the socket it sits on."""

    id: int
    cpus: str = ""
    socket: int = 0
    memory_GB: float = 0.0


@dataclass
class PciNode:
    """A node of the PCIe tree: a root (host bridge), a switch (bridge), or an endpoint (gpu, nic, other)."""

    bus_id: str  # domain:bus:device.function, lower case, e.g. 0000:1b:00.0
    kind: str  # "root", "switch", "gpu", "nic", "other"
    parent: Optional[str] = None  # the upstream node's bus_id; None for a root
    gts: float = 0.0  # link rate to the parent, GT/s
    width: int = 0  # link lanes to the parent
    numa: int = -1  # roots: the NUMA node they attach to

    @property
    def GBps(self) -> float:
        return pcie_GBps(self.gts, self.width)


@dataclass
class NvLink:
    """``count`` NVLinks of ``GBps`` each (per direction) to a peer GPU (its bus id) or to ``"nvswitch"``."""

    peer: str
    count: int = 1
    GBps: float = 25.0


@dataclass
class Gpu:
    index: int
    bus_id: str = ""
    name: str = ""
    numa: int = -1
    memory_GB: float = 0.0
    nvlinks: list[NvLink] = field(default_factory=list)

    def nvlink_GBps(self, peer: Optional[str] = None) -> float:
        """Total NVLink bandwidth per direction to ``peer`` (a bus id or ``"nvswitch"``), or to anything."""
        return sum(link.count * link.GBps for link in self.nvlinks if peer is None or link.peer == peer)


@dataclass
class Nic:
    name: str
    bus_id: str = ""
    numa: int = -1
    speed_Gbps: float = 0.0  # line rate; 0 when unknown
    rdma: bool = False  # an InfiniBand / RoCE device backs it
    ib_device: str = ""  # e.g. mlx5_0

    @property
    def GBps(self) -> float:
        return self.speed_Gbps / 8


@dataclass
class Host:
    name: str
    numa: list[Numa] = field(default_factory=list)
    pci: list[PciNode] = field(default_factory=list)
    gpus: list[Gpu] = field(default_factory=list)
    nics: list[Nic] = field(default_factory=list)
    cores: int = 0
    socket_GBps: float = 40.0  # the inter-socket link, per direction
    absent: dict[str, str] = field(default_factory=dict)  # source -> why it gave nothing (no NVML, no InfiniBand...)

    # ---- lookups -------------------------------------------------------------------------------
    def gpu(self, index: int) -> Gpu:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(f"host {self.name} has no GPU {index}")

    def nic(self, name: str) -> Nic:
        for n in self.nics:
            if n.name == name:
                return n
        raise KeyError(f"host {self.name} has no NIC {name}")

    def pci_node(self, bus_id: str) -> Optional[PciNode]:
        for node in self.pci:
            if node.bus_id == bus_id:
                return node
        return None

    def socket_of(self, numa: int) -> int:
        for n in self.numa:
            if n.id == numa:
                return n.socket
        return 0

    def upstream(self, bus_id: str) -> list[PciNode]:
        """The device's PCIe nodes from itself up to its root (empty if the tree does not know it)."""
        chain, node, seen = [], self.pci_node(bus_id), set()
        while node is not None and node.bus_id not in seen:
            chain.append(node)
            seen.add(node.bus_id)
            node = self.pci_node(node.parent) if node.parent else None
        return chain


@dataclass(frozen=True)
class Path:
    type: PathType
    GBps: float  # per direction, the slowest link on the way
    latency_us: float

    @property
    def name(self) -> str:
        return self.type.name


@dataclass(frozen=True)
class Device:
    """A device of one host: ``kind`` is "gpu" (index), "nic" (name) or "cpu" (NUMA node id)."""

    host: int
    kind: str
    id: Any


@dataclass(frozen=True)
class HostLink:
    """The network between two hosts (by name) as measured end to end: one-way latency of a small message, the payload
    rate one way, and each way's rate with both ways in use at once (0: not measured); ``pycoll tune --hosts``
    measures them."""

    a: str
    b: str
    GBps: float
    latency_us: float
    source: str = ""
    both_ways_GBps: float = 0.0

    def joins(self, x: str, y: str) -> bool:
        return {self.a, self.b} == {x, y}


@dataclass(frozen=True)
class HostMemory:
    """One core's memory copy and reduction rates on a host (by name), out of cache, in GB/s of bytes copied or
    reduced; ``pycoll tune --hosts`` measures them with the links, and an untuned job prices its memory-bound work
    with them. Kept beside the links, by name, because namespace hosts of one machine share a hostname and are told
    apart only when the job's topologies merge (``vm``, ``vm#1``)."""

    host: str
    copy_GBps: float
    reduce_GBps: float
    source: str = ""


@dataclass
class Topology:
    hosts: list[Host] = field(default_factory=list)
    net_latency_us: float = LATENCY_US[PathType.NET]
    source: str = ""  # where it came from: "discovered", a file, "nccl-xml:<file>", a fixture name
    links: list[HostLink] = field(default_factory=list)  # measured host pairs; unmeasured ones follow the NICs
    memory: list[HostMemory] = field(default_factory=list)  # measured hosts' memory; unmeasured: the built-in rates

    def link(self, a: int, b: int) -> Optional[HostLink]:
        """The measured link between hosts ``a`` and ``b`` (indices), None when not measured (or the same host)."""
        if a == b:
            return None
        x, y = self.hosts[a].name, self.hosts[b].name
        return next((lk for lk in self.links if lk.joins(x, y)), None)

    def with_links(self, links: Iterable[HostLink]) -> "Topology":
        """A copy whose links are ``links`` in place of any it had between the same hosts."""
        fresh = list(links)
        kept = [old for old in self.links if not any(new.joins(old.a, old.b) for new in fresh)]
        return dataclasses.replace(self, links=kept + fresh)

    def with_memory(self, memory: Iterable[HostMemory]) -> "Topology":
        """A copy whose hosts' memory rates are ``memory`` in place of any it had for the same hosts."""
        fresh = list(memory)
        kept = [old for old in self.memory if not any(new.host == old.host for new in fresh)]
        return dataclasses.replace(self, memory=kept + fresh)

    def memory_rates(self, hosts: Iterable[int]) -> Optional[tuple[float, float]]:
        """The slowest (copy, reduction) memory rates of ``hosts`` (indices); None unless every one was measured."""
        rates = {m.host: m for m in self.memory}
        chosen = [rates.get(self.hosts[h].name) for h in hosts]
        if not chosen or any(m is None for m in chosen):
            return None
        return min(m.copy_GBps for m in chosen), min(m.reduce_GBps for m in chosen)  # type: ignore[union-attr]

    # ---- paths ---------------------------------------------------------------------------------
    def path(self, a: Device, b: Device) -> Path:
        """The path class, bandwidth and latency between two devices (see ``PathType``)."""
        if a.host != b.host:
            measured = self.link(a.host, b.host)
            if measured is not None:
                return Path(PathType.NET, measured.GBps, measured.latency_us)
            bw = min(self._nic_GBps(a), self._nic_GBps(b))
            return Path(PathType.NET, bw, self.net_latency_us)
        host = self.hosts[a.host]
        if a == b:
            return Path(PathType.LOC, float("inf"), 0.0)
        if a.kind == "gpu" and b.kind == "gpu":
            ga, gb = host.gpu(a.id), host.gpu(b.id)
            direct = ga.nvlink_GBps(gb.bus_id)
            if direct > 0:
                return Path(PathType.NVL, direct, LATENCY_US[PathType.NVL])
            sa, sb = ga.nvlink_GBps("nvswitch"), gb.nvlink_GBps("nvswitch")
            if sa > 0 and sb > 0:
                return Path(PathType.NVS, min(sa, sb), LATENCY_US[PathType.NVS])
        return self._pci_path(host, a, b)

    def numa_of(self, d: Device) -> int:
        """The NUMA node a device sits on (its own record, else its PCIe root's), -1 if unknown."""
        return self._numa_of(self.hosts[d.host], d)

    def _numa_of(self, host: Host, d: Device) -> int:
        if d.kind == "cpu":
            return int(d.id)
        dev = host.gpu(d.id) if d.kind == "gpu" else host.nic(d.id)
        if dev.numa >= 0:
            return dev.numa
        chain = host.upstream(dev.bus_id)
        return chain[-1].numa if chain else -1

    def _bus_of(self, host: Host, d: Device) -> str:
        if d.kind == "gpu":
            return host.gpu(d.id).bus_id
        if d.kind == "nic":
            return host.nic(d.id).bus_id
        return ""

    def _pci_path(self, host: Host, a: Device, b: Device) -> Path:
        ca, cb = host.upstream(self._bus_of(host, a)), host.upstream(self._bus_of(host, b))
        ids_b = {n.bus_id: i for i, n in enumerate(cb)}
        common = next(((i, ids_b[n.bus_id]) for i, n in enumerate(ca) if n.bus_id in ids_b), None)
        if common is not None:
            ia, ib = common
            hops = ca[:ia] + cb[:ib]  # links below the common ancestor
            bw = min((n.GBps for n in hops if n.GBps > 0), default=float("inf"))
            top = ca[ia]
            switches = {n.bus_id for n in ca[: ia + 1] + cb[: ib + 1] if n.kind == "switch"}
            if top.kind == "root":
                kind = PathType.PHB
            elif len(switches) <= 1:
                kind = PathType.PIX
            else:
                kind = PathType.PXB
            return Path(kind, bw, LATENCY_US[kind])
        # different PCIe roots (or a CPU end): one socket means through the host bridge(s), else across sockets
        bw = min((n.GBps for n in ca + cb if n.kind != "root" and n.GBps > 0), default=float("inf"))
        sa, sb = host.socket_of(self._numa_of(host, a)), host.socket_of(self._numa_of(host, b))
        if sa == sb:
            return Path(PathType.PHB, bw, LATENCY_US[PathType.PHB])
        return Path(PathType.SYS, min(bw, host.socket_GBps), LATENCY_US[PathType.SYS])

    def _nic_GBps(self, d: Device) -> float:
        host = self.hosts[d.host]
        if d.kind == "nic":
            return host.nic(d.id).GBps or float("inf")
        nic = self.nearest_nic(d)
        return nic.GBps if nic is not None and nic.GBps else float("inf")

    def _nearest_nics(self, d: Device) -> list[Nic]:
        """The NICs tied for nearest to ``d``: the best path class, then the fastest."""
        host = self.hosts[d.host]
        ranked = [((int(self.path(d, Device(d.host, "nic", nic.name)).type), -nic.GBps), i) for i, nic in enumerate(host.nics)]
        if not ranked:
            return []
        best = min(key for key, _ in ranked)
        return [host.nics[i] for key, i in ranked if key == best]

    def nearest_nic(self, d: Device) -> Optional[Nic]:
        """The NIC nearest to ``d`` (best path class, then fastest), or None. A NIC is its own nearest. GPUs that
        share the same tied set (two GPUs and two NICs on one switch) take its NICs in turn, by GPU index."""
        host = self.hosts[d.host]
        if d.kind == "nic":
            return host.nic(d.id)
        best = self._nearest_nics(d)
        if len(best) <= 1 or d.kind != "gpu":
            return best[0] if best else None
        names = [n.name for n in best]
        peers = [g.index for g in host.gpus if [n.name for n in self._nearest_nics(Device(d.host, "gpu", g.index))] == names]
        return best[peers.index(d.id) % len(best)]

    # ---- devices and ranks ---------------------------------------------------------------------
    def devices(self, kind: str) -> list[Device]:
        """Every device of ``kind`` ("gpu" or "cpu": NUMA nodes), host by host."""
        out = []
        for h, host in enumerate(self.hosts):
            if kind == "gpu":
                out += [Device(h, "gpu", g.index) for g in host.gpus]
            elif kind == "nic":
                out += [Device(h, "nic", n.name) for n in host.nics]
            else:
                out += [Device(h, "cpu", n.id) for n in host.numa] or [Device(h, "cpu", 0)]
        return out

    def place(self, ranks: int, kind: str = "gpu", per_host: int = 0) -> list[Device]:
        """Where ``ranks`` ranks run: one per GPU host by host ("gpu"), or spread over each host's NUMA nodes
        ("cpu", ``per_host`` ranks a host, default its cores). Raises ValueError if they do not fit."""
        out: list[Device] = []
        for h, host in enumerate(self.hosts):
            if kind == "gpu":
                slots = [Device(h, "gpu", g.index) for g in host.gpus][: per_host or None]
            else:
                n = per_host or host.cores or 1
                nodes = [x.id for x in host.numa] or [0]
                slots = [Device(h, "cpu", nodes[i * len(nodes) // n]) for i in range(n)]
            out += slots
            if len(out) >= ranks:
                return out[:ranks]
        raise ValueError(f"{ranks} ranks do not fit this topology ({len(out)} {kind} slots on {len(self.hosts)} hosts)")

    # ---- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = {"format": FORMAT, "version": VERSION, **dataclasses.asdict(self)}
        for key in ("links", "memory"):  # files without measurements read as they always did
            if not out[key]:
                del out[key]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Topology":
        if data.get("format") != FORMAT:
            raise ValueError(f"not a pycoll topology (format {data.get('format')!r})")
        if int(data.get("version", 0)) > VERSION:
            raise ValueError(f"topology version {data.get('version')} is newer than this pycoll reads ({VERSION})")
        hosts = []
        for h in data.get("hosts", []):
            hosts.append(Host(
                name=h["name"], cores=int(h.get("cores", 0)), socket_GBps=float(h.get("socket_GBps", 40.0)),
                absent=dict(h.get("absent", {})),
                numa=[Numa(**n) for n in h.get("numa", [])],
                pci=[PciNode(**p) for p in h.get("pci", [])],
                gpus=[Gpu(**{**g, "nvlinks": [NvLink(**link) for link in g.get("nvlinks", [])]}) for g in h.get("gpus", [])],
                nics=[Nic(**n) for n in h.get("nics", [])],
            ))
        return cls(hosts=hosts, net_latency_us=float(data.get("net_latency_us", LATENCY_US[PathType.NET])),
                   source=str(data.get("source", "")), links=[HostLink(**lk) for lk in data.get("links", [])],
                   memory=[HostMemory(**m) for m in data.get("memory", [])])

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def dump(self, path: str) -> None:
        """Write the JSON to ``path`` atomically: processes dumping the same file together leave one whole file."""
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(self.dumps() + "\n")
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    # ---- building clusters ---------------------------------------------------------------------
    @classmethod
    def cluster(cls, node: "Topology", count: int, name: str = "node") -> "Topology":
        """``count`` copies of a one-host topology, named ``name0``, ``name1``..."""
        if len(node.hosts) != 1:
            raise ValueError("a cluster is built from a one-host topology")
        data = node.to_dict()["hosts"][0]
        hosts = []
        for i in range(count):
            one = cls.from_dict({"format": FORMAT, "version": VERSION, "hosts": [{**data, "name": f"{name}{i}"}]}).hosts[0]
            hosts.append(one)
        return cls(hosts=hosts, net_latency_us=node.net_latency_us, source=f"{count} x {node.source or 'node'}")


def matrix(topo: Topology, host: int = 0, kinds: Iterable[str] = ("gpu", "nic")) -> tuple[list[str], list[list[str]]]:
    """Labels and the path-class matrix of one host's devices, as ``nvidia-smi topo -m`` prints it."""
    devs = [d for k in kinds for d in topo.devices(k) if d.host == host]
    labels = [f"GPU{d.id}" if d.kind == "gpu" else str(d.id) for d in devs]
    rows = [["X" if a == b else topo.path(a, b).name for b in devs] for a in devs]
    return labels, rows
