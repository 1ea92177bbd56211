"""Transports and the per-peer choice among them: the first, in priority order, that both ends enabled and that can connect."""

from __future__ import annotations

from typing import Optional

from .base import Channel, PeerInfo, Transport
from .loopback import LoopbackTransport
from .rdma import RdmaTransport
from .shm import ShmTransport
from .tcp import TcpTransport

__all__ = ["Channel", "PeerInfo", "Transport", "make_transports", "choose"]


def make_transports() -> list[Transport]:
    """Every transport this build has, highest priority first (cuda_ipc will slot in here)."""
    return [LoopbackTransport(), ShmTransport(), RdmaTransport(), TcpTransport()]


def choose(transports: list[Transport], me: PeerInfo, peer: PeerInfo) -> Optional[Transport]:
    """The transport for ``peer``; symmetric because both ends see the same two PeerInfos."""
    for t in transports:
        if t.name in me.transports and t.name in peer.transports and t.can_connect(me, peer):
            return t
    return None
