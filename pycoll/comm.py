"""The communicator: its state, the argument checks every call shares, and the children it makes. Its mpi4py
methods are the mixins it inherits, one module per kind (``comm_reductions``, ``comm_collectives``, ``comm_p2p``,
``comm_objects``, ``comm_management``)."""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import numpy as np

from . import arrays, buffers, datatypes
from . import ops as _ops
from .algorithms.base import Call, Layout
from .algorithms.registry import REPRODUCIBLE
from .algorithms.cuda_ipc import IpcState
from .algorithms.arena_meeting import ArenaState, arena_enabled
from .arrays import Buf, VBuf
from .buffers import IN_PLACE
from .config import SHM_DIR
from .errors import AbortedError, InvalidArgumentError, InvalidRootError
from .comm_collectives import CollectiveCalls
from .comm_management import _FROM_GROUP, _WORLD_CTX, CommManagement, _child_ctx, _group_world
from .comm_objects import ObjectCalls
from .comm_p2p import PointToPointCalls
from .comm_reductions import ReductionCalls
from .executor import Executor
from .ops import Op
from .p2p_protocol import Owner, Sig
from .p2p_fast import FastP2P
from .runtime import Runtime


# Collective kinds as they travel in message headers (append only).
_KINDS = {
    "allreduce": 1,
    "reduce_scatter": 2,
    "allgather": 3,
    "broadcast": 4,
    "reduce": 5,
    "alltoall": 6,
    "gather": 7,
    "scatter": 8,
    "barrier": 9,
    "scan": 10,
    "exscan": 11,
}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}


def _describe(sig: Sig) -> str:
    name = _KIND_NAMES.get(sig.kind, f"kind {sig.kind}")
    parts = []
    if sig.count:
        parts.append(f"count={sig.count}")
    if sig.dtype:
        parts.append(f"dtype={datatypes.from_code(sig.dtype).name}")
    if sig.op:
        parts.append(f"op={_ops.BY_CODE[sig.op].name}")
    if name in ("broadcast", "reduce", "gather", "scatter"):
        parts.append(f"root={sig.root}")
    if sig.vhash:
        parts.append(f"counts#{sig.vhash & 0xFFFF:04x}")
    return f"{name}({', '.join(parts)})"


