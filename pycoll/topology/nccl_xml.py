"""Import of NCCL's XML topology format (what ``NCCL_TOPO_DUMP_FILE`` writes and ``NCCL_TOPO_FILE`` reads).

The format, as NCCL documents and dumps it::

    <system version="1">
      <cpu host_hash="0x.." numaid="0" affinity="ffffffff,..." arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="143">
        <pci busid="0000:15:00.0" class="0x060400" link_speed="32.0 GT/s PCIe" link_width="16">
          <pci busid="0000:18:00.0" class="0x030200" link_speed="32.0 GT/s PCIe" link_width="16">
            <gpu dev="0" sm="90" rank="0" gdr="1"><nvlink target="0000:05:00.0" count="18" tclass="0x068000"/></gpu>
          </pci>
          <pci busid="0000:17:00.0" class="0x020700" link_speed="32.0 GT/s PCIe" link_width="16">
            <nic><net name="mlx5_0" dev="0" speed="400000" port="1" guid="0x..." maxconn="131072" gdr="1"/></nic>
          </pci>
        </pci>
      </cpu>
    </system>

A ``<cpu>`` is a NUMA node (its ``affinity`` a hex CPU mask); ``<cpu>`` elements with different ``host_hash``
are different hosts. A ``<pci>`` is a PCIe switch (class 0x0604xx) or an endpoint; its link attributes
describe its link to the element above. An ``<nvlink>``'s ``tclass`` says what it reaches: a GPU (0x03xxxx),
an NVSwitch (0x068000) or a CPU (0x068001). A ``<net>``'s speed is in Mb/s. Each ``<cpu>`` is its own socket
here (NCCL joins CPU nodes by its SYS links), and its PCIe root is named ``numa<id>``.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Optional

from .values import format_cpulist, normalize_bus_id, nvlink_GBps, parse_cpulist, parse_link_speed
from .model import Gpu, Host, Nic, Numa, NvLink, PciNode, Topology

BRIDGE_CLASS = 0x0604
NVSWITCH_CLASS = 0x068000
CPU_CLASS = 0x068001


def _where(elem: ET.Element) -> str:
    attrs = " ".join(f'{k}="{v}"' for k, v in list(elem.attrib.items())[:3])
    return f"<{elem.tag}{' ' + attrs if attrs else ''}>"


def _int(elem: ET.Element, name: str, default: Optional[int] = None, base: int = 0) -> int:
    raw = elem.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise ValueError(f"NCCL topology XML: {_where(elem)} lacks the {name!r} attribute")
        return default
    try:
        return int(raw.strip(), base)
    except ValueError:
        raise ValueError(f"NCCL topology XML: {_where(elem)} has {name}={raw!r}, not an integer") from None


def _hex(elem: ET.Element, name: str) -> int:
    raw = elem.get(name)
    if raw is None:
        raise ValueError(f"NCCL topology XML: {_where(elem)} lacks the {name!r} attribute")
    try:
        return int(raw.strip(), 16)
    except ValueError:
        raise ValueError(f"NCCL topology XML: {_where(elem)} has {name}={raw!r}, not a hex number") from None


def _bus(elem: ET.Element, name: str) -> str:
    raw = elem.get(name)
    bus_id = normalize_bus_id(raw or "")
    if not bus_id:
        raise ValueError(f"NCCL topology XML: {_where(elem)} has {name}={raw!r}, not a PCI bus id (dddd:bb:dd.f)")
    return bus_id


def cpumask_to_cpulist(mask: str) -> str:
    """A Linux cpumap (``ffff0000,0000ffff``: 32-bit words, most significant first) as a cpulist."""
    text = mask.replace(",", "").strip()
    if not text:
        return ""
    bits = int(text, 16)
    return format_cpulist([i for i in range(bits.bit_length()) if bits >> i & 1])


def _socket_GBps(cpu: ET.Element) -> Optional[float]:
    """The inter-socket bandwidth NCCL's tuning assumes for this CPU (GB/s), None if it names no figure."""
    vendor, family, model = cpu.get("vendor", ""), _int(cpu, "familyid", -1), _int(cpu, "modelid", -1)
    if vendor == "GenuineIntel":
        if family == 6 and (model >= 0xCF or model in (0xAD, 0xAE, 0xAF)):
            return 40.0  # Emerald / Granite Rapids
        if family == 6 and model >= 0x8F:
            return 22.0  # Sapphire Rapids
        return 10.0 if family == 6 and model >= 0x55 else 6.0  # Skylake and later, else Broadwell
    if vendor == "AuthenticAMD":
        return {26: 32.0, 0xBF: 32.0, 25: 24.0, 0xAF: 24.0}.get(family, 16.0)  # Zen 5, Zen 3/4, else Zen 1/2
    return None


