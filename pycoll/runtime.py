"""Process-wide start-up and shutdown: bootstrap, transport choice per peer, channels and the p2p engine."""

from __future__ import annotations

import atexit
import dataclasses
import gc
import ipaddress
import json
import logging
import os
import socket
import threading
from typing import Any, Optional, Sequence

from . import config, machine, memory
from .algorithms import arena_jit, cost, cost_topology
from .algorithms.base import LANES
from .algorithms.cost import CostModel
from .bootstrap.interfaces import ipv4_addresses
from .bootstrap.rendezvous import BootstrapInfo, bootstrap, publish_all
from .bootstrap.store import barrier as store_barrier
from .config import parse_rate
from .errors import InvalidArgumentError
from .p2p import Engine
from .topology import live as topo_live
from .topology.values import format_cpulist, parse_cpulist
from .topology.model import Device, Topology
from .topology.rings import comm_ring
from .transport.base import Channel, PeerInfo
from .transport.selection import choose, make_transports

HOSTID = config.str_param(
    "PYCOLL_HOSTID",
    "",
    "Override the host identity; ranks with equal ids use shared memory. Default: hostname, boot id and network namespace.",
)

GC_FREEZE = config.bool_param(
    "PYCOLL_GC_FREEZE",
    True,
    "Once the runtime is up, move every object the cyclic garbage collector tracks then (mostly the imported modules' "
    "functions and classes) to its permanent generation (gc.freeze): later full collections, and the interpreter's "
    "at exit, skip them. 0 leaves the collector as it was.",
)

LINK_RATE = config.str_param(
    "PYCOLL_LINK_RATE",
    "",
    "The rate of each host's link to the others, in tc's units (1gbit, 10gbit, 125mbps): the cost model's network "
    "bandwidth becomes its TCP payload share, whatever the topology or a tuning file said. `pycoll run --link-rate` "
    "sets it for its ranks. Empty: the NIC speed from sysfs (or the topology file), else the tuned or built-in figure.",
)

log = logging.getLogger("pycoll")


def link_rate_bits(text: str) -> int:
    """Bits per second of a link rate the user gave (tc units); InvalidArgumentError naming PYCOLL_LINK_RATE."""
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise InvalidArgumentError(f"PYCOLL_LINK_RATE: {exc}", op="init") from None


def with_link_rate(model: CostModel, text: str) -> CostModel:
    """``model`` with its network bandwidth from a link rate the user gave (tc units), at TCP's payload share."""
    return dataclasses.replace(model, net_GBps=link_rate_bits(text) / 8e9 * cost_topology.TCP_EFFICIENCY,
                               source=f"{model.source}; links {text.strip()} (PYCOLL_LINK_RATE)")


def _cores_of(peers: Sequence[PeerInfo]) -> int:
    """The cores the processes of one machine share: the CPUs any may run on, capped by their cgroup quota."""
    return machine.cores_for((parse_cpulist(p.cpus) for p in peers if p.cpus), [p.cpu_quota for p in peers])


