"""Reference topologies (a DGX-H100-like node, a 4-GPU PCIe box, a 2-socket CPU node, DGX clusters) and their JSON files.

``python -m pycoll.topology.fixtures`` rewrites ``pycoll/topology/fixtures/*.json`` from the builders here;
``load(name)`` reads a committed file. The figures are public spec-sheet ones:

- DGX H100: 2 sockets (Xeon Platinum 8480C, 56 cores and 112 threads each, 1 TiB each), 8 H100 SXM5 80 GB
  on NVSwitch (18 NVLink4 links of 25 GB/s per direction each: 450 GB/s), 8 ConnectX-7 at 400 Gb/s.
  Each socket has 2 PCIe Gen5 x16 switches; each switch holds 2 GPUs and their 2 NICs. The socket link
  is NCCL's figure for Sapphire Rapids (22 GB/s).
- 4-GPU PCIe box: 1 socket (32 cores, 64 threads), 4 L40S (PCIe Gen4 x16, no NVLink) on 2 Gen4 switches
  that interleave them as servers often do (GPU0 and GPU2 on one, GPU1 and GPU3 on the other), a
  100 Gb/s ConnectX-6 on the first switch and a 10 Gb/s on-board port on the root complex.
- 2-socket CPU node: 2 x 32 cores (128 threads), 2 NUMA nodes of 256 GiB, one 100 Gb/s NIC on socket 0.
"""

from __future__ import annotations

import argparse
import os
from importlib import resources
from typing import Callable, Optional

from . import files as topology_files
from .model import Gpu, Host, Nic, Numa, NvLink, PciNode, Topology

GEN4, GEN5 = 16.0, 32.0
H100_NVLINKS, NVLINK4_GBPS = 18, 25.0
NDR_GBPS = 400.0  # ConnectX-7 line rate, Gb/s
SAPPHIRE_RAPIDS_SOCKET_GBPS = 22.0

DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def dgx_h100(name: str = "dgx-h100") -> Topology:
    """A DGX-H100-like node: 8 GPUs on NVSwitch, 8 RDMA NICs, 4 PCIe switches on 2 sockets."""
    # (root, switch, [(gpu index, gpu bus), ...], [(nic name, nic bus), ...], numa) per PCIe switch
    layout = [
        ("0000:14", "0000:15:00.0", [(0, "0000:18:00.0"), (1, "0000:2a:00.0")], [("mlx5_0", "0000:17:00.0"), ("mlx5_1", "0000:29:00.0")], 0),
        ("0000:36", "0000:37:00.0", [(2, "0000:3a:00.0"), (3, "0000:5d:00.0")], [("mlx5_2", "0000:39:00.0"), ("mlx5_3", "0000:5c:00.0")], 0),
        ("0000:96", "0000:97:00.0", [(4, "0000:9a:00.0"), (5, "0000:ab:00.0")], [("mlx5_4", "0000:99:00.0"), ("mlx5_5", "0000:aa:00.0")], 1),
        ("0000:b6", "0000:b7:00.0", [(6, "0000:ba:00.0"), (7, "0000:db:00.0")], [("mlx5_6", "0000:b9:00.0"), ("mlx5_7", "0000:da:00.0")], 1),
    ]
    host = Host(
        name=name, cores=224, socket_GBps=SAPPHIRE_RAPIDS_SOCKET_GBPS,
        numa=[Numa(0, "0-55,112-167", 0, 1024.0), Numa(1, "56-111,168-223", 1, 1024.0)],
    )
    for root, switch, gpus, nics, numa in layout:
        host.pci += [PciNode(root, "root", None, 0.0, 0, numa), PciNode(switch, "switch", root, GEN5, 16)]
        for index, bus in gpus:
            host.pci.append(PciNode(bus, "gpu", switch, GEN5, 16, numa))
            host.gpus.append(Gpu(index, bus, "NVIDIA H100 80GB HBM3", numa, 79.65,
                                 [NvLink("nvswitch", H100_NVLINKS, NVLINK4_GBPS)]))
        for nic, bus in nics:
            host.pci.append(PciNode(bus, "nic", switch, GEN5, 16, numa))
            host.nics.append(Nic(nic, bus, numa, NDR_GBPS, True, nic))
    host.gpus.sort(key=lambda g: g.index)
    host.nics.sort(key=lambda n: n.name)
    return Topology(hosts=[host], source="fixture:dgx-h100")


