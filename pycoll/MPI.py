"""mpi4py-compatible namespace: ``from pycoll import MPI`` then use MPI.COMM_WORLD, MPI.SUM, MPI.IN_PLACE, ..."""

from __future__ import annotations

import pickle as _pickle
import socket
import time
from typing import Any

import numpy as _np

from . import comm_management as _management
from . import comm_p2p as _p2p_calls
from . import datatypes as _datatypes, derived_types as _derived_types
from . import errors as _errors
from . import ops as _ops
from . import runtime as _runtime
from .buffers import IN_PLACE
from .comm import Comm, self_comm, world_comm
from .comm_management import _PREDEFINED, COMM_NULL
from .datatypes import Datatype
from .errors import PycollError as Exception  # noqa: A001 - mpi4py's name
from .ops import Op
from .p2p_protocol import ANY_SOURCE, ANY_TAG, PROC_NULL
from .request import REQUEST_NULL, Request
from .status import UNDEFINED, Status
from .version import version as _version

Intracomm = Comm
BOTTOM = None
SUCCESS = 0
# MPICH's error classes (what Exception.Get_error_class returns)
ERR_BUFFER, ERR_COUNT, ERR_TYPE, ERR_TAG, ERR_COMM, ERR_RANK, ERR_ROOT, ERR_GROUP, ERR_OP = 1, 2, 3, 4, 5, 6, 7, 8, 9
ERR_TOPOLOGY, ERR_DIMS, ERR_ARG, ERR_UNKNOWN, ERR_TRUNCATE, ERR_OTHER, ERR_INTERN = 10, 11, 12, 13, 14, 15, 16
ERR_IN_STATUS, ERR_PENDING, ERR_REQUEST, ERR_ACCESS, ERR_AMODE, ERR_BAD_FILE = 17, 18, 19, 20, 21, 22
ERR_CONVERSION, ERR_DUP_DATAREP, ERR_FILE_EXISTS, ERR_FILE_IN_USE, ERR_FILE = 23, 24, 25, 26, 27
ERR_IO, ERR_NAME, ERR_NO_MEM, ERR_NOT_SAME, ERR_NO_SPACE, ERR_NO_SUCH_FILE, ERR_PORT = 32, 33, 34, 35, 36, 37, 38
ERR_QUOTA, ERR_READ_ONLY, ERR_SERVICE, ERR_SPAWN, ERR_UNSUPPORTED_DATAREP = 39, 40, 41, 42, 43
ERR_UNSUPPORTED_OPERATION, ERR_WIN, ERR_BASE, ERR_LOCKTYPE, ERR_KEYVAL, ERR_RMA_CONFLICT = 44, 45, 46, 47, 48, 49
ERR_RMA_SYNC, ERR_SIZE, ERR_DISP, ERR_ASSERT = 50, 51, 52, 53
ERR_LASTCODE = 0x3FFFFFFF

SUM, PROD, MIN, MAX, AVG = _ops.SUM, _ops.PROD, _ops.MIN, _ops.MAX, _ops.AVG
BAND, BOR, BXOR, LAND, LOR, LXOR = _ops.BAND, _ops.BOR, _ops.BXOR, _ops.LAND, _ops.LOR, _ops.LXOR

globals().update(_datatypes.DATATYPES)  # MPI.FLOAT, MPI.DOUBLE, MPI.INT, MPI.INT64_T, ...

_comms = _PREDEFINED  # COMM_WORLD and COMM_SELF once made (kept in pycoll.comm_management; Comm pickles them by name)


def _world() -> Comm:
    if "world" not in _comms:
        rt = _runtime.get_runtime()
        _comms["world"] = world_comm(rt)
        _comms["self"] = self_comm(rt)
    return _comms["world"]


def _predefined(name: str) -> Comm:
    """``COMM_WORLD`` or ``COMM_SELF`` by name: how a pickled one unpickles."""
    return __getattr__(name)


_management._predefined_by_name[:] = [_predefined]


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
    return f"pycoll {_version()}"


