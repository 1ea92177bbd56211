"""Requests returned by nonblocking calls (Wait/Test/Waitall), and the Status of a receive."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np

from . import datatypes
from .errors import InvalidArgumentError, PycollError
from .p2p import ANY_SOURCE, ANY_TAG, Engine, RecvRequest, Request as _P2PRequest, Schedule

if TYPE_CHECKING:
    from .comm import Comm


class Status:
    """What a receive got: its source, tag and size (``MPI.Status``)."""

    def __init__(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, nbytes: int = 0) -> None:
        self.source = source
        self.tag = tag
        self.nbytes = nbytes
        self.error = 0

    def Get_source(self) -> int:  # noqa: N802
        return self.source

    def Get_tag(self) -> int:  # noqa: N802
        return self.tag

    def Get_error(self) -> int:  # noqa: N802
        return self.error

    def Get_count(self, datatype: Any = None) -> int:  # noqa: N802
        itemsize = 1 if datatype is None else datatypes.resolve(datatype).itemsize
        return self.nbytes // itemsize

    def Get_elements(self, datatype: Any = None) -> int:  # noqa: N802
        return self.Get_count(datatype)

    def _fill(self, other: "Status") -> None:
        self.source, self.tag, self.nbytes = other.source, other.tag, other.nbytes

    @property
    def count(self) -> int:
        return self.nbytes


class Request:
    """A nonblocking operation: a running collective schedule or one point-to-point transfer."""

    __slots__ = ("_engine", "_comm", "_schedule", "_p2p", "_finish", "_after", "_status", "_result", "_completed")

    def __init__(
        self,
        engine: Optional[Engine],
        comm: Optional["Comm"],
        schedule: Optional[Schedule] = None,
        p2p: Optional[_P2PRequest] = None,
        finish: Optional[Callable[[np.ndarray], Any]] = None,
        after: Any = None,
    ) -> None:
        self._engine = engine
        self._comm = comm
        self._schedule = schedule
        self._p2p = p2p
        self._finish = finish  # turns received bytes into the object of a lowercase irecv
        self._after = after  # a device call's staging (pycoll.cuda.memory.Staged): copies the result back on completion
        self._status: Optional[Status] = None  # made when a receive completes (or when asked for)
        self._result: Any = None
        self._completed = schedule is None and p2p is None

    @classmethod
    def completed(cls, status: Optional[Status] = None) -> "Request":
        req = cls(None, None)
        req._status = status
        return req

    def _timeout(self) -> float:
        return self._comm.timeout if self._comm is not None else 300.0

    def _done(self) -> bool:
        if self._schedule is not None:
            return self._schedule.done
        return self._p2p is None or self._p2p.done

    def _complete(self, status: Optional[Status]) -> Any:
        if not self._completed:
            self._completed = True
            if self._schedule is not None:
                err = self._schedule.error
                after, self._after = self._after, None
                if after is not None:
                    if err is None:
                        after.finish()  # the device result is in place (in stream order) when Wait returns
                    else:
                        after.discard()
                if err is not None:
                    assert self._engine is not None
                    if self._comm is not None:
                        self._comm._failed(self._schedule)
                    else:
                        self._engine.abort(self._schedule.owner, err)
                    raise err
            elif self._p2p is not None:
                if self._p2p.error is not None:
                    raise self._p2p.error
                if type(self._p2p) is RecvRequest:
                    p = self._p2p
                    if status is not None:  # written straight into the caller's status
                        status.source = self._comm.world_to_comm(p.source) if self._comm else p.source
                        status.tag, status.nbytes = p.recv_tag, p.nbytes
                    if self._finish is not None:
                        assert p.dst is not None
                        self._result = self._finish(p.dst[: p.nbytes])
                    return self._result
        if status is not None:
            status._fill(self._own_status())
        return self._result

    def _own_status(self) -> Status:
        st = self._status
        if st is None:
            p = self._p2p
            if type(p) is RecvRequest and p.done and p.error is None:
                st = Status(self._comm.world_to_comm(p.source) if self._comm else p.source, p.recv_tag, p.nbytes)
            else:
                st = Status()
            self._status = st
        return st

    def Wait(self, status: Optional[Status] = None) -> None:  # noqa: N802
        """Block until the operation completes (or raise its error, or time out)."""
        self.wait(status)

    def wait(self, status: Optional[Status] = None) -> Any:
        """Like Wait; returns the received object for a lowercase ``irecv``."""
        if not self._completed:
            p = self._p2p
            if p is not None:
                if not p.done:
                    self._engine.wait_one(p, self._timeout())  # type: ignore[union-attr]
            elif not self._done():
                assert self._engine is not None and self._schedule is not None
                self._engine.wait_schedule(self._schedule, self._timeout())
        return self._complete(status)

    def Test(self, status: Optional[Status] = None) -> bool:  # noqa: N802
        """Make progress without blocking; True (and the status filled) once complete."""
        flag, _ = self.test(status)
        return flag

    def test(self, status: Optional[Status] = None) -> tuple[bool, Any]:
        if not self._completed:
            if self._engine is not None:
                self._engine.progress()
            if not self._done():
                return False, None
        return True, self._complete(status)

    def Get_status(self, status: Optional[Status] = None) -> bool:  # noqa: N802
        done = self._completed or self._done()
        if done and status is not None:
            status._fill(self._own_status())
        return done

    def Free(self) -> None:  # noqa: N802
        """Drop the handle; the operation still completes in the background."""

    def Cancel(self) -> None:  # noqa: N802
        raise InvalidArgumentError("cancelling a pycoll request is not supported", op="Request.Cancel")

    @staticmethod
    def Waitall(requests: Sequence["Request"], statuses: Optional[Sequence[Optional[Status]]] = None) -> None:  # noqa: N802
        Request._wait_p2p(requests)
        errors: list[PycollError] = []
        for i, req in enumerate(requests):
            try:
                req.Wait(statuses[i] if statuses is not None else None)
            except PycollError as err:
                errors.append(err)
        if errors:
            raise errors[0]

    @staticmethod
    def _wait_p2p(requests: Sequence["Request"]) -> None:
        """Wait once for every pending point-to-point transfer among ``requests`` (one engine wait, not one each)."""
        pending = [r._p2p for r in requests if not r._completed and r._p2p is not None and not r._p2p.done]
        if len(pending) > 1:
            first = next(r for r in requests if not r._completed and r._p2p is not None and not r._p2p.done)
            engine = first._engine
            if engine is not None and all(r._engine is engine for r in requests if r._p2p is not None):
                engine.wait_requests(pending, first._timeout(), pending[0].owner)  # a timeout raises here, once

    @staticmethod
    def waitall(requests: Sequence["Request"], statuses: Optional[Sequence[Optional[Status]]] = None) -> list[Any]:
        Request._wait_p2p(requests)
        return [req.wait(statuses[i] if statuses is not None else None) for i, req in enumerate(requests)]

    @staticmethod
    def Testall(requests: Sequence["Request"], statuses: Optional[Sequence[Optional[Status]]] = None) -> bool:  # noqa: N802
        for req in requests:
            if req._engine is not None:
                req._engine.progress()
                break
        if not all(req._completed or req._done() for req in requests):
            return False
        Request.Waitall(requests, statuses)
        return True

    @staticmethod
    def Waitany(requests: Sequence["Request"], status: Optional[Status] = None) -> int:  # noqa: N802
        """Index of a request that completed (blocking until one does)."""
        pending = [r for r in requests if not r._completed]
        if not pending:
            return -1  # MPI.UNDEFINED in spirit: nothing left to wait for
        engine = next((r._engine for r in pending if r._engine is not None), None)
        if engine is not None and not any(r._done() for r in pending):
            owner = next((r._schedule.owner if r._schedule else r._p2p.owner) for r in pending if r._engine)  # type: ignore[union-attr]
            engine._wait(lambda: any(r._done() for r in pending), lambda: 0, pending[0]._timeout(), owner, lambda: ())
        for i, req in enumerate(requests):
            if not req._completed and req._done():
                req.Wait(status)
                return i
        return -1  # pragma: no cover