def pcie_4gpu(name: str = "pcie-4gpu") -> Topology:
    """4 PCIe GPUs without NVLink on 2 switches (GPU0+GPU2, GPU1+GPU3), one socket, an RDMA NIC and an on-board port."""
    host = Host(name=name, cores=64, socket_GBps=24.0, numa=[Numa(0, "0-63", 0, 512.0)],
                absent={"nvlink": "no active NVLink"})
    host.pci += [
        PciNode("0000:40", "root", None, 0.0, 0, 0), PciNode("0000:c0", "root", None, 0.0, 0, 0),
        PciNode("0000:41:00.0", "switch", "0000:40", GEN4, 16), PciNode("0000:c1:00.0", "switch", "0000:c0", GEN4, 16),
    ]
    for index, bus, switch in [(0, "0000:43:00.0", "0000:41:00.0"), (1, "0000:c3:00.0", "0000:c1:00.0"),
                               (2, "0000:44:00.0", "0000:41:00.0"), (3, "0000:c4:00.0", "0000:c1:00.0")]:
        host.pci.append(PciNode(bus, "gpu", switch, GEN4, 16, 0))
        host.gpus.append(Gpu(index, bus, "NVIDIA L40S", 0, 44.99))
    host.pci += [PciNode("0000:45:00.0", "nic", "0000:41:00.0", GEN4, 16, 0), PciNode("0000:c8:00.0", "nic", "0000:c0", 8.0, 4, 0)]
    host.nics += [Nic("ens1f0np0", "0000:45:00.0", 0, 100.0, True, "mlx5_0"), Nic("eno1", "0000:c8:00.0", 0, 10.0, False, "")]
    return Topology(hosts=[host], source="fixture:pcie-4gpu")


def cpu_2socket(name: str = "cpu-2socket") -> Topology:
    """A 2-socket CPU node: 2 NUMA nodes of 32 cores (64 threads) each, one 100 Gb/s NIC on socket 0, no GPU."""
    host = Host(
        name=name, cores=128, socket_GBps=24.0,
        numa=[Numa(0, "0-31,64-95", 0, 256.0), Numa(1, "32-63,96-127", 1, 256.0)],
        pci=[PciNode("0000:00", "root", None, 0.0, 0, 0), PciNode("0000:80", "root", None, 0.0, 0, 1),
             PciNode("0000:17:00.0", "nic", "0000:00", GEN4, 16, 0)],
        nics=[Nic("ens2f0", "0000:17:00.0", 0, 100.0, False, "")],
        absent={"nvml": "no NVIDIA driver (CPU node)", "infiniband": "no RDMA device"},
    )
    return Topology(hosts=[host], source="fixture:cpu-2socket")


def cluster(n: int, node: Optional[Topology] = None) -> Topology:
    """``n`` DGX-H100-like nodes (or copies of ``node``), named dgx0, dgx1..."""
    node = node or dgx_h100()
    topo = Topology.cluster(node, n, name="dgx")
    topo.source = f"fixture:cluster-{n}x-{node.source.removeprefix('fixture:') or 'node'}"
    return topo


BUILDERS: dict[str, Callable[[], Topology]] = {
    "dgx-h100": dgx_h100,
    "pcie-4gpu": pcie_4gpu,
    "cpu-2socket": cpu_2socket,
    "cluster-2x-dgx-h100": lambda: cluster(2),
    "cluster-16x-dgx-h100": lambda: cluster(16),
}


def path(name: str) -> str:
    """The committed JSON file of fixture ``name`` (one of ``BUILDERS``)."""
    if name not in BUILDERS:
        raise KeyError(f"no topology fixture {name!r}; there are {', '.join(BUILDERS)}")
    return str(resources.files("pycoll.topology").joinpath("fixtures", f"{name}.json"))


def load(name: str) -> Topology:
    """A fixture read from its committed JSON file."""
    return topology_files.load(path(name))


def write(directory: str = DIR) -> list[str]:
    """Write every fixture's JSON file into ``directory``; returns the paths."""
    os.makedirs(directory, exist_ok=True)
    out = []
    for name, build in BUILDERS.items():
        target = os.path.join(directory, f"{name}.json")
        build().dump(target)
        out.append(target)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pycoll.topology.fixtures", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=DIR, help="where to write the JSON files (default: the package's)")
    args = parser.parse_args(argv)
    for p in write(args.dir):
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
