"""pycoll: collective communication for Python with an MPI-aligned API, over shared memory and TCP."""

from __future__ import annotations

from typing import Optional

from . import errors
from .buffers import IN_PLACE
from .errors import (
    AbortedError,
    CommunicatorBrokenError,
    InvalidArgumentError,
    MismatchError,
    PeerFailureError,
    PeerLostError,
    PeerMismatchError,
    ProtocolError,
    PycollError,
    RemoteError,
    TimeoutError,
)

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("pycoll")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.1.0"

__all__ = [
    "MPI",
    "IN_PLACE",
    "init",
    "finalize",
    "errors",
    "PycollError",
    "InvalidArgumentError",
    "MismatchError",
    "TimeoutError",
    "PeerFailureError",
    "ProtocolError",
    "RemoteError",
    "CommunicatorBrokenError",
    "AbortedError",
    "PeerLostError",
    "PeerMismatchError",
]


def init(timeout: Optional[float] = None):
    """Start pycoll (bootstrap, connect every peer) and return the world communicator."""
    from . import MPI, runtime

    runtime.get_runtime(timeout)
    return MPI.COMM_WORLD


def finalize() -> None:
    """Flush and close every connection; the process may then exit."""
    from . import runtime

    runtime.shutdown()


def __getattr__(name: str):
    if name == "MPI":
        import importlib

        return importlib.import_module(".MPI", __name__)
    raise AttributeError(f"module 'pycoll' has no attribute {name!r}")
