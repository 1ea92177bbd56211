"""mpi4py's Request, Prequest and Grequest (nonblocking calls), Status (what a receive found) and Message (a matched probe)."""

from __future__ import annotations

import time
import traceback
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import numpy as np

from . import datatypes
from .errors import InvalidArgumentError, PycollError, TimeoutError
from .p2p import ANY_SOURCE, ANY_TAG, PROC_NULL, Engine, RecvRequest, Request as _P2PRequest, Schedule

if TYPE_CHECKING:
    from .comm import Comm

UNDEFINED = -32766  # MPI.UNDEFINED (MPICH's value): no index, no rank, no color


def _type_size(datatype: Any, op: str) -> int:
    """Bytes per element of ``datatype`` (None: bytes)."""
    if datatype is None:
        return 1
    get_size = getattr(datatype, "Get_size", None)
    try:
        return int(get_size()) if get_size is not None else datatypes.resolve(datatype).itemsize
    except (TypeError, ValueError, KeyError) as exc:
        raise InvalidArgumentError(f"{datatype!r} is not a datatype ({exc})", op=op) from None


class Status:
    """What a receive or probe found: ``source``, ``tag``, size in bytes (``count``), ``error``, ``cancelled``
    (``MPI.Status``). ``Status()`` is empty (ANY_SOURCE, ANY_TAG, 0 bytes); ``Status(other)`` copies one."""

    __slots__ = ("source", "tag", "nbytes", "error", "cancelled")

    def __init__(self, status: Optional["Status"] = None) -> None:
        if status is None:
            self.source, self.tag, self.nbytes, self.error, self.cancelled = ANY_SOURCE, ANY_TAG, 0, 0, False
        elif isinstance(status, Status):
            self._fill(status)
        else:
            raise TypeError(f"Status() copies a Status; got {type(status).__name__}")

    @classmethod
    def _of(cls, source: int, tag: int, nbytes: int) -> "Status":
        st = cls.__new__(cls)
        st.source, st.tag, st.nbytes, st.error, st.cancelled = source, tag, nbytes, 0, False
        return st

    def _fill(self, other: "Status") -> None:
        self.source, self.tag, self.nbytes, self.error, self.cancelled = (
            other.source, other.tag, other.nbytes, other.error, other.cancelled)

    def Get_source(self) -> int:  # noqa: N802
        return self.source

    def Set_source(self, source: int) -> None:  # noqa: N802
        self.source = source

    def Get_tag(self) -> int:  # noqa: N802
        return self.tag

    def Set_tag(self, tag: int) -> None:  # noqa: N802
        self.tag = tag

    def Get_error(self) -> int:  # noqa: N802
        return self.error

    def Set_error(self, error: int) -> None:  # noqa: N802
        self.error = error

    def Get_count(self, datatype: Any = None) -> int:  # noqa: N802
        """Whole elements of ``datatype`` (default bytes) received; MPI.UNDEFINED if the bytes are not a whole number."""
        size = _type_size(datatype, "Status.Get_count")
        if size == 0:
            return 0
        count, rest = divmod(self.nbytes, size)
        return UNDEFINED if rest else count

    def Get_elements(self, datatype: Any = None) -> int:  # noqa: N802
        return self.Get_count(datatype)

    def Set_elements(self, datatype: Any, count: int) -> None:  # noqa: N802
        """Say that ``count`` elements of ``datatype`` were received."""
        self.nbytes = int(count) * _type_size(datatype, "Status.Set_elements")

    def Is_cancelled(self) -> bool:  # noqa: N802
        return bool(self.cancelled)

    def Set_cancelled(self, flag: bool) -> None:  # noqa: N802
        self.cancelled = bool(flag)

    @property
    def count(self) -> int:
        """Bytes received (``Get_elements(MPI.BYTE)``)."""
        return self.nbytes

    @count.setter
    def count(self, value: int) -> None:
        self.nbytes = int(value)

    def tomemory(self) -> "_StatusWords":
        """The status as MPICH lays it out (count low, count high and cancelled, source, tag, error), writable."""
        return _StatusWords(self)

    def __reduce__(self) -> Any:
        return (_status_of, (self.source, self.tag, self.nbytes, self.error, self.cancelled))

    def __repr__(self) -> str:
        return f"<pycoll.MPI.Status source={self.source} tag={self.tag} count={self.nbytes} error={self.error}>"


