"""The transport interface: ordered, non-blocking byte channels to one peer each. No collectives here."""

from __future__ import annotations

import abc
import builtins
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..errors import TimeoutError


@dataclass
class PeerInfo:
    """What one rank publishes about itself at start-up."""

    rank: int
    host_id: str  # equal on ranks that share memory (same machine, same network namespace)
    hostname: str
    pid: int
    transports: list[str]  # the transports this rank enabled, in priority order
    addresses: dict[str, Any] = field(default_factory=dict)  # transport name -> its listen address
    device: list = field(default_factory=list)  # [kind, id] of the device it runs on (pycoll.topology.live)
    machine: str = ""  # its machine (boot id, pycoll.machine): equal across the network namespaces of one machine
    cpus: str = ""  # the CPUs it may run on (a Linux cpulist)
    cpu_quota: float = 0.0  # the CPUs its cgroup grants; 0: no limit

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "PeerInfo":
        return cls(**d)


class Channel(abc.ABC):
    """An ordered byte stream to one peer. Every call returns at once; none blocks."""

    kind: str = "?"
    ended: bool = False  # the stream has ended behind bytes still staged (no more will come)

    def __init__(self, peer: int) -> None:
        self.peer = peer  # world rank of the other end

    @abc.abstractmethod
    def send_some(self, data: memoryview) -> int:
        """Accept up to ``len(data)`` bytes (copied out before return); 0 when there is no room."""

    def recv_some(self, out: memoryview) -> int:
        """Copy up to ``len(out)`` received bytes into ``out``; 0 when none have arrived (here: by peek and consume)."""
        got = 0
        while got < len(out):
            view = self.peek()
            if not view:
                break
            n = min(len(view), len(out) - got)
            out[got : got + n] = view[:n]
            self.consume(n)
            got += n
        return got

    @abc.abstractmethod
    def peek(self, want: int = 0) -> memoryview:
        """A zero-copy view of received, unconsumed, contiguous bytes (possibly empty). ``want``: the bytes the
        caller waits for, which a channel that reads on demand (a socket) may read up to; others ignore it."""

    @abc.abstractmethod
    def consume(self, n: int) -> None:
        """Release the first ``n`` bytes that ``peek`` showed."""

    def fileno(self) -> Optional[int]:
        """A descriptor that becomes readable when data arrives, or None if the channel must be polled."""
        return None

    def check_alive(self) -> Optional[str]:
        """None while the peer looks alive, else the reason it is not (called when a wait is idle)."""
        return None

    def has_pending_output(self) -> bool:
        """True while bytes accepted by send_some are still queued inside the channel."""
        return False

    def unsafe_to_exit(self) -> bool:
        """True while bytes already accepted could still be lost if this process exited now."""
        return False

    @abc.abstractmethod
    def close(self) -> None:
        """Tell the peer we are gone and release resources; idempotent."""


Barrier = Callable[[str], None]


class Transport(abc.ABC):
    """Builds channels of one kind. Set-up runs once per process, in three steps driven by the p2p layer."""

    name: str = "?"

    def enabled(self) -> bool:
        """False if this transport is switched off or unusable in this process."""
        return True

    def listen(self, me: PeerInfo, store_host: str) -> Any:
        """Start accepting connections; return the address to publish (JSON-serialisable) or None."""
        return None

    @abc.abstractmethod
    def can_connect(self, me: PeerInfo, peer: PeerInfo) -> bool:
        """Whether this transport can reach ``peer``; must give the same answer on both sides."""

    @abc.abstractmethod
    def connect(
        self, me: PeerInfo, peers: list[PeerInfo], job_id: str, barrier: Barrier, timeout: float
    ) -> dict[int, Channel]:
        """Open a channel to every peer in ``peers`` (all of which chose this transport).

        Every rank calls this for every transport, with a possibly empty list, so that
        ``barrier(name)`` (a job-wide barrier) can be used to order the set-up.
        """

    def close(self) -> None:
        """Release listening sockets and other set-up resources."""


# ---- set-up data exchanged per pair of ranks through the bootstrap store (queue pairs, IPC handles) ----


def publish_pair(store: Any, name: str, me: int, peer: int, value: Any) -> None:
    """Publish ``value`` (JSON) for ``peer`` under ``pycoll/<name>/<me>-<peer>``."""
    store.set(f"pycoll/{name}/{me}-{peer}", json.dumps(value).encode())


def read_pair(store: Any, name: str, me: int, peer: int, deadline: float) -> Any:
    """What ``peer`` published for this rank, waiting until ``deadline`` (monotonic); a TimeoutError names it."""
    try:
        return json.loads(store.get(f"pycoll/{name}/{peer}-{me}", max(deadline - time.monotonic(), 0.0)))
    except builtins.TimeoutError as exc:
        raise TimeoutError(
            f"{name} set-up: rank {peer} did not publish its part in time ({exc})", op="init", rank=me, peers=[peer]
        ) from None
