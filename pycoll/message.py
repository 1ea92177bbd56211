"""mpi4py's Message: a message that a matched probe (Mprobe, Improbe) took, and its receives."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from .errors import InvalidArgumentError
from .handles import HANDLES, HandleForms
from .p2p_protocol import ANY_SOURCE, ANY_TAG, PROC_NULL
from .request import Request
from .status import Status

if TYPE_CHECKING:
    from .comm import Comm


class Message(HandleForms):
    """A message a matched probe took (``MPI.Message``): only its ``Recv``, ``Irecv``, ``recv`` or ``irecv`` receives
    it, after which it is ``MESSAGE_NULL``. ``MESSAGE_NO_PROC`` is the message of a probe of MPI.PROC_NULL."""

    __slots__ = ("_comm", "_found", "_noproc", "__weakref__")

    def __init__(self, message: Optional["Message"] = None) -> None:
        if message is None:
            self._comm, self._found, self._noproc = None, None, False
        elif isinstance(message, Message):
            self._comm, self._found, self._noproc = message._comm, message._found, message._noproc
        else:
            raise TypeError(f"Message() copies a Message; got {type(message).__name__}")

    @classmethod
    def _of(cls, comm: "Comm", found: Any) -> "Message":
        msg = cls()
        msg._comm, msg._found = comm, found
        return msg

    def __bool__(self) -> bool:
        return self._found is not None or self._noproc

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        return self._noproc == other._noproc and self._found is other._found

    __hash__ = object.__hash__

    def __reduce__(self) -> Any:
        if self is MESSAGE_NULL:
            return "MESSAGE_NULL"
        if self is MESSAGE_NO_PROC:
            return "MESSAGE_NO_PROC"
        if self._found is None:
            return (type(self), (MESSAGE_NO_PROC if self._noproc else MESSAGE_NULL,))
        raise ValueError("cannot serialize 'pycoll.MPI.Message' instance: a matched message is local to its process")

    def __repr__(self) -> str:
        what = "MESSAGE_NO_PROC" if self._noproc else "MESSAGE_NULL" if self._found is None else "matched message"
        return f"<pycoll.MPI.Message {what}>"

    @property
    def handle(self) -> int:
        if self._found is None:
            return 1 if self._noproc else 0
        HANDLES[id(self._found)] = self
        return id(self._found)

    @classmethod
    def fromhandle(cls, handle: int) -> "Message":
        if handle in (0, 1):
            return cls(MESSAGE_NO_PROC if handle else MESSAGE_NULL)
        target = HANDLES.get(handle)
        if not isinstance(target, Message) or id(target._found) != handle:
            raise InvalidArgumentError(f"no pending message has handle {handle:#x}", op="Message.fromhandle")
        return cls(target)

    def free(self) -> None:
        """Nothing to free (as in mpi4py)."""

    def _take(self, opname: str) -> tuple[Optional["Comm"], Any]:
        """(communicator, engine message) to receive, and this object becomes MESSAGE_NULL; (None, None) for
        MESSAGE_NO_PROC (the constant itself stays as it is)."""
        if self._noproc:
            if self is not MESSAGE_NO_PROC:
                self._noproc = False
            return None, None
        if self._found is None:
            raise InvalidArgumentError("the message is MPI.MESSAGE_NULL (received already, or never probed)", op=opname)
        comm, found = self._comm, self._found
        self._comm = self._found = None
        return comm, found

    # ---- matched receives -----------------------------------------------------------------------
    def Recv(self, buf: Any, status: Optional[Status] = None) -> None:  # noqa: N802
        comm, found = self._take("Message.Recv")
        if comm is None:
            if status is not None:
                status._fill(Status._of(PROC_NULL, ANY_TAG, 0))
            return
        comm._mrecv(found, buf, status, "Message.Recv")

    def Irecv(self, buf: Any) -> Request:  # noqa: N802
        comm, found = self._take("Message.Irecv")
        if comm is None:
            return Request.completed(Status._of(PROC_NULL, ANY_TAG, 0))
        return comm._imrecv(found, buf, "Message.Irecv")

    def recv(self, status: Optional[Status] = None) -> Any:
        comm, found = self._take("Message.recv")
        if comm is None:
            if status is not None:
                status._fill(Status._of(PROC_NULL, ANY_TAG, 0))
            return None
        return comm._imrecv(found, None, "Message.recv", obj=True).wait(status)

    def irecv(self) -> Request:
        comm, found = self._take("Message.irecv")
        if comm is None:
            return Request.completed(Status._of(PROC_NULL, ANY_TAG, 0))
        return comm._imrecv(found, None, "Message.irecv", obj=True)

    # ---- matched probes ---------------------------------------------------------------------------
    @classmethod
    def Probe(cls, comm: "Comm", source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> "Message":  # noqa: N802
        return comm.Mprobe(source, tag, status)

    @classmethod
    def Iprobe(cls, comm: "Comm", source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> Optional["Message"]:  # noqa: N802
        return comm.Improbe(source, tag, status)

    @classmethod
    def probe(cls, comm: "Comm", source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> "Message":
        return comm.mprobe(source, tag, status)

    @classmethod
    def iprobe(cls, comm: "Comm", source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> Optional["Message"]:
        return comm.improbe(source, tag, status)


MESSAGE_NULL = Message()
MESSAGE_NO_PROC = Message()
MESSAGE_NO_PROC._noproc = True