def _status_of(source: int, tag: int, nbytes: int, error: int, cancelled: bool) -> Status:
    st = Status._of(source, tag, nbytes)
    st.error, st.cancelled = error, cancelled
    return st


class _StatusWords:
    """``Status.tomemory()``: five integers read from and written through to the status."""

    __slots__ = ("_st",)

    def __init__(self, st: Status) -> None:
        self._st = st

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int) -> int:
        st = self._st
        words = (st.nbytes & 0x7FFFFFFF, (st.nbytes >> 31) << 1 | int(bool(st.cancelled)), st.source, st.tag, st.error)
        return words[i]

    def __setitem__(self, i: int, value: int) -> None:
        st = self._st
        i = range(5)[i]  # negative indices; IndexError past the end
        if i == 0:
            st.nbytes = (st.nbytes & ~0x7FFFFFFF) | (int(value) & 0x7FFFFFFF)
        elif i == 1:
            st.nbytes = (st.nbytes & 0x7FFFFFFF) | (int(value) >> 1) << 31
            st.cancelled = bool(int(value) & 1)
        else:
            setattr(st, ("source", "tag", "error")[i - 2], int(value))

    def __iter__(self) -> Iterator[int]:
        return (self[i] for i in range(5))


_HANDLES: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()  # handle -> request or message


