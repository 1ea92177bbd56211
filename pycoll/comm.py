"""The communicator: mpi4py's buffer and object API, argument checks, and dispatch to algorithms."""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, NoReturn, Optional, Sequence

import numpy as np

from . import buffers, datatypes, errors, not_provided, typemap
from . import ops as _ops
from .algorithms import Call, Layout
from .algorithms.registry import REPRODUCIBLE
from .algorithms.cuda_ipc import IpcState
from .algorithms.shared import ArenaState, arena_enabled
from .buffers import IN_PLACE, Buf, VBuf
from .config import SHM_DIR
from .errors import AbortedError, InvalidArgumentError, InvalidRootError
from .executor import Executor
from .ops import Op
from .p2p import ANY_SOURCE, ANY_TAG, P2P_SIG, PROC_NULL, Owner, Sig
from .p2p_fast import FastP2P
from .request import MESSAGE_NO_PROC, Message, Prequest, Request, Status
from .runtime import Runtime

UNDEFINED = -32766

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
_ELEMENTWISE = {"allreduce": "Allreduce", "scan": "Scan", "exscan": "Exscan"}  # the calls _allreduce_call checks
_WORLD_CTX = 2


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


def _units(arr: Any, unit: Optional[np.dtype]) -> Any:
    """``arr`` seen as the call's elements: as it is, or as opaque elements of a user-defined op's datatype."""
    return arr if unit is None else arr.view(unit)


