"""The topology a running job uses: this host's (found once per process), each rank's device, its NIC, the cluster.

At start-up every rank finds its host's topology (``local_topology``: PYCOLL_TOPO_FILE or discovery, once per
process) and its own device (``own_device``): the GPU it drives, else the NUMA node of its CPU affinity.
The ranks exchange devices and one topology per host; ``cluster`` merges them into the same ``Topology``
and placement (a ``Device`` per world rank) on every rank. Communicators walk ``comm_ring`` over it, and
the TCP transport listens on the NIC ``listen_nic`` picks. None of this raises for a missing source:
what cannot be found falls back to a host-only topology (one CPU device per host).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from typing import Any, Mapping, Optional, Sequence

from ..machine import affinity
from .discover import TOPO_DISCOVER, load_or_discover, merge
from .values import format_cpulist, parse_cpulist
from .model import Device, Host, Numa, Topology

log = logging.getLogger("pycoll.topology")

_local: Optional[Topology] = None
_local_s = 0.0  # seconds the first lookup took
_lock = threading.Lock()


def host_only(name: str, reason: str, cpus: Optional[set[int]] = None) -> Topology:
    """A topology that knows only the host: one NUMA node with ``cpus`` (default: those this process may use), no
    GPU, no NIC."""
    cpus = affinity() if cpus is None else cpus
    host = Host(name=name, numa=[Numa(id=0, cpus=format_cpulist(cpus))], cores=len(cpus), absent={"topology": reason})
    return Topology(hosts=[host], source="host only")


def local_topology() -> Topology:
    """This host's topology, found once per process (later calls return the same object): PYCOLL_TOPO_FILE, else
    discovery; with PYCOLL_TOPO_DISCOVER=0, or if that fails, a host-only one. Always exactly one host."""
    global _local, _local_s
    with _lock:
        if _local is None:
            t0 = time.perf_counter()
            _local = _find_local()
            _local_s = time.perf_counter() - t0
            log.debug("topology of this host (%s) in %.1f ms", _local.source, _local_s * 1e3)
        return _local


def local_seconds() -> float:
    """How long finding this host's topology took (0 before ``local_topology`` ran)."""
    return _local_s


def _find_local() -> Topology:
    name = socket.gethostname()
    if not TOPO_DISCOVER.get():
        return host_only(name, "PYCOLL_TOPO_DISCOVER=0")
    try:
        topo = load_or_discover()
    except Exception as exc:  # an unreadable PYCOLL_TOPO_FILE, a sysfs surprise: degrade, never fail start-up
        log.warning("topology discovery failed (%s: %s); using a host-only topology", type(exc).__name__, exc)
        return host_only(name, f"discovery failed: {type(exc).__name__}: {exc}")
    if len(topo.hosts) == 1:
        return topo
    if not topo.hosts:
        return host_only(name, f"{topo.source or 'the topology'} has no host")
    # a file of several hosts: this host is the one named like it, else the first
    host = next((h for h in topo.hosts if h.name == name), topo.hosts[0])
    log.info("topology %s has %d hosts; this host is %s", topo.source, len(topo.hosts), host.name)
    return Topology(hosts=[host], net_latency_us=topo.net_latency_us, source=topo.source, links=topo.links,
                    memory=topo.memory)


def reset() -> None:
    """Forget this host's topology (tests)."""
    global _local, _local_s
    with _lock:
        _local, _local_s = None, 0.0


# ---- this rank's device ----------------------------------------------------------------------------


def _visible_gpus(raw: str) -> Optional[list[int]]:
    """GPU indices of a CUDA_VISIBLE_DEVICES value; None when it names GPUs otherwise (UUIDs, MIG instances)."""
    out = []
    for item in (x.strip() for x in raw.split(",")):
        if not item:
            continue
        try:
            index = int(item)
        except ValueError:
            return None
        if index < 0:
            break  # CUDA ignores everything from an invalid index on
        out.append(index)
    return out


