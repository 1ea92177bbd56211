"""Topology: what devices each host has and how they connect (discovery, the model, NCCL XML, dump and load)."""

from __future__ import annotations

from .discover import discover, load_or_discover, merge
from .model import Device, Gpu, Host, HostLink, HostMemory, Nic, Numa, NvLink, Path, PathType, PciNode, Topology, matrix, pcie_GBps
from .rings import DoubleTree, comm_ring, ring_order, trees

__all__ = [
    "Device", "DoubleTree", "Gpu", "Host", "HostLink", "HostMemory", "Nic", "Numa", "NvLink", "Path", "PathType", "PciNode", "Topology",
    "comm_ring", "discover", "load_or_discover", "matrix", "merge", "pcie_GBps", "ring_order", "trees",
]
