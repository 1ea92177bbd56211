"""What the Horovod engine is given and agrees on: a submitted tensor operation and its completion, the
negotiated response, the operations the response cache may keep, and the engine's error."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from .. import MPI
from ..errors import PycollError


CACHEABLE = frozenset({"allreduce", "broadcast", "reducescatter", "barrier"})  # every rank's metadata is the same
OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}


class HorovodError(PycollError):
    """A request the engine could not carry out (the engine stopped, a root that has joined, a duplicate name)."""


class Done:
    """A request's completion, as ``threading.Event`` offers it, for a fraction of its cost (a gradient hook makes
    one per tensor): a flag, and one condition that every waiter of the process shares."""

    __slots__ = ("flag",)
    _cond = threading.Condition(threading.Lock())

    def __init__(self) -> None:
        self.flag = False

    def is_set(self) -> bool:
        return self.flag

    def set(self) -> None:
        with Done._cond:
            self.flag = True
            Done._cond.notify_all()

    def wait(self, timeout: Optional[float] = None) -> bool:
        if self.flag:
            return True
        with Done._cond:
            return Done._cond.wait_for(self.is_set, timeout)


@dataclass(eq=False)
class Request:
    """One submitted tensor operation. ``array`` is its input (C-ordered); ``out``, where given, receives the
    result (the input itself for an in-place call). ``extra`` is what differs by rank: an allgather's first
    dimension, an alltoall's splits."""

    name: str
    kind: str
    array: Optional[np.ndarray] = None
    out: Optional[np.ndarray] = None
    op: str = "sum"
    root: int = 0
    prescale: float = 1.0
    postscale: float = 1.0
    extra: Any = None
    fn: Optional[Callable[[], Any]] = None  # a "call": run on the loop's thread at the agreed point
    result: Any = None
    error: Optional[BaseException] = None
    done: Done = field(default_factory=Done)
    submitted_us: float = 0.0
    agreed_us: float = 0.0

    def meta(self) -> tuple:
        """What every rank must agree on: kind, dtype, shape (an allgather's and alltoall's without the first
        dimension), op, root and scales."""
        a = self.array
        dtype = a.dtype if a is not None else None
        shape = tuple(a.shape) if a is not None else ()
        if self.kind in ("allgather", "alltoall"):
            shape = shape[1:]
        return (self.kind, dtype, shape, self.op, self.root, self.prescale, self.postscale)

    def finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self.result, self.error = result, error
        self.done.set()


@dataclass
class Response:
    """A negotiated operation, the same on every rank: its name, the agreed metadata, each rank's ``extra``
    (None for a rank that has joined), or the error every rank that submitted it raises."""

    name: str
    meta: tuple
    extras: Optional[list] = None
    error: Optional[str] = None
    peers: tuple = ()

    @property
    def kind(self) -> str:
        return self.meta[0]
