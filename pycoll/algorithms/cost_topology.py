"""The cost model's terms taken from a topology (``CostModel.from_topology``): links from the paths between ranks, the
hosts' NICs and measured host pairs, the hosts' measured memory rates, and device constants for GPU ranks;
docs/simulator.md gives every constant's source."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:  # the topology package is imported only when a model is built from one
    from ..topology.model import Device, Topology
    from .cost import CostModel

# The share of a link's signalling rate that carries payload.
NVLINK_EFFICIENCY = 20.6 / 25.0  # NCCL (src/graph/topo.h) rates an SM90 NVLink at 20.6 GB/s of its 25 GB/s (SM80: 20.0)
PCIE_EFFICIENCY = 12.0 / 15.75  # NCCL's PCI_BW: 12 GB/s for a PCIe Gen3 x16 link that signals 15.75 GB/s
RDMA_EFFICIENCY = 4096 / (4096 + 26)  # InfiniBand: a 4 KiB MTU of payload behind LRH 8 + BTH 12 + ICRC 4 + VCRC 2 bytes
TCP_EFFICIENCY = 1448 / 1538  # TCP over Ethernet: 1448 payload bytes (MSS with timestamps) per 1538 bytes of wire time
# Device ranks.
GPU_STEP_US = 2.6  # a kernel's per-step flag handshake: NCCL's Ring/Simple NVLink hop (3.4 us) less the NVSwitch hop (0.8)
GPU_LAUNCH_US = 8.4  # NCCL's base latency of a Ring/Simple call (src/graph/tuning.cc, baseLat)
GPU_CHUNK_BYTES = 512 << 10  # NCCL's Simple protocol step: NCCL_BUFFSIZE 4 MiB over NCCL_STEPS 8
GPU_PCI_GBPS = 12.0  # NCCL's PCI_BW, for GPUs whose path the topology cannot rate
GPU_NET_GBPS = 12.0  # NCCL's NET_BW (100 Gbit/s), for hosts whose NICs the topology does not know
# Memory bandwidth of a GPU (GB/s, the vendors' data sheets), by a substring of its name; the first match wins.
HBM_GBPS = (("H200", 4800.0), ("H100", 3350.0), ("A100", 2039.0), ("V100", 900.0), ("L40", 864.0))
HBM_DEFAULT_GBPS = 2000.0


def _path_efficiency(kind: int) -> float:
    from ..topology.model import PathType

    if kind in (PathType.NVL, PathType.NVS):
        return NVLINK_EFFICIENCY
    if kind in (PathType.PIX, PathType.PXB, PathType.PHB):
        return PCIE_EFFICIENCY
    return 1.0  # the socket link (SYS): the topology gives its figure as a payload rate already


def _neighbours(placement: Sequence["Device"]) -> list[tuple["Device", "Device"]]:
    """Pairs of ranks that follow each other on one host, each host's ranks taken as a ring in rank order."""
    by_host: dict[int, list["Device"]] = {}
    for d in placement:
        by_host.setdefault(d.host, []).append(d)
    pairs = []
    for devs in by_host.values():
        if len(devs) > 1:
            pairs += [(a, b) for a, b in zip(devs, devs[1:] + devs[:1]) if a != b]
    return pairs


def _intra(topo: "Topology", pairs: list[tuple["Device", "Device"]]) -> tuple[Optional[float], Optional[float]]:
    """(GB/s, latency us) of the slowest path between neighbouring ranks, payload rates; None where unknown."""
    seen: dict[tuple, tuple[float, float]] = {}
    for a, b in pairs:
        key = (a.host, a.kind, a.id, b.kind, b.id)
        if key not in seen:
            path = topo.path(a, b)
            seen[key] = (path.GBps * _path_efficiency(path.type), path.latency_us)
    rates = [bw for bw, _ in seen.values() if math.isfinite(bw) and bw > 0]
    lats = [lat for _, lat in seen.values()]
    return (min(rates) if rates else None), (max(lats) if lats else None)


def _host_net_GBps(host: Any, ranks_here: int) -> Optional[float]:
    """Payload GB/s a host's ranks can send off the host: the fastest NICs, at most one per rank (RDMA ones when
    there are any), added up, as NCCL runs a channel per NIC. None when the host names no NIC with a speed."""
    nics = [n for n in host.nics if n.GBps > 0]
    if any(n.rdma for n in nics):
        nics = [n for n in nics if n.rdma]
    if not nics:
        return None
    nics = sorted(nics, key=lambda n: -n.GBps)[: max(1, ranks_here)]
    return sum(n.GBps * (RDMA_EFFICIENCY if n.rdma else TCP_EFFICIENCY) for n in nics)


def _hbm_GBps(topo: "Topology", placement: Sequence["Device"]) -> float:
    names = {topo.hosts[h].gpu(i).name for h, i in {(d.host, d.id) for d in placement}}
    rates = [next((bw for key, bw in HBM_GBPS if key in name.upper()), HBM_DEFAULT_GBPS) for name in names]
    return min(rates, default=HBM_DEFAULT_GBPS)


def _measured_links(topo: "Topology", hosts: Sequence[int], cache_speedup: float,
                    nic_GBps: Optional[float]) -> tuple[Optional[float], Optional[float], Optional[float]]:
    """(GB/s, latency us, socket GB/s) of the slowest measured link between any two of ``hosts``; None when some pair is
    unmeasured (an algorithm's steps may cross any pair, so one unknown pair leaves the figure to the NICs). The socket
    rate is None too where no pair's cores were found to bound it (``tcp_rate``); each link's rate is its wire's as
    ``wire_GBps`` reads it."""
    pairs = [(a, b) for i, a in enumerate(hosts) for b in hosts[i + 1:]]
    links = [topo.link(a, b) for a, b in pairs]
    if not pairs or any(lk is None for lk in links):
        return None, None, None
    return link_terms([lk for lk in links if lk], cache_speedup, nic_GBps)