class Request:
    """A nonblocking operation (``MPI.Request``): a running collective schedule, or point-to-point transfers (one,
    or a receive and a send for Isendrecv).

    As in mpi4py, a request is null once completed (by Wait, Test or their many-request forms) or freed: false, and
    equal to ``MPI.REQUEST_NULL``. ``Request()`` makes a null request, ``Request(other)`` a copy equal to ``other``.
    Waiting on a request that already completed returns at once and fills the status the operation had (pycoll's
    torch backend tests first and reads the status after).
    """

    __slots__ = ("_engine", "_comm", "_schedule", "_p2p", "_finish", "_after", "_status", "_result", "_completed",
                 "_active", "_more", "_origin", "__weakref__")
    _persists = False  # a persistent request is inactive once complete, not null

    def __init__(
        self,
        engine: Any = None,
        comm: Optional["Comm"] = None,
        schedule: Optional[Schedule] = None,
        p2p: Optional[_P2PRequest] = None,
        finish: Optional[Callable[[np.ndarray], Any]] = None,
        after: Any = None,
    ) -> None:
        if comm is None and engine is not None:  # mpi4py's Request(request): a copy
            self._copy(engine)
            return
        self._engine: Optional[Engine] = engine
        self._comm = comm
        self._schedule = schedule
        self._p2p = p2p
        self._finish = finish  # turns received bytes into the object of a lowercase irecv
        self._after = after  # a device call's staging (pycoll.cuda.memory.Staged): copies the result back on completion
        # made when asked for after the operation finished (an eager receive keeps its (source, tag, nbytes) till then)
        self._status: Any = None
        self._result: Any = None
        self._more: Optional[tuple[_P2PRequest, ...]] = None  # further transfers the request waits for (Isendrecv)
        self._origin: Optional[Request] = None  # the request this one copies (they compare equal)
        self._active = comm is not None  # not null
        self._completed = not self._active  # the completion was reported (or there is nothing to report)

    def _copy(self, other: Any) -> None:
        if not isinstance(other, Request):
            raise TypeError(f"{type(self).__name__}() copies a Request; got {type(other).__name__}")
        for name in Request.__slots__[:-1]:
            setattr(self, name, getattr(other, name))
        self._origin = other._origin if other._origin is not None else other

    @classmethod
    def completed(cls, status: Optional[Status] = None) -> "Request":
        """An active request whose operation has nothing left to do (one with MPI.PROC_NULL): Wait reports ``status``."""
        req = cls()
        req._active, req._completed, req._status = True, False, status
        return req

    @classmethod
    def _finished(cls, status: Optional[Status]) -> "Request":
        """``completed(status)`` made without the constructor's checks: an eager send or receive that is done."""
        req = _new(_Done)
        req._status, req._active, req._completed = status, True, False
        return req

    @staticmethod
    def _started(engine: Any, comm: "Comm", p2p: _P2PRequest) -> "Request":
        """``Request(engine, comm, p2p=p2p)`` made without the constructor's checks."""
        req = _new(_Pending)
        req._engine, req._comm, req._p2p, req._finish, req._status = engine, comm, p2p, None, None
        req._active, req._completed = True, False
        return req

    @staticmethod
    def _received(source: int, tag: int, nbytes: int) -> "Request":
        """``_finished`` for an eager receive, with its status as (source, tag, nbytes) until one is asked for."""
        req = _new(_Done)
        req._status, req._active, req._completed = (source, tag, nbytes), True, False
        return req

    # ---- identity (mpi4py's handle semantics) -------------------------------------------------
    def _identity(self) -> "Request":
        return self._origin if self._origin is not None else self

    def __bool__(self) -> bool:
        return self._active

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Request):
            return NotImplemented
        if not (self._active and other._active):
            return self._active == other._active  # null equals null only
        return self._identity() is other._identity()

    __hash__ = object.__hash__

    def __reduce__(self) -> Any:
        if self is REQUEST_NULL:
            return "REQUEST_NULL"
        if not self._active:
            return (type(self), ())
        raise ValueError(f"cannot serialize 'pycoll.MPI.{type(self).__name__}' instance: a request is local to its process")

    @property
    def handle(self) -> int:
        """An integer naming the request (0 when null); ``fromhandle`` gives it back while the request lives."""
        if not self._active:
            return 0
        target = self._identity()
        _HANDLES[id(target)] = target
        return id(target)

    @classmethod
    def fromhandle(cls, handle: int) -> "Request":
        if handle == 0:
            return cls()
        target = _HANDLES.get(handle)
        if not isinstance(target, Request):
            raise InvalidArgumentError(f"no live request has handle {handle:#x}", op=f"{cls.__name__}.fromhandle")
        return cls(target)

    def toint(self) -> int:
        return self.handle

    def py2f(self) -> int:
        return self.handle

    @classmethod
    def fromint(cls, arg: int, /) -> "Request":
        return cls.fromhandle(arg)

    @classmethod
    def f2py(cls, arg: int) -> "Request":
        return cls.fromhandle(arg)

    # ---- completion ---------------------------------------------------------------------------
    def _timeout(self) -> float:
        return self._comm.timeout if self._comm is not None else 300.0

    def _expire(self, timeout: float) -> None:
        """For a caller that kept its own deadline of ``timeout`` s and saw it pass: unless the operation completed,
        abort it and raise the TimeoutError a wait of that length raises (naming the ranks it still waits for)."""
        if self._completed or self._done() or self._engine is None:
            return
        owner = self._schedule.owner if self._schedule is not None else self._p2p.owner  # type: ignore[union-attr]
        self._engine._timed_out(owner, timeout, self._parts())

    def _done(self) -> bool:
        if self._schedule is not None:
            return self._schedule.done
        p = self._p2p
        if p is None:
            return True
        if not p.done:
            return False
        more = self._more
        return more is None or all(r.done for r in more)

    def _parts(self) -> tuple:
        """What the engine waits on for this request (for waits on several requests, and their timeout reports)."""
        if self._completed:
            return ()
        if self._schedule is not None:
            return tuple(self._schedule.waiting)
        p = self._p2p
        return () if p is None else (p,) + (self._more or ())

    def _owner(self) -> Any:
        return self._schedule.owner if self._schedule is not None else self._p2p.owner if self._p2p is not None else None

    def _complete(self, status: Optional[Status]) -> Any:
        """Report the finished operation, once: raise its error, fill ``status``, return a lowercase receive's object.
        The request is then null (a persistent one inactive)."""
        self._completed = True
        if not self._persists:
            self._active = False
        sched = self._schedule
        if sched is not None:
            err = sched.error
            after, self._after = self._after, None
            if after is not None:
                if err is None:
                    after.finish()  # the device result is in place (in stream order) when Wait returns
                else:
                    after.discard()
            if err is not None:
                assert self._engine is not None
                if self._comm is not None:
                    self._comm._failed(sched)
                else:
                    self._engine.abort(sched.owner, err)
                raise err
        else:
            p = self._p2p
            if p is not None:
                if p.error is not None:
                    raise p.error
                if self._more is not None:
                    for r in self._more:
                        if r.error is not None:
                            raise r.error
                if type(p) is RecvRequest:
                    if status is not None:  # written straight into the caller's status
                        status.source = self._comm.world_to_comm(p.source) if self._comm else p.source
                        status.tag, status.nbytes, status.cancelled = p.recv_tag, p.nbytes, False
                    if self._finish is not None:
                        assert p.dst is not None
                        return self._finish(p.dst[: p.nbytes])
                    return None
        if status is not None:
            status._fill(self._own_status())
        return self._result

    def _own_status(self) -> Status:
        st = self._status
        if type(st) is tuple:  # an eager receive's (source, tag, nbytes)
            st = self._status = Status._of(*st)
        elif st is None:
            p = self._p2p
            if type(p) is RecvRequest and p.done and p.error is None:
                st = Status._of(self._comm.world_to_comm(p.source) if self._comm else p.source, p.recv_tag, p.nbytes)
            else:
                st = Status()
            self._status = st
        return st

    def Wait(self, status: Optional[Status] = None) -> bool:  # noqa: N802
        """Block until the operation completes (or raise its error, or time out); True."""
        self.wait(status)
        return True

    def wait(self, status: Optional[Status] = None) -> Any:
        """Like Wait; returns the received object for a lowercase ``irecv``."""
        if not self._completed:
            p = self._p2p
            if p is not None:
                if self._more is not None:
                    if not self._done():
                        assert self._engine is not None
                        self._engine.wait_requests((p,) + self._more, self._timeout(), p.owner)
                elif not p.done:
                    self._engine.wait_one(p, self._timeout())  # type: ignore[union-attr]
            elif self._schedule is not None and not self._schedule.done:
                assert self._engine is not None
                self._engine.wait_schedule(self._schedule, self._timeout())
            return self._complete(status)
        if status is not None:
            status._fill(self._own_status())
        return None

    def Test(self, status: Optional[Status] = None) -> bool:  # noqa: N802
        """Make progress without blocking; True (and the status filled) once complete."""
        flag, _ = self.test(status)
        return flag

    def test(self, status: Optional[Status] = None) -> tuple[bool, Any]:
        if not self._completed:
            if not self._done():
                if self._engine is not None:
                    self._engine.progress()
                if not self._done():
                    return False, None
            return True, self._complete(status)
        if status is not None:
            status._fill(self._own_status())
        return True, None

    def Get_status(self, status: Optional[Status] = None) -> bool:  # noqa: N802
        """Whether the operation completed (making progress), without completing the request; fills ``status`` if so."""
        if not self._completed and not self._done():
            if self._engine is not None:
                self._engine.progress()
            if not self._done():
                return False
        if status is not None:
            status._fill(self._own_status())
        return True

    get_status = Get_status

    def Cancel(self) -> None:  # noqa: N802
        """Cancel a receive that no message matched yet (its status then says so). A send is not cancelled: it
        completes as usual (MPI lets a cancel fail); a collective cannot be cancelled."""
        if not self._active:
            raise InvalidArgumentError("Cancel on a null request (it completed, or was freed)", op="Request.Cancel")
        if self._completed:
            return
        if self._schedule is not None:
            raise InvalidArgumentError("a collective operation cannot be cancelled", op="Request.Cancel",
                                       rank=self._comm.rank if self._comm is not None else None)
        p = self._p2p
        if type(p) is RecvRequest and self._more is None and not p.done:
            assert self._engine is not None
            if self._engine.cancel_recv(p):
                st = Status()
                st.cancelled = True
                self._p2p, self._finish, self._status = None, None, st

    cancel = Cancel

    def Free(self) -> None:  # noqa: N802
        """Make the request null; a pending operation still completes in the background (its error is lost)."""
        if not self._active:
            raise InvalidArgumentError("Free on a null request (it completed, or was freed)", op="Request.Free")
        self._active = False
        self._completed = True

    def free(self) -> None:
        """Free the request unless it is null."""
        if self._active:
            self.Free()

    # ---- many requests --------------------------------------------------------------------------
    @staticmethod
    def _pending(requests: Sequence["Request"]) -> list[int]:
        """Indices of the requests whose completion is still to be reported (null and inactive ones are skipped)."""
        try:
            return [i for i, r in enumerate(requests) if not r._completed]
        except AttributeError:
            bad = next(r for r in requests if not isinstance(r, Request))
            raise TypeError(f"expected a sequence of requests; got a {type(bad).__name__}") from None

    @staticmethod
    def _ready(requests: Sequence["Request"], pending: list[int], block: bool) -> list[int]:
        """The pending requests that are done: after one round of progress, or (``block``) once at least one is."""
        done = [i for i in pending if requests[i]._done()]
        if done:
            return done
        first = requests[pending[0]]
        engine = next((requests[i]._engine for i in pending if requests[i]._engine is not None), None)
        if engine is None:
            if block:  # generalized requests only: their creators complete them
                return Grequest._poll(requests, pending)
            return done
        engine.progress()
        done = [i for i in pending if requests[i]._done()]
        if done or not block:
            return done
        owner = next(requests[i]._owner() for i in pending if requests[i]._owner() is not None)
        engine._wait(
            lambda: any(requests[i]._done() for i in pending),
            lambda: sum(s.steps for s in (requests[i]._schedule for i in pending) if s is not None),
            first._timeout(), owner, lambda: [x for i in pending for x in requests[i]._parts()],
        )
        return [i for i in pending if requests[i]._done()]

    @staticmethod
    def _grow(statuses: Any, n: int) -> None:
        """mpi4py lengthens a list of statuses to the number it reports."""
        if isinstance(statuses, list) and len(statuses) < n:
            statuses.extend(Status() for _ in range(n - len(statuses)))

    @staticmethod
    def _complete_each(requests: Sequence["Request"], indices: Sequence[int], statuses: Any) -> list[Any]:
        """Complete ``requests[i]`` for each index (status k into ``statuses[k]``); raise the first error after all."""
        if statuses is not None:
            Request._grow(statuses, len(indices))
        n_st = len(statuses) if statuses is not None else 0
        objs: list[Any] = []
        errors: list[PycollError] = []
        for k, i in enumerate(indices):
            r = requests[i]
            if k >= n_st and r._p2p is None and r._schedule is None and type(r) in _PLAIN and not r._completed:
                r._completed, r._active = True, False  # done when it started (an eager transfer): nothing to report
                objs.append(r._result)
                continue
            try:
                objs.append(r.wait(statuses[k] if k < n_st else None))  # type: ignore[index]
            except PycollError as err:
                errors.append(err)
                objs.append(None)
        if errors:
            raise errors[0]
        return objs

    @staticmethod
    def _wait_compiled(requests: Sequence["Request"]) -> bool:
        """Waitall without statuses over requests of the compiled point-to-point path only (done at their start,
        or one engine request each): one engine wait, then every request completes at once (True). False, with
        nothing completed, for any other request or a failed one (the general path reports it)."""
        pending: Optional[list] = None
        first: Any = None
        for r in requests:
            t = type(r)
            if t is _Done:
                continue
            if t is not _Pending or r._finish is not None:
                return False
            if r._completed:
                continue
            p = r._p2p
            if p is not None and not p.done:
                if pending is None:
                    pending, first = [p], r
                elif r._engine is not first._engine:
                    return False
                else:
                    pending.append(p)
        if pending is not None:
            fast = getattr(first._comm, "_fast", None)
            if fast is not None:  # receives it posted, taken in order as their messages come
                fast.wait_posted(pending)
                pending = [p for p in pending if not p.done]
        if pending:
            first._engine.wait_requests(pending, first._timeout(), pending[0].owner)  # a timeout raises here
            for p in pending:
                if p.error is not None:
                    return False
        for r in requests:
            if type(r) is _Pending and not r._completed and r._p2p is not None and r._p2p.error is not None:
                return False
        for r in requests:
            r._completed = True
            r._active = False
        return True

    @staticmethod
    def _wait_p2p(requests: Sequence["Request"]) -> None:
        """Wait once for every pending point-to-point transfer among ``requests`` (one engine wait, not one each)."""
        pending = []
        first: Optional[Request] = None
        for r in requests:
            p = r._p2p
            if not r._completed and p is not None and not r._done():
                pending.append(p)
                if r._more is not None:
                    pending.extend(r._more)
                if first is None:
                    first = r
        if len(pending) > 1 and first is not None:
            engine = first._engine
            if engine is not None and all(r._engine is engine for r in requests if r._p2p is not None):
                engine.wait_requests(pending, first._timeout(), pending[0].owner)  # a timeout raises here, once

    @classmethod
    def Waitall(cls, requests: Sequence["Request"], statuses: Optional[Sequence[Status]] = None) -> bool:  # noqa: N802
        """Complete every request (raising the first error once all are done); True."""
        cls.waitall(requests, statuses)
        return True

    @classmethod
    def waitall(cls, requests: Sequence["Request"], statuses: Optional[Sequence[Status]] = None) -> list[Any]:
        """Like Waitall; returns each request's object (None but for lowercase receives)."""
        if statuses is None and Request._wait_compiled(requests):
            return [None] * len(requests)
        Request._wait_p2p(requests)
        return Request._complete_each(requests, range(len(requests)), statuses)

    @classmethod
    def Testall(cls, requests: Sequence["Request"], statuses: Optional[Sequence[Status]] = None) -> bool:  # noqa: N802
        """Complete every request if all are done (True); else complete none (False)."""
        flag, _ = cls.testall(requests, statuses)
        return flag

    @classmethod
    def testall(cls, requests: Sequence["Request"], statuses: Optional[Sequence[Status]] = None) -> tuple[bool, Optional[list[Any]]]:
        pending = Request._pending(requests)
        if pending and not all(requests[i]._done() for i in pending):
            engine = next((requests[i]._engine for i in pending if requests[i]._engine is not None), None)
            if engine is not None:
                engine.progress()
            if not all(requests[i]._done() for i in pending):
                if statuses is not None:
                    Request._grow(statuses, len(requests))
                return False, None
        return True, Request._complete_each(requests, range(len(requests)), statuses)

    @classmethod
    def Waitany(cls, requests: Sequence["Request"], status: Optional[Status] = None) -> int:  # noqa: N802
        """Complete one request (blocking until one is done) and return its index; MPI.UNDEFINED if none is active."""
        index, _ = cls.waitany(requests, status)
        return index

    @classmethod
    def waitany(cls, requests: Sequence["Request"], status: Optional[Status] = None) -> tuple[int, Any]:
        pending = Request._pending(requests)
        if not pending:
            if status is not None:
                status._fill(Status())
            return UNDEFINED, None
        i = Request._ready(requests, pending, True)[0]
        return i, requests[i].wait(status)

    @classmethod
    def Testany(cls, requests: Sequence["Request"], status: Optional[Status] = None) -> tuple[int, bool]:  # noqa: N802
        """(index, True) after completing a done request; (UNDEFINED, False) if none is done; (UNDEFINED, True) if none
        is active."""
        index, flag, _ = cls.testany(requests, status)
        return index, flag

    @classmethod
    def testany(cls, requests: Sequence["Request"], status: Optional[Status] = None) -> tuple[int, bool, Any]:
        pending = Request._pending(requests)
        if not pending:
            if status is not None:
                status._fill(Status())
            return UNDEFINED, True, None
        done = Request._ready(requests, pending, False)
        if not done:
            return UNDEFINED, False, None
        return done[0], True, requests[done[0]].wait(status)

    @classmethod
    def Waitsome(cls, requests: Sequence["Request"], statuses: Optional[list[Status]] = None) -> Optional[list[int]]:  # noqa: N802
        """Complete every done request (blocking until one is): their indices; None if none is active."""
        indices, _ = cls.waitsome(requests, statuses)
        return indices

    @classmethod
    def waitsome(cls, requests: Sequence["Request"], statuses: Optional[list[Status]] = None) -> tuple[Optional[list[int]], Optional[list[Any]]]:
        pending = Request._pending(requests)
        if not pending:
            return None, None
        done = Request._ready(requests, pending, True)
        return done, Request._complete_each(requests, done, statuses)

    @classmethod
    def Testsome(cls, requests: Sequence["Request"], statuses: Optional[list[Status]] = None) -> Optional[list[int]]:  # noqa: N802
        """Complete every done request: their indices (maybe none); None if none is active."""
        indices, _ = cls.testsome(requests, statuses)
        return indices

    @classmethod
    def testsome(cls, requests: Sequence["Request"], statuses: Optional[list[Status]] = None) -> tuple[Optional[list[int]], Optional[list[Any]]]:
        pending = Request._pending(requests)
        if not pending:
            return None, None
        done = Request._ready(requests, pending, False)
        return done, Request._complete_each(requests, done, statuses)

    @classmethod
    def Get_status_any(cls, requests: Sequence["Request"], status: Optional[Status] = None) -> tuple[int, bool]:  # noqa: N802
        """Testany without completing anything."""
        pending = Request._pending(requests)
        if not pending:
            if status is not None:
                status._fill(Status())
            return UNDEFINED, True
        done = Request._ready(requests, pending, False)
        if not done:
            return UNDEFINED, False
        requests[done[0]].Get_status(status)
        return done[0], True

    @classmethod
    def Get_status_all(cls, requests: Sequence["Request"], statuses: Optional[list[Status]] = None) -> bool:  # noqa: N802
        """Testall without completing anything."""
        pending = Request._pending(requests)
        if pending and len(Request._ready(requests, pending, False)) < len(pending):
            return False
        if statuses is not None:
            Request._grow(statuses, len(requests))
            for req, st in zip(requests, statuses):
                req.Get_status(st)
        return True

    @classmethod
    def Get_status_some(cls, requests: Sequence["Request"], statuses: Optional[list[Status]] = None) -> Optional[list[int]]:  # noqa: N802
        """Testsome without completing anything."""
        pending = Request._pending(requests)
        if not pending:
            return None
        done = Request._ready(requests, pending, False)
        if statuses is not None:
            Request._grow(statuses, len(done))
            for k, i in enumerate(done[: len(statuses)]):
                requests[i].Get_status(statuses[k])
        return done

    get_status_any = Get_status_any
    get_status_all = Get_status_all
    get_status_some = Get_status_some


