"""The pycoll exception hierarchy: every error names the operation, the ranks and the cause."""

from __future__ import annotations

import builtins
from typing import Iterable, Optional


class PycollError(Exception):
    """Base class of every error pycoll raises (also available as ``MPI.Exception``).

    Attributes:
        op: the operation, e.g. ``"Allreduce #12"``.
        rank: the rank that raised, in the communicator of the operation (None if unknown).
        peers: the other ranks involved in the cause.
        cause: a short sentence saying what went wrong.
    """

    def __init__(
        self,
        cause: str,
        *,
        op: Optional[str] = None,
        rank: Optional[int] = None,
        peers: Iterable[int] = (),
    ) -> None:
        self.cause = cause
        self.op = op
        self.rank = rank
        self.peers = tuple(peers)
        super().__init__(self._format())

    def _format(self) -> str:
        where = []
        if self.op:
            where.append(self.op)
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.peers:
            label = "peer" if len(self.peers) == 1 else "peers"
            where.append(f"{label} {', '.join(str(p) for p in self.peers)}")
        prefix = f"[{'; '.join(where)}] " if where else ""
        return prefix + self.cause

    def __reduce__(self):  # keep the keyword fields across pickling
        return (_rebuild, (type(self), self.cause, self.op, self.rank, self.peers))

    ERROR_CLASS = 15  # MPI_ERR_OTHER (MPICH's value); subclasses that map to a narrower MPI error class override it

    def Get_error_class(self) -> int:  # noqa: N802 - mpi4py name
        return self.ERROR_CLASS

    def Get_error_string(self) -> str:  # noqa: N802 - mpi4py name
        return str(self)


def _rebuild(cls, cause, op, rank, peers):
    return cls(cause, op=op, rank=rank, peers=peers)


class InvalidArgumentError(PycollError, ValueError):
    """A call's arguments are wrong on this rank: dtype, count, buffer, root, op. Nothing was sent."""

    ERROR_CLASS = 12  # MPI_ERR_ARG


class InvalidRootError(InvalidArgumentError):
    """A root that is not a rank of the communicator."""

    ERROR_CLASS = 7  # MPI_ERR_ROOT


class MismatchError(InvalidArgumentError):
    """Ranks called different collectives, or the same one with different arguments."""


class TimeoutError(PycollError, builtins.TimeoutError):  # noqa: A001 - deliberate name
    """A wait lasted longer than the communicator's timeout."""


class PeerFailureError(PycollError, ConnectionError):
    """A peer process died, closed its connection, or sent a malformed message."""


class ProtocolError(PeerFailureError):
    """A message from a peer did not follow pycoll's wire format."""


class DeviceError(PycollError):
    """A CUDA operation failed on this rank: a copy, a kernel launch, or mapping a peer's memory (CUDA IPC)."""


class RemoteError(PycollError):
    """Another rank failed inside this operation and aborted it; the cause is that rank's error."""


class CommunicatorBrokenError(PycollError):
    """An earlier failure left this communicator unusable; create a new one."""


class PeerLostError(RemoteError, PeerFailureError):
    """Another rank saw a peer die inside this operation and aborted it; ``peers`` names the dead rank."""


class CommunicatorLostError(PeerLostError, CommunicatorBrokenError):
    """A call on a communicator that a peer's death broke earlier; ``peers`` names the dead rank."""


class PeerMismatchError(RemoteError, MismatchError):
    """Another rank found that ranks called different collectives (or different arguments) in this operation."""


class AbortedError(CommunicatorBrokenError):
    """``Comm.Abort`` tore the communicator down (on this rank, from any thread) while this call waited."""


class NotProvidedError(PycollError, NotImplementedError):
    """An MPI feature pycoll does not provide (intercommunicators, one-sided windows, MPI-IO, dynamic processes).

    A NotImplementedError, as mpi4py raises for a call its MPI lacks: mpi4py's tests, and programs written
    like them, catch that to skip the feature.
    """

    def Get_error_class(self) -> int:  # noqa: N802 - mpi4py name
        return 44  # MPI_ERR_UNSUPPORTED_OPERATION (MPICH's value)


class InfoError(InvalidArgumentError):
    """A call on an ``MPI.Info`` was refused: the Info is null or freed, or predefined and read-only."""

    ERROR_CLASS = 28  # MPI_ERR_INFO (MPICH's value)

    def Get_error_class(self) -> int:  # noqa: N802 - mpi4py name
        return self.ERROR_CLASS


class InfoKeyError(InfoError):
    """An Info key that is not a non-empty string of at most ``MPI.MAX_INFO_KEY`` characters, or an index
    past the last key (``Get_nthkey``)."""

    ERROR_CLASS = 29  # MPI_ERR_INFO_KEY


class InfoValueError(InfoError):
    """An Info value that is not a string of at most ``MPI.MAX_INFO_VAL`` characters."""

    ERROR_CLASS = 30  # MPI_ERR_INFO_VALUE


class InfoNoKeyError(InfoError):
    """``Info.Delete`` of a key the Info does not hold."""

    ERROR_CLASS = 31  # MPI_ERR_INFO_NOKEY
