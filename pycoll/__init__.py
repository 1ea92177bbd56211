"""pycoll: collective communication for Python with an MPI-aligned API, over shared memory and TCP."""

from __future__ import annotations

from typing import Optional

from . import errors
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
    # Lazy: `import pycoll` (the launcher, the CLI) must not pull in NumPy or importlib.metadata.
    if name == "MPI":
        import importlib

        return importlib.import_module(".MPI", __name__)
    if name == "IN_PLACE":
        from .buffers import IN_PLACE

        return IN_PLACE
    if name == "__version__":
        from .version import version

        value = globals()["__version__"] = version()
        return value
    raise AttributeError(f"module 'pycoll' has no attribute {name!r}")