class _Done(Request):
    """A request whose operation finished as it started (an eager send, a receive that found its message next in
    the ring): the attributes that only a pending operation sets are the class's, so making one costs three writes."""

    __slots__ = ()
    _engine = _comm = _schedule = _p2p = _finish = _after = _result = _more = _origin = None


class _Pending(Request):
    """A point-to-point request of the compiled path still under way (its engine request in ``_p2p``): what only
    a collective or an Isendrecv sets is the class's."""

    __slots__ = ()
    _schedule = _after = _result = _more = _origin = None


_new = object.__new__
_PLAIN = (Request, _Done, _Pending)


class Prequest(Request):
    """A persistent request (``MPI.Prequest``, from ``Send_init``, ``Recv_init``, ...): each ``Start`` runs its
    operation again; once complete it is inactive (Wait returns at once), not null, until freed."""

    __slots__ = ("_starter",)
    _persists = True

    def __init__(self, request: Optional[Request] = None) -> None:
        self._starter: Optional[Callable[[], Request]] = None
        if request is not None and not isinstance(request, Prequest) and (not isinstance(request, Request) or request._active):
            raise TypeError(f"Prequest() copies a persistent request; got {type(request).__name__}")
        Request.__init__(self, request)
        if isinstance(request, Prequest):
            self._starter = request._starter

    @classmethod
    def _persistent(cls, starter: Callable[[], Request]) -> "Prequest":
        """An inactive persistent request whose ``Start`` runs ``starter`` (a nonblocking call of the same shape)."""
        req = cls()
        req._starter, req._active = starter, True
        return req

    def Start(self) -> None:  # noqa: N802
        """Start the operation (the request must be inactive: never started, or completed)."""
        if not self._active:
            raise InvalidArgumentError("Start on a freed persistent request", op="Prequest.Start")
        if not self._completed:
            raise InvalidArgumentError("Start on a persistent request that is still active (complete it first)",
                                       op="Prequest.Start")
        assert self._starter is not None
        op = self._starter()
        self._engine, self._comm, self._schedule, self._p2p, self._more = op._engine, op._comm, op._schedule, op._p2p, op._more
        self._finish, self._after, self._status, self._result = op._finish, op._after, op._status, None
        self._completed = op._completed

    @classmethod
    def Startall(cls, requests: Sequence["Prequest"]) -> None:  # noqa: N802
        for req in requests:
            req.Start()