# ---- communicator management: groups, topologies, comparisons, and the features pycoll does not provide ----
from .comm_management import COMM_TYPE_SHARED, Intercomm  # noqa: E402
from .group import CONGRUENT, GROUP_EMPTY, GROUP_NULL, IDENT, SIMILAR, UNEQUAL, Group  # noqa: E402
from .not_provided import (  # noqa: E402
    File,
    Win,
    Close_port,
    Lookup_name,
    Open_port,
    Publish_name,
    Unpublish_name,
)
from .cart_comm import Cartcomm  # noqa: E402
from .cart_comm import compute_dims as Compute_dims  # noqa: E402, N812
from .graph_comm import UNWEIGHTED, WEIGHTS_EMPTY, Distgraphcomm, Graphcomm  # noqa: E402
from .topology_comm import CART, DIST_GRAPH, GRAPH, Topocomm  # noqa: E402


# ---- names mpi4py's own test helpers (mpiunittest.py, arrayimpl.py, main.py) look up at import ----
# Element types pycoll does not move are the null datatype, which mpi4py's helpers read as "not available here";
# setdefault: a name that pycoll.datatypes defines properly wins.
for _unavailable in ("C_LONG_DOUBLE_COMPLEX",):
    globals().setdefault(_unavailable, _datatypes.DATATYPE_NULL)


def get_vendor() -> tuple[str, tuple[int, int, int]]:
    """The implementation's name and (major, minor, micro) version, as mpi4py.MPI.get_vendor() returns MPICH's."""
    parts = [int(p) if p.isdigit() else 0 for p in _version().split(".")[:3]]
    major, minor, micro = parts + [0] * (3 - len(parts))
    return ("pycoll", (major, minor, micro))


def Get_abi_version() -> tuple[int, int]:  # noqa: N802
    """(-1, -1): pycoll implements no MPI binary interface (mpi4py answers so for an MPI without one)."""
    return (-1, -1)


def Query_thread() -> int:  # noqa: N802
    """The thread level pycoll provides, the one Init_thread returns."""
    return THREAD_SERIALIZED


# ---- point-to-point and requests: probes, matched messages, persistent requests, buffered mode ----
from .message import MESSAGE_NO_PROC, MESSAGE_NULL, Message  # noqa: E402
from .request import Grequest, Prequest  # noqa: E402

from .comm_p2p import BUFFER_AUTOMATIC  # noqa: E402

BSEND_OVERHEAD = 96  # MPICH's; pycoll's Bsend copies the message itself and needs no attached space
globals().setdefault("ERR_ARG", 12)  # MPICH's error classes, as Status.error values
_attached: Any = None


def _comm_lock(comm: Comm, key: Any = None) -> Any:
    """mpi4py's internal per-communicator lock named ``key`` (created on first use)."""
    return comm._obj_lock(key)


def _comm_lock_table(comm: Comm) -> dict:
    """mpi4py's internal table of a communicator's locks, by name: its object methods take theirs."""
    return comm._lock_table()


def Attach_buffer(buf: Any) -> None:  # noqa: N802
    """Attach the process's buffer for buffered sends: writable memory, or None / BUFFER_AUTOMATIC. pycoll's
    Bsend copies each message into memory of its own, so the buffer is only kept, not used (see Comm.Attach_buffer)."""
    global _attached
    _attached = _p2p_calls.attach_buffer(_attached, buf, "Attach_buffer")


def Detach_buffer() -> Any:  # noqa: N802
    """Give back the object Attach_buffer kept (None if nothing is attached); buffered sends never wait for space."""
    global _attached
    buf, _attached = _attached, None
    return buf


def Flush_buffer() -> None:  # noqa: N802
    """Wait until the buffered sends of every communicator have left."""
    _p2p_calls.flush_all_bsends()


def Iflush_buffer() -> Request:  # noqa: N802
    """Flush_buffer, then a request that is already complete."""
    Flush_buffer()
    return Request.completed()


