"""mpi4py's calls on many requests at once (Waitall, Testany, Waitsome, Get_status_all...), which
``request.Request`` inherits: finding the pending ones, one wait for all of them, completing each."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

from .errors import TimeoutError
from .status import UNDEFINED, Status

if TYPE_CHECKING:
    from .request import Request


def poll_generalized(requests: Sequence[Any], pending: list[int], timeout: float = 300.0) -> list[int]:
    """Wait (napping) for another thread to complete one of ``requests``; a TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [i for i in pending if requests[i]._done()]
        if done:
            return done
        time.sleep(0.001)
    raise TimeoutError(f"no generalized request was completed within {timeout:g} s", op="Grequest.Wait")


class RequestSets:
    """The many-request classmethods of ``Request``; single-request completion is the request's own."""

    __slots__ = ()

    @staticmethod
    def _pending(requests: Sequence["Request"]) -> list[int]:
        """Indices of the requests whose completion is still to be reported (null and inactive ones are skipped)."""
        try:
            return [i for i, r in enumerate(requests) if not r._completed]
        except AttributeError:
            bad = next(r for r in requests if not isinstance(r, RequestSets))
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
                return poll_generalized(requests, pending)
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
        if statuses is None and cls._wait_compiled(requests):
            return [None] * len(requests)
        cls._wait_p2p(requests)
        return cls._complete_each(requests, range(len(requests)), statuses)

    @classmethod
    def Testall(cls, requests: Sequence["Request"], statuses: Optional[Sequence[Status]] = None) -> bool:  # noqa: N802
        """Complete every request if all are done (True); else complete none (False)."""
        flag, _ = cls.testall(requests, statuses)
        return flag

    @classmethod
    def testall(cls, requests: Sequence["Request"], statuses: Optional[Sequence[Status]] = None) -> tuple[bool, Optional[list[Any]]]:
        pending = cls._pending(requests)
        if pending and not all(requests[i]._done() for i in pending):
            engine = next((requests[i]._engine for i in pending if requests[i]._engine is not None), None)
            if engine is not None:
                engine.progress()
            if not all(requests[i]._done() for i in pending):
                if statuses is not None:
                    cls._grow(statuses, len(requests))
                return False, None
        return True, cls._complete_each(requests, range(len(requests)), statuses)

    @classmethod
    def Waitany(cls, requests: Sequence["Request"], status: Optional[Status] = None) -> int:  # noqa: N802
        """Complete one request (blocking until one is done) and return its index; MPI.UNDEFINED if none is active."""
        index, _ = cls.waitany(requests, status)
        return index

    @classmethod
    def waitany(cls, requests: Sequence["Request"], status: Optional[Status] = None) -> tuple[int, Any]:
        pending = cls._pending(requests)
        if not pending:
            if status is not None:
                status._fill(Status())
            return UNDEFINED, None
        i = cls._ready(requests, pending, True)[0]
        return i, requests[i].wait(status)

    @classmethod
    def Testany(cls, requests: Sequence["Request"], status: Optional[Status] = None) -> tuple[int, bool]:  # noqa: N802
        """(index, True) after completing a done request; (UNDEFINED, False) if none is done; (UNDEFINED, True) if none
        is active."""
        index, flag, _ = cls.testany(requests, status)
        return index, flag

    @classmethod
    def testany(cls, requests: Sequence["Request"], status: Optional[Status] = None) -> tuple[int, bool, Any]:
        pending = cls._pending(requests)
        if not pending:
            if status is not None:
                status._fill(Status())
            return UNDEFINED, True, None
        done = cls._ready(requests, pending, False)
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
        pending = cls._pending(requests)
        if not pending:
            return None, None
        done = cls._ready(requests, pending, True)
        return done, cls._complete_each(requests, done, statuses)

    @classmethod
    def Testsome(cls, requests: Sequence["Request"], statuses: Optional[list[Status]] = None) -> Optional[list[int]]:  # noqa: N802
        """Complete every done request: their indices (maybe none); None if none is active."""
        indices, _ = cls.testsome(requests, statuses)
        return indices

    @classmethod
    def testsome(cls, requests: Sequence["Request"], statuses: Optional[list[Status]] = None) -> tuple[Optional[list[int]], Optional[list[Any]]]:
        pending = cls._pending(requests)
        if not pending:
            return None, None
        done = cls._ready(requests, pending, False)
        return done, cls._complete_each(requests, done, statuses)

    @classmethod
    def Get_status_any(cls, requests: Sequence["Request"], status: Optional[Status] = None) -> tuple[int, bool]:  # noqa: N802
        """Testany without completing anything."""
        pending = cls._pending(requests)
        if not pending:
            if status is not None:
                status._fill(Status())
            return UNDEFINED, True
        done = cls._ready(requests, pending, False)
        if not done:
            return UNDEFINED, False
        requests[done[0]].Get_status(status)
        return done[0], True

    @classmethod
    def Get_status_all(cls, requests: Sequence["Request"], statuses: Optional[list[Status]] = None) -> bool:  # noqa: N802
        """Testall without completing anything."""
        pending = cls._pending(requests)
        if pending and len(cls._ready(requests, pending, False)) < len(pending):
            return False
        if statuses is not None:
            cls._grow(statuses, len(requests))
            for req, st in zip(requests, statuses):
                req.Get_status(st)
        return True

    @classmethod
    def Get_status_some(cls, requests: Sequence["Request"], statuses: Optional[list[Status]] = None) -> Optional[list[int]]:  # noqa: N802
        """Testsome without completing anything."""
        pending = cls._pending(requests)
        if not pending:
            return None
        done = cls._ready(requests, pending, False)
        if statuses is not None:
            cls._grow(statuses, len(done))
            for k, i in enumerate(done[: len(statuses)]):
                requests[i].Get_status(statuses[k])
        return done

    get_status_any = Get_status_any
    get_status_all = Get_status_all
    get_status_some = Get_status_some