class Grequest(Request):
    """A generalized request (``MPI.Grequest``): an operation outside pycoll, complete when its creator calls
    ``Complete``. ``query_fn(status)`` fills the status at completion, ``free_fn()`` runs when it is freed,
    ``cancel_fn(completed)`` on Cancel."""

    __slots__ = ("_query", "_free_fn", "_cancel_fn", "_args", "_kwargs", "_flag")

    def __init__(self, request: Optional[Request] = None) -> None:
        if request is not None and not isinstance(request, Grequest) and (not isinstance(request, Request) or request._active):
            raise TypeError(f"Grequest() copies a generalized request; got {type(request).__name__}")
        Request.__init__(self, request)
        for name in Grequest.__slots__:
            setattr(self, name, getattr(request, name) if isinstance(request, Grequest) else None)

    @classmethod
    def Start(  # noqa: N802
        cls,
        query_fn: Optional[Callable[..., None]] = None,
        free_fn: Optional[Callable[..., None]] = None,
        cancel_fn: Optional[Callable[..., None]] = None,
        args: Optional[tuple] = None,
        kwargs: Optional[dict] = None,
    ) -> "Grequest":
        req = cls()
        req._query, req._free_fn, req._cancel_fn = query_fn, free_fn, cancel_fn
        req._args, req._kwargs = tuple(args or ()), dict(kwargs or {})
        req._flag = _P2PRequest(None, -1, 0, -1)  # type: ignore[arg-type]  # done once completed
        req._p2p, req._active, req._completed = req._flag, True, False
        return req

    def _call(self, fn: Optional[Callable[..., None]], *first: Any) -> None:
        """Run one of the creator's callbacks; what it raises is printed and raised as a pycoll error."""
        if fn is None:
            return
        try:
            fn(*first, *self._args, **self._kwargs)
        except PycollError:
            traceback.print_exc()
            raise
        except Exception as exc:
            traceback.print_exc()
            raise PycollError(f"a generalized request's callback raised {type(exc).__name__}: {exc}", op="Grequest") from exc

    def Complete(self) -> None:  # noqa: N802
        """Say that the operation is done."""
        if self._flag is None or self._flag.done:
            raise InvalidArgumentError("Complete on a generalized request that is not pending", op="Grequest.Complete")
        self._flag.done = True

    def complete(self, obj: Any = None) -> None:
        """Complete, with ``obj`` the result that ``wait`` returns."""
        self._result = obj
        self.Complete()

    def _own_status(self) -> Status:
        if self._status is None:
            st = Status()
            self._call(self._query, st)
            self._status = st
        return self._status

    def _complete(self, status: Optional[Status]) -> Any:
        try:
            st = self._own_status()  # query_fn runs at completion, asked for a status or not
            if status is not None:
                status._fill(st)
            result, self._result = self._result, None
            self._p2p = None
            return result
        finally:
            self._completed, self._active = True, False
            self._call(self._free_fn)

    def wait(self, status: Optional[Status] = None) -> Any:
        if not self._completed and not self._done():
            Grequest._poll([self], [0])
        return Request.wait(self, status)

    @staticmethod
    def _poll(requests: Sequence[Request], pending: list[int], timeout: float = 300.0) -> list[int]:
        """Wait (napping) for another thread to complete one of ``requests``; a TimeoutError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = [i for i in pending if requests[i]._done()]
            if done:
                return done
            time.sleep(0.001)
        raise TimeoutError(f"no generalized request was completed within {timeout:g} s", op="Grequest.Wait")

    def Cancel(self) -> None:  # noqa: N802
        if not self._active:
            raise InvalidArgumentError("Cancel on a null request (it completed, or was freed)", op="Request.Cancel")
        self._call(self._cancel_fn, bool(self._flag is not None and self._flag.done))

    cancel = Cancel

    def Free(self) -> None:  # noqa: N802
        Request.Free(self)
        self._call(self._free_fn)


class Message:
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
        _HANDLES[id(self._found)] = self
        return id(self._found)

    @classmethod
    def fromhandle(cls, handle: int) -> "Message":
        if handle in (0, 1):
            return cls(MESSAGE_NO_PROC if handle else MESSAGE_NULL)
        target = _HANDLES.get(handle)
        if not isinstance(target, Message) or id(target._found) != handle:
            raise InvalidArgumentError(f"no pending message has handle {handle:#x}", op="Message.fromhandle")
        return cls(target)

    def toint(self) -> int:
        return self.handle

    def py2f(self) -> int:
        return self.handle

    @classmethod
    def fromint(cls, arg: int, /) -> "Message":
        return cls.fromhandle(arg)

    @classmethod
    def f2py(cls, arg: int) -> "Message":
        return cls.fromhandle(arg)

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


REQUEST_NULL = Request()
MESSAGE_NULL = Message()
MESSAGE_NO_PROC = Message()
MESSAGE_NO_PROC._noproc = True
