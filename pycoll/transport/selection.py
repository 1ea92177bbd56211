"""The per-peer choice of transport: every transport this build has, in priority order, and for each peer the first
that both ends enabled and that can connect (RDMA's modules loaded only on a host that could use them)."""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from .base import Barrier, Channel, PeerInfo, Transport
from .loopback import LoopbackTransport
from .shm import ShmTransport
from .tcp import TcpTransport

# Where the kernel lists RDMA devices (rdma_verbs.SYSFS_IB).
_SYSFS_IB = "/sys/class/infiniband"


def _no_rdma_here() -> Optional[str]:
    """Why RDMA is off, when that is plain without the RDMA modules: no PYCOLL_IB_* knob set and no device in
    sysfs (the reason RdmaTransport gives then); None when only RdmaTransport itself can tell."""
    if "pycoll.transport.rdma" in sys.modules or any(k.startswith("PYCOLL_IB_") for k in os.environ):
        return None
    try:
        if os.listdir(_SYSFS_IB):
            return None
    except OSError:
        pass
    return f"no RDMA device ({_SYSFS_IB} is empty or missing)"


class _Rdma(Transport):
    """RdmaTransport, imported only when this host could use it: a host with no RDMA device never loads the RDMA
    modules (1,500 lines), and this stand-in is off for the same reason, with the same log line."""

    name = "rdma"

    def __init__(self) -> None:
        self._real: Any = None
        self._off = False
        self.store: Any = None  # the bootstrap store, set by the runtime before connect
        self.reason: Optional[str] = None

    def _transport(self) -> Any:
        if self._real is None:
            from .rdma import RdmaTransport

            self._real = RdmaTransport()
        self._real.store = self.store
        return self._real

    def __getattr__(self, name: str) -> Any:  # port, nic, pool, ... of the real transport
        if name.startswith("__") or name in ("_real", "_off", "store", "reason"):
            raise AttributeError(name)
        return getattr(self._transport(), name)

    def enabled(self) -> bool:
        reason = _no_rdma_here() if self._real is None else None
        if reason is not None:
            import logging

            self._off, self.reason = True, reason
            logging.getLogger("pycoll").info("RDMA transport off: %s; peers use shared memory or TCP", reason)
            return False
        real = self._transport()
        ok = bool(real.enabled())
        self.reason = real.reason
        return ok

    def listen(self, me: PeerInfo, store_host: str) -> Any:
        return None if self._off else self._transport().listen(me, store_host)

    def can_connect(self, me: PeerInfo, peer: PeerInfo) -> bool:
        return False if self._off else bool(self._transport().can_connect(me, peer))

    def connect(self, me: PeerInfo, peers: list[PeerInfo], job_id: str, barrier: Barrier, timeout: float) -> dict[int, Channel]:
        if self._off:  # no rank chose RDMA with us: only the set-up barrier that every rank's RDMA set-up ends with
            barrier("rdma-connected")
            return {}
        return self._transport().connect(me, peers, job_id, barrier, timeout)

    def close(self) -> None:
        if self._real is not None:
            self._real.close()


def make_transports() -> list[Transport]:
    """Every transport this build has, highest priority first (cuda_ipc will slot in here)."""
    return [LoopbackTransport(), ShmTransport(), _Rdma(), TcpTransport()]


def choose(transports: list[Transport], me: PeerInfo, peer: PeerInfo) -> Optional[Transport]:
    """The transport for ``peer``; symmetric because both ends see the same two PeerInfos."""
    for t in transports:
        if t.name in me.transports and t.name in peer.transports and t.can_connect(me, peer):
            return t
    return None
