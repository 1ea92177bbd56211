"""The reductions of mpi4py's communicator: each one's argument checks and its blocking and ``I`` forms: Allreduce,
Reduce, Scan, Exscan, Reduce_local, Reduce_scatter(_block)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from . import ops as _ops
from .algorithms.base import Call
from .buffers import IN_PLACE
from .errors import InvalidArgumentError
from .p2p_protocol import Sig, counts_hash
from .request import Request

_ELEMENTWISE = {"allreduce": "Allreduce", "scan": "Scan", "exscan": "Exscan"}  # the calls _allreduce_call checks


def _units(arr: Any, unit: Optional[np.dtype]) -> Any:
    """``arr`` seen as the call's elements: as it is, or as opaque elements of a user-defined op's datatype."""
    return arr if unit is None else arr.view(unit)


class ReductionCalls:
    """The reductions of ``Comm`` (a mixin: ``Comm`` holds the state they use)."""

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
        return call, self._sig(call, total, counts_hash(counts), op=o)

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

