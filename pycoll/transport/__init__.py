"""Transports: how bytes reach one peer (loopback, shared memory, TCP, RDMA), and the per-peer choice among them
(``selection``)."""

from __future__ import annotations

from typing import Any

from .base import Channel, PeerInfo, Transport
from .selection import choose, make_transports

__all__ = ["Channel", "PeerInfo", "Transport", "make_transports", "choose"]


def __getattr__(name: str) -> Any:
    if name == "RdmaTransport":  # was imported here eagerly
        from .rdma import RdmaTransport

        return RdmaTransport
    raise AttributeError(f"module 'pycoll.transport' has no attribute {name!r}")
