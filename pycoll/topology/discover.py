"""Discovery of this host's topology from sysfs (NUMA, PCIe tree, NICs, InfiniBand) and NVML (GPUs, NVLink).

Every source that gives nothing (no NVML, no GPU, no InfiniBand, no NUMA directory) is recorded in
``Host.absent`` with the reason; discovery itself does not raise for an absent source. The sysfs root and
the NVML module are parameters, so tests run discovery on fake trees and a fake ``pynvml``.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..config import bool_param, str_param
from . import files as topology_files
from .model import Gpu, Host, HostLink, HostMemory, Nic, Numa, NvLink, PciNode, Topology
from .values import DEFAULT_NVLINK_GBPS, format_cpulist, normalize_bus_id, nvlink_GBps, parse_cpulist, parse_link_speed

log = logging.getLogger("pycoll.topology")

_ROOT = re.compile(r"^pci([0-9a-fA-F]{4}):([0-9a-fA-F]{2})$")
NVIDIA_VENDOR = "0x10de"

TOPO_FILE = str_param(
    "PYCOLL_TOPO_FILE", "", "A topology file (pycoll JSON, or NCCL's XML) to load instead of discovering this host."
)
TOPO_DUMP_FILE = str_param(
    "PYCOLL_TOPO_DUMP_FILE", "", "Write the topology pycoll discovered (or loaded) to this JSON file."
)
TOPO_DISCOVER = bool_param(
    "PYCOLL_TOPO_DISCOVER",
    True,
    "0: ranks skip topology discovery (and PYCOLL_TOPO_FILE) at start-up; the runtime then knows hosts only, one "
    "CPU device each.",
)


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _read_int(path: str, default: int = -1) -> int:
    text = _read(path)
    for base in (0, 10):  # "0x020000", "-1", and a decimal with a leading zero
        try:
            return int(text, base) if text is not None else default
        except ValueError:
            continue
    return default


# ---- NUMA and CPUs ---------------------------------------------------------------------------------


def _numa_nodes(sysfs: str, absent: dict[str, str]) -> list[Numa]:
    node_dir = os.path.join(sysfs, "devices/system/node")
    nodes: list[Numa] = []
    try:
        names = sorted((n for n in os.listdir(node_dir) if re.fullmatch(r"node\d+", n)), key=lambda n: int(n[4:]))
    except OSError:
        names = []
    for name in names:
        cpus = _read(os.path.join(node_dir, name, "cpulist")) or ""
        if not parse_cpulist(cpus):
            continue  # memory-only node (CXL, a GPU's memory): no ranks run there
        first = parse_cpulist(cpus)[0]
        socket_id = _read_int(os.path.join(sysfs, f"devices/system/cpu/cpu{first}/topology/physical_package_id"), 0)
        mem_kb = 0
        for line in (_read(os.path.join(node_dir, name, "meminfo")) or "").splitlines():
            m = re.search(r"MemTotal:\s+(\d+)\s*kB", line)
            if m:
                mem_kb = int(m.group(1))
        nodes.append(Numa(id=int(name[4:]), cpus=cpus, socket=max(socket_id, 0), memory_GB=round(mem_kb / 2**20, 2)))
    if not nodes:
        online = _read(os.path.join(sysfs, "devices/system/cpu/online")) or ""
        if not parse_cpulist(online):
            online = format_cpulist(range(os.cpu_count() or 1))
        absent["numa"] = f"no NUMA nodes with CPUs under {node_dir}: one node assumed"
        nodes.append(Numa(id=0, cpus=online, socket=0))
    return nodes


# ---- the PCIe tree ---------------------------------------------------------------------------------


@dataclass
class _PciDev:
    bus_id: str
    chain: list[str]  # bus ids from the top of the tree down to this device
    root: str  # the host bridge, "dddd:bb"
    path: str  # sysfs directory
    cls: int = 0
    vendor: str = ""
    numa: int = -1


def _pci_devices(sysfs: str) -> dict[str, _PciDev]:
    """Every PCI function under ``sysfs``, with the chain of bridges above it (from the resolved device path)."""
    base = os.path.join(sysfs, "bus/pci/devices")
    out: dict[str, _PciDev] = {}
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return out
    for name in names:
        path = os.path.realpath(os.path.join(base, name))
        parts = path.split(os.sep)
        root, chain = "", []
        for part in parts:
            m = _ROOT.match(part)
            if m:
                root, chain = f"{m.group(1).lower()}:{m.group(2).lower()}", []
            elif root and normalize_bus_id(part):
                chain.append(normalize_bus_id(part))
        bus_id = normalize_bus_id(name)
        if not bus_id or not chain or chain[-1] != bus_id:
            continue
        out[bus_id] = _PciDev(
            bus_id=bus_id, chain=chain, root=root, path=path,
            cls=_read_int(os.path.join(path, "class"), 0), vendor=(_read(os.path.join(path, "vendor")) or "").lower(),
            numa=_read_int(os.path.join(path, "numa_node"), -1),
        )
    return out


def _link(dev: _PciDev, devices: dict[str, _PciDev]) -> tuple[float, int]:
    """A device's link to its upstream port: the lower of both ends' maximum rate and width (an idle GPU trains
    its link down, so the current rate under-reports), else the current rate."""
    upstream = devices.get(dev.chain[-2]) if len(dev.chain) > 1 else None
    gts = parse_link_speed(_read(os.path.join(dev.path, "max_link_speed")))
    width = _read_int(os.path.join(dev.path, "max_link_width"), 0)
    if upstream is not None:
        up_gts = parse_link_speed(_read(os.path.join(upstream.path, "max_link_speed")))
        up_width = _read_int(os.path.join(upstream.path, "max_link_width"), 0)
        gts = min(gts, up_gts) if gts and up_gts else gts or up_gts
        width = min(width, up_width) if width > 0 and up_width > 0 else max(width, up_width, 0)
    if not gts:
        gts = parse_link_speed(_read(os.path.join(dev.path, "current_link_speed")))
    if width <= 0:
        width = max(_read_int(os.path.join(dev.path, "current_link_width"), 0), 0)
    return gts, width


def _endpoint_kind(dev: _PciDev) -> str:
    if dev.cls >> 16 == 0x03 and dev.vendor == NVIDIA_VENDOR:
        return "gpu"
    if dev.cls >> 16 == 0x02:
        return "nic"
    return "other"


def _pci_tree(devices: dict[str, _PciDev], endpoints: dict[str, str], single_numa: int) -> list[PciNode]:
    """The model's PCIe nodes for ``endpoints`` (bus id -> kind) and what lies above them.

    Like NCCL, each step up skips one bridge: an endpoint's parent is the bridge two levels up (the switch's
    upstream port, past its downstream port), and so on, until the root port, which folds into the host
    bridge. A physical switch is then one node, and two devices under it are PIX apart, as nvidia-smi says.
    """
    nodes: dict[str, PciNode] = {}
    root_numa: dict[str, int] = {}
    for bus_id, kind in sorted(endpoints.items()):
        dev = devices.get(bus_id)
        if dev is None:
            continue
        root = dev.root
        if dev.numa >= 0:
            root_numa.setdefault(root, dev.numa)
        k = len(dev.chain) - 1
        child, child_kind = dev, kind
        while True:
            parent_id = dev.chain[k - 2] if k >= 2 else root
            if child.bus_id not in nodes:
                gts, width = _link(child, devices)
                nodes[child.bus_id] = PciNode(child.bus_id, child_kind, parent_id, gts, width,
                                              child.numa if child_kind != "switch" else -1)
            if k < 2 or dev.chain[k - 2] in nodes:
                break
            k -= 2
            child_kind = "switch"
            child = devices.get(dev.chain[k]) or _PciDev(dev.chain[k], dev.chain[: k + 1], root, path="")
    for root in sorted({d.root for b, d in devices.items() if b in endpoints}):
        nodes[root] = PciNode(root, "root", None, 0.0, 0, root_numa.get(root, single_numa))
    return [nodes[b] for b in sorted(nodes, key=lambda b: (nodes[b].kind != "root", b))]


# ---- NICs ------------------------------------------------------------------------------------------


def _pci_of(link: str) -> str:
    """The PCI bus id at or above what ``link`` (a ``device`` symlink) resolves to; "" if none."""
    target = os.path.realpath(link)
    if not os.path.exists(target):
        return ""
    for part in reversed(target.split(os.sep)):
        bus_id = normalize_bus_id(part)
        if bus_id:
            return bus_id
    return ""


def _ib_rate_Gbps(sysfs: str, ib: str) -> float:
    best = 0.0
    ports = os.path.join(sysfs, "class/infiniband", ib, "ports")
    try:
        names = sorted(os.listdir(ports))
    except OSError:
        return 0.0
    for port in names:
        m = re.match(r"\s*([0-9.]+)\s*Gb/sec", _read(os.path.join(ports, port, "rate")) or "")
        if m:
            best = max(best, float(m.group(1)))
    return best


def _nics(sysfs: str, absent: dict[str, str]) -> list[Nic]:
    ib_by_pci: dict[str, str] = {}
    ib_dir = os.path.join(sysfs, "class/infiniband")
    try:
        ib_names = sorted(os.listdir(ib_dir))
    except OSError:
        ib_names = []
        absent["infiniband"] = f"no {ib_dir} (no RDMA device or driver)"
    for ib in ib_names:
        bus_id = _pci_of(os.path.join(ib_dir, ib, "device"))
        if bus_id:
            ib_by_pci.setdefault(bus_id, ib)
    if ib_names and not ib_by_pci:
        absent["infiniband"] = f"{len(ib_names)} RDMA devices without a PCI device"
    elif "infiniband" not in absent and not ib_names:
        absent["infiniband"] = f"{ib_dir} is empty (no RDMA device)"

    nics: list[Nic] = []
    net_dir = os.path.join(sysfs, "class/net")
    try:
        names = sorted(os.listdir(net_dir))
    except OSError:
        names = []
    used_ib: set[str] = set()
    for name in names:
        link = os.path.join(net_dir, name, "device")
        if name == "lo" or not os.path.lexists(link):
            continue  # loopback and virtual devices (bridges, veth, ifb, bonds) have no device
        bus_id = _pci_of(link)
        speed = _read_int(os.path.join(net_dir, name, "speed"), 0)
        ib = ib_by_pci.get(bus_id, "")
        if ib:
            used_ib.add(ib)
        rate = speed / 1000 if speed > 0 else (_ib_rate_Gbps(sysfs, ib) if ib else 0.0)
        nics.append(Nic(name=name, bus_id=bus_id, speed_Gbps=rate, rdma=bool(ib), ib_device=ib))
    for bus_id, ib in sorted(ib_by_pci.items(), key=lambda kv: kv[1]):
        if ib not in used_ib:  # an InfiniBand port without a netdev (no IPoIB)
            nics.append(Nic(name=ib, bus_id=bus_id, speed_Gbps=_ib_rate_Gbps(sysfs, ib), rdma=True, ib_device=ib))
    if not nics:
        absent["nic"] = f"no network device with a hardware device under {net_dir}"
    return nics


# ---- GPUs through NVML -----------------------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _call(nvml: Any, name: str, *args: Any) -> Any:
    """``nvml.name(*args)``, or None when the binding lacks it or NVML refuses (unsupported, invalid link...)."""
    fn = getattr(nvml, name, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except Exception:  # NVMLError and its subclasses, or a binding without the symbol in the library
        return None


def _gpus(nvml: Any, devices: dict[str, _PciDev], absent: dict[str, str]) -> list[Gpu]:
    if nvml is None:
        try:
            import pynvml as nvml  # type: ignore[import-not-found,no-redef]
        except ImportError:
            absent["nvml"] = "pynvml is not installed (pip install nvidia-ml-py)"
            return []
        except Exception as exc:  # broken install
            absent["nvml"] = f"pynvml fails to import: {type(exc).__name__}: {exc}"
            return []
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded...
        absent["nvml"] = f"nvmlInit failed: {exc or type(exc).__name__}"
        return []
    try:
        return _nvml_gpus(nvml, devices, absent)
    finally:
        _call(nvml, "nvmlShutdown")


def _nvml_gpus(nvml: Any, devices: dict[str, _PciDev], absent: dict[str, str]) -> list[Gpu]:
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except Exception as exc:
        absent["nvml"] = f"nvmlDeviceGetCount failed: {exc or type(exc).__name__}"
        return []
    if count == 0:
        absent["gpu"] = "NVML reports no GPU"
        return []
    max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))
    switch_type = getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    gpu_type = getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_GPU", 0)
    enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
    found: list[tuple[Gpu, Any, float]] = []
    for i in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            bus_id = normalize_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)
        except Exception as exc:
            absent[f"gpu{i}"] = f"NVML cannot open GPU {i}: {exc or type(exc).__name__}"
            continue
        mem = _call(nvml, "nvmlDeviceGetMemoryInfo", handle)
        cc = _call(nvml, "nvmlDeviceGetCudaComputeCapability", handle)
        per_link = nvlink_GBps(int(cc[0]) * 10 + int(cc[1])) if cc else DEFAULT_NVLINK_GBPS
        dev = devices.get(bus_id)
        gpu = Gpu(index=i, bus_id=bus_id, name=_text(_call(nvml, "nvmlDeviceGetName", handle) or ""),
                  numa=dev.numa if dev is not None else -1,
                  memory_GB=round(int(getattr(mem, "total", 0)) / 2**30, 2) if mem is not None else 0.0)
        found.append((gpu, handle, per_link))
    gpu_buses = {g.bus_id for g, _, _ in found}
    for gpu, handle, per_link in found:
        peers: dict[str, int] = {}
        for link in range(max_links):
            if _call(nvml, "nvmlDeviceGetNvLinkState", handle, link) != enabled:
                continue
            info = _call(nvml, "nvmlDeviceGetNvLinkRemotePciInfo_v2", handle, link) or _call(
                nvml, "nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
            remote = normalize_bus_id(info.busId) if info is not None else ""
            kind = _call(nvml, "nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
            if kind == switch_type:
                peer = "nvswitch"
            elif kind == gpu_type or remote in gpu_buses:
                peer = remote
            elif remote in devices and devices[remote].cls >> 8 == 0x0680:  # NVSwitch: a "bridge, other" device
                peer = "nvswitch"
            elif remote and remote not in gpu_buses and remote in devices:
                peer = remote  # a CPU (POWER9) or another NVLink endpoint: a direct link
            else:
                peer = "nvswitch"  # an NVLink to no visible PCI function: the switch fabric
            if peer:
                peers[peer] = peers.get(peer, 0) + 1
        gpu.nvlinks = [NvLink(peer, n, per_link) for peer, n in sorted(peers.items())]
    if not any(g.nvlinks for g, _, _ in found):
        absent["nvlink"] = "no active NVLink"
    return [g for g, _, _ in found]


# ---- the host --------------------------------------------------------------------------------------


def discover(sysfs_root: str = "/sys", nvml: Any = None, hostname: Optional[str] = None) -> Topology:
    """This host's topology: NUMA nodes and CPUs, the PCIe tree, NICs (with RDMA), GPUs and NVLink.

    ``sysfs_root`` replaces ``/sys``; ``nvml`` replaces the ``pynvml`` module (tests pass fakes). Absent
    sources land in ``Host.absent``."""
    absent: dict[str, str] = {}
    numa = _numa_nodes(sysfs_root, absent)
    cpus = {c for n in numa for c in parse_cpulist(n.cpus)}
    if os.path.realpath(sysfs_root) == "/sys" and hasattr(os, "sched_getaffinity"):
        cores = len(cpus & os.sched_getaffinity(0)) or len(os.sched_getaffinity(0))  # what this process may use
    else:
        cores = len(cpus)
    devices = _pci_devices(sysfs_root)
    if not devices:
        absent["pci"] = f"no PCI devices under {os.path.join(sysfs_root, 'bus/pci/devices')}"
    nics = _nics(sysfs_root, absent)
    gpus = _gpus(nvml, devices, absent)
    seen = sum(1 for d in devices.values() if _endpoint_kind(d) == "gpu")
    if "nvml" in absent and seen:
        absent["nvml"] += f" ({seen} NVIDIA GPU{'s' if seen > 1 else ''} on the PCI bus)"
    endpoints = {n.bus_id: "nic" for n in nics if n.bus_id}
    endpoints.update({g.bus_id: "gpu" for g in gpus if g.bus_id})
    single = numa[0].id if len(numa) == 1 else -1
    pci = _pci_tree(devices, endpoints, single)
    for item in [*gpus, *nics]:
        dev = devices.get(item.bus_id)
        if item.numa < 0 and dev is not None:
            item.numa = dev.numa
        if item.numa < 0:
            roots = [p for p in pci if p.bus_id == (dev.root if dev else "")]
            item.numa = roots[0].numa if roots else single
    host = Host(name=hostname or socket.gethostname(), numa=numa, pci=pci, gpus=gpus, nics=nics, cores=cores,
                absent=absent)
    return Topology(hosts=[host], source="discovered")


def load_or_discover(sysfs_root: str = "/sys", nvml: Any = None) -> Topology:
    """The topology ``PYCOLL_TOPO_FILE`` names, else this host's, discovered; written to ``PYCOLL_TOPO_DUMP_FILE``
    when that is set (atomically, so ranks of one host dumping together leave one whole file)."""
    path = TOPO_FILE.get()
    topo = topology_files.load(path) if path else discover(sysfs_root, nvml)
    dump = TOPO_DUMP_FILE.get()
    if dump:
        try:
            topo.dump(dump)
        except OSError as exc:
            log.warning("cannot write the topology to PYCOLL_TOPO_DUMP_FILE=%s: %s", dump, exc)
    return topo


def merge(parts: Sequence[Topology], host_ids: Sequence[str]) -> tuple[Topology, list[int]]:
    """One topology from every rank's own (one host each) and the ranks' host ids (``runtime.host_id()``):
    one Host per distinct id, in order of first rank. Returns it and each rank's host index."""
    if len(parts) != len(host_ids):
        raise ValueError(f"{len(parts)} topologies for {len(host_ids)} host ids")
    index: dict[str, int] = {}
    hosts: list[Host] = []
    names: set[str] = set()
    rank_host = []
    for topo, hid in zip(parts, host_ids):
        if hid not in index:
            if len(topo.hosts) != 1:
                raise ValueError(f"a rank's topology has {len(topo.hosts)} hosts, expected one")
            host = Topology.from_dict(topo.to_dict()).hosts[0]
            base, k = host.name, 1
            while host.name in names:  # virtual hosts (network namespaces) of one machine share its hostname
                host.name, k = f"{base}#{k}", k + 1
            names.add(host.name)
            index[hid] = len(hosts)
            hosts.append(host)
        rank_host.append(index[hid])
    source = parts[0].source if parts else ""
    links: list[HostLink] = []
    memory: list[HostMemory] = []
    for topo in parts:  # measurements, each pair and host once (a file of several hosts gives every rank the same)
        links += [lk for lk in topo.links if not any(have.joins(lk.a, lk.b) for have in links)]
        memory += [m for m in topo.memory if not any(have.host == m.host for have in memory)]
    return Topology(hosts=hosts, source=f"merged from {len(parts)} ranks ({source})", links=links,
                    memory=memory), rank_host