class Comm(ReductionCalls, CollectiveCalls, PointToPointCalls, ObjectCalls, CommManagement):
    """An intracommunicator: a group of ranks with its own message contexts and timeout."""

    def __init__(self, runtime: Runtime, world_ranks: Optional[list[int]] = None, ctx: int = 0, name: str = "") -> None:
        if world_ranks is None:  # Comm(comm): __new__ made this object another reference to comm (see there)
            return
        self._rt = runtime
        self._engine = runtime.engine
        self._world = world_ranks
        self._to_comm = {w: i for i, w in enumerate(world_ranks)}
        self._rank = self._to_comm[runtime.rank]
        self._size = len(world_ranks)
        self._ctx = ctx  # even: point-to-point; ctx | 1: collectives
        self._seq = 0
        self._children = 0
        self._freed = False
        self._aborted: Optional[AbortedError] = None
        self._name = name
        self.timeout: float = runtime.timeout
        self._reproducible: Optional[bool] = None  # None: as PYCOLL_REPRODUCIBLE says
        self._layout = Layout.from_ids([runtime.peers[w].host_id for w in world_ranks], runtime.ring_of(world_ranks))
        self._arena: Optional[ArenaState] = None
        if self._size > 1 and self._layout.hosts == 1 and arena_enabled():
            self._arena = ArenaState(os.path.join(SHM_DIR.get(), f"pycoll-{runtime.info.job_id}-arena-{ctx:x}"))
        # device buffers of one host: CUDA IPC buffers, set up by the first device call that selects them
        self._ipc: Optional[IpcState] = IpcState() if self._arena is not None else None
        self._x = Executor(self, _describe)  # runs every collective: plans, selection, inline arena calls
        self._fast = FastP2P(self)  # point-to-point calls between ranks of this host, compiled

    @property
    def reproducible(self) -> bool:
        """Whether this communicator's reductions return, bit for bit, the left fold of the ranks' inputs in rank
        order (docs/reproducibility.md): what was set here, else ``PYCOLL_REPRODUCIBLE``. Communicators made from
        this one inherit what was set here."""
        mine = self._reproducible
        return REPRODUCIBLE.get() if mine is None else mine

    @reproducible.setter
    def reproducible(self, value: Optional[bool]) -> None:
        """True or False for this communicator (set alike on every rank, between calls), or None to follow
        ``PYCOLL_REPRODUCIBLE`` again."""
        self._reproducible = None if value is None else bool(value)

    @property
    def _compiled(self) -> Any:
        """The gate of the compiled arena path (whether it is open, and how many calls finished inline)."""
        return self._x.gate

    # ---- identity --------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def Get_rank(self) -> int:  # noqa: N802
        return self._rank

    def Get_size(self) -> int:  # noqa: N802
        return self._size

    def Get_name(self) -> str:  # noqa: N802
        return self._name

    def Set_name(self, name: str) -> None:  # noqa: N802
        self._name = name

    def Is_inter(self) -> bool:  # noqa: N802
        return False

    def Is_intra(self) -> bool:  # noqa: N802
        return True

    def world_to_comm(self, world_rank: int) -> int:
        """This communicator's rank for a world rank (unchanged if not a member)."""
        return self._to_comm.get(world_rank, world_rank)

    def world_rank(self, rank: int) -> int:
        """The world rank of one of this communicator's ranks."""
        return self._world[rank]

    def __repr__(self) -> str:
        return f"<pycoll.Comm {self._name} rank {self._rank}/{self._size}>"

    # ---- plumbing --------------------------------------------------------------------------
    def _live(self, opname: str, numbered: bool = False) -> None:
        """Raise if this communicator cannot take ``opname``: freed, torn down, or broken by a failure. A
        ``numbered`` call (a collective, about to take the next call number) numbered before the call a peer
        failed in goes on: a rank ahead of this one failed a later call, and this one may still finish (if it
        fails too, the peer that found it reports it under its own number)."""
        if self._freed:
            raise InvalidArgumentError("the communicator was freed", op=opname, rank=self._rank)
        if self._aborted is not None:
            raise AbortedError(f"the communicator was torn down: {self._aborted.cause}", op=opname, rank=self._rank)
        err = self._engine.broken(self._ctx)
        if err is not None and not (numbered and self._engine.broken_since(self._ctx) > self._seq + 1):
            from .errors import CommunicatorBrokenError, CommunicatorLostError, PeerFailureError, RemoteError

            op = f"{opname} #{self._seq + 1}"
            self._engine.flush(1.0, delivered=True)  # reports this rank passes on leave before it raises (and perhaps exits)
            since = self._engine.broken_since(self._ctx)  # after the flush: a report it took may name an earlier call
            if isinstance(err, RemoteError) and since == self._seq + 1:
                self._seq += 1  # the failure was in this very call (a peer found it first): report it as such
                raise type(err)(err.cause, op=f"{opname} #{self._seq}", rank=self._rank, peers=err.peers)
            if isinstance(err, PeerFailureError) and err.peers:  # a death: name the dead rank, as its witnesses do
                dead = ", ".join(map(str, err.peers))
                raise CommunicatorLostError(f"rank {dead} failed earlier ({err.cause})", op=op, rank=self._rank, peers=err.peers)
            when = f" from its call #{since} on" if since > 0 else ""  # -1: every call (a death, an abort)
            raise CommunicatorBrokenError(f"a failure broke this communicator{when}: {err}", op=op, rank=self._rank)

    def _owner(self, opname: str, ctx: int, tag: int = -1) -> Owner:
        return Owner(opname, ctx, self._rank, self._to_comm.__getitem__, self._world, _describe, tag)

    def _check_root(self, root: int, opname: str) -> int:
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self._size:
            raise InvalidRootError(f"root {root!r} is not a rank of this {self._size}-rank communicator", op=opname, rank=self._rank)
        return int(root)

    def _check_op(self, op: Any, dtype: np.dtype, opname: str) -> Op:
        try:
            resolved = _ops.resolve(op)
        except TypeError as exc:
            raise InvalidArgumentError(str(exc), op=opname, rank=self._rank) from None
        reason = resolved.check(dtype)
        if reason:
            raise InvalidArgumentError(reason, op=opname, rank=self._rank)
        return resolved

    def _reduction_op(self, op: Any, buf: Buf, opname: str) -> tuple[Op, Optional[np.dtype]]:
        """The checked op as a call on ``buf`` runs it (a user-defined op bound to the buffer's datatype), and the
        dtype the call's arrays take (None: as they are; see ``Op.bind``)."""
        return self._check_op(op, buf.dtype, opname).bind(buf.datatype, buf.dtype, buf.elements)

    def _sig(self, call: Call, count: int = 0, vhash: int = 0, op: Optional[Op] = None) -> Sig:
        code = datatypes.code_of(call.dtype) if call.coll != "barrier" else 0
        return Sig(_KINDS[call.coll], code, op.code if op else 0, call.root, count, vhash)

    def _failed(self, sched: Any) -> None:
        """A nonblocking call failed (its request found it): tell the peers (see ``Executor.failed``)."""
        self._x.failed(sched)

    # ---- argument resolution -----------------------------------------------------------------
    def _recv(self, spec: Any, opname: str, blocks: int = 1) -> Buf:
        if spec is IN_PLACE:
            raise InvalidArgumentError("MPI.IN_PLACE is not allowed as the receive buffer here", op=opname, rank=self._rank)
        return buffers.parse(spec, "recvbuf", opname, writable=True, blocks=blocks)

    def _send(self, spec: Any, opname: str, blocks: int = 1) -> Buf:
        if spec is IN_PLACE:
            raise InvalidArgumentError("MPI.IN_PLACE is not allowed as the send buffer here", op=opname, rank=self._rank)
        return buffers.parse(spec, "sendbuf", opname, blocks=blocks)

    def _per_rank(self, spec: Any, what: str, opname: str, vector: bool, writable: bool) -> VBuf:
        """One block per rank: ``[buf, counts, displs]`` if vector, else ``len // size`` (or the spec's count) each."""
        if vector:
            return buffers.parse_vector(spec, what, opname, self._size, writable=writable)
        if spec is IN_PLACE:
            raise InvalidArgumentError(f"MPI.IN_PLACE is not allowed as {what} here", op=opname, rank=self._rank)
        b = buffers.parse(spec, what, opname, writable=writable, blocks=self._size)
        each = b.count // self._size
        return VBuf(b.array, b.dtype, [each] * self._size, [i * each for i in range(self._size)])

    def _same_type(self, a: np.dtype, b: np.dtype, opname: str) -> None:
        if a != b:
            raise InvalidArgumentError(f"sendbuf holds {a.name} but recvbuf holds {b.name}", op=opname, rank=self._rank)

    def _distinct(self, send: np.ndarray, recv: np.ndarray, opname: str) -> None:
        if arrays.overlaps(send, recv):
            raise InvalidArgumentError("sendbuf and recvbuf overlap; pass MPI.IN_PLACE instead", op=opname, rank=self._rank)

    # ---- children ----------------------------------------------------------------------
    def _child(self, world: list[int], ctx: int, name: str) -> "Comm":
        """A plain communicator over ``world`` (world ranks) with this one's timeout."""
        child = Comm(self._rt, world, ctx, name)
        child.timeout = self.timeout
        child._reproducible = self._reproducible
        return child

    @classmethod
    def Create_from_group(cls, group: Any, stringtag: str = "org.mpi4py", info: Any = None, errhandler: Any = None) -> "Comm":  # noqa: N802
        """Collective over ``group``'s processes: a communicator over them, from no parent (MPI-4). Concurrent
        calls with overlapping groups differ by ``stringtag``."""
        from . import runtime as _runtime

        op = "Create_from_group"
        rt = _runtime.current()
        if rt is None:
            raise InvalidArgumentError("pycoll is not initialized (use MPI.COMM_WORLD first)", op=op)
        problem, members = _group_world(group, range(rt.size), op)
        if problem or rt.rank not in members:
            raise InvalidArgumentError(problem or "this process is not a member of the group", op=op, rank=rt.rank)
        key = (id(rt), members, str(stringtag))
        _FROM_GROUP[key] = count = _FROM_GROUP.get(key, 0) + 1
        return Comm(rt, list(members), _child_ctx(_WORLD_CTX, -3, ("from_group", members, str(stringtag), count)), str(stringtag))


def world_comm(runtime: Runtime) -> Comm:
    return Comm(runtime, list(range(runtime.size)), _WORLD_CTX, "MPI_COMM_WORLD")


def group_comm(runtime: Runtime, world_ranks: Sequence[int], key: str) -> Comm:
    """A communicator over ``world_ranks`` built without a collective call: every member passes the same ``key``,
    which names it and keeps its messages apart from every other communicator's."""
    ranks = [int(r) for r in world_ranks]
    return Comm(runtime, ranks, _child_ctx(_WORLD_CTX, -2, (key, tuple(ranks))), key)


def self_comm(runtime: Runtime) -> Comm:
    return Comm(runtime, [runtime.rank], _child_ctx(_WORLD_CTX, -1, ("self", runtime.rank)), "MPI_COMM_SELF")