class _Memory(bytearray):
    """Memory from ``Alloc_mem``: a writable buffer (any buffer spec takes it), empty once freed."""

    @property
    def address(self) -> int:
        return _np.frombuffer(self, _np.uint8).ctypes.data if len(self) else 0

    @property
    def nbytes(self) -> int:
        return len(self)

    readonly = False


def Alloc_mem(size: int, info: Any = None) -> bytearray:  # noqa: N802
    """``size`` bytes of writable memory (zeroed)."""
    if isinstance(size, bool) or not isinstance(size, (int, _np.integer)) or size < 0:
        raise _errors.InvalidArgumentError(f"size {size!r} is not a non-negative integer", op="Alloc_mem")
    return _Memory(int(size))


def Free_mem(mem: Any) -> None:  # noqa: N802
    """Release memory from Alloc_mem (it is empty afterwards)."""
    if not isinstance(mem, _Memory):
        raise _errors.InvalidArgumentError(f"{type(mem).__name__} did not come from Alloc_mem", op="Free_mem")
    try:
        del mem[:]
    except BufferError:  # still viewed by an array: it is released with the last view
        pass


class Pickle:
    """How lowercase calls serialize objects (``MPI.pickle``): ``dumps`` and ``loads``, highest pickle protocol."""

    PROTOCOL = _pickle.HIGHEST_PROTOCOL

    def dumps(self, obj: Any) -> bytes:
        return _pickle.dumps(obj, protocol=self.PROTOCOL)

    def loads(self, data: Any) -> Any:
        return _pickle.loads(data)


globals().setdefault("pickle", Pickle())


# ---- reduction ops and datatypes: MAXLOC/MINLOC and their value-index pairs, REPLACE, NO_OP, OP_NULL, user-defined
# ops (Op.Create), derived datatypes (Datatype.Create_*) and addresses. The pair types (FLOAT_INT, DOUBLE_INT,
# LONG_INT, INT_INT/TWOINT, SHORT_INT, LONG_DOUBLE_INT) come with the other datatypes from pycoll.datatypes.
from . import flat_bytes as _flat_bytes  # noqa: E402

MAXLOC, MINLOC, REPLACE, NO_OP, OP_NULL = _ops.MAXLOC, _ops.MINLOC, _ops.REPLACE, _ops.NO_OP, _ops.OP_NULL
DATATYPE_NULL = _datatypes.DATATYPE_NULL
ORDER_C, ORDER_FORTRAN, ORDER_F = _derived_types.ORDER_C, _derived_types.ORDER_FORTRAN, _derived_types.ORDER_FORTRAN
globals().update({f"COMBINER_{_name}": _code for _name, _code in _datatypes.COMBINERS.items()})
# Fortran element types with no NumPy counterpart here: DATATYPE_NULL, which mpi4py's tests read as "not available".
for _name in ("CHARACTER", "LOGICAL", "LOGICAL1", "LOGICAL2", "LOGICAL4", "LOGICAL8", "LOGICAL16", "INTEGER16",
              "REAL16", "COMPLEX4", "COMPLEX32", "C_LONG_DOUBLE_COMPLEX"):
    if globals().get(_name) is None or not globals()[_name]:
        globals()[_name] = DATATYPE_NULL


def Get_address(location: Any) -> int:  # noqa: N802
    """The address of a buffer's first byte, as an integer (mpi4py's MPI.Get_address)."""
    return _flat_bytes.address(location)


def Aint_add(base: int, disp: int) -> int:  # noqa: N802
    return int(base) + int(disp)


def Aint_diff(addr1: int, addr2: int) -> int:  # noqa: N802
    return int(addr1) - int(addr2)


# ---- info objects (pycoll.info): MPI.Info, INFO_NULL, INFO_ENV, the key and value limits, their error classes ----
from .info import (  # noqa: E402
    ERR_INFO,
    ERR_INFO_KEY,
    ERR_INFO_NOKEY,
    ERR_INFO_VALUE,
    INFO_ENV,
    INFO_NULL,
    MAX_INFO_KEY,
    MAX_INFO_VAL,
    Info,
)
