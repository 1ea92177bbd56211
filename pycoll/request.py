"""mpi4py's Request and its kinds: Prequest (persistent) and Grequest (generalized); a running collective's
schedule or point-to-point transfers behind one handle, and their completion."""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np

from .errors import InvalidArgumentError, PycollError
from .handles import HANDLES, HandleForms
from .p2p import Engine
from .p2p_protocol import RecvRequest, Request as _P2PRequest, Schedule
from .request_sets import RequestSets, poll_generalized
from .status import Status

if TYPE_CHECKING:
    from .comm import Comm


class Request(RequestSets, HandleForms):
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

    @classmethod
    def _received_object(cls, source: int, tag: int, nbytes: int, obj: Any) -> "Request":
        """``_received`` for an object receive (``irecv``): its wait returns ``obj``."""
        req = cls.completed(None)
        req._status, req._result = (source, tag, nbytes), obj
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
        HANDLES[id(target)] = target
        return id(target)

    @classmethod
    def fromhandle(cls, handle: int) -> "Request":
        if handle == 0:
            return cls()
        target = HANDLES.get(handle)
        if not isinstance(target, Request):
            raise InvalidArgumentError(f"no live request has handle {handle:#x}", op=f"{cls.__name__}.fromhandle")
        return cls(target)

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


class GroupRequest(Request):
    """Several point-to-point transfers of one operation as one request (a nonblocking neighborhood collective): done
    once all are; ``then`` runs once they have all succeeded (a packed receive buffer's unpacking). As for any
    collective, its status is empty."""

    __slots__ = ("_then",)

    @classmethod
    def of(cls, comm: Any, requests: Sequence[Request], then: Optional[Callable[[], None]] = None) -> "GroupRequest":
        parts = [p for r in requests for p in r._parts()]
        req = cls(comm._engine, comm, p2p=parts[0] if parts else None)
        req._more = tuple(parts[1:]) if len(parts) > 1 else None
        req._then = then
        return req

    def _complete(self, status: Optional[Status]) -> Any:
        self._completed, self._active = True, False
        for p in (self._p2p,) + (self._more or ()):
            if p is not None and p.error is not None:
                raise p.error
        then, self._then = self._then, None
        if then is not None:
            then()
        if status is not None:
            status._fill(Status())
        return None


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
            poll_generalized([self], [0])
        return Request.wait(self, status)

    def Cancel(self) -> None:  # noqa: N802
        if not self._active:
            raise InvalidArgumentError("Cancel on a null request (it completed, or was freed)", op="Request.Cancel")
        self._call(self._cancel_fn, bool(self._flag is not None and self._flag.done))

    cancel = Cancel

    def Free(self) -> None:  # noqa: N802
        Request.Free(self)
        self._call(self._free_fn)


REQUEST_NULL = Request()
