"""mpi4py-compatible namespace: ``from pycoll import MPI`` then use MPI.COMM_WORLD, MPI.SUM, MPI.IN_PLACE, ..."""

from __future__ import annotations

import socket
import time
from typing import Any

from . import datatypes as _datatypes
from . import ops as _ops
from . import runtime as _runtime
from .buffers import IN_PLACE
from .comm import COMM_NULL, UNDEFINED, Comm, self_comm, world_comm
from .datatypes import Datatype
from .errors import PycollError as Exception  # noqa: A001 - mpi4py's name
from .ops import Op
from .p2p import ANY_SOURCE, ANY_TAG, PROC_NULL
from .request import Request, Status

Intracomm = Comm
REQUEST_NULL = Request.completed()
BOTTOM = None
SUCCESS = 0
ERR_OTHER = 1

SUM, PROD, MIN, MAX, AVG = _ops.SUM, _ops.PROD, _ops.MIN, _ops.MAX, _ops.AVG
BAND, BOR, BXOR, LAND, LOR, LXOR = _ops.BAND, _ops.BOR, _ops.BXOR, _ops.LAND, _ops.LOR, _ops.LXOR

globals().update(_datatypes.DATATYPES)  # MPI.FLOAT, MPI.DOUBLE, MPI.INT, MPI.INT64_T, ...

_comms: dict[str, Comm] = {}


def _world() -> Comm:
    if "world" not in _comms:
        rt = _runtime.get_runtime()
        _comms["world"] = world_comm(rt)
        _comms["self"] = self_comm(rt)
    return _comms["world"]


def __getattr__(name: str) -> Any:
    """COMM_WORLD and COMM_SELF start pycoll on first use, as importing mpi4py.MPI starts MPI."""
    if name == "COMM_WORLD":
        return _world()
    if name == "COMM_SELF":
        _world()
        return _comms["self"]
    raise AttributeError(f"module 'pycoll.MPI' has no attribute {name!r}")


def Init() -> None:  # noqa: N802
    _world()


def Init_thread(required: int = 0) -> int:  # noqa: N802
    _world()
    return THREAD_SERIALIZED


THREAD_SINGLE, THREAD_FUNNELED, THREAD_SERIALIZED, THREAD_MULTIPLE = 0, 1, 2, 3


def Is_initialized() -> bool:  # noqa: N802
    return _runtime.current() is not None


def Is_finalized() -> bool:  # noqa: N802
    rt = _runtime.current()
    return rt is not None and rt.engine.closed


def Finalize() -> None:  # noqa: N802
    _runtime.shutdown()


def Wtime() -> float:  # noqa: N802
    return time.perf_counter()


def Wtick() -> float:  # noqa: N802
    return time.get_clock_info("perf_counter").resolution


def Get_processor_name() -> str:  # noqa: N802
    return socket.gethostname()


def Get_version() -> tuple[int, int]:  # noqa: N802
    return (3, 1)


def Get_library_version() -> str:  # noqa: N802
    from . import __version__

    return f"pycoll {__version__}"