def _vhash(values: Sequence[int]) -> int:
    digest = hashlib.blake2b(struct.pack(f"<{len(values)}q", *values), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def _child_ctx(parent: int, counter: int, tag: Any) -> int:
    digest = hashlib.blake2b(repr((parent, counter, tag)).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & ~1) % ((1 << 63) - 2) + 4  # even, never the world or control ctx


_NO_BYTES = np.empty(0, np.uint8)
_TAG_MAX = (1 << 63) - 1  # a tag travels as a signed 64-bit header word
_LOCK_TABLES_LOCK = threading.Lock()  # guards the creation of Comm._lock_table entries


def _no_data(buf: Any) -> Optional[np.ndarray]:
    """A point-to-point buffer spec that says "no data" in mpi4py's spellings (``None``, ``[None, 0, datatype]``):
    an empty buffer; else None."""
    if buf is None:
        return _NO_BYTES
    if type(buf) in (list, tuple) and 1 <= len(buf) <= 3 and buf[0] is None:
        if all(x == 0 for x in buf[1:] if isinstance(x, (int, np.integer)) and not isinstance(x, bool)):
            return _NO_BYTES
    return None


class _WSide:
    """One side of an Alltoallw: the user's buffer as bytes and each rank's block in it (byte displacement, the
    datatype elements' ``Access`` or None for an empty block, bytes)."""

    __slots__ = ("raw", "blocks")

    def __init__(self, raw: np.ndarray, blocks: list[tuple[int, Any, int]]) -> None:
        self.raw, self.blocks = raw, blocks

    @property
    def nbytes(self) -> list[int]:
        return [n for _, _, n in self.blocks]

    def _direct(self) -> Optional[tuple[np.ndarray, list[int], list[int]]]:
        """The buffer itself with byte counts and displacements, where every block is one contiguous run."""
        if not all(a is None or a.contiguous for _, a, _ in self.blocks):
            return None
        return self.raw, self.nbytes, [d + (a.offset if a is not None else 0) for d, a, _ in self.blocks]

    def gathered(self) -> tuple[np.ndarray, list[int], list[int]]:
        """The blocks to send: the buffer itself where it can be, else a packed copy of them in rank order."""
        direct = self._direct()
        if direct is not None:
            return direct
        pieces = [a.read(self.raw[d:])[0].view(np.uint8) for d, a, _ in self.blocks if a is not None]
        packed = np.concatenate(pieces) if pieces else np.empty(0, np.uint8)
        counts = self.nbytes
        return packed, counts, [int(x) for x in np.cumsum([0] + counts[:-1])]

    def target(self, fill: bool) -> tuple[np.ndarray, list[int], list[int]]:
        """Where the blocks are received: the buffer itself where it can be, else a staging copy (holding the
        blocks now if ``fill``: in place, they are sent from there too) that the call's ``Unpacking`` writes back
        into the user's buffer when the call completes."""
        direct = self._direct()
        if direct is not None:
            return direct
        counts = self.nbytes
        stage = self.gathered()[0].copy() if fill else np.empty(sum(counts), np.uint8)
        back = _WriteBack(self.raw, self.blocks, stage)
        current = getattr(buffers._collecting, "current", None)  # the executor's collector of packed receive buffers
        if current is None:
            raise InvalidArgumentError("recvbuf: derived datatypes with gaps need the executor's write-back")
        current.packed.append(back)
        return back.stage, counts, [int(x) for x in np.cumsum([0] + counts[:-1])]


class _WriteBack:
    """Alltoallw's staged receive blocks, scattered into the user's buffer by ``unpack`` (as ``buffers.Packed``)."""

    __slots__ = ("raw", "blocks", "stage")

    def __init__(self, raw: np.ndarray, blocks: list[tuple[int, Any, int]], stage: np.ndarray) -> None:
        self.raw, self.blocks, self.stage = raw, blocks, stage

    def unpack(self) -> None:
        off = 0
        for d, a, n in self.blocks:
            if a is None:
                continue
            piece, sub = self.stage[off:off + n], self.raw[d:]
            if a.contiguous:
                sub[a.offset:a.offset + n] = piece
            else:
                a.write(sub, piece.view(a.base))
            off += n


class _WPlan:
    """A checked Alltoallw: both sides (the same one in place) and whether the call is in place."""

    __slots__ = ("send", "recv", "in_place")

    def __init__(self, send: _WSide, recv: _WSide, in_place: bool) -> None:
        self.send, self.recv, self.in_place = send, recv, in_place


class Comm:
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
    def _live(self, opname: str) -> None:
        if self._freed:
            raise InvalidArgumentError("the communicator was freed", op=opname, rank=self._rank)
        if self._aborted is not None:
            raise AbortedError(f"the communicator was torn down: {self._aborted.cause}", op=opname, rank=self._rank)
        err = self._engine.broken(self._ctx)
        if err is not None:
            from .errors import CommunicatorBrokenError, CommunicatorLostError, PeerFailureError, RemoteError

            op = f"{opname} #{self._seq + 1}"
            self._engine.flush(1.0, delivered=True)  # reports this rank passes on leave before it raises (and perhaps exits)
            if isinstance(err, RemoteError) and self._engine.broken_since(self._ctx) == self._seq + 1:
                self._seq += 1  # the failure was in this very call (a peer found it first): report it as such
                raise type(err)(err.cause, op=f"{opname} #{self._seq}", rank=self._rank, peers=err.peers)
            if isinstance(err, PeerFailureError) and err.peers:  # a death: name the dead rank, as its witnesses do
                dead = ", ".join(map(str, err.peers))
                raise CommunicatorLostError(f"rank {dead} failed earlier ({err.cause})", op=op, rank=self._rank, peers=err.peers)
            raise CommunicatorBrokenError(f"an earlier failure broke this communicator: {err}", op=op, rank=self._rank)

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
        if buffers.overlaps(send, recv):
            raise InvalidArgumentError("sendbuf and recvbuf overlap; pass MPI.IN_PLACE instead", op=opname, rank=self._rank)

    # ---- reductions ----------------------------------------------------------------------------
    def _allreduce_call(self, sendbuf: Any, recvbuf: Any, op: Any, coll: str = "allreduce") -> tuple[Call, Sig]:
        """An elementwise reduction of one vector per rank: Allreduce, and Scan and Exscan (``coll``)."""
        name = _ELEMENTWISE[coll]
        recv = self._recv(recvbuf, name)
        if sendbuf is None:  # mpi4py reads None as IN_PLACE here
            sendbuf = IN_PLACE
        if sendbuf is IN_PLACE:
            send = recv
        else:
            send = self._send(sendbuf, name)
            self._same_type(send.dtype, recv.dtype, name)
            if send.count != recv.count:
                raise InvalidArgumentError(f"sendbuf has {send.count} elements, recvbuf {recv.count}", op=name, rank=self._rank)
            self._distinct(send.array, recv.array, name)
        o, unit = self._reduction_op(op, recv, name)
        recv_arr = _units(recv.array, unit)
        send_arr = recv_arr if send is recv else _units(send.array, unit)
        call = Call(coll, recv_arr.dtype, send_arr, recv_arr, o, in_place=sendbuf is IN_PLACE)
        return call, self._sig(call, recv_arr.shape[0], op=o)

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Allreduce", self._allreduce_call, (sendbuf, recvbuf, op), stream)

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Iallreduce", self._allreduce_call, (sendbuf, recvbuf, op), stream)

    def _reduce_call(self, sendbuf: Any, recvbuf: Any, op: Any, root: int) -> tuple[Call, Sig]:
        name = "Reduce"
        root = self._check_root(root, name)
        at_root = self._rank == root
        if sendbuf is None and at_root:  # mpi4py reads the root's None sendbuf as IN_PLACE
            sendbuf = IN_PLACE
        if sendbuf is IN_PLACE:
            if not at_root:
                raise InvalidArgumentError("MPI.IN_PLACE is only allowed at the root", op=name, rank=self._rank)
            recv = self._recv(recvbuf, name)
            send = recv
        else:
            send = self._send(sendbuf, name)
            recv = self._recv(recvbuf, name) if at_root else None
            if recv is not None:
                self._same_type(send.dtype, recv.dtype, name)
                if recv.count != send.count:
                    raise InvalidArgumentError(f"sendbuf has {send.count} elements, recvbuf {recv.count}", op=name, rank=self._rank)
                self._distinct(send.array, recv.array, name)
        o, unit = self._reduction_op(op, send, name)
        send_arr = _units(send.array, unit)
        recv_arr = (send_arr if recv is send else _units(recv.array, unit)) if recv is not None else None
        call = Call("reduce", send_arr.dtype, send_arr, recv_arr, o, root=root, in_place=sendbuf is IN_PLACE)
        return call, self._sig(call, send_arr.shape[0], op=o)

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Reduce", self._reduce_call, (sendbuf, recvbuf, op, root), stream)

    def Ireduce(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Ireduce", self._reduce_call, (sendbuf, recvbuf, op, root), stream)

    # ---- prefix reductions (Scan, Exscan) ------------------------------------------------------
    def Scan(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> None:  # noqa: N802
        """Inclusive prefix reduction: rank r gets op(x_0, ..., x_r), combined in rank order."""
        self._x.run("Scan", self._allreduce_call, (sendbuf, recvbuf, op, "scan"), stream)

    def Iscan(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Iscan", self._allreduce_call, (sendbuf, recvbuf, op, "scan"), stream)

    def Exscan(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> None:  # noqa: N802
        """Exclusive prefix reduction: rank r > 0 gets op(x_0, ..., x_{r-1}); rank 0's recvbuf is left untouched."""
        self._x.run("Exscan", self._allreduce_call, (sendbuf, recvbuf, op, "exscan"), stream)

    def Iexscan(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Iexscan", self._allreduce_call, (sendbuf, recvbuf, op, "exscan"), stream)

    def scan(self, sendobj: Any, op: Any = _ops.SUM) -> Any:
        """Objects: the reduction of ranks 0..r's objects, in rank order (AVG divides by r+1)."""
        o = _ops.resolve(op)
        return o.reduce_objects(self.allgather(sendobj)[: self._rank + 1])

    def exscan(self, sendobj: Any, op: Any = _ops.SUM) -> Any:
        """Objects: the reduction of ranks 0..r-1's objects; None at rank 0."""
        o = _ops.resolve(op)
        values = self.allgather(sendobj)[: self._rank]
        return o.reduce_objects(values) if values else None

    def Reduce_local(self, inbuf: Any, inoutbuf: Any, op: Any = _ops.SUM) -> None:  # noqa: N802
        """inoutbuf = inbuf op inoutbuf, elementwise, on this rank alone (no communication)."""
        _ops.reduce_local(op, inbuf, inoutbuf, "Reduce_local", self._rank)

    def _reduce_scatter_call(
        self, sendbuf: Any, recvbuf: Any, recvcounts: Optional[Sequence[int]], op: Any, name: str
    ) -> tuple[Call, Sig]:
        # In place, Reduce_scatter_block's recvbuf holds every rank's block: a spec's count is per block (as mpi4py)
        in_place_blocks = recvcounts is None and sendbuf is IN_PLACE
        recv = self._recv(recvbuf, name, blocks=self._size if in_place_blocks else 1)
        o, unit = self._reduction_op(op, recv, name)
        per = recv.elements if unit is not None else 1  # the buffers' elements in one of the call's (opaque) elements
        recv_arr = _units(recv.array, unit)
        if recvcounts is None:  # Reduce_scatter_block: every rank gets recvbuf's count
            if in_place_blocks:
                each = recv_arr.shape[0] // self._size
            else:
                each = recv_arr.shape[0]
            counts = [each] * self._size
        else:
            try:
                items = list(recvcounts)
            except TypeError:
                raise InvalidArgumentError(f"recvcounts must be a sequence of integers, got {recvcounts!r}", op=name, rank=self._rank) from None
            if not all(isinstance(c, (int, np.integer)) and not isinstance(c, bool) for c in items):  # int() takes 2.5, "3"
                raise InvalidArgumentError(f"recvcounts must be integers, got {items!r}", op=name, rank=self._rank)
            counts = [int(c) for c in items]
            if len(counts) != self._size or min(counts, default=0) < 0:
                raise InvalidArgumentError(
                    f"recvcounts needs {self._size} non-negative entries, got {list(counts)}", op=name, rank=self._rank
                )
            if recv.elements > 1 and unit is None:  # counts of a derived datatype's elements, flattened
                counts = [c * recv.elements for c in counts]
        total = sum(counts)
        if sendbuf is IN_PLACE:
            if recv_arr.shape[0] < total:
                raise InvalidArgumentError(f"in place, recvbuf needs {total} elements, has {recv_arr.shape[0]}", op=name, rank=self._rank)
            send_arr = recv_arr[:total]
        else:
            send = self._send(sendbuf, name, blocks=self._size if recvcounts is None else 1)
            self._same_type(send.dtype, recv.dtype, name)
            send_arr = _units(send.array, unit) if send.count % per == 0 else send.array
            if send_arr.shape[0] != total or send_arr.dtype != recv_arr.dtype:
                raise InvalidArgumentError(f"sendbuf needs {total} elements (sum of recvcounts), has {send_arr.shape[0]}", op=name, rank=self._rank)
            if recv_arr.shape[0] < counts[self._rank]:
                raise InvalidArgumentError(f"recvbuf needs {counts[self._rank]} elements, has {recv_arr.shape[0]}", op=name, rank=self._rank)
            self._distinct(send.array, recv.array, name)
        call = Call("reduce_scatter", recv_arr.dtype, send_arr, recv_arr, o, counts=counts, in_place=sendbuf is IN_PLACE)
        return call, self._sig(call, total, _vhash(counts), op=o)

    def Reduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Reduce_scatter_block", self._reduce_scatter_call, (sendbuf, recvbuf, None, op, "Reduce_scatter_block"), stream)

    def Ireduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Ireduce_scatter_block", self._reduce_scatter_call, (sendbuf, recvbuf, None, op, "Ireduce_scatter_block"), stream)

    def Reduce_scatter(  # noqa: N802
        self, sendbuf: Any, recvbuf: Any, recvcounts: Optional[Sequence[int]] = None, op: Any = _ops.SUM
    , *, stream: Any = None) -> None:
        if recvcounts is None:
            recvcounts = self._gather_counts(recvbuf, "Reduce_scatter")
        self._x.run("Reduce_scatter", self._reduce_scatter_call, (sendbuf, recvbuf, recvcounts, op, "Reduce_scatter"), stream)

    def Ireduce_scatter(  # noqa: N802
        self, sendbuf: Any, recvbuf: Any, recvcounts: Optional[Sequence[int]] = None, op: Any = _ops.SUM
    , *, stream: Any = None) -> Request:
        if recvcounts is None:
            recvcounts = self._gather_counts(recvbuf, "Ireduce_scatter")
        return self._x.start("Ireduce_scatter", self._reduce_scatter_call, (sendbuf, recvbuf, recvcounts, op, "Ireduce_scatter"), stream)

    def _gather_counts(self, recvbuf: Any, name: str) -> list[int]:
        """Without recvcounts, each rank's recvbuf size is its count (one extra allgather)."""
        try:
            mine = self._recv(recvbuf, name).count
        except InvalidArgumentError:
            mine = 0  # the call itself will reject the buffer and tell the peers
        counts = np.empty(self._size, np.int64)
        self.Allgather(np.array([mine], np.int64), counts)
        return [int(c) for c in counts]

    # ---- data movement -------------------------------------------------------------------------
    def _bcast_call(self, buf: Any, root: int) -> tuple[Call, Sig]:
        name = "Bcast"
        root = self._check_root(root, name)
        b = buffers.parse(buf, "buf", name, writable=self._rank != root)
        call = Call("broadcast", b.dtype, recv=b.array, root=root)
        return call, self._sig(call, b.count)

    def Bcast(self, buf: Any, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Bcast", self._bcast_call, (buf, root), stream)

    def Ibcast(self, buf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Ibcast", self._bcast_call, (buf, root), stream)

    def _allgather_call(self, sendbuf: Any, recvbuf: Any, vector: bool) -> tuple[Call, Sig]:
        name = "Allgatherv" if vector else "Allgather"
        rv = self._per_rank(recvbuf, "recvbuf", name, vector, writable=True)
        mine = rv.counts[self._rank]
        send_arr = None
        if sendbuf is None:  # mpi4py reads None as IN_PLACE here
            sendbuf = IN_PLACE
        if sendbuf is not IN_PLACE:
            s = self._send(sendbuf, name)
            self._same_type(s.dtype, rv.dtype, name)
            if s.count != mine:
                raise InvalidArgumentError(f"sendbuf has {s.count} elements, recvbuf expects {mine} from this rank", op=name, rank=self._rank)
            self._distinct(s.array, rv.array, name)
            send_arr = s.array
        call = Call("allgather", rv.dtype, send_arr, rv.array, counts=rv.counts, displs=rv.displs, in_place=sendbuf is IN_PLACE)
        return call, self._sig(call, sum(rv.counts), _vhash(rv.counts) if vector else 0)

    def Allgather(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Allgather", self._allgather_call, (sendbuf, recvbuf, False), stream)

    def Iallgather(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Iallgather", self._allgather_call, (sendbuf, recvbuf, False), stream)

    def Allgatherv(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Allgatherv", self._allgather_call, (sendbuf, recvbuf, True), stream)

    def Iallgatherv(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Iallgatherv", self._allgather_call, (sendbuf, recvbuf, True), stream)

    def _gather_call(self, sendbuf: Any, recvbuf: Any, root: int, vector: bool) -> tuple[Call, Sig]:
        name = "Gatherv" if vector else "Gather"
        root = self._check_root(root, name)
        at_root = self._rank == root
        if sendbuf is None and at_root:  # mpi4py reads the root's None sendbuf as IN_PLACE
            sendbuf = IN_PLACE
        if sendbuf is IN_PLACE and not at_root:
            raise InvalidArgumentError("MPI.IN_PLACE is only allowed at the root", op=name, rank=self._rank)
        send = None if sendbuf is IN_PLACE else self._send(sendbuf, name)
        recv_arr, counts, displs = None, [], []
        dtype = send.dtype if send is not None else None
        if at_root:
            rv = self._per_rank(recvbuf, "recvbuf", name, vector, writable=True)
            recv_arr, counts, displs, dtype = rv.array, rv.counts, rv.displs, rv.dtype
            if send is not None:
                self._same_type(send.dtype, rv.dtype, name)
                if send.count != counts[root]:
                    raise InvalidArgumentError(f"sendbuf has {send.count} elements, recvbuf expects {counts[root]}", op=name, rank=self._rank)
                self._distinct(send.array, rv.array, name)
        assert dtype is not None
        total = -1 if vector else (sum(counts) if at_root else self._size * send.count)  # type: ignore[union-attr]
        call = Call(
            "gather", dtype, send.array if send else None, recv_arr, root=root, counts=counts, displs=displs, in_place=send is None,
            vector=vector, total=total,
        )
        return call, self._sig(call)

    def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Gather", self._gather_call, (sendbuf, recvbuf, root, False), stream)

    def Igather(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Igather", self._gather_call, (sendbuf, recvbuf, root, False), stream)

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Gatherv", self._gather_call, (sendbuf, recvbuf, root, True), stream)

    def Igatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Igatherv", self._gather_call, (sendbuf, recvbuf, root, True), stream)

    def _scatter_call(self, sendbuf: Any, recvbuf: Any, root: int, vector: bool) -> tuple[Call, Sig]:
        name = "Scatterv" if vector else "Scatter"
        root = self._check_root(root, name)
        at_root = self._rank == root
        if recvbuf is None and at_root:  # mpi4py reads the root's None recvbuf as IN_PLACE
            recvbuf = IN_PLACE
        if recvbuf is IN_PLACE and not at_root:
            raise InvalidArgumentError("MPI.IN_PLACE is only allowed at the root", op=name, rank=self._rank)
        recv = None if recvbuf is IN_PLACE else buffers.parse(recvbuf, "recvbuf", name, writable=True)
        send_arr, counts, displs = None, [], []
        dtype = recv.dtype if recv is not None else None
        if at_root:
            sv = self._per_rank(sendbuf, "sendbuf", name, vector, writable=False)
            send_arr, counts, displs, dtype = sv.array, sv.counts, sv.displs, sv.dtype
            if recv is not None:
                self._same_type(sv.dtype, recv.dtype, name)
                if recv.count != counts[root]:
                    raise InvalidArgumentError(f"recvbuf has {recv.count} elements, sendbuf gives {counts[root]}", op=name, rank=self._rank)
                self._distinct(sv.array, recv.array, name)
        assert dtype is not None
        total = -1 if vector else (sum(counts) if at_root else self._size * recv.count)  # type: ignore[union-attr]
        call = Call(
            "scatter", dtype, send_arr, recv.array if recv else None, root=root, counts=counts, displs=displs, in_place=recv is None,
            vector=vector, total=total,
        )
        return call, self._sig(call)

    def Scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Scatter", self._scatter_call, (sendbuf, recvbuf, root, False), stream)

    def Iscatter(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Iscatter", self._scatter_call, (sendbuf, recvbuf, root, False), stream)

    def Scatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Scatterv", self._scatter_call, (sendbuf, recvbuf, root, True), stream)

    def Iscatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Iscatterv", self._scatter_call, (sendbuf, recvbuf, root, True), stream)

    def _alltoall_call(self, sendbuf: Any, recvbuf: Any, vector: bool) -> tuple[Call, Sig]:
        name = "Alltoallv" if vector else "Alltoall"
        rv = self._per_rank(recvbuf, "recvbuf", name, vector, writable=True)
        sv = rv if sendbuf is IN_PLACE else self._per_rank(sendbuf, "sendbuf", name, vector, writable=False)
        if not vector and sv.counts != rv.counts:
            raise InvalidArgumentError(
                f"sendbuf has {sum(sv.counts)} elements, recvbuf {sum(rv.counts)}", op=name, rank=self._rank
            )
        if sv is not rv:
            self._same_type(sv.dtype, rv.dtype, name)
            self._distinct(sv.array, rv.array, name)
        call = Call(
            "alltoall",
            rv.dtype,
            sv.array,
            rv.array,
            counts=rv.counts,
            displs=rv.displs,
            send_counts=sv.counts,
            send_displs=sv.displs,
            in_place=sendbuf is IN_PLACE,
            vector=vector,
        )
        return call, self._sig(call, 0 if vector else rv.counts[0])

    def Alltoall(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Alltoall", self._alltoall_call, (sendbuf, recvbuf, False), stream)

    def Ialltoall(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Ialltoall", self._alltoall_call, (sendbuf, recvbuf, False), stream)

    def Alltoallv(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> None:  # noqa: N802
        self._x.run("Alltoallv", self._alltoall_call, (sendbuf, recvbuf, True), stream)

    def Ialltoallv(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> Request:  # noqa: N802
        return self._x.start("Ialltoallv", self._alltoall_call, (sendbuf, recvbuf, True), stream)

    # ---- Alltoallw: per-peer datatypes and byte displacements, moved as bytes by the Alltoallv machinery ------
    def _w_side(self, spec: Any, what: str, name: str, writable: bool) -> "_WSide":
        """Resolve ``[buf, counts, displs, datatypes]``, ``[buf, (counts, displs), datatypes]`` or
        ``[buf, datatypes]`` (one element of each rank's datatype at byte 0): displacements in bytes."""
        size = self._size
        if not isinstance(spec, (list, tuple)) or not 2 <= len(spec) <= 4:
            raise InvalidArgumentError(
                f"{what} must be [buf, counts, displs, datatypes], [buf, (counts, displs), datatypes] or [buf, datatypes]",
                op=name, rank=self._rank)
        counts: Any = None
        displs: Any = None
        if len(spec) == 2:
            obj, types = spec
        elif len(spec) == 3:
            obj, pair, types = spec
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise InvalidArgumentError(f"{what}: the middle item must be (counts, displs)", op=name, rank=self._rank)
            counts, displs = pair
        else:
            obj, counts, displs, types = spec
        if obj is None:  # MPI.BOTTOM: absolute addresses
            if counts is None or displs is None:
                raise InvalidArgumentError(f"{what}: MPI.BOTTOM needs counts and displacements", op=name, rank=self._rank)
        if (counts is None) != (displs is None):
            raise InvalidArgumentError(f"{what}: give both counts and displacements, or neither", op=name, rank=self._rank)
        try:
            if counts is None:
                counts, displs = [1] * size, [0] * size
            else:
                counts = buffers._int_list(counts, size, "counts", what, name)
                displs = buffers._int_list(displs, size, "displs", what, name)
            if isinstance(types, (list, tuple)):
                if len(types) != size:
                    raise InvalidArgumentError(f"{what}: datatypes has {len(types)} entries for {size} ranks", op=name)
            else:
                types = [types] * size
            layouts = [t._live(what) if isinstance(t, datatypes.Datatype) else
                       typemap.Layout.basic(buffers._dtype_of(t, what, name)) for t in types]
            if obj is None:  # MPI.BOTTOM: the datatypes' displacements are absolute addresses
                return self._w_bottom(counts, displs, layouts, what, name)
            flat = buffers._as_flat_array(obj, what, name)
            device = isinstance(flat, buffers.DeviceArray)
            raw = flat.view(np.uint8) if device else buffers._raw_bytes(obj, what, name)
        except InvalidArgumentError as err:
            raise InvalidArgumentError(err.cause, op=name, rank=self._rank) from None
        if writable and not buffers._writable(raw):
            raise InvalidArgumentError(f"{what} is read-only", op=name, rank=self._rank)
        nbytes = int(raw.shape[0])
        blocks: list[tuple[int, Any, int]] = []  # per rank: (byte displacement, Access or None, bytes)
        for i, (c, d, layout) in enumerate(zip(counts, displs, layouts)):
            if c < 0 or d < 0:
                raise InvalidArgumentError(f"{what}: rank {i}'s count {c} or displacement {d} is negative", op=name,
                                           rank=self._rank)
            if c == 0 or layout.elements == 0:
                blocks.append((d, None, 0))
                continue
            try:
                if d > nbytes:
                    raise ValueError(f"displacement {d} is past the end")
                access = layout.access(c, nbytes - d)
            except ValueError as exc:
                raise InvalidArgumentError(
                    f"{what}: rank {i}'s block ({c} elements at byte {d}) does not fit the {nbytes}-byte buffer ({exc})",
                    op=name, rank=self._rank) from None
            if device and not access.contiguous:
                raise InvalidArgumentError(f"{what}: rank {i}'s datatype has gaps; derived datatypes with gaps take host "
                                           "buffers", op=name, rank=self._rank)
            blocks.append((d, access, access.count * layout.base.itemsize))
        if writable:  # contiguous blocks written twice: MPI forbids it
            spans = [(d + a.offset, n) for d, a, n in blocks if a is not None and a.contiguous]
            try:
                buffers._check_disjoint([n for _, n in spans], [s for s, _ in spans], what, name)
            except InvalidArgumentError as err:
                raise InvalidArgumentError(err.cause.replace("elements", "bytes"), op=name, rank=self._rank) from None
        return _WSide(raw, blocks)

    def _w_bottom(self, counts: list, displs: list, layouts: list, what: str, name: str) -> "_WSide":
        """An Alltoallw side at MPI.BOTTOM: each block's bytes lie at absolute host addresses (its datatype's
        displacements from ``MPI.Get_address``, plus its byte displacement). The side's buffer is a byte array
        made over the span from the lowest to the highest address touched, kept only for the call."""
        runs: list = []  # per rank: (absolute starts, lengths, layout) or None
        lo, hi = None, None
        for i, (c, d, layout) in enumerate(zip(counts, displs, layouts)):
            if c < 0 or d < 0:
                raise InvalidArgumentError(f"{what}: rank {i}'s count {c} or displacement {d} is negative", op=name,
                                           rank=self._rank)
            if c == 0 or layout.elements == 0:
                runs.append(None)
                continue
            starts, lengths = layout._runs(np.arange(c, dtype=np.int64))
            starts = starts + d
            first, last = int(starts.min()), int((starts + lengths * layout.base.itemsize).max())
            if first <= 0:
                raise InvalidArgumentError(f"{what}: rank {i}'s block starts at address {first}; with MPI.BOTTOM the "
                                           "datatype's displacements must be absolute addresses (MPI.Get_address)",
                                           op=name, rank=self._rank)
            lo = first if lo is None else min(lo, first)
            hi = last if hi is None else max(hi, last)
            runs.append((starts, lengths, layout))
        if lo is None:
            return _WSide(np.empty(0, np.uint8), [(0, None, 0) for _ in runs])
        import ctypes
        span = hi - lo
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(lo))
        blocks: list[tuple[int, Any, int]] = []
        for r in runs:
            if r is None:
                blocks.append((0, None, 0))
                continue
            starts, lengths, layout = r
            access = typemap.Access(layout.base, *typemap._merge(starts - lo, lengths, layout.base.itemsize), span)
            blocks.append((0, access, access.count * layout.base.itemsize))
        return _WSide(raw, blocks)

    def _alltoallw_plan(self, sendbuf: Any, recvbuf: Any, name: str) -> "_WPlan":
        """Check both sides here, then agree with every rank on the byte counts (one small Allgather), so that a
        mismatch, or a rank whose arguments were wrong, makes every rank raise before any data moves."""
        size = self._size
        plan: Optional[_WPlan] = None
        failure: Optional[BaseException] = None
        try:
            recv = self._w_side(recvbuf, "recvbuf", name, writable=True)
            if sendbuf is IN_PLACE:
                send = recv
            else:
                send = self._w_side(sendbuf, "sendbuf", name, writable=False)
                if buffers.overlaps(send.raw, recv.raw):
                    raise InvalidArgumentError("sendbuf and recvbuf overlap; pass MPI.IN_PLACE instead", op=name,
                                               rank=self._rank)
            plan = _WPlan(send, recv, sendbuf is IN_PLACE)
            mine = np.array(send.nbytes + recv.nbytes, np.int64)
        except (InvalidArgumentError, errors.NotProvidedError) as err:
            failure = err
            mine = np.full(2 * size, -1, np.int64)
        table = np.empty((size, 2 * size), np.int64)
        self.Allgather(mine, table)
        if failure is not None:
            raise failure
        assert plan is not None
        bad = [j for j in range(size) if table[j, 0] < 0]
        if bad:
            raise errors.RemoteError(f"rank {bad[0]} rejected its own arguments to this call", op=name, rank=self._rank,
                                     peers=bad)
        for j in range(size):  # j sends table[j, i] bytes to i, which expects table[i, size + j]
            for i in range(size):
                sent, expected = int(table[j, i]), int(table[i, size + j])
                if sent != expected:
                    raise errors.MismatchError(
                        f"rank {j} sends {sent} bytes to rank {i}, which expects {expected} bytes from it", op=name,
                        rank=self._rank, peers=sorted({i, j} - {self._rank}))
        return plan

    def _alltoallw_call(self, plan: "_WPlan") -> tuple[Call, Sig]:
        recv_arr, rcounts, rdispls = plan.recv.target(fill=plan.in_place)
        if plan.in_place:  # each block is sent from where the block from that rank is received
            send_arr, scounts, sdispls = recv_arr, rcounts, rdispls
        else:
            send_arr, scounts, sdispls = plan.send.gathered()
        call = Call("alltoall", np.dtype(np.uint8), send_arr, recv_arr, counts=rcounts, displs=rdispls,
                    send_counts=scounts, send_displs=sdispls, in_place=plan.in_place, vector=True)
        return call, self._sig(call, 0)

    def Alltoallw(self, sendbuf: Any, recvbuf: Any) -> None:  # noqa: N802
        self._x.run("Alltoallw", self._alltoallw_call, (self._alltoallw_plan(sendbuf, recvbuf, "Alltoallw"),))

    def Ialltoallw(self, sendbuf: Any, recvbuf: Any) -> Request:  # noqa: N802
        return self._x.start("Ialltoallw", self._alltoallw_call, (self._alltoallw_plan(sendbuf, recvbuf, "Ialltoallw"),))

    def _barrier_call(self) -> tuple[Call, Sig]:
        call = Call("barrier", np.dtype(np.uint8))
        return call, self._sig(call)

    def Barrier(self) -> None:  # noqa: N802
        self._x.run("Barrier", self._barrier_call, ())

    def Ibarrier(self) -> Request:  # noqa: N802
        return self._x.start("Ibarrier", self._barrier_call, ())

    # ---- point-to-point ------------------------------------------------------------------------
    def _peer(self, peer: int, opname: str, allow_any: bool) -> int:
        if not isinstance(peer, (int, np.integer)):  # before any comparison: an array would compare elementwise
            raise InvalidArgumentError(f"rank {peer!r} is not an integer", op=opname, rank=self._rank)
        if peer == PROC_NULL or (allow_any and peer == ANY_SOURCE):
            return int(peer)
        if not 0 <= peer < self._size:
            raise InvalidArgumentError(f"rank {peer!r} is not in this {self._size}-rank communicator", op=opname, rank=self._rank)
        return self._world[int(peer)]

    def _tag(self, tag: int, opname: str, allow_any: bool) -> int:
        if not isinstance(tag, (int, np.integer)) or (tag < 0 and not (allow_any and tag == ANY_TAG)):
            raise InvalidArgumentError(f"tag {tag!r} must be a non-negative integer", op=opname, rank=self._rank)
        if tag > _TAG_MAX:
            raise InvalidArgumentError(f"tag {tag!r} is above the largest tag, {_TAG_MAX}", op=opname, rank=self._rank)
        return int(tag)

    def _p2p_ready(self, opname: str) -> Owner:
        """The communicator's point-to-point base owner, after the liveness checks (cheap while nothing failed)."""
        if self._freed or self._aborted is not None or self._engine.broken_ctxs:
            self._live(opname)
        try:
            return self._p2p_base
        except AttributeError:
            self._p2p_base: Owner = self._owner("point-to-point", self._ctx)
            return self._p2p_base

    def _eager_ok(self, peer: int, tag: int, any_tag: bool = False) -> bool:
        """Whether a call naming ``peer`` (a rank here) and ``tag`` (>= 0, or ANY_TAG for a receive) may take the
        engine's eager path: plain ints in range on a live communicator; anything else goes through the checks of
        the posted path."""
        return (type(peer) is int and type(tag) is int and 0 <= peer < self._size and (0 <= tag <= _TAG_MAX or any_tag and tag == ANY_TAG)
                and not (self._freed or self._aborted is not None or self._engine.broken_ctxs))

    def _isend_array(self, arr: np.ndarray, dest: int, tag: int, opname: str) -> Any:
        """The engine's send request (None for PROC_NULL); arguments checked in the common case by type alone."""
        base = self._p2p_ready(opname)
        if type(dest) is int and type(tag) is int and 0 <= dest < self._size and 0 <= tag <= _TAG_MAX:
            peer = self._world[dest]
        else:
            peer = self._peer(dest, opname, False)
            tag = self._tag(tag, opname, False)
            if peer == PROC_NULL:
                return None
        return self._engine.isend(peer, arr, self._ctx, tag, P2P_SIG, base.call(opname, "dest", dest, tag))

    def _irecv_array(self, arr: Optional[np.ndarray], source: int, tag: int, opname: str) -> Any:
        """The engine's receive request (None for PROC_NULL)."""
        base = self._p2p_ready(opname)
        if type(source) is int and type(tag) is int and 0 <= source < self._size and -1 <= tag <= _TAG_MAX:
            peer = self._world[source]
        else:
            peer = self._peer(source, opname, True)
            tag = self._tag(tag, opname, True)
            if peer == PROC_NULL:
                return None
        return self._engine.irecv(peer, arr, self._ctx, tag, None, base.call(opname, "source", source, tag))

    def _p2p_buf(self, buf: Any, opname: str, writable: bool = False) -> np.ndarray:
        """A host buffer for point-to-point, as flat bytes; device buffers are for collectives only in this build."""
        try:
            arr = buffers.parse_bytes(buf, "buf", opname, writable)
        except InvalidArgumentError as exc:
            arr = _no_data(buf)
            if arr is None:
                raise InvalidArgumentError(exc.cause, op=exc.op or opname, rank=self._rank) from None
        if arr is None:
            raise InvalidArgumentError("point-to-point calls take host buffers only; device buffers work in collectives",
                                       op=opname, rank=self._rank)
        return arr

    def _p2p_request(self, req: Any, recv: bool = False, finish: Optional[Callable] = None) -> Request:
        if req is None:
            return Request.completed(Status._of(PROC_NULL, ANY_TAG, 0) if recv else None)
        return Request(self._engine, self, p2p=req, finish=finish)

    def _p2p_wait(self, req: Any, status: Optional[Status] = None) -> None:
        """Complete a blocking call's request: wait, raise its error, fill the status."""
        if req is None:
            if status is not None:
                status._fill(Status._of(PROC_NULL, ANY_TAG, 0))
            return
        if not req.done:
            self._engine.wait_one(req, self.timeout)
        if req.error is not None:
            raise req.error
        if status is not None:
            status.source, status.tag, status.nbytes = self._to_comm[req.source], req.recv_tag, req.nbytes

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request:  # noqa: N802
        arr = self._fast.isend(buf, dest, tag)
        if arr is True:
            return Request._finished(None)  # an eager send: the frame is in the peer's ring, the buffer free again
        if type(arr) is not np.ndarray:  # a rendezvous announced: done when the peer acknowledges it
            return Request._started(self._engine, self, arr)
        if self._eager_ok(dest, tag) and self._engine.send_eager(self._world[dest], arr, self._ctx, tag):
            return Request._finished(None)  # an eager send: the frame is in the peer's ring, the buffer free again
        return self._p2p_request(self._isend_array(arr, dest, tag, "Isend"))

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:  # noqa: N802
        arr = self._fast.send(buf, dest, tag)
        if arr is None:
            return
        if self._eager_ok(dest, tag) and self._engine.send_eager(self._world[dest], arr, self._ctx, tag):
            return
        self._p2p_wait(self._isend_array(arr, dest, tag, "Send"))

    Rsend = Send  # ready mode: the receive is posted already; pycoll does not need to know

    def Irsend(self, buf: Any, dest: int, tag: int = 0) -> Request:  # noqa: N802
        return self._p2p_request(self._isend_array(self._p2p_buf(buf, "Irsend"), dest, tag, "Irsend"))

    def _issend_array(self, arr: np.ndarray, dest: int, tag: int, opname: str) -> Any:
        """The engine's synchronous send request (None for PROC_NULL): done once the receiver matched it."""
        base = self._p2p_ready(opname)
        peer = self._peer(dest, opname, False)
        tag = self._tag(tag, opname, False)
        if peer == PROC_NULL:
            return None
        return self._engine.issend(peer, arr, self._ctx, tag, base.call(opname, "dest", dest, tag))

    def Ssend(self, buf: Any, dest: int, tag: int = 0) -> None:  # noqa: N802
        """Send, returning once a receive on ``dest`` matched the message (synchronous mode)."""
        self._p2p_wait(self._issend_array(self._p2p_buf(buf, "Ssend"), dest, tag, "Ssend"))

    def Issend(self, buf: Any, dest: int, tag: int = 0) -> Request:  # noqa: N802
        """Nonblocking synchronous send: the request completes once a receive on ``dest`` matched the message."""
        return self._p2p_request(self._issend_array(self._p2p_buf(buf, "Issend"), dest, tag, "Issend"))

    def _bsend_array(self, arr: np.ndarray, dest: int, tag: int, opname: str, copy: bool = True) -> None:
        """Buffered mode: a copy of ``arr`` leaves in the background (later calls move it; a failure shows there,
        or in Flush_buffer, which waits for the sends still under way)."""
        req = self._isend_array(arr.copy() if copy else arr, dest, tag, opname)
        if req is not None and not req.done:
            pending = self.__dict__.setdefault("_bsends", [])
            if len(pending) >= 64:
                pending[:] = [r for r in pending if not r.done]
            pending.append(req)
            _BSENDING.add(self)

    # ---- buffered-mode buffers (MPI-4.1): kept and given back; pycoll's buffered sends copy into memory of their own
    def Attach_buffer(self, buf: Any) -> None:  # noqa: N802
        """Attach a buffer for this communicator's buffered sends: writable memory (e.g. from MPI.Alloc_mem),
        or None / MPI.BUFFER_AUTOMATIC. pycoll's Bsend copies each message into memory of its own and never
        runs out of space, so the buffer is only kept, not used, until Detach_buffer gives it back."""
        self._live("Attach_buffer")
        self.__dict__["_attached"] = attach_buffer(self.__dict__.get("_attached"), buf, "Attach_buffer", self._rank)

    def Detach_buffer(self) -> Any:  # noqa: N802
        """Give back the object Attach_buffer kept (BUFFER_AUTOMATIC for automatic buffering; None if nothing
        is attached). It returns at once: no buffered message lives in the buffer (Flush_buffer waits for them)."""
        self._live("Detach_buffer")
        return self.__dict__.pop("_attached", None)

    def Flush_buffer(self) -> None:  # noqa: N802
        """Wait until every buffered send made on this communicator has left (raises the first one's error)."""
        self._live("Flush_buffer")
        self._flush_bsends()

    def Iflush_buffer(self) -> Request:  # noqa: N802
        """Flush_buffer, then a request that is already complete."""
        self.Flush_buffer()
        return Request.completed()

    def _flush_bsends(self) -> None:
        pending = self.__dict__.pop("_bsends", [])
        _BSENDING.discard(self)
        first: Optional[BaseException] = None
        for req in pending:
            if not req.done:
                try:
                    self._engine.wait_one(req, self.timeout)
                except Exception as exc:  # noqa: BLE001 - the first failure is raised once every send was waited
                    first = first or exc
            first = first or req.error
        if first is not None:
            raise first

    def Bsend(self, buf: Any, dest: int, tag: int = 0) -> None:  # noqa: N802
        """Buffered send: returns at once, the message copied (pycoll needs no attached buffer)."""
        self._bsend_array(self._p2p_buf(buf, "Bsend"), dest, tag, "Bsend")

    def Ibsend(self, buf: Any, dest: int, tag: int = 0) -> Request:  # noqa: N802
        """Nonblocking buffered send: the request is complete once the message is copied, at once."""
        return self._p2p_request(self._bsend_array(self._p2p_buf(buf, "Ibsend"), dest, tag, "Ibsend"))

    def Irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:  # noqa: N802
        arr = self._fast.irecv(buf, source, tag)
        if type(arr) is tuple:  # the message was next in the peer's ring: taken
            return Request._received(source, arr[0], arr[1])
        if type(arr) is not np.ndarray:  # posted in the engine
            return Request._started(self._engine, self, arr)
        if self._eager_ok(source, tag, True):  # a matching message already at the head of the peer's ring: taken now
            got = self._engine.take_now(self._world[source], arr, self._ctx, tag)
            if got is not None:
                return Request._received(source, got[1], got[0])
        return self._p2p_request(self._irecv_array(arr, source, tag, "Irecv"), True)

    def Recv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> None:  # noqa: N802
        arr = self._fast.recv(buf, source, tag, status)
        if arr is None:
            return
        if self._eager_ok(source, tag, True):
            got = self._engine.recv_eager(self._world[source], arr, self._ctx, tag)
            if got is not None:
                if status is not None:
                    status.source, status.tag, status.nbytes = source, got[1], got[0]
                return
        self._p2p_wait(self._irecv_array(arr, source, tag, "Recv"), status)

    def Sendrecv(  # noqa: N802
        self,
        sendbuf: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
        status: Optional[Status] = None,
    ) -> None:
        got = self._fast.sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag, status)
        if got is None:
            return
        sarr, rarr = got
        sreq = None
        if self._eager_ok(dest, sendtag) and self._eager_ok(source, recvtag, True):
            engine = self._engine
            if sarr.nbytes <= engine.eager_max:
                got = engine.sendrecv_eager(self._world[dest], sarr, sendtag, self._world[source], rarr, recvtag, self._ctx)
                if got is not False:  # the send left whole, so receiving after it cannot deadlock
                    if got is True:
                        self._p2p_wait(self._irecv_array(rarr, source, recvtag, "Sendrecv"), status)
                    elif status is not None:
                        status.source, status.tag, status.nbytes = source, got[1], got[0]
                    return
            else:  # announce (or queue) the send, take the peer's message straight from its ring, then the ack
                sreq = self._isend_array(sarr, dest, sendtag, "Sendrecv")
                got = engine.recv_eager(self._world[source], rarr, self._ctx, recvtag)
                if got is not None:
                    if status is not None:
                        status.source, status.tag, status.nbytes = source, got[1], got[0]
                    self._p2p_wait(sreq)
                    return
        rreq = self._irecv_array(rarr, source, recvtag, "Sendrecv")
        if sreq is None:
            sreq = self._isend_array(sarr, dest, sendtag, "Sendrecv")
        pending = [r for r in (rreq, sreq) if r is not None and not r.done]
        if pending:
            self._engine.wait_requests(pending, self.timeout, pending[0].owner)
        try:
            self._p2p_wait(rreq, status)
        finally:
            self._p2p_wait(sreq)

    def Sendrecv_replace(  # noqa: N802
        self, buf: Any, dest: int, sendtag: int = 0, source: int = ANY_SOURCE, recvtag: int = ANY_TAG, status: Optional[Status] = None
    ) -> None:
        """Send ``buf``'s contents to ``dest`` and replace them with the message from ``source``."""
        arr = self._p2p_buf(buf, "Sendrecv_replace", writable=True)
        self.Sendrecv(arr.copy(), dest, sendtag, arr, source, recvtag, status)

    def _pair(self, rreq: Any, sreq: Any) -> Request:
        """One request for a receive and a send (either None for PROC_NULL); its status is the receive's."""
        if rreq is None:
            req = self._p2p_request(sreq)
            req._status = Status._of(PROC_NULL, ANY_TAG, 0)
            return req
        req = Request(self._engine, self, p2p=rreq)
        if sreq is not None:
            req._more = (sreq,)
        return req

    def Isendrecv(  # noqa: N802
        self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None, source: int = ANY_SOURCE, recvtag: int = ANY_TAG
    ) -> Request:
        """Nonblocking Sendrecv: one request for both transfers."""
        rarr = self._p2p_buf(recvbuf, "Isendrecv", writable=True)
        sarr = self._p2p_buf(sendbuf, "Isendrecv")
        rreq = self._irecv_array(rarr, source, recvtag, "Isendrecv")
        return self._pair(rreq, self._isend_array(sarr, dest, sendtag, "Isendrecv"))

    def Isendrecv_replace(  # noqa: N802
        self, buf: Any, dest: int, sendtag: int = 0, source: int = ANY_SOURCE, recvtag: int = ANY_TAG
    ) -> Request:
        """Nonblocking Sendrecv_replace."""
        arr = self._p2p_buf(buf, "Isendrecv_replace", writable=True)
        sarr = arr.copy()  # before the receive is posted: a buffered message may land at once
        rreq = self._irecv_array(arr, source, recvtag, "Isendrecv_replace")
        return self._pair(rreq, self._isend_array(sarr, dest, sendtag, "Isendrecv_replace"))

    # ---- probes and matched receives --------------------------------------------------------------
    def _probe(self, opname: str, source: int, tag: int, status: Optional[Status], block: bool, take: bool) -> Any:
        """The engine's message a receive of (source, tag) would take (None: none yet; MESSAGE_NO_PROC for
        PROC_NULL), its status filled; ``take`` (matched probes) reserves it for a Message's receive."""
        base = self._p2p_ready(opname)
        peer = self._peer(source, opname, True)
        tag = self._tag(tag, opname, True)
        if peer == PROC_NULL:
            if status is not None:
                status._fill(Status._of(PROC_NULL, ANY_TAG, 0))
            return MESSAGE_NO_PROC
        engine = self._engine
        if block:
            found = engine.probe(peer, self._ctx, tag, base.call(opname, "source", source, tag), self.timeout, take)
        else:
            found = engine.iprobe(peer, self._ctx, tag, take)
        if found is not None and status is not None:
            status._fill(Status._of(self._to_comm[found.src], found.tag, found.nbytes))
        return found

    def Probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> bool:  # noqa: N802
        """Block until a message that a receive of (source, tag) would take has arrived; it stays there. True."""
        self._probe("Probe", source, tag, status, True, False)
        return True

    def Iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> bool:  # noqa: N802
        """Whether a message that a receive of (source, tag) would take has arrived (status filled if so)."""
        return self._probe("Iprobe", source, tag, status, False, False) is not None

    def _message(self, found: Any) -> Message:
        return Message(MESSAGE_NO_PROC) if found is MESSAGE_NO_PROC else Message._of(self, found)

    def Mprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> Message:  # noqa: N802
        """Block until a message of (source, tag) has arrived, and take it: only the returned Message receives it."""
        return self._message(self._probe("Mprobe", source, tag, status, True, True))

    def Improbe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> Optional[Message]:  # noqa: N802
        """Mprobe without blocking: the Message, or None if no such message has arrived."""
        found = self._probe("Improbe", source, tag, status, False, True)
        return None if found is None else self._message(found)

    probe = Probe
    iprobe = Iprobe
    mprobe = Mprobe
    improbe = Improbe

    def _mrecv(self, found: Any, buf: Any, status: Optional[Status], opname: str) -> None:
        """Receive a matched message into ``buf``."""
        arr = self._p2p_buf(buf, opname, writable=True)
        owner = self._p2p_ready(opname).call(opname, "source", self._to_comm[found.src], found.tag)
        self._p2p_wait(self._engine.mrecv(found, arr, owner), status)

    def _imrecv(self, found: Any, buf: Any, opname: str, obj: bool = False) -> Request:
        """A request receiving a matched message: into ``buf``, or (``obj``) as a lowercase receive's object."""
        arr = None if obj else self._p2p_buf(buf, opname, writable=True)
        owner = self._p2p_ready(opname).call(opname, "source", self._to_comm[found.src], found.tag)
        return Request(self._engine, self, p2p=self._engine.mrecv(found, arr, owner), finish=self._loads if obj else None)

    # ---- persistent requests --------------------------------------------------------------------
    def _persistent(self, opname: str, buf: Any, peer: int, tag: int, start: Callable[..., Any], recv: bool = False) -> Prequest:
        """An inactive persistent request; each Start runs ``start(flat bytes, peer, tag, opname)``. The arguments
        are checked now, as MPI does."""
        arr = self._p2p_buf(buf, opname, writable=recv)
        self._peer(peer, opname, recv)
        self._tag(tag, opname, recv)
        return Prequest._persistent(lambda: self._p2p_request(start(arr, peer, tag, opname), recv))

    def Send_init(self, buf: Any, dest: int, tag: int = 0) -> Prequest:  # noqa: N802
        """A persistent send: each Start sends ``buf``'s contents at that time."""
        return self._persistent("Send_init", buf, dest, tag, self._isend_array)

    def Ssend_init(self, buf: Any, dest: int, tag: int = 0) -> Prequest:  # noqa: N802
        return self._persistent("Ssend_init", buf, dest, tag, self._issend_array)

    def Bsend_init(self, buf: Any, dest: int, tag: int = 0) -> Prequest:  # noqa: N802
        return self._persistent("Bsend_init", buf, dest, tag, self._bsend_array)

    def Rsend_init(self, buf: Any, dest: int, tag: int = 0) -> Prequest:  # noqa: N802
        return self._persistent("Rsend_init", buf, dest, tag, self._isend_array)

    def Recv_init(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Prequest:  # noqa: N802
        """A persistent receive into ``buf``."""
        return self._persistent("Recv_init", buf, source, tag, self._irecv_array, recv=True)

    # ---- Python objects (pickle) ---------------------------------------------------------------
    @staticmethod
    def _dumps(obj: Any) -> np.ndarray:
        return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)

    @staticmethod
    def _loads(data: np.ndarray) -> Any:
        return pickle.loads(data.tobytes()) if data.size else None  # an empty message is None (mpi4py)

    def _allgather_bytes(self, data: np.ndarray) -> list[np.ndarray]:
        sizes = np.empty(self._size, np.int64)
        self.Allgather(np.array([data.size], np.int64), sizes)
        out = np.empty(int(sizes.sum()), np.uint8)
        counts = [int(s) for s in sizes]
        displs = [int(d) for d in np.concatenate(([0], np.cumsum(sizes)[:-1]))]
        self.Allgatherv(data, [out, counts, displs])
        return [out[d : d + c] for c, d in zip(counts, displs)]

    def _lock_table(self) -> dict:
        """mpi4py's per-communicator locks of the object methods, by name (``MPI._comm_lock_table``)."""
        table = self.__dict__.get("_locks")
        if table is None:
            with _LOCK_TABLES_LOCK:
                table = self.__dict__.setdefault("_locks", {})
        return table

    def _obj_lock(self, key: Any) -> Any:
        table = self._lock_table()
        lock = table.get(key)
        if lock is None:
            with _LOCK_TABLES_LOCK:
                lock = table.setdefault(key, threading.Lock())
        return lock

    def bcast(self, obj: Any = None, root: int = 0) -> Any:
        root = self._check_root(root, "bcast")
        with self._obj_lock("bcast"):  # as mpi4py: one thread at a time in this communicator's bcast
            data = self._dumps(obj) if self._rank == root else None
            size = np.array([data.size if data is not None else 0], np.int64)
            self.Bcast(size, root)
            if data is None:
                data = np.empty(int(size[0]), np.uint8)
            self.Bcast(data, root)
        return obj if self._rank == root else self._loads(data)

    def allgather(self, sendobj: Any) -> list[Any]:
        return [self._loads(b) for b in self._allgather_bytes(self._dumps(sendobj))]

    def allreduce(self, sendobj: Any, op: Any = _ops.SUM) -> Any:
        o = _ops.resolve(op)
        return o.reduce_objects(self.allgather(sendobj))

    def gather(self, sendobj: Any, root: int = 0) -> Optional[list[Any]]:
        root = self._check_root(root, "gather")
        data = self._dumps(sendobj)
        sizes = np.empty(self._size, np.int64) if self._rank == root else None
        self.Gather(np.array([data.size], np.int64), sizes, root)
        if self._rank != root:
            self.Gatherv(data, None, root)
            return None
        assert sizes is not None
        counts = [int(s) for s in sizes]
        out = np.empty(sum(counts), np.uint8)
        displs = [int(d) for d in np.concatenate(([0], np.cumsum(sizes)[:-1]))]
        self.Gatherv(data, [out, counts, displs], root)
        return [self._loads(out[d : d + c]) for c, d in zip(counts, displs)]

    def reduce(self, sendobj: Any, op: Any = _ops.SUM, root: int = 0) -> Any:
        o = _ops.resolve(op)
        values = self.gather(sendobj, root)
        return o.reduce_objects(values) if values is not None else None

    def scatter(self, sendobj: Optional[Sequence[Any]] = None, root: int = 0) -> Any:
        root = self._check_root(root, "scatter")
        size = np.empty(1, np.int64)
        if self._rank == root:
            if sendobj is None or len(sendobj) != self._size:
                raise InvalidArgumentError(f"scatter needs a sequence of {self._size} objects at the root", op="scatter", rank=self._rank)
            parts = [self._dumps(o) for o in sendobj]
            sizes = np.array([p.size for p in parts], np.int64)
            self.Scatter(sizes, size, root)
            self.Scatterv([np.concatenate(parts) if parts else np.empty(0, np.uint8), [int(s) for s in sizes]], np.empty(parts[root].size, np.uint8), root)
            return sendobj[root]
        self.Scatter(None, size, root)
        data = np.empty(int(size[0]), np.uint8)
        self.Scatterv(None, data, root)
        return self._loads(data)

    def alltoall(self, sendobj: Sequence[Any]) -> list[Any]:
        if len(sendobj) != self._size:
            raise InvalidArgumentError(f"alltoall needs a sequence of {self._size} objects", op="alltoall", rank=self._rank)
        parts = [self._dumps(o) for o in sendobj]
        scounts = np.array([p.size for p in parts], np.int64)
        rcounts = np.empty(self._size, np.int64)
        self.Alltoall(scounts, rcounts)
        out = np.empty(int(rcounts.sum()), np.uint8)
        send = np.concatenate(parts) if parts else np.empty(0, np.uint8)
        self.Alltoallv([send, [int(c) for c in scounts]], [out, [int(c) for c in rcounts]])
        displs = np.concatenate(([0], np.cumsum(rcounts)[:-1]))
        return [self._loads(out[int(d) : int(d) + int(c)]) for c, d in zip(rcounts, displs)]

    def barrier(self) -> None:
        self.Barrier()

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        self._p2p_wait(self._isend_array(self._dumps(obj), dest, tag, "send"))

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        return self._p2p_request(self._isend_array(self._dumps(obj), dest, tag, "isend"))

    def ssend(self, obj: Any, dest: int, tag: int = 0) -> None:
        """Send an object, returning once a receive on ``dest`` matched it."""
        self._p2p_wait(self._issend_array(self._dumps(obj), dest, tag, "ssend"))

    def issend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        return self._p2p_request(self._issend_array(self._dumps(obj), dest, tag, "issend"))

    def bsend(self, obj: Any, dest: int, tag: int = 0) -> None:
        self._bsend_array(self._dumps(obj), dest, tag, "bsend", copy=False)

    def ibsend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        return self._p2p_request(self._bsend_array(self._dumps(obj), dest, tag, "ibsend", copy=False))

    def recv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> Any:
        if buf is not None:  # as mpi4py warns; pycoll sizes the receive to the message whatever buf says
            warnings.warn("recv(): the 'buf' argument is deprecated and ignored", UserWarning, stacklevel=2)
        return self._p2p_request(self._irecv_array(None, source, tag, "recv"), True, self._loads).wait(status)

    def irecv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        return self._p2p_request(self._irecv_array(None, source, tag, "irecv"), True, self._loads)

    def sendrecv(
        self, sendobj: Any, dest: int, sendtag: int = 0, recvbuf: Any = None, source: int = ANY_SOURCE, recvtag: int = ANY_TAG, status: Optional[Status] = None
    ) -> Any:
        rreq = self.irecv(None, source, recvtag)
        self.isend(sendobj, dest, sendtag).Wait()
        return rreq.wait(status)

    # ---- communicator management ---------------------------------------------------------------
    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """mpi4py's constructor forms besides pycoll's own: ``Comm()`` and ``Comm(COMM_NULL)`` give a null
        communicator; ``Comm(comm)`` (or ``Intracomm(comm)``, ``Cartcomm(cart)``) another reference to ``comm``:
        a new object sharing its state, equal to it, as mpi4py's objects share one MPI handle."""
        if not kwargs and len(args) <= 1:
            comm = args[0] if args else None
            if comm is None or isinstance(comm, _NullComm):
                return _NullComm()
            if not isinstance(comm, cls):
                raise TypeError(f"expecting {'an' if cls.__name__[0] in 'AEIOU' else 'a'} {cls.__name__}, got {type(comm).__name__}")
            ref = super().__new__(cls)
            ref.__dict__ = comm.__dict__
            return ref
        return super().__new__(cls)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _NullComm):
            return self._freed  # a freed communicator equals COMM_NULL, as in mpi4py
        return isinstance(other, Comm) and other.__dict__ is self.__dict__

    def __hash__(self) -> int:
        return id(self.__dict__)

    def __reduce__(self) -> Any:
        """COMM_WORLD and COMM_SELF pickle by name; any other communicator cannot leave its process (mpi4py)."""
        for name, key in (("COMM_WORLD", "world"), ("COMM_SELF", "self")):
            if _PREDEFINED.get(key) is self and _predefined_by_name:
                return (_predefined_by_name[0], (name,))
            if _PREDEFINED.get(key) == self:  # another reference to it: unpickles as another reference
                return (type(self), (_PREDEFINED[key],))
        raise ValueError(f"cannot pickle {self!r}: a communicator is local to its process")

    def _child(self, world: list[int], ctx: int, name: str) -> "Comm":
        """A plain communicator over ``world`` (world ranks) with this one's timeout."""
        child = Comm(self._rt, world, ctx, name)
        child.timeout = self.timeout
        child._reproducible = self._reproducible
        return child

    def _derived(self, members: list[int], what: tuple, name: str) -> "Comm":
        """A communicator over ``members`` (ranks here, in order) that every rank knows without asking the others
        (from the layout, say): no agreement round. Collective in that every rank of this one calls it, members or
        not, in the same order with the same arguments; ``what`` tells it from its siblings. COMM_NULL outside."""
        self._children += 1
        if self._rank not in members:
            return COMM_NULL  # type: ignore[return-value]
        return self._child([self._world[r] for r in members], _child_ctx(self._ctx, self._children, what), name)

    def _copy(self, ctx: int, name: str) -> "Comm":
        """Dup's communicator: the same ranks (a topology communicator also keeps its topology)."""
        return self._child(list(self._world), ctx, name)

    def _agreed(self, opname: str, mine: Any, problem: str = "", same: bool = False) -> list[Any]:
        """Every rank's ``mine``, by one allgather. A rank that found its arguments bad passes ``problem``: it
        raises InvalidArgumentError, the others RemoteError naming it. With ``same``, ranks that passed different
        values all raise MismatchError."""
        from .errors import MismatchError, RemoteError

        table = self.allgather((problem, mine))
        bad = [r for r, (p, _) in enumerate(table) if p]
        if problem:
            raise InvalidArgumentError(problem, op=opname, rank=self._rank, peers=[r for r in bad if r != self._rank])
        if bad:
            raise RemoteError(f"rank {bad[0]} rejected its arguments ({table[bad[0]][0]})", op=opname, rank=self._rank, peers=bad)
        values = [m for _, m in table]
        if same and any(v != values[0] for v in values):
            odd = [r for r, v in enumerate(values) if v != values[0]]
            raise MismatchError(f"ranks passed different arguments: rank 0 {values[0]!r}, rank {odd[0]} {values[odd[0]]!r}",
                                op=opname, rank=self._rank, peers=odd)
        return values

    def Split(self, color: int = 0, key: int = 0) -> "Comm":  # noqa: N802
        """Collective: one communicator per color (a non-negative int), ranks ordered by (key, rank here);
        ``color=UNDEFINED`` gives COMM_NULL."""
        return self._split(color, key, "Split")

    def _split(self, color: Any, key: Any, opname: str, problem: str = "") -> "Comm":
        self._live(opname)
        self._children += 1
        if color is None:
            color = UNDEFINED
        if not problem:
            for what, value in (("color", color), ("key", key)):
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                    problem = f"{what} {value!r} is not an integer"
            if not problem and color < 0 and color != UNDEFINED:
                problem = f"color {color} is negative (colors are >= 0, or MPI.UNDEFINED)"
        mine = (int(color), int(key)) if not problem else None
        table = self._agreed(opname, mine, problem)
        if color == UNDEFINED:
            return COMM_NULL  # type: ignore[return-value]
        members = sorted((k, r) for r, (c, k) in enumerate(table) if c == color)
        world = [self._world[r] for _, r in members]
        ctx = _child_ctx(self._ctx, self._children, ("split", int(color)))
        return self._child(world, ctx, f"{self._name}.split({color})")

    def Split_type(self, split_type: int, key: int = 0, info: Any = None) -> "Comm":  # noqa: N802
        """Collective: ``COMM_TYPE_SHARED`` groups the ranks of one host (the runtime's host identity: ranks that
        share memory); ``UNDEFINED`` gives COMM_NULL. Other split types are refused on every rank."""
        problem = ""
        if split_type == UNDEFINED:
            color = UNDEFINED
        elif split_type == COMM_TYPE_SHARED:
            host = self._rt.peers[self._rt.rank].host_id
            color = min(p.rank for p in self._rt.peers if p.host_id == host)  # the same number on every rank of a host
        else:
            color, problem = UNDEFINED, f"split_type {split_type!r} is not MPI.COMM_TYPE_SHARED or MPI.UNDEFINED"
        child = self._split(color, key, "Split_type", problem)
        if child is not COMM_NULL:
            child._name = f"{self._name}.split_type(shared)"
        return child

    def Create(self, group: Any) -> "Comm":  # noqa: N802
        """Collective over this communicator: a communicator over ``group`` (processes of this one, in the
        group's order). Every rank passes the same group, or each the group it belongs to (disjoint groups);
        ranks outside their group get COMM_NULL."""
        op = "Create"
        self._live(op)
        self._children += 1
        problem, members = self._group_members(group, op)
        table = self._agreed(op, members, problem)
        for r, g in enumerate(table):
            if self._world[r] in g:
                odd = [self._to_comm[w] for w in g if table[self._to_comm[w]] != g]
                if odd:
                    from .errors import MismatchError

                    raise MismatchError(f"rank {r} passed group {list(g)} but its member rank {odd[0]} passed "
                                        f"{list(table[odd[0]])}", op=op, rank=self._rank, peers=[r] + odd)
        if self._rt.rank not in members:
            return COMM_NULL  # type: ignore[return-value]
        return self._child(list(members), _child_ctx(self._ctx, self._children, ("create", members)), f"{self._name}.create")

    def Create_group(self, group: Any, tag: int = 0) -> "Comm":  # noqa: N802
        """Collective over ``group`` only (the other ranks of this communicator do not call, or get COMM_NULL):
        a communicator over the group's processes. Concurrent calls with overlapping groups differ by ``tag``."""
        op = "Create_group"
        self._live(op)
        problem, members = self._group_members(group, op)
        if not problem and (isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or tag < 0):
            problem = f"tag {tag!r} must be a non-negative integer"
        if problem:
            raise InvalidArgumentError(problem, op=op, rank=self._rank)
        if self._rt.rank not in members:
            return COMM_NULL  # type: ignore[return-value]
        made = self.__dict__.setdefault("_group_children", {})  # calls so far per (group, tag): the same on every member
        made[(members, int(tag))] = count = made.get((members, int(tag)), 0) + 1
        return self._child(list(members), _child_ctx(self._ctx, 0, ("create_group", members, int(tag), count)),
                           f"{self._name}.create_group")

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

    def _group_members(self, group: Any, opname: str) -> tuple[str, tuple[int, ...]]:
        return _group_world(group, self._world, opname)

    def Get_group(self) -> Any:  # noqa: N802
        """A new group of this communicator's processes, in rank order."""
        from .group import Group

        self._live("Get_group")
        return Group._of(self._world, self._rt.rank)

    @property
    def group(self) -> Any:
        return self.Get_group()

    def Compare(self, comm: "Comm") -> int:  # noqa: N802
        """IDENT (the same communicator), CONGRUENT (same ranks in the same order), SIMILAR (same processes,
        other order) or UNEQUAL."""
        from .group import CONGRUENT, IDENT, compare_members

        if not isinstance(comm, Comm):
            raise InvalidArgumentError(f"cannot compare a communicator with {comm!r}", op="Compare", rank=self._rank)
        if comm is self:
            return IDENT
        result = compare_members(self._world, comm._world)
        return CONGRUENT if result == IDENT else result

    def Get_topology(self) -> int:  # noqa: N802
        return UNDEFINED  # a topology communicator answers its kind

    @property
    def topology(self) -> int:
        return self.Get_topology()

    @property
    def is_topo(self) -> bool:
        return False

    @property
    def is_inter(self) -> bool:
        return False

    @property
    def is_intra(self) -> bool:
        return True

    @property
    def name(self) -> str:
        return self.Get_name()

    @name.setter
    def name(self, value: str) -> None:
        self.Set_name(value)

    def toint(self) -> int:
        """-1: a pycoll communicator has no integer (C or Fortran) handle, which mpi4py's callers check for."""
        return -1

    py2f = toint

    # The topology communicators (pycoll.topology_comm) subclass Comm, so this module cannot import them; that
    # module registers its constructors here when it is imported (pycoll.MPI imports it).
    def Create_cart(self, dims: Sequence[int], periods: Any = None, reorder: bool = False) -> Any:  # noqa: N802
        """Collective: a Cartcomm laying the first prod(dims) ranks out on the grid, in rank order (``reorder``
        is accepted; pycoll keeps the order); the other ranks get COMM_NULL."""
        return _topologies("Create_cart").create_cart(self, dims, periods)

    def Cart_map(self, dims: Sequence[int], periods: Any = None) -> int:  # noqa: N802
        """The rank this process would have in ``Create_cart(dims, periods, reorder=True)``: its own, or
        UNDEFINED past the grid."""
        return _topologies("Cart_map").cart_map(self, dims, periods)

    def Create_graph(self, index: Sequence[int], edges: Sequence[int], reorder: bool = False) -> Any:  # noqa: N802
        """Collective: a Graphcomm over the first len(index) ranks (node i's neighbors are
        edges[index[i-1]:index[i]]); the other ranks get COMM_NULL. ``reorder`` is accepted; the order stays."""
        return _topologies("Create_graph").create_graph(self, index, edges)

    def Graph_map(self, index: Sequence[int], edges: Sequence[int]) -> int:  # noqa: N802
        return _topologies("Graph_map").graph_map(self, index, edges)

    def Create_dist_graph_adjacent(  # noqa: N802
        self, sources: Optional[Sequence[int]], destinations: Optional[Sequence[int]], sourceweights: Any = None,
        destweights: Any = None, info: Any = None, reorder: bool = False,
    ) -> Any:
        """Collective: a Distgraphcomm in which each rank names its own incoming and outgoing neighbors."""
        return _topologies("Create_dist_graph_adjacent").create_dist_graph_adjacent(
            self, sources, destinations, sourceweights, destweights)

    def Create_dist_graph(  # noqa: N802
        self, sources: Sequence[int], degrees: Sequence[int], destinations: Sequence[int], weights: Any = None,
        info: Any = None, reorder: bool = False,
    ) -> Any:
        """Collective: a Distgraphcomm from edges any rank may contribute (sources[i] to degrees[i] destinations)."""
        return _topologies("Create_dist_graph").create_dist_graph(self, sources, degrees, destinations, weights)

    def Dup(self, info: Any = None) -> "Comm":  # noqa: N802
        """A communicator over the same ranks with contexts of its own (a topology communicator keeps its
        topology). Its info hints: this one's (``info`` None), else those of the ``MPI.Info`` given
        (``INFO_NULL``: none), as Dup_with_info. pycoll keeps hints for Get_info; none changes what it does."""
        self._live("Dup")
        hints = dict(self._hints) if info is None else _info_items(info, "Dup", self._rank)
        self._children += 1
        child = self._copy(_child_ctx(self._ctx, self._children, "dup"), f"{self._name}.dup")
        child._hints = hints
        return child

    Clone = Dup

    def Dup_with_info(self, info: Any) -> "Comm":  # noqa: N802
        """Dup with the hints of ``info`` (an MPI.Info; INFO_NULL for none) instead of this communicator's."""
        self._live("Dup_with_info")
        if info is None:
            raise InvalidArgumentError("info must be an MPI.Info (MPI.INFO_NULL for no hints), not None",
                                       op="Dup_with_info", rank=self._rank)
        _info_items(info, "Dup_with_info", self._rank)
        return self.Dup(info)

    def Idup(self, info: Any = None) -> tuple["Comm", Request]:  # noqa: N802
        """Dup, and a request that is already complete (Dup sends nothing)."""
        return self.Dup(info), Request.completed()

    def Idup_with_info(self, info: Any) -> tuple["Comm", Request]:  # noqa: N802
        """Dup_with_info, and a request that is already complete."""
        return self.Dup_with_info(info), Request.completed()

    # ---- info hints: kept per communicator (shared by its references), returned by Get_info ----
    @property
    def _hints(self) -> dict[str, str]:
        return self.__dict__.setdefault("_hint_items", {})

    @_hints.setter
    def _hints(self, value: dict[str, str]) -> None:
        self.__dict__["_hint_items"] = value

    def Set_info(self, info: Any) -> None:  # noqa: N802
        """Add the hints of ``info`` (an MPI.Info) to this communicator's, a key set again taking the new
        value (INFO_NULL adds none). pycoll keeps them for Get_info; none changes what it does."""
        self._live("Set_info")
        if info is None:
            raise InvalidArgumentError("info must be an MPI.Info, not None", op="Set_info", rank=self._rank)
        self._hints.update(_info_items(info, "Set_info", self._rank))

    def Get_info(self) -> Any:  # noqa: N802
        """A new MPI.Info holding this communicator's hints (the caller frees it)."""
        from .info import Info

        self._live("Get_info")
        return Info.Create(self._hints)

    @property
    def info(self) -> Any:
        """Info hints: ``comm.info`` is Get_info(), ``comm.info = info`` Set_info(info)."""
        return self.Get_info()

    @info.setter
    def info(self, value: Any) -> None:
        self.Set_info(value)

    def Free(self) -> None:  # noqa: N802
        """Release the communicator: later calls on it raise, and it compares equal to COMM_NULL."""
        self._live("Free")
        self._freed = True
        self._x.clear()
        if self._arena is not None:
            self._arena.close()
        if self._ipc is not None:
            self._ipc.close()

    def free(self) -> None:
        """``Free`` unless already freed or predefined (COMM_WORLD, COMM_SELF)."""
        if not self._freed and not _is_predefined(self):
            self.Free()

    # the MPI features pycoll does not provide: each raises NotProvidedError (a NotImplementedError)
    def Create_intercomm(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        not_provided.refuse(not_provided.INTERCOMM, "Create_intercomm")

    def Spawn(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        not_provided.refuse(not_provided.DYNAMIC, "Spawn")

    def Spawn_multiple(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        not_provided.refuse(not_provided.DYNAMIC, "Spawn_multiple")

    def Accept(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        not_provided.refuse(not_provided.DYNAMIC, "Accept")

    def Connect(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        not_provided.refuse(not_provided.DYNAMIC, "Connect")

    def Disconnect(self) -> None:  # noqa: N802
        not_provided.refuse(not_provided.DYNAMIC, "Disconnect")

    @classmethod
    def Get_parent(cls) -> Any:  # noqa: N802
        not_provided.refuse(not_provided.DYNAMIC, "Get_parent")

    @classmethod
    def Join(cls, fd: int) -> Any:  # noqa: N802
        not_provided.refuse(not_provided.DYNAMIC, "Join")

    def Abort(self, errorcode: int = 1, *, terminate: bool = True) -> None:  # noqa: N802
        """Tear this communicator down, from any thread, without waiting for anyone.

        Calls waiting on it in other threads raise ``AbortedError`` within 50 ms, its peers raise an error
        naming this rank, and later calls on it raise ``AbortedError``. With ``terminate`` (MPI's meaning,
        the default) the process then exits with ``errorcode`` and the launcher stops the others; with
        ``terminate=False`` (NCCL's ncclCommAbort) the process and its other communicators live on.
        """
        err = AbortedError(f"Comm.Abort({errorcode}) was called on rank {self._rank}", op=f"Abort of {self._name}", rank=self._rank)
        self._aborted = err
        if terminate:  # the peers see this process go (closed sockets, exited pid) within their liveness check
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # exiting regardless
                    pass
            os._exit(errorcode)
        if self._size > 1:
            self._engine.request_abort(self._ctx & ~1, err, self._world)


class _NullComm:
    """``MPI.COMM_NULL``: equal to every null communicator (``MPI.Comm()``) and to freed ones; any call on it
    is an error."""

    def __repr__(self) -> str:
        return "<pycoll.MPI.COMM_NULL>"

    def __bool__(self) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _NullComm):
            return True
        return other._freed if isinstance(other, Comm) else NotImplemented

    def __hash__(self) -> int:
        return hash(_NullComm)

    def __reduce__(self) -> Any:
        return "COMM_NULL" if self is COMM_NULL else (_NullComm, ())

    def Get_name(self) -> str:  # noqa: N802
        return "MPI_COMM_NULL"

    def free(self) -> None:
        """Nothing to free (mpi4py's ``free`` skips null communicators)."""

    def __getattr__(self, name: str) -> Any:
        raise InvalidArgumentError(f"{name} called on MPI.COMM_NULL")


COMM_NULL = _NullComm()


class Intercomm:
    """mpi4py's intercommunicator class. ``Intercomm()`` is a null communicator, as in mpi4py; nothing makes
    a live one, since pycoll does not provide intercommunicators."""

    def __new__(cls, comm: Any = None) -> Any:
        if comm is None or isinstance(comm, _NullComm):
            return _NullComm()
        raise TypeError("expecting an intercommunicator (pycoll does not provide intercommunicators)")

    @classmethod
    def Create_from_groups(cls, *args: Any, **kwargs: Any) -> NoReturn:  # noqa: N802
        not_provided.refuse(not_provided.INTERCOMM, "Intercomm.Create_from_groups")


# ---- communicator management helpers ---------------------------------------------------------------
COMM_TYPE_SHARED = 1  # Split_type: the ranks of one host (MPICH's value)
_FROM_GROUP: dict[tuple[int, tuple[int, ...], str], int] = {}  # Create_from_group calls per (runtime, group, tag)


def _group_world(group: Any, world: Sequence[int], opname: str) -> tuple[str, tuple[int, ...]]:
    """``group``'s members (world ranks) and, when it cannot be used over ``world``, why ("" when it can)."""
    from .group import Group

    if not isinstance(group, Group):
        return f"expected an MPI.Group, got {type(group).__name__}", ()
    if not group:
        return "the group is MPI.GROUP_NULL", ()
    members = group.members
    allowed = set(world)
    outside = [w for w in members if w not in allowed]
    if outside:
        return f"the group holds processes outside this communicator (world ranks {outside})", ()
    return "", members


class _BufferAutomatic:
    """``MPI.BUFFER_AUTOMATIC``: attach it (or None) to ask for automatic buffering; Detach_buffer returns it."""

    def __repr__(self) -> str:
        return "<pycoll.MPI.BUFFER_AUTOMATIC>"

    def __bool__(self) -> bool:
        return False

    def __int__(self) -> int:
        return 0

    def __reduce__(self) -> str:
        return "BUFFER_AUTOMATIC"


BUFFER_AUTOMATIC = _BufferAutomatic()
_BSENDING: "weakref.WeakSet[Comm]" = weakref.WeakSet()  # communicators with buffered sends maybe under way


def attach_buffer(current: Any, buf: Any, opname: str, rank: Optional[int] = None) -> Any:
    """What an Attach_buffer call keeps: ``buf`` checked (writable memory, None or BUFFER_AUTOMATIC, which
    None becomes), when nothing (``current`` None) is attached yet."""
    if current is not None:
        raise InvalidArgumentError("a buffer is attached already; Detach_buffer it first", op=opname, rank=rank)
    if buf is None or buf is BUFFER_AUTOMATIC:
        return BUFFER_AUTOMATIC
    try:
        readonly = memoryview(buf).readonly
    except TypeError:  # not the buffer protocol: an array exporter (NumPy, DLPack, CUDA) also serves
        if not any(hasattr(buf, a) for a in ("__array_interface__", "__cuda_array_interface__", "__dlpack__")):
            raise InvalidArgumentError(f"expected writable memory (e.g. MPI.Alloc_mem), None or MPI.BUFFER_AUTOMATIC, "
                                       f"got {type(buf).__name__}", op=opname, rank=rank) from None
        readonly = False
    if readonly:
        raise InvalidArgumentError(f"the {type(buf).__name__} to attach is read-only", op=opname, rank=rank)
    return buf


def flush_all_bsends() -> None:
    """Wait for the buffered sends of every communicator (MPI.Flush_buffer, MPI.Detach_buffer)."""
    for comm in list(_BSENDING):
        comm._flush_bsends()


def _info_items(info: Any, opname: str, rank: Optional[int] = None) -> dict[str, str]:
    """The (key, value) items of an MPI.Info, as a dict ({} for INFO_NULL); anything else is refused."""
    from .info import Info

    if not isinstance(info, Info):
        raise InvalidArgumentError(f"info must be an MPI.Info, not {type(info).__name__}", op=opname, rank=rank)
    return dict(info.items())


# pycoll.topology_comm's constructors of Cartcomm, Graphcomm and Distgraphcomm, registered by it when imported
_topology_constructors: list[Any] = []


def register_topologies(constructors: Any) -> None:
    """Called by pycoll.topology_comm: the object whose functions build topology communicators from a Comm."""
    _topology_constructors[:] = [constructors]


def _topologies(op: str) -> Any:
    if not _topology_constructors:
        raise InvalidArgumentError("topology communicators come with pycoll.MPI: import it first", op=op)
    return _topology_constructors[0]


# COMM_WORLD and COMM_SELF ("world", "self") once ``pycoll.MPI`` made them, and its function that returns one by
# its MPI name, which a pickled one calls to unpickle: both set there, the only place they are made
_PREDEFINED: dict[str, Comm] = {}
_predefined_by_name: list[Callable[[str], Comm]] = []


def _is_predefined(comm: Comm) -> bool:
    return any(c == comm for c in _PREDEFINED.values())


def world_comm(runtime: Runtime) -> Comm:
    return Comm(runtime, list(range(runtime.size)), _WORLD_CTX, "MPI_COMM_WORLD")


def group_comm(runtime: Runtime, world_ranks: Sequence[int], key: str) -> Comm:
    """A communicator over ``world_ranks`` built without a collective call: every member passes the same ``key``,
    which names it and keeps its messages apart from every other communicator's."""
    ranks = [int(r) for r in world_ranks]
    return Comm(runtime, ranks, _child_ctx(_WORLD_CTX, -2, (key, tuple(ranks))), key)


def self_comm(runtime: Runtime) -> Comm:
    return Comm(runtime, [runtime.rank], _child_ctx(_WORLD_CTX, -1, ("self", runtime.rank)), "MPI_COMM_SELF")
