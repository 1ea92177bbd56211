"""Rendezvous: find this process's rank and size from its launcher and connect all ranks to one store
(``rendezvous``: the launchers and the job token; ``interfaces``: the local addresses; ``store``: the store's
interface and wire; ``store_server``, ``store_client`` and ``torch_store``: the stores)."""

from __future__ import annotations

from .interfaces import SOCKET_IFNAME, interface_address, ipv4_addresses
from .rendezvous import (
    BootstrapInfo,
    bootstrap,
    detect_launcher,
    from_torch_store,
    job_token,
    publish_all,
    slurm_tasks_on_node,
)
from .store import Store, barrier
from .store_client import TCPStore
from .store_server import TCPStoreServer
from .torch_store import TorchStore

__all__ = [
    "BootstrapInfo",
    "SOCKET_IFNAME",
    "Store",
    "TCPStore",
    "TCPStoreServer",
    "TorchStore",
    "barrier",
    "bootstrap",
    "detect_launcher",
    "from_torch_store",
    "interface_address",
    "ipv4_addresses",
    "job_token",
    "publish_all",
    "slurm_tasks_on_node",
]