class _HostBuilder:
    def __init__(self, name: str) -> None:
        self.host = Host(name=name)
        self.cpus: set[int] = set()
        self.nvlinks: list[tuple[Gpu, ET.Element, int]] = []

    def add_cpu(self, cpu: ET.Element) -> None:
        numa = _int(cpu, "numaid")
        if any(n.id == numa for n in self.host.numa):
            raise ValueError(f"NCCL topology XML: two <cpu numaid=\"{numa}\"> on host {self.host.name}")
        try:
            cpulist = cpumask_to_cpulist(cpu.get("affinity", ""))
        except ValueError:
            raise ValueError(f"NCCL topology XML: {_where(cpu)} has affinity={cpu.get('affinity')!r}, not a CPU mask") from None
        self.cpus.update(parse_cpulist(cpulist))
        self.host.numa.append(Numa(id=numa, cpus=cpulist, socket=len(self.host.numa)))
        bw = _socket_GBps(cpu)
        if bw is not None:
            self.host.socket_GBps = bw
        root = f"numa{numa}"
        self.host.pci.append(PciNode(root, "root", None, 0.0, 0, numa))
        for child in cpu:
            if child.tag == "pci":
                self.add_pci(child, root, numa)
            elif child.tag == "nic":  # a NIC NCCL could not place on the PCIe tree: on the CPU itself
                self.add_nic(child, "", numa)

    def add_pci(self, pci: ET.Element, parent: str, numa: int) -> None:
        bus_id = _bus(pci, "busid")
        if self.host.pci_node(bus_id) is not None:
            raise ValueError(f"NCCL topology XML: PCI bus id {bus_id} appears twice on host {self.host.name}")
        cls = _hex(pci, "class")
        gts = parse_link_speed(pci.get("link_speed"))
        width = _int(pci, "link_width", 0)
        gpus, nic = pci.findall("gpu"), pci.find("nic")
        if gpus:
            kind = "gpu"
        elif nic is not None:
            kind = "nic"
        elif cls >> 8 == BRIDGE_CLASS:
            kind = "switch"
        else:
            kind = "other"
        self.host.pci.append(PciNode(bus_id, kind, parent, gts, width, numa if kind != "switch" else -1))
        for g in gpus:
            dev, sm = _int(g, "dev"), _int(g, "sm", 0)
            if any(x.index == dev for x in self.host.gpus):
                raise ValueError(f"NCCL topology XML: two <gpu dev=\"{dev}\"> on host {self.host.name}")
            name = f"sm_{sm}" + (f" ({pci.get('vendor')}:{pci.get('device')})" if pci.get("device") else "")
            gpu = Gpu(index=dev, bus_id=bus_id, name=name, numa=numa)
            self.host.gpus.append(gpu)
            self.nvlinks += [(gpu, link, sm) for link in g.findall("nvlink")]
        if nic is not None:
            self.add_nic(nic, bus_id, numa)
        for child in pci.findall("pci"):
            self.add_pci(child, bus_id, numa)

    def add_nic(self, nic: ET.Element, bus_id: str, numa: int) -> None:
        for net in nic.findall("net"):
            dev = _int(net, "dev")
            name = net.get("name") or f"net{dev}"
            mbps = _int(net, "speed", 0)
            rdma = _int(net, "port", 0) >= 1 or _int(net, "gdr", 0) == 1  # NCCL's socket nets say port 0
            if any(n.name == name for n in self.host.nics):
                raise ValueError(f"NCCL topology XML: two <net name=\"{name}\"> on host {self.host.name}")
            self.host.nics.append(Nic(name=name, bus_id=bus_id, numa=numa, speed_Gbps=max(mbps, 0) / 1000,
                                      rdma=rdma, ib_device=name if rdma else ""))

    def finish(self) -> Host:
        gpu_buses = {g.bus_id for g in self.host.gpus}
        for gpu, link, sm in self.nvlinks:
            count, tclass = _int(link, "count"), _hex(link, "tclass")
            if tclass == NVSWITCH_CLASS:
                peer = "nvswitch"
            elif tclass == CPU_CLASS:
                peer = "cpu"
            elif tclass >> 16 == 0x03:
                peer = _bus(link, "target")
                if peer not in gpu_buses:
                    raise ValueError(f"NCCL topology XML: GPU {gpu.index}'s NVLink targets {peer}, which is no <gpu>")
            else:
                raise ValueError(f"NCCL topology XML: NVLink tclass {link.get('tclass')} is not a GPU, NVSwitch or CPU")
            same = [x for x in gpu.nvlinks if x.peer == peer]
            if same:
                same[0].count += count
            else:
                gpu.nvlinks.append(NvLink(peer, count, nvlink_GBps(sm)))
        self.host.gpus.sort(key=lambda g: g.index)
        self.host.cores = len(self.cpus)
        if not self.host.gpus:
            self.host.absent["gpu"] = "no <gpu> in the XML"
        if not self.host.nics:
            self.host.absent["nic"] = "no <net> in the XML"
        return self.host


def parse(text: str, source: str = "") -> Topology:
    """A Topology from NCCL's XML topology; ValueError names what is malformed."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise ValueError(f"NCCL topology XML is not well-formed: {exc}") from None
    if root.tag != "system":
        raise ValueError(f"NCCL topology XML must have <system> at the top, not <{root.tag}>")
    cpus = root.findall("cpu")
    if not cpus:
        raise ValueError("NCCL topology XML: <system> has no <cpu>")
    builders: dict[str, _HostBuilder] = {}
    for cpu in cpus:
        key = cpu.get("host_hash", "")
        if key not in builders:
            builders[key] = _HostBuilder(f"host{len(builders)}")
        builders[key].add_cpu(cpu)
    return Topology(hosts=[b.finish() for b in builders.values()], source=source or "nccl-xml")
