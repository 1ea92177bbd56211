"""The communicator: mpi4py's buffer and object API, argument checks, and dispatch to algorithms."""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
import sys
from typing import Any, Callable, Optional, Sequence

import numpy as np

from . import buffers, datatypes
from . import ops as _ops
from .algorithms import Call, Layout
from .algorithms.cuda_ipc import IpcState
from .algorithms.shared import ArenaState, arena_enabled
from .buffers import IN_PLACE, Buf, VBuf
from .errors import AbortedError, InvalidArgumentError
from .executor import Executor
from .ops import Op
from .p2p import ANY_SOURCE, ANY_TAG, P2P_SIG, PROC_NULL, Owner, Sig
from .request import Request, Status
from .runtime import Runtime
from .transport.shm import SHM_DIR

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


def _vhash(values: Sequence[int]) -> int:
    digest = hashlib.blake2b(struct.pack(f"<{len(values)}q", *values), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def _child_ctx(parent: int, counter: int, tag: Any) -> int:
    digest = hashlib.blake2b(repr((parent, counter, tag)).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & ~1) % ((1 << 63) - 2) + 4  # even, never the world or control ctx


class Comm:
    """An intracommunicator: a group of ranks with its own message contexts and timeout."""

    def __init__(self, runtime: Runtime, world_ranks: list[int], ctx: int, name: str) -> None:
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
        self._layout = Layout.from_ids([runtime.peers[w].host_id for w in world_ranks], runtime.ring_of(world_ranks))
        self._arena: Optional[ArenaState] = None
        if self._size > 1 and self._layout.hosts == 1 and arena_enabled():
            self._arena = ArenaState(os.path.join(SHM_DIR.get(), f"pycoll-{runtime.info.job_id}-arena-{ctx:x}"))
        # device buffers of one host: CUDA IPC buffers, set up by the first device call that selects them
        self._ipc: Optional[IpcState] = IpcState() if self._arena is not None else None
        self._x = Executor(self, _describe)  # runs every collective: plans, selection, inline arena calls

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
            raise InvalidArgumentError(f"root {root!r} is not a rank of this {self._size}-rank communicator", op=opname, rank=self._rank)
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

    def _sig(self, call: Call, count: int = 0, vhash: int = 0, op: Optional[Op] = None) -> Sig:
        code = datatypes.from_numpy(call.dtype).code if call.coll != "barrier" else 0
        return Sig(_KINDS[call.coll], code, op.code if op else 0, call.root, count, vhash)

    def _failed(self, sched: Any) -> None:
        """A nonblocking call failed (its request found it): tell the peers (see ``Executor.failed``)."""
        self._x.failed(sched)

    def _run(self, label: str, build: Callable[..., tuple[Call, Sig]], *args: Any, stream: Any = None) -> None:
        self._x.run(label, build, args, stream)

    def _start(self, label: str, build: Callable[..., tuple[Call, Sig]], *args: Any, stream: Any = None) -> Request:
        return self._x.start(label, build, args, stream)

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
        if sendbuf is IN_PLACE:
            send = recv
        else:
            send = self._send(sendbuf, name)
            self._same_type(send.dtype, recv.dtype, name)
            if send.count != recv.count:
                raise InvalidArgumentError(f"sendbuf has {send.count} elements, recvbuf {recv.count}", op=name, rank=self._rank)
            self._distinct(send.array, recv.array, name)
        o = self._check_op(op, recv.dtype, name)
        call = Call(coll, recv.dtype, send.array, recv.array, o, in_place=sendbuf is IN_PLACE)
        return call, self._sig(call, recv.count, op=o)

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> None:  # noqa: N802
        self._run("Allreduce", self._allreduce_call, sendbuf, recvbuf, op, stream=stream)

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Iallreduce", self._allreduce_call, sendbuf, recvbuf, op, stream=stream)

    def _reduce_call(self, sendbuf: Any, recvbuf: Any, op: Any, root: int) -> tuple[Call, Sig]:
        name = "Reduce"
        root = self._check_root(root, name)
        at_root = self._rank == root
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
        o = self._check_op(op, send.dtype, name)
        call = Call("reduce", send.dtype, send.array, recv.array if recv else None, o, root=root, in_place=sendbuf is IN_PLACE)
        return call, self._sig(call, send.count, op=o)

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        self._run("Reduce", self._reduce_call, sendbuf, recvbuf, op, root, stream=stream)

    def Ireduce(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Ireduce", self._reduce_call, sendbuf, recvbuf, op, root, stream=stream)

    # ---- prefix reductions (Scan, Exscan) ------------------------------------------------------
    def Scan(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> None:  # noqa: N802
        """Inclusive prefix reduction: rank r gets op(x_0, ..., x_r), combined in rank order."""
        self._run("Scan", self._allreduce_call, sendbuf, recvbuf, op, "scan", stream=stream)

    def Iscan(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Iscan", self._allreduce_call, sendbuf, recvbuf, op, "scan", stream=stream)

    def Exscan(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> None:  # noqa: N802
        """Exclusive prefix reduction: rank r > 0 gets op(x_0, ..., x_{r-1}); rank 0's recvbuf is left untouched."""
        self._run("Exscan", self._allreduce_call, sendbuf, recvbuf, op, "exscan", stream=stream)

    def Iexscan(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Iexscan", self._allreduce_call, sendbuf, recvbuf, op, "exscan", stream=stream)

    def scan(self, sendobj: Any, op: Any = _ops.SUM) -> Any:
        """Objects: the reduction of ranks 0..r's objects, in rank order (AVG divides by r+1)."""
        o = _ops.resolve(op)
        return o.reduce_objects(self.allgather(sendobj)[: self._rank + 1])

    def exscan(self, sendobj: Any, op: Any = _ops.SUM) -> Any:
        """Objects: the reduction of ranks 0..r-1's objects; None at rank 0."""
        o = _ops.resolve(op)
        values = self.allgather(sendobj)[: self._rank]
        return o.reduce_objects(values) if values else None

    def _reduce_scatter_call(
        self, sendbuf: Any, recvbuf: Any, recvcounts: Optional[Sequence[int]], op: Any, name: str
    ) -> tuple[Call, Sig]:
        # In place, Reduce_scatter_block's recvbuf holds every rank's block: a spec's count is per block (as mpi4py)
        in_place_blocks = recvcounts is None and sendbuf is IN_PLACE
        recv = self._recv(recvbuf, name, blocks=self._size if in_place_blocks else 1)
        if recvcounts is None:  # Reduce_scatter_block: every rank gets recvbuf's count
            if in_place_blocks:
                each = recv.count // self._size
            else:
                each = recv.count
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
        total = sum(counts)
        if sendbuf is IN_PLACE:
            if recv.count < total:
                raise InvalidArgumentError(f"in place, recvbuf needs {total} elements, has {recv.count}", op=name, rank=self._rank)
            send_arr = recv.array[:total]
        else:
            send = self._send(sendbuf, name, blocks=self._size if recvcounts is None else 1)
            self._same_type(send.dtype, recv.dtype, name)
            if send.count != total:
                raise InvalidArgumentError(f"sendbuf needs {total} elements (sum of recvcounts), has {send.count}", op=name, rank=self._rank)
            if recv.count < counts[self._rank]:
                raise InvalidArgumentError(f"recvbuf needs {counts[self._rank]} elements, has {recv.count}", op=name, rank=self._rank)
            self._distinct(send.array, recv.array, name)
            send_arr = send.array
        o = self._check_op(op, recv.dtype, name)
        call = Call("reduce_scatter", recv.dtype, send_arr, recv.array, o, counts=counts, in_place=sendbuf is IN_PLACE)
        return call, self._sig(call, total, _vhash(counts), op=o)

    def Reduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> None:  # noqa: N802
        self._run("Reduce_scatter_block", self._reduce_scatter_call, sendbuf, recvbuf, None, op, "Reduce_scatter_block",
                  stream=stream)

    def Ireduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Ireduce_scatter_block", self._reduce_scatter_call, sendbuf, recvbuf, None, op, "Ireduce_scatter_block", stream=stream)

    def Reduce_scatter(  # noqa: N802
        self, sendbuf: Any, recvbuf: Any, recvcounts: Optional[Sequence[int]] = None, op: Any = _ops.SUM
    , *, stream: Any = None) -> None:
        if recvcounts is None:
            recvcounts = self._gather_counts(recvbuf, "Reduce_scatter")
        self._run("Reduce_scatter", self._reduce_scatter_call, sendbuf, recvbuf, recvcounts, op, "Reduce_scatter",
                  stream=stream)

    def Ireduce_scatter(  # noqa: N802
        self, sendbuf: Any, recvbuf: Any, recvcounts: Optional[Sequence[int]] = None, op: Any = _ops.SUM
    , *, stream: Any = None) -> Request:
        if recvcounts is None:
            recvcounts = self._gather_counts(recvbuf, "Ireduce_scatter")
        return self._start("Ireduce_scatter", self._reduce_scatter_call, sendbuf, recvbuf, recvcounts, op, "Ireduce_scatter", stream=stream)

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
        self._run("Bcast", self._bcast_call, buf, root, stream=stream)

    def Ibcast(self, buf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Ibcast", self._bcast_call, buf, root, stream=stream)

    def _allgather_call(self, sendbuf: Any, recvbuf: Any, vector: bool) -> tuple[Call, Sig]:
        name = "Allgatherv" if vector else "Allgather"
        rv = self._per_rank(recvbuf, "recvbuf", name, vector, writable=True)
        mine = rv.counts[self._rank]
        send_arr = None
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
        self._run("Allgather", self._allgather_call, sendbuf, recvbuf, False, stream=stream)

    def Iallgather(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Iallgather", self._allgather_call, sendbuf, recvbuf, False, stream=stream)

    def Allgatherv(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> None:  # noqa: N802
        self._run("Allgatherv", self._allgather_call, sendbuf, recvbuf, True, stream=stream)

    def Iallgatherv(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Iallgatherv", self._allgather_call, sendbuf, recvbuf, True, stream=stream)

    def _gather_call(self, sendbuf: Any, recvbuf: Any, root: int, vector: bool) -> tuple[Call, Sig]:
        name = "Gatherv" if vector else "Gather"
        root = self._check_root(root, name)
        at_root = self._rank == root
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
        self._run("Gather", self._gather_call, sendbuf, recvbuf, root, False, stream=stream)

    def Igather(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Igather", self._gather_call, sendbuf, recvbuf, root, False, stream=stream)

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        self._run("Gatherv", self._gather_call, sendbuf, recvbuf, root, True, stream=stream)

    def Igatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Igatherv", self._gather_call, sendbuf, recvbuf, root, True, stream=stream)

    def _scatter_call(self, sendbuf: Any, recvbuf: Any, root: int, vector: bool) -> tuple[Call, Sig]:
        name = "Scatterv" if vector else "Scatter"
        root = self._check_root(root, name)
        at_root = self._rank == root
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
        self._run("Scatter", self._scatter_call, sendbuf, recvbuf, root, False, stream=stream)

    def Iscatter(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Iscatter", self._scatter_call, sendbuf, recvbuf, root, False, stream=stream)

    def Scatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        self._run("Scatterv", self._scatter_call, sendbuf, recvbuf, root, True, stream=stream)

    def Iscatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Iscatterv", self._scatter_call, sendbuf, recvbuf, root, True, stream=stream)

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
        self._run("Alltoall", self._alltoall_call, sendbuf, recvbuf, False, stream=stream)

    def Ialltoall(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Ialltoall", self._alltoall_call, sendbuf, recvbuf, False, stream=stream)

    def Alltoallv(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> None:  # noqa: N802
        self._run("Alltoallv", self._alltoall_call, sendbuf, recvbuf, True, stream=stream)

    def Ialltoallv(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Ialltoallv", self._alltoall_call, sendbuf, recvbuf, True, stream=stream)

    def _barrier_call(self) -> tuple[Call, Sig]:
        call = Call("barrier", np.dtype(np.uint8))
        return call, self._sig(call)

    def Barrier(self) -> None:  # noqa: N802
        self._run("Barrier", self._barrier_call)

    def Ibarrier(self) -> Request:  # noqa: N802
        return self._start("Ibarrier", self._barrier_call)

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
        return (type(peer) is int and type(tag) is int and 0 <= peer < self._size and (tag >= 0 or any_tag and tag == ANY_TAG)
                and not (self._freed or self._aborted is not None or self._engine.broken_ctxs))

    def _isend_array(self, arr: np.ndarray, dest: int, tag: int, opname: str) -> Any:
        """The engine's send request (None for PROC_NULL); arguments checked in the common case by type alone."""
        base = self._p2p_ready(opname)
        if type(dest) is int and type(tag) is int and 0 <= dest < self._size and tag >= 0:
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
        if type(source) is int and type(tag) is int and 0 <= source < self._size and tag >= -1:
            peer = self._world[source]
        else:
            peer = self._peer(source, opname, True)
            tag = self._tag(tag, opname, True)
            if peer == PROC_NULL:
                return None
        return self._engine.irecv(peer, arr, self._ctx, tag, None, base.call(opname, "source", source, tag))

    def _p2p_buf(self, buf: Any, opname: str, writable: bool = False) -> np.ndarray:
        """A host buffer for point-to-point, as flat bytes; device buffers are for collectives only in this build."""
        arr = buffers.parse_bytes(buf, "buf", opname, writable)
        if arr is None:
            raise InvalidArgumentError("point-to-point calls take host buffers only; device buffers work in collectives",
                                       op=opname, rank=self._rank)
        return arr

    def _p2p_request(self, req: Any, recv: bool = False, finish: Optional[Callable] = None) -> Request:
        if req is None:
            return Request.completed(Status(PROC_NULL, ANY_TAG, 0) if recv else None)
        return Request(self._engine, self, p2p=req, finish=finish)

    def _p2p_wait(self, req: Any, status: Optional[Status] = None) -> None:
        """Complete a blocking call's request: wait, raise its error, fill the status."""
        if req is None:
            if status is not None:
                status._fill(Status(PROC_NULL, ANY_TAG, 0))
            return
        if not req.done:
            self._engine.wait_one(req, self.timeout)
        if req.error is not None:
            raise req.error
        if status is not None:
            status.source, status.tag, status.nbytes = self._to_comm[req.source], req.recv_tag, req.nbytes

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request:  # noqa: N802
        return self._p2p_request(self._isend_array(self._p2p_buf(buf, "Isend"), dest, tag, "Isend"))

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:  # noqa: N802
        arr = self._p2p_buf(buf, "Send")
        if self._eager_ok(dest, tag) and self._engine.send_eager(self._world[dest], arr, self._ctx, tag):
            return
        self._p2p_wait(self._isend_array(arr, dest, tag, "Send"))

    Ssend = Send
    Rsend = Send
    Bsend = Send

    def Irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:  # noqa: N802
        return self._p2p_request(self._irecv_array(self._p2p_buf(buf, "Irecv", writable=True), source, tag, "Irecv"), True)

    def Recv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> None:  # noqa: N802
        arr = self._p2p_buf(buf, "Recv", writable=True)
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
        rarr = self._p2p_buf(recvbuf, "Sendrecv", writable=True)
        sarr = self._p2p_buf(sendbuf, "Sendrecv")
        if self._eager_ok(dest, sendtag) and self._eager_ok(source, recvtag, True):
            got = self._engine.sendrecv_eager(self._world[dest], sarr, sendtag, self._world[source], rarr, recvtag, self._ctx)
            if got is not False:  # the send left whole, so receiving after it cannot deadlock
                if got is True:
                    self._p2p_wait(self._irecv_array(rarr, source, recvtag, "Sendrecv"), status)
                elif status is not None:
                    status.source, status.tag, status.nbytes = source, got[1], got[0]
                return
        rreq = self._irecv_array(rarr, source, recvtag, "Sendrecv")
        sreq = self._isend_array(sarr, dest, sendtag, "Sendrecv")
        pending = [r for r in (rreq, sreq) if r is not None and not r.done]
        if pending:
            self._engine.wait_requests(pending, self.timeout, pending[0].owner)
        try:
            self._p2p_wait(rreq, status)
        finally:
            self._p2p_wait(sreq)

    # ---- Python objects (pickle) ---------------------------------------------------------------
    @staticmethod
    def _dumps(obj: Any) -> np.ndarray:
        return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)

    @staticmethod
    def _loads(data: np.ndarray) -> Any:
        return pickle.loads(data.tobytes())

    def _allgather_bytes(self, data: np.ndarray) -> list[np.ndarray]:
        sizes = np.empty(self._size, np.int64)
        self.Allgather(np.array([data.size], np.int64), sizes)
        out = np.empty(int(sizes.sum()), np.uint8)
        counts = [int(s) for s in sizes]
        displs = [int(d) for d in np.concatenate(([0], np.cumsum(sizes)[:-1]))]
        self.Allgatherv(data, [out, counts, displs])
        return [out[d : d + c] for c, d in zip(counts, displs)]

    def bcast(self, obj: Any = None, root: int = 0) -> Any:
        root = self._check_root(root, "bcast")
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

    def recv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> Any:
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
    def Split(self, color: int = 0, key: int = 0) -> "Comm":  # noqa: N802
        self._live("Split")
        self._children += 1
        table = self.allgather((int(color), int(key)))
        if color == UNDEFINED or color is None:
            return COMM_NULL  # type: ignore[return-value]
        members = sorted((k, r) for r, (c, k) in enumerate(table) if c == color)
        world = [self._world[r] for _, r in members]
        ctx = _child_ctx(self._ctx, self._children, ("split", int(color)))
        child = Comm(self._rt, world, ctx, f"{self._name}.split({color})")
        child.timeout = self.timeout
        return child

    def Dup(self) -> "Comm":  # noqa: N802
        self._live("Dup")
        self._children += 1
        child = Comm(self._rt, list(self._world), _child_ctx(self._ctx, self._children, "dup"), f"{self._name}.dup")
        child.timeout = self.timeout
        return child

    Clone = Dup

    def Free(self) -> None:  # noqa: N802
        self._live("Free")
        self._freed = True
        self._x.clear()
        if self._arena is not None:
            self._arena.close()
        if self._ipc is not None:
            self._ipc.close()

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
    """``MPI.COMM_NULL``: compares equal only to itself; any call on it is an error."""

    def __repr__(self) -> str:
        return "<pycoll.MPI.COMM_NULL>"

    def __bool__(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        raise InvalidArgumentError(f"{name} called on MPI.COMM_NULL")


COMM_NULL = _NullComm()


def world_comm(runtime: Runtime) -> Comm:
    return Comm(runtime, list(range(runtime.size)), _WORLD_CTX, "MPI_COMM_WORLD")


def group_comm(runtime: Runtime, world_ranks: Sequence[int], key: str) -> Comm:
    """A communicator over ``world_ranks`` built without a collective call: every member passes the same ``key``,
    which names it and keeps its messages apart from every other communicator's."""
    ranks = [int(r) for r in world_ranks]
    return Comm(runtime, ranks, _child_ctx(_WORLD_CTX, -2, (key, tuple(ranks))), key)


def self_comm(runtime: Runtime) -> Comm:
    return Comm(runtime, [runtime.rank], _child_ctx(_WORLD_CTX, -1, ("self", runtime.rank)), "MPI_COMM_SELF")
