"""RDMA protocol logic with no verbs in it: HCA selection, GID choice, credits, rings and the interface that a
provider implements (registered memory is ``rdma_memory``).

Everything here is plain Python over integers and memoryviews, so it is unit-tested without an RDMA device
and shared by both providers of ``pycoll.transport.rdma`` (pyverbs and the shared-memory fake NIC).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Iterable, NamedTuple, Optional, Sequence

from ..errors import ProtocolError
from .rdma_memory import Region


@dataclasses.dataclass(frozen=True)
class HcaFilter:
    """A parsed PYCOLL_IB_HCA (NCCL_IB_HCA syntax): ``[^][=]name[:port],...``.

    ``^`` excludes the listed devices instead of selecting them; ``=`` makes names match exactly, else a
    name matches every device it is a prefix of (``mlx5`` selects ``mlx5_0`` and ``mlx5_1``).
    An entry without a port covers all of that device's ports. An empty filter allows everything.
    """

    items: tuple[tuple[str, Optional[int]], ...] = ()
    exclude: bool = False
    exact: bool = False

    def _matches(self, name: str, port: int) -> bool:
        for want, want_port in self.items:
            if (name == want if self.exact else name.startswith(want)) and want_port in (None, port):
                return True
        return False

    def allows(self, name: str, port: int) -> bool:
        if not self.items:
            return True
        return self._matches(name, port) != self.exclude

    def rank(self, name: str, port: int) -> int:
        """Position of the first entry that selects (name, port): a selection list is also a preference order."""
        if self.exclude or not self.items:
            return 0
        for i, (want, want_port) in enumerate(self.items):
            if (name == want if self.exact else name.startswith(want)) and want_port in (None, port):
                return i
        return len(self.items)


def parse_hca(spec: str) -> HcaFilter:
    """Parse a PYCOLL_IB_HCA value; raises ValueError naming the bad entry."""
    text = spec.strip()
    exclude = exact = False
    if text.startswith("^"):
        exclude, text = True, text[1:]
    if text.startswith("="):
        exact, text = True, text[1:]
    items = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        name, sep, port = entry.partition(":")
        if not name:
            raise ValueError(f"entry {entry!r} has no device name")
        if sep:
            if not port.isdigit() or int(port) < 1:
                raise ValueError(f"entry {entry!r}: the port must be a number from 1")
            items.append((name, int(port)))
        else:
            items.append((name, None))
    if (exclude or exact) and not items:
        raise ValueError(f"{spec!r} names no device")
    return HcaFilter(tuple(items), exclude, exact)


@dataclasses.dataclass(frozen=True)
class PortInfo:
    """One port of one RDMA device, as a provider reports it."""

    device: str  # e.g. mlx5_0
    port: int
    active: bool
    link_layer: str  # "InfiniBand", "Ethernet" (RoCE) or "fake"
    lid: int = 0
    gid: str = ""  # the GID this port would use (see pick_gid), "" when none
    gid_index: int = -1
    fabric: str = ""  # ports of equal fabric reach each other (same IB subnet, RoCE, or one host's fake NIC)

    @property
    def label(self) -> str:
        return f"{self.device}:{self.port}"


def fabric_of(link_layer: str, gid: str) -> str:
    """The fabric a port is on: InfiniBand ports by subnet prefix (the GID's first 64 bits), RoCE ports as one."""
    if link_layer == "InfiniBand":
        return "ib:" + ":".join(gid.split(":")[:4]) if gid else "ib"
    if link_layer == "Ethernet":
        return "roce"
    return link_layer


def usable_ports(ports: Iterable[PortInfo], hca: HcaFilter) -> list[PortInfo]:
    """Active ports that PYCOLL_IB_HCA allows, in its preference order (then by name and port)."""
    ok = [p for p in ports if p.active and hca.allows(p.device, p.port)]
    return sorted(ok, key=lambda p: (hca.rank(p.device, p.port), p.device, p.port))


def choose_port(ports: Sequence[PortInfo], topo: Any = None, device: Any = None) -> Optional[PortInfo]:
    """The port this rank uses: among ``ports`` (already filtered and ordered), the one whose device the topology
    places nearest to ``device`` (the rank's GPU or NUMA node, a ``topology.model.Device``); without a topology
    that knows these NICs, the first."""
    if not ports:
        return None
    if topo is not None and device is not None:
        try:
            host = topo.hosts[device.host]
            names = {p.device for p in ports}
            nics = [n for n in host.nics if n.rdma and n.ib_device in names]
            if nics:
                hosts = list(topo.hosts)
                hosts[device.host] = dataclasses.replace(host, nics=nics)
                near = type(topo)(hosts=hosts, net_latency_us=topo.net_latency_us).nearest_nic(device)
                if near is not None:
                    return next(p for p in ports if p.device == near.ib_device)
        except (AttributeError, IndexError, KeyError, ValueError, StopIteration):
            pass  # a topology that cannot place this device: keep the preference order
    return ports[0]


def pick_gid(entries: Iterable[tuple[int, str, str]], want: int = -1) -> int:
    """The GID index to use from (index, gid text, type) of a port's table; -1 if none is usable.

    ``want`` >= 0 (PYCOLL_IB_GID_INDEX) is taken as is when the table has it. Otherwise, like NCCL: RoCE v2
    before v1 (routable), an IPv4-mapped address before a link-local one, then the lowest index; an
    InfiniBand port (type "IB") uses index 0. All-zero GIDs are empty slots.
    """
    table = [(i, g.lower(), t) for i, g, t in entries if g and set(g.replace(":", "")) != {"0"}]
    if want >= 0:
        return want if any(i == want for i, _, _ in table) else -1
    if not table:
        return -1

    def score(e: tuple[int, str, str]) -> tuple[int, int, int]:
        i, gid, kind = e
        v2 = 0 if "v2" in kind.lower() else 1
        mapped = 0 if gid.startswith("0000:0000:0000:0000:0000:ffff:") else 1
        return (v2, mapped, i)

    return min(table, key=score)[0]


IMM_MAX = (1 << 31) - 1  # a data write's immediate value is its length; one write carries at most this
# Control cell: three u64 words the peer RDMA-writes into our memory (monotonic totals, so a torn or late
# write never moves them backwards): bytes it consumed from our writes, receives it re-posted, closed flag.
CTRL_CONSUMED, CTRL_REPOSTED, CTRL_CLOSED = 0, 1, 2
CTRL_WORDS = 3
CTRL_BYTES = 64


class Credits:
    """The sender's view of one receive ring: bytes written and receive slots used against what the peer freed.

    A write needs ring space at the current position (writes never wrap: ``writable`` splits at the end) and
    one posted receive at the peer (a write with immediate consumes one). The peer reports its totals of
    bytes consumed and receives re-posted; both only grow.
    """

    def __init__(self, capacity: int, recv_slots: int) -> None:
        if capacity <= 0 or recv_slots <= 0:
            raise ValueError("a ring needs capacity and receive slots")
        self.capacity = capacity
        self.recv_slots = recv_slots
        self.sent = 0  # bytes written in total
        self.acked = 0  # bytes the peer consumed in total
        self.msgs = 0  # writes with immediate posted in total
        self.reposted = 0  # receives the peer re-posted in total

    @property
    def free(self) -> int:
        return self.capacity - (self.sent - self.acked)

    @property
    def slots(self) -> int:
        return self.recv_slots - (self.msgs - self.reposted)

    @property
    def position(self) -> int:
        return self.sent % self.capacity

    def writable(self, want: int, chunk: int) -> int:
        """Bytes the next write may carry: at most ``want`` and ``chunk``, the free space, up to the ring's end."""
        if self.slots <= 0:
            return 0
        return max(0, min(want, chunk, self.free, self.capacity - self.position, IMM_MAX))

    def wrote(self, n: int) -> None:
        if n <= 0 or n > self.free or self.slots <= 0:
            raise ValueError(f"a write of {n} bytes exceeds the credits ({self.free} bytes, {self.slots} slots)")
        self.sent += n
        self.msgs += 1

    def update(self, consumed: int, reposted: int, peer: int) -> bool:
        """Take the peer's totals; True if they freed anything. A total that shrinks or passes what was sent is
        a protocol error (a corrupt control cell)."""
        if consumed == self.acked and reposted == self.reposted:
            return False
        if consumed < self.acked or consumed > self.sent or reposted < self.reposted or reposted > self.msgs + self.recv_slots:
            raise ProtocolError(
                f"RDMA credit update from rank {peer} is inconsistent (consumed {consumed} of {self.sent} bytes "
                f"sent, had {self.acked}; re-posted {reposted}, had {self.reposted})",
                peers=[peer],
            )
        self.acked, self.reposted = consumed, reposted
        return True


class CreditReturn:
    """The receiver's side: when to tell the sender what it freed. Often enough that the sender never stalls
    for long, rarely enough that small messages do not each cost a write."""

    def __init__(self, capacity: int, recv_slots: int) -> None:
        self.capacity = capacity
        self.recv_slots = recv_slots
        self.consumed = 0
        self.reposted = 0
        self._told = (0, 0)

    def due(self, ring_empty: bool) -> bool:
        """A quarter of the ring or of the receive slots freed since the last report, or everything consumed
        and something unreported (the sender may be waiting for exactly that)."""
        bytes_new = self.consumed - self._told[0]
        slots_new = self.reposted - self._told[1]
        if bytes_new == 0 and slots_new == 0:
            return False
        return ring_empty or bytes_new * 4 >= self.capacity or slots_new * 4 >= self.recv_slots

    def told(self) -> tuple[int, int]:
        """Record that the current totals are on their way; returns them."""
        self._told = (self.consumed, self.reposted)
        return self._told


class ByteRing:
    """The receive side of a byte ring that a peer writes into: ``arrived`` advances the tail as writes land."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.capacity = len(view)
        self.tail = 0  # bytes arrived in total
        self.head = 0  # bytes consumed in total

    @property
    def pending(self) -> int:
        return self.tail - self.head

    def arrived(self, n: int, peer: int) -> None:
        if n < 0 or self.pending + n > self.capacity:
            raise ProtocolError(
                f"rank {peer} wrote {n} bytes into an RDMA ring holding {self.pending} of {self.capacity} (credit overrun)",
                peers=[peer],
            )
        self.tail += n

    def peek(self) -> memoryview:
        n = self.pending
        if n == 0:
            return self.view[:0]
        pos = self.head % self.capacity
        return self.view[pos : pos + min(n, self.capacity - pos)]

    def consume(self, n: int) -> None:
        if n < 0 or n > self.pending:
            raise ValueError(f"consume({n}) with {self.pending} bytes pending")
        self.head += n


class Completion(NamedTuple):
    """One work completion: ``recv`` for an arrived write with immediate (``imm`` is its value), else the
    completion of a posted write. ``ok`` False carries the provider's ``status`` text."""

    wr_id: int
    ok: bool
    recv: bool = False
    imm: int = 0
    nbytes: int = 0
    status: str = ""


class Endpoint(abc.ABC):
    """One RC queue pair with its own completion queue."""

    @abc.abstractmethod
    def address(self) -> dict:
        """What the peer needs to connect to this queue pair (JSON-serialisable: QPN, PSN, LID, GID...)."""

    @abc.abstractmethod
    def connect(self, remote: dict) -> None:
        """Take the queue pair to RTR then RTS towards ``remote`` (the peer's ``address()``)."""

    @abc.abstractmethod
    def post_write(self, wr_id: int, src: Region, offset: int, length: int, raddr: int, rkey: int, imm: Optional[int]) -> None:
        """RDMA WRITE ``length`` bytes at ``src.addr + offset`` to ``raddr``; with ``imm``, WRITE WITH IMMEDIATE."""

    @abc.abstractmethod
    def post_recv(self, count: int) -> None:
        """Post ``count`` receives (each absorbs one write with immediate)."""

    @abc.abstractmethod
    def poll(self, max_entries: int) -> list[Completion]:
        """Completions ready now (never blocks)."""

    @abc.abstractmethod
    def error(self) -> Optional[str]:
        """None while the queue pair is usable, else why not (its state is ERR)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Destroy the queue pair and its completion queue; idempotent."""


class Nic(abc.ABC):
    """One opened port: a protection domain, memory registration and queue pairs."""

    port: PortInfo

    @abc.abstractmethod
    def alloc(self, length: int) -> Region:
        """Allocate and register ``length`` bytes that peers may write into (with a view)."""

    @abc.abstractmethod
    def register(self, addr: int, length: int) -> Region:
        """Register existing memory as the source of writes (local read only)."""

    @abc.abstractmethod
    def deregister(self, region: Region) -> None:
        """Undo ``alloc`` or ``register``."""

    @abc.abstractmethod
    def endpoint(self, send_depth: int, recv_depth: int) -> Endpoint:
        """A new RC queue pair able to hold ``send_depth`` posted writes and ``recv_depth`` receives."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the protection domain and the device; idempotent."""


class NoRdma(Exception):
    """This process cannot use RDMA: the reason says why (no pyverbs, no device, no active port)."""


class Provider(abc.ABC):
    """A source of RDMA ports: pyverbs over real devices, or the shared-memory fake NIC."""

    name: str = "?"

    @abc.abstractmethod
    def ports(self) -> list[PortInfo]:
        """Every port of every device; raises NoRdma when there is no device at all."""

    @abc.abstractmethod
    def open(self, port: PortInfo, job_id: str) -> Nic:
        """Open ``port`` for this job."""