def _machine_shares(peers: Sequence[PeerInfo]) -> Optional[list[tuple[int, float]]]:
    """Where hosts of the job share one machine (network namespaces of one kernel), each host's (cores, fraction of
    the machine's ranks): its share of the machine by ranks; None where every machine holds one host."""
    machines: dict[str, list[PeerInfo]] = {}
    for p in peers:
        machines.setdefault(p.machine or p.host_id, []).append(p)
    if all(len({p.host_id for p in group}) == 1 for group in machines.values()):
        return None
    shares = []
    for group in machines.values():
        cores = _cores_of(group)
        for hid in {p.host_id for p in group}:
            here = sum(1 for p in group if p.host_id == hid)
            shares.append((max(1, cores * here // len(group)), here / len(group)))
    return shares


def shared_machine_cores(peers: Sequence[PeerInfo]) -> Optional[int]:
    """Where hosts of the job share one machine, the cores the most crowded host gets: its share of the machine's
    cores by ranks; None where every machine holds one host (nothing to correct)."""
    shares = _machine_shares(peers)
    return None if shares is None else min(cores for cores, _ in shares)


def shared_machine_memory(peers: Sequence[PeerInfo]) -> Optional[float]:
    """Where hosts of the job share one machine, the share of its memory's rate that the most crowded host gets (the
    fraction of the machine's ranks it holds: all of them copy at once in a composed call's host steps, which the
    model prices on the largest host); None where every machine holds one host."""
    shares = _machine_shares(peers)
    return None if shares is None else max(fraction for _, fraction in shares)


def host_id() -> str:
    """Ranks share memory only if this matches: same machine (boot id) and same network namespace."""
    override = HOSTID.get()
    if override:
        return override
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        pass
    try:
        parts.append(str(os.stat("/proc/self/ns/net").st_ino))
    except OSError:
        pass
    return "/".join(parts)


def _setup_logging() -> None:
    level = config.DEBUG.get().upper()
    logger = logging.getLogger("pycoll")
    if level in ("WARN", "WARNING") and not logger.handlers:
        logger.setLevel(logging.WARNING)
        return
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("pycoll %(process)d %(levelname)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(getattr(logging, level, logging.INFO))


class Runtime:
    """Everything one process holds for pycoll: its rank, peers, channels and engine."""

    def __init__(self, timeout: Optional[float] = None, info: Optional[BootstrapInfo] = None) -> None:
        _setup_logging()
        memory.keep_freed_memory()  # a fresh array per call then reuses faulted-in memory, as under MPICH
        self.timeout = config.TIMEOUT.get() if timeout is None else timeout
        self.info: BootstrapInfo = bootstrap(self.timeout) if info is None else info
        self.rank, self.size = self.info.rank, self.info.size
        if self.size > 1:  # while the rendezvous below waits for the job's ranks
            arena_jit.prepare_first_calls(self.info.local_size)
        transports = make_transports()
        local = topo_live.local_topology()  # this host's, once per process
        kind, ident = topo_live.own_device(local.hosts[0], self.info.local_rank)
        me = PeerInfo(
            rank=self.rank,
            host_id=host_id(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            transports=[t.name for t in transports if t.enabled()],
            device=[kind, ident],
            machine=machine.machine_id(),
            cpus=format_cpulist(sorted(machine.affinity())),
            cpu_quota=machine.own_cpu_quota(),
        )
        near = self._nearest_nic(local, Device(0, kind, ident))
        for t in transports:
            if t.name == "tcp" and near is not None:
                t.near_address = near  # type: ignore[attr-defined]
            if t.name == "rdma":  # it exchanges queue-pair numbers per pair of ranks through the store
                t.store = self.info.store  # type: ignore[attr-defined]
        for t in transports:
            if t.name in me.transports and self.size > 1:
                addr = t.listen(me, self.info.store_host)
                if addr is not None:
                    me.addresses[t.name] = addr
        rate = LINK_RATE.get().strip()
        if rate:
            link_rate_bits(rate)  # a bad value fails every rank alike, before the exchange
        # The rendezvous is this one exchange: each rank's record, its host's topology (from the ranks that may be
        # first on their host), and rank 0's cost model with the link rate it was given.
        record: dict[str, Any] = {"peer": me.to_json()}
        if self.size > 1 and (self.info.local_rank or 0) == 0:
            record["topology"] = local.to_dict()
        if self.rank == 0 and self.size > 1:
            record["model"] = {"base": cost.load().to_json(), "link_rate": rate}
        records = [json.loads(r) for r in publish_all(self.info, "pycoll/peers", json.dumps(record).encode(), self.timeout)]
        self.peers = [PeerInfo.from_json(r["peer"]) for r in records]
        self.me = self.peers[self.rank]
        # the job's ranks on this machine (network namespaces included) and the cores they share: ranks that
        # outnumber them wait by yielding the core rather than spinning (the same count on every rank)
        on_machine = [p for p in self.peers if (p.machine or p.host_id) == (self.me.machine or self.me.host_id)]
        self.machine_ranks = [p.rank for p in on_machine]
        self.machine_cores = _cores_of(on_machine)
        machine.set_load(len(self.machine_ranks), self.machine_cores)
        by_transport: dict[str, list[PeerInfo]] = {t.name: [] for t in transports}
        for peer in self.peers:
            chosen = choose(transports, self.me, peer)
            if chosen is None:
                raise InvalidArgumentError(
                    f"no transport reaches rank {peer.rank} (this rank enables {me.transports}, it enables {peer.transports})",
                    op="init",
                    rank=self.rank,
                    peers=[peer.rank],
                )
            by_transport[chosen.name].append(peer)
        self.transport_of = {p.rank: name for name, ps in by_transport.items() for p in ps}

        def job_barrier(name: str) -> None:
            if self.info.store is not None:
                store_barrier(self.info.store, f"pycoll/{name}", self.size, self.timeout)

        self.local_ranks = [p.rank for p in self.peers if p.host_id == self.me.host_id]
        if self.size > 1:  # where the launcher did not say how many ranks share this host
            arena_jit.prepare_first_calls(len(self.local_ranks))

        def host_barrier(name: str) -> None:  # shared memory is set up by the ranks of one host among themselves
            local = self.local_ranks
            if self.info.store is not None and len(local) > 1:
                store_barrier(self.info.store, f"pycoll/{name}/{local[0]}", len(local), self.timeout)

        channels: dict[int, Channel] = {}
        self._transports = transports
        for t in transports:
            if t.name != "self" and sum(t.name in p.transports for p in self.peers) < 2:
                continue  # no two ranks offer it (every rank sees the same): no set-up, no barrier
            barrier = host_barrier if t.name == "shm" else job_barrier
            channels.update(t.connect(self.me, by_transport[t.name], self.info.job_id, barrier, self.timeout))
        self.topology, self.placement = self._merge_topology(records)
        self.device: Device = self.placement[self.rank]
        self._rings: dict[tuple[Device, ...], tuple[int, ...]] = {}
        self.engine = Engine(self.rank, channels)
        self.engine.tags_per_call = LANES
        self.engine.kernel_source = arena_jit.p2p_kernels
        self.cost_model = self._agree_on_cost_model(records[0].get("model"))
        self.engine.oversubscribed = machine.oversubscribed()
        self.hosts = len({p.host_id for p in self.peers})
        log.info(
            "rank %d/%d up (launcher %s, %d hosts, on %s %s; topology %s in %.1f ms): %s",
            self.rank,
            self.size,
            self.info.launcher,
            self.hosts,
            self.device.kind,
            self.device.id,
            local.source,
            topo_live.local_seconds() * 1e3,
            ", ".join(f"{r}:{n}" for r, n in sorted(self.transport_of.items())),
        )
        self._closed = False
        atexit.register(self.close)
        if GC_FREEZE.get():
            # the imports' tens of thousands of objects (numpy, torch, pycoll) live as long as the process: a full
            # collection scans them all (about 9 ms with NumPy here, far more with torch), and exit scans them again
            gc.freeze()

    def _nearest_nic(self, local: Topology, device: Device) -> Optional[str]:
        """The IPv4 address of the NIC nearest this rank's device, when its host has several NICs with one and the
        job spans hosts (a store on loopback means one host); the TCP transport listens there unless
        PYCOLL_SOCKET_ADDR or PYCOLL_SOCKET_IFNAME say otherwise."""
        if self.size == 1:
            return None
        try:
            if ipaddress.ip_address(self.info.store_host).is_loopback:
                return None
        except ValueError:
            pass
        host = local.hosts[0]
        choice = topo_live.listen_nic(local, device, ipv4_addresses(n.name for n in host.nics))
        if choice is None:
            return None
        log.info("rank %d on %s %s: TCP prefers NIC %s (%s)", self.rank, device.kind, device.id, *choice)
        return choice[1]

    def _merge_topology(self, records: list[dict[str, Any]]) -> tuple[Topology, list[Device]]:
        """The cluster's topology and placement, the same on every rank: each host's is the one its first rank that
        published one gave (ranks that may be first on their host publish theirs)."""
        tops: dict[str, Topology] = {}
        for peer, record in zip(self.peers, records):
            if peer.host_id in tops or "topology" not in record:
                continue
            try:
                tops[peer.host_id] = Topology.from_dict(record["topology"])
            except (ValueError, KeyError, TypeError) as exc:  # unreadable (a newer format?): host-only for it
                log.warning("topology of rank %d's host unreadable (%s); using a host-only one", peer.rank, exc)
        for hid in {p.host_id for p in self.peers} - set(tops):  # its local ranks named none of them first
            log.warning("no rank of host %s sent its topology; using a host-only one", hid)
        return topo_live.cluster([p.host_id for p in self.peers], [p.device for p in self.peers], tops)

    def ring_of(self, world_ranks: Sequence[int]) -> tuple[int, ...]:
        """The ring a communicator of ``world_ranks`` walks, as indices into them (``comm_ring`` over their
        placement): the same on every rank."""
        devices = tuple(self.placement[w] for w in world_ranks)
        ring = self._rings.get(devices)
        if ring is None:
            ring = self._rings[devices] = tuple(comm_ring(self.topology, devices))
        return ring

    def _agree_on_cost_model(self, from_rank0: Optional[dict[str, Any]]) -> CostModel:
        """Rank 0's cost model on every rank: algorithm choices must be identical everywhere. Rank 0 published its
        loaded constants and link rate in the rendezvous; every rank derives the job's model from them and the
        merged topology, which are the same bytes everywhere, so the models are equal without another exchange."""
        if from_rank0 is None:  # one rank
            model, rate = cost.load(), LINK_RATE.get().strip()
        else:
            model = CostModel.from_json(from_rank0["base"])
            rate = str(from_rank0.get("link_rate", ""))
        if model.source == CostModel().source:  # untuned: the links come from the topology
            model = self._topology_model(model)
        if rate and self.size > 1:  # the user's figure for the links wins
            model = with_link_rate(model, rate)
        shared, memory = shared_machine_cores(self.peers), shared_machine_memory(self.peers)
        if shared is not None and memory is not None:
            model = dataclasses.replace(model, cores=shared, host_memory_GBps=model.host_memory_GBps * memory,
                                        source=f"{model.source}; {shared} core(s) and {memory:.2g} of the memory's "
                                               "rate a host (hosts share a machine)")
        if self.rank != 0:
            model = dataclasses.replace(model, source=f"{model.source} (from rank 0)")
        cost.use(model)
        log.info("cost model: %s", model.source)
        return model

    def _topology_model(self, base: CostModel) -> CostModel:
        """``base`` with its link terms from the job's topology (host buffers: every rank as the CPU nearest its
        device); ``base`` itself where the topology cannot say (a NIC of unknown speed keeps its network)."""
        placement = [d if d.kind == "cpu" else Device(d.host, "cpu", max(self.topology.numa_of(d), 0)) for d in self.placement]
        try:
            return CostModel.from_topology(self.topology, placement, "cpu", base)
        except (ValueError, KeyError, IndexError) as exc:  # a topology the model cannot read: keep the constants
            log.warning("cost model: topology not usable (%s); keeping %s", exc, base.source)
            return base

    def close(self) -> None:
        """Drain queued sends, tell peers we are gone, release segments and sockets."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            self.engine.flush(min(self.timeout, 10.0))
        finally:
            self.engine.close()
            for t in self._transports:
                t.close()
            self.info.close()


_runtime: Optional[Runtime] = None
_lock = threading.Lock()


def get_runtime(timeout: Optional[float] = None, info: Optional[BootstrapInfo] = None) -> Runtime:
    """This process's runtime, started on first use: by the launcher's bootstrap, or from ``info`` when given
    (the torch backend passes the ``torch.distributed`` store it was handed)."""
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = Runtime(timeout, info)
        return _runtime


def current() -> Optional[Runtime]:
    return _runtime


def shutdown() -> None:
    global _runtime
    with _lock:
        if _runtime is not None:
            _runtime.close()