def own_gpu(host: Host, local_rank: Optional[int], env: Mapping[str, str]) -> Optional[int]:
    """The index (NVML's) of the GPU this rank drives, or None.

    With CUDA_VISIBLE_DEVICES set to indices: the one listed, or the ``local_rank``-th of several (the first
    without a local rank); empty, -1, or UUIDs: none. Unset: GPU ``local_rank`` modulo the host's GPUs when
    the launcher gave a local rank, else none. An index the host does not have: none."""
    if not host.gpus:
        return None
    have = sorted(g.index for g in host.gpus)
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return have[local_rank % len(have)] if local_rank is not None and local_rank >= 0 else None
    visible = _visible_gpus(raw)
    if not visible:
        return None
    index = visible[(local_rank or 0) % len(visible)]
    return index if index in have else None


def numa_of_cpus(host: Host, cpus: set[int]) -> int:
    """The NUMA node that holds most of ``cpus`` (ties: the lowest id); the first node when none does."""
    best, best_n = (host.numa[0].id if host.numa else 0), 0
    for node in sorted(host.numa, key=lambda n: n.id):
        n = len(cpus & set(parse_cpulist(node.cpus)))
        if n > best_n:
            best, best_n = node.id, n
    return best


def own_device(host: Host, local_rank: Optional[int], env: Mapping[str, str] = os.environ,
               cpus: Optional[set[int]] = None) -> tuple[str, Any]:
    """(kind, id) of this rank's device on ``host``: ("gpu", index) from ``own_gpu``, else ("cpu", NUMA node of
    ``cpus``, default this process's CPU affinity)."""
    gpu = own_gpu(host, local_rank, env)
    if gpu is not None:
        return ("gpu", gpu)
    return ("cpu", numa_of_cpus(host, affinity() if cpus is None else cpus))


# ---- the NIC the TCP transport listens on ---------------------------------------------------------


def listen_nic(topo: Topology, device: Device, addresses: Mapping[str, str]) -> Optional[tuple[str, str]]:
    """(NIC name, IPv4 address) nearest ``device`` (``Topology.nearest_nic``) among its host's NICs that have an
    address in ``addresses`` (name -> IPv4), when at least two have one; None otherwise (keep the default)."""
    host = topo.hosts[device.host]
    usable = [n for n in host.nics if addresses.get(n.name)]
    if len(usable) < 2:
        return None
    hosts = list(topo.hosts)
    hosts[device.host] = dataclasses.replace(host, nics=usable)
    nic = Topology(hosts=hosts, net_latency_us=topo.net_latency_us).nearest_nic(device)
    return (nic.name, addresses[nic.name]) if nic is not None else None


# ---- the cluster --------------------------------------------------------------------------------------


def _checked(topo: Topology, d: Device) -> Device:
    """``d`` if its host has it, else a CPU device on that host's first NUMA node."""
    host = topo.hosts[d.host]
    if d.kind == "gpu" and any(g.index == d.id for g in host.gpus):
        return d
    if d.kind == "cpu" and any(n.id == d.id for n in host.numa):
        return d
    return Device(d.host, "cpu", host.numa[0].id if host.numa else 0)


def cluster(host_ids: Sequence[str], devices: Sequence[Sequence[Any]],
            host_topos: Mapping[str, Topology]) -> tuple[Topology, list[Device]]:
    """The merged topology and each rank's Device, from each rank's host id and (kind, id), and one topology per
    host id (a host id without one, or with a device its host lacks, falls back to host-only / a CPU)."""
    parts = []
    for hid in host_ids:
        topo = host_topos.get(hid)
        if topo is None or len(topo.hosts) != 1:
            topo = host_only(hid.split("/")[0] or "host", "no topology from this host", cpus=set())
        parts.append(topo)
    topo, host_of = merge(parts, host_ids)
    placement = []
    for r, dev in enumerate(devices):
        kind, ident = dev if len(dev) == 2 else ("cpu", 0)
        placement.append(_checked(topo, Device(host_of[r], str(kind), ident)))
    return topo, placement