def link_terms(links: Sequence[Any], cache_speedup: float,
               nic_GBps: Optional[float] = None) -> tuple[float, float, Optional[float]]:
    """(wire GB/s, latency us, socket GB/s) that measured ``links`` give the model: the slowest wire (``wire_GBps``),
    the longest latency, and the slowest socket rate the cores were found to bound (None where none was)."""
    return (min(wire_GBps(lk, cache_speedup, nic_GBps) for lk in links), max(lk.latency_us for lk in links),
            slowest_tcp_rate(links))


def wire_GBps(link: Any, cache_speedup: float, nic_GBps: Optional[float] = None) -> float:
    """The rate of a measured link's wire, as the model prices it beside the cores' socket copies: its one-way reading,
    but where the cores bound that reading (``tcp_rate``), the wire's own rate hid behind them, and it is at least what
    the cores feed a socket with their buffers in cache (``cache_speedup`` times their rate), or the NICs' line rate
    where the hosts name one. The copies then bound the call, cached or not. (Unshaped namespace hosts: 2-rank
    Bcasts of 1 and 4 MiB ran at 5.6 and 6.1 GB/s, priced 1.65x their time at the 3.8 the 16 MiB reading gave.)"""
    cores = tcp_rate(link.GBps, link.both_ways_GBps)
    if cores is None:
        return link.GBps
    return max(link.GBps, nic_GBps if nic_GBps else cores * cache_speedup)


def slowest_tcp_rate(links: Sequence[Any]) -> Optional[float]:
    """The slowest core's socket rate (``tcp_rate``) that any of the measured ``links`` shows; None where none does."""
    bound = [r for r in (tcp_rate(lk.GBps, lk.both_ways_GBps) for lk in links) if r is not None]
    return min(bound) if bound else None


def tcp_rate(one_way_GBps: float, both_ways_GBps: float) -> Optional[float]:
    """A core's rate through a socket (``tcp_GBps``) as a measured link shows it: where both ways at once cross
    clearly slower each than one way alone, the cores' copies bound them and each core did twice each way's bytes;
    None where the link bound both (the cores were faster than it showed) or both ways were not measured."""
    if both_ways_GBps <= 0 or both_ways_GBps > 0.8 * one_way_GBps:
        return None
    return 2 * both_ways_GBps


def model_from_topology(topo: "Topology", placement: Sequence["Device"], kind: str, base: "CostModel") -> "CostModel":
    """``base`` for ranks placed on ``placement`` of ``topo`` (``CostModel.from_topology`` says how)."""
    if kind not in ("gpu", "cpu"):
        raise ValueError(f"rank kind must be 'gpu' or 'cpu', not {kind!r}")
    counts: dict[int, int] = {}
    for d in placement:
        counts[d.host] = counts.get(d.host, 0) + 1
    intra_GBps, intra_us = _intra(topo, _neighbours(placement))
    nets = [_host_net_GBps(topo.hosts[h], n) for h, n in counts.items()] if len(counts) > 1 else []
    net_GBps = min(nets) if nets and all(x is not None for x in nets) else None  # type: ignore[type-var]
    link_GBps, link_us, tcp_GBps = _measured_links(topo, sorted(counts), base.tcp_cache_speedup, net_GBps)
    if link_GBps is not None:  # measured end to end beats the NICs' line rate
        net_GBps = link_GBps
    where = f"topology {topo.source or '(unnamed)'}: {len(placement)} {kind} ranks on {len(counts)} hosts"
    plain = dataclasses.replace(base, corrections=(), residuals=())
    if kind == "gpu":
        hbm = _hbm_GBps(topo, placement)
        from ..topology.model import LATENCY_US, PathType

        return dataclasses.replace(
            plain,
            shm_latency_us=(intra_us if intra_us is not None else LATENCY_US[PathType.NVS]) + GPU_STEP_US,
            shm_GBps=intra_GBps if intra_GBps is not None else GPU_PCI_GBPS,
            net_latency_us=(link_us if link_us is not None else topo.net_latency_us) + GPU_STEP_US,
            net_GBps=net_GBps if net_GBps is not None else GPU_NET_GBPS,
            reduce_GBps=hbm / 3,  # c = a + b reads two bytes and writes one per byte reduced
            copy_GBps=hbm / 2, cma_GBps=hbm / 2, device_GBps=hbm / 2,
            ipc_GBps=intra_GBps if intra_GBps is not None else GPU_PCI_GBPS,
            msg_us=0.0, cores=max(counts.values(), default=1), chunk_bytes=GPU_CHUNK_BYTES,
            fused=True, call_us=GPU_LAUNCH_US, source=where,
        )
    cores = [topo.hosts[h].cores for h in counts if topo.hosts[h].cores > 0]
    memory = topo.memory_rates(sorted(counts))
    if memory is not None:  # the hosts' measured memory, not the built-in machine's (`pycoll tune --hosts`)
        plain = plain.at_memory_speed(*memory)
        where += f"; memory {memory[0]:.3g} GB/s copies, {memory[1]:.3g} reductions (measured)"
    return dataclasses.replace(
        plain,
        shm_GBps=min(base.shm_GBps, intra_GBps) if intra_GBps is not None else base.shm_GBps,
        net_GBps=net_GBps if net_GBps is not None else base.net_GBps,
        net_latency_us=link_us if link_us is not None else base.net_latency_us,
        tcp_GBps=tcp_GBps if tcp_GBps is not None else base.tcp_GBps,
        cores=min(cores) if cores else base.cores,
        source=where,
    )
