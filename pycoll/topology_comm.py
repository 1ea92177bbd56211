"""Topology communicators' common base (MPI.Topocomm): neighbours, the neighborhood collectives in their buffer,
object and nonblocking forms, and the checks every topology constructor shares."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from . import arrays, buffers
from .buffers import IN_PLACE
from .comm import Comm
from .comm_management import _child_ctx
from .errors import InvalidArgumentError
from .p2p_protocol import PROC_NULL
from .request import GroupRequest


# Comm.Get_topology() results (MPICH's values); a communicator without a topology answers UNDEFINED
GRAPH, CART, DIST_GRAPH = 1, 2, 3


def checked_index(value: Any, what: str, opname: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidArgumentError(f"{what} {value!r} is not an integer", op=opname)
    return value.__index__()


def int_list(values: Any, what: str, opname: str) -> list[int]:
    try:
        items = list(values)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be a sequence of integers, got {values!r}", op=opname) from None
    return [checked_index(v, f"{what} entry", opname) for v in items]


class Topocomm(Comm):
    """A communicator with a process topology (Cartesian, graph or distributed graph), and the neighborhood
    collectives over it. As in mpi4py, ``Cartcomm(cart)`` is another reference to ``cart``, and ``Cartcomm(comm)``
    of any other kind of communicator raises TypeError (see ``Comm.__new__``)."""

    @classmethod
    def _made(cls, parent: Comm, world: list[int], ctx: int, name: str) -> Any:
        topo = cls(parent._rt, world, ctx, name)
        topo.timeout = parent.timeout
        return topo

    @property
    def is_topo(self) -> bool:
        return True

    @property
    def degrees(self) -> tuple[int, int]:
        """The numbers of incoming and outgoing neighbors."""
        inedges, outedges = self.inoutedges
        return len(inedges), len(outedges)

    @property
    def indegree(self) -> int:
        return self.degrees[0]

    @property
    def outdegree(self) -> int:
        return self.degrees[1]

    @property
    def inoutedges(self) -> tuple[list[int], list[int]]:
        raise TypeError("expecting a Cartesian, graph or distributed graph communicator")  # each kind answers

    def Free(self) -> None:  # noqa: N802
        private = self.__dict__.pop("_neighbors_comm", None)
        if private is not None:
            private.Free()
        super().Free()

    @property
    def inedges(self) -> list[int]:
        return self.inoutedges[0]

    @property
    def outedges(self) -> list[int]:
        return self.inoutedges[1]

    # ---- neighborhood collectives ----------------------------------------------------------
    def _tags(self) -> tuple[list[int], list[int]]:
        """The tag of each incoming and each outgoing message: the k-th message between two ranks pairs with
        the k-th (graphs); a Cartesian grid overrides it."""
        inedges, outedges = self.inoutedges

        def nth(ranks: list[int]) -> list[int]:
            seen: dict[int, int] = {}
            out = []
            for r in ranks:
                out.append(seen.get(r, 0))
                seen[r] = out[-1] + 1
            return out

        return nth(inedges), nth(outedges)

    def _exchange(self, opname: str, sends: list[Any], recvs: list[Any]) -> None:
        """Send ``sends[j]`` to outgoing neighbor j and receive ``recvs[i]`` from incoming neighbor i, over a
        private communicator of the same ranks (its messages never meet the user's); PROC_NULL neighbors skip."""
        for req in self._start_exchange(opname, sends, recvs):
            req.Wait()

    def _start_exchange(self, opname: str, sends: list[Any], recvs: list[Any]) -> list[Any]:
        """``_exchange``'s transfers, started: their requests."""
        self._live(opname)
        private = self.__dict__.get("_neighbors_comm")
        if private is None:  # made on the first neighborhood call, alike on every rank (the context is fixed)
            private = Comm(self._rt, list(self._world), _child_ctx(self._ctx, -5, "neighbors"), f"{self._name}.neighbors")
            private.timeout = self.timeout
            self.__dict__["_neighbors_comm"] = private
        private.timeout = self.timeout
        inedges, outedges = self.inoutedges
        rtags, stags = self._tags()
        pending = [private.Irecv(buf, source=src, tag=tag) for buf, src, tag in zip(recvs, inedges, rtags) if src != PROC_NULL]
        pending += [private.Isend(buf, dest=dst, tag=tag) for buf, dst, tag in zip(sends, outedges, stags) if dst != PROC_NULL]
        return pending

    def _not_in_place(self, spec: Any, what: str, opname: str) -> None:
        if spec is IN_PLACE:
            raise InvalidArgumentError(f"MPI.IN_PLACE is not allowed as {what} of a neighborhood collective", op=opname, rank=self._rank)

    def _blocks(self, spec: Any, what: str, opname: str, count: int, vector: bool, writable: bool) -> Any:
        """``count`` blocks of a neighborhood buffer: even blocks, or ``[buf, counts, displs]`` with ``vector``."""
        self._not_in_place(spec, what, opname)
        if vector:
            v = buffers.parse_vector(spec, what, opname, count, writable=writable)
            return v, [v.part(i) for i in range(count)]
        b = buffers.parse(spec, what, opname, writable=writable, blocks=max(count, 1))
        each = b.count // count if count else 0
        return b, [b.array[i * each:(i + 1) * each] for i in range(count)]

    def _neighbor_call(self, opname: str, sendbuf: Any, recvbuf: Any, alltoall: bool, vector: bool,
                       nonblocking: bool = False) -> Any:
        indegree, outdegree = self.degrees
        recv, rblocks = self._blocks(recvbuf, "recvbuf", opname, indegree, vector, writable=True)
        if alltoall:
            send, sblocks = self._blocks(sendbuf, "sendbuf", opname, outdegree, vector, writable=False)
        else:
            send = self._send(sendbuf, opname)
            sblocks = [send.array] * outdegree
            wrong = [i for i, b in enumerate(rblocks) if b.size != send.count]
            if wrong and not vector:
                raise InvalidArgumentError(f"recvbuf blocks hold {rblocks[0].size} elements, sendbuf {send.count}", op=opname, rank=self._rank)
        if send.dtype != recv.dtype:
            raise InvalidArgumentError(f"sendbuf holds {send.dtype.name} but recvbuf holds {recv.dtype.name}", op=opname, rank=self._rank)
        if nonblocking:  # one request for every transfer; a packed receive buffer is unpacked once they are done
            return GroupRequest.of(self, self._start_exchange(opname, sblocks, rblocks),
                                   recv.finish if isinstance(recv, arrays.Buf) else None)
        self._exchange(opname, sblocks, rblocks)
        if isinstance(recv, arrays.Buf):
            recv.finish()
        return None

    def Neighbor_allgather(self, sendbuf: Any, recvbuf: Any) -> None:  # noqa: N802
        """Send sendbuf to every outgoing neighbor; block i of recvbuf comes from incoming neighbor i (left as it
        is for a PROC_NULL neighbor)."""
        self._neighbor_call("Neighbor_allgather", sendbuf, recvbuf, alltoall=False, vector=False)

    def Neighbor_allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:  # noqa: N802
        self._neighbor_call("Neighbor_allgatherv", sendbuf, recvbuf, alltoall=False, vector=True)

    def Neighbor_alltoall(self, sendbuf: Any, recvbuf: Any) -> None:  # noqa: N802
        """Block j of sendbuf goes to outgoing neighbor j; block i of recvbuf comes from incoming neighbor i."""
        self._neighbor_call("Neighbor_alltoall", sendbuf, recvbuf, alltoall=True, vector=False)

    def Neighbor_alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:  # noqa: N802
        self._neighbor_call("Neighbor_alltoallv", sendbuf, recvbuf, alltoall=True, vector=True)

    def _neighbor_alltoallw(self, opname: str, sendbuf: Any, recvbuf: Any, nonblocking: bool) -> Any:
        """Block j of ``sendbuf`` (bytes at its displacement, in its own datatype) goes to outgoing neighbor j; block
        i of ``recvbuf`` comes from incoming neighbor i, written back through its datatype once it is in."""
        self._live(opname)
        indegree, outdegree = self.degrees
        self._not_in_place(sendbuf, "sendbuf", opname)
        self._not_in_place(recvbuf, "recvbuf", opname)
        send = self._w_side(sendbuf, "sendbuf", opname, writable=False, blocks=outdegree)
        recv = self._w_side(recvbuf, "recvbuf", opname, writable=True, blocks=indegree)
        packed, counts, displs = send.gathered()
        sblocks = [packed[d:d + c] for c, d in zip(counts, displs)]
        landing, rcounts, rdispls, back = recv.landing(fill=False)
        rblocks = [landing[d:d + c] for c, d in zip(rcounts, rdispls)]
        if nonblocking:
            return GroupRequest.of(self, self._start_exchange(opname, sblocks, rblocks),
                                   back.unpack if back is not None else None)
        self._exchange(opname, sblocks, rblocks)
        if back is not None:
            back.unpack()
        return None

    def Neighbor_alltoallw(self, sendbuf: Any, recvbuf: Any) -> None:  # noqa: N802
        """Neighbor_alltoall with a datatype and a byte displacement for each neighbor's block
        (``[buf, counts, displs, datatypes]``; MPI.BOTTOM with absolute addresses)."""
        self._neighbor_alltoallw("Neighbor_alltoallw", sendbuf, recvbuf, nonblocking=False)

    def Ineighbor_alltoallw(self, sendbuf: Any, recvbuf: Any) -> Any:  # noqa: N802
        return self._neighbor_alltoallw("Ineighbor_alltoallw", sendbuf, recvbuf, nonblocking=True)

    def neighbor_allgather(self, sendobj: Any) -> list[Any]:
        """Objects: one from each incoming neighbor (None from a PROC_NULL one)."""
        indegree, outdegree = self.degrees
        return self._neighbor_objects("neighbor_allgather", [sendobj] * outdegree, indegree)

    def neighbor_alltoall(self, sendobj: Sequence[Any]) -> list[Any]:
        """Objects: ``sendobj[j]`` to outgoing neighbor j; one from each incoming neighbor."""
        indegree, outdegree = self.degrees
        if len(sendobj) != outdegree:
            raise InvalidArgumentError(f"neighbor_alltoall needs {outdegree} objects, got {len(sendobj)}", op="neighbor_alltoall", rank=self._rank)
        return self._neighbor_objects("neighbor_alltoall", list(sendobj), indegree)

    def _neighbor_objects(self, opname: str, objs: list[Any], indegree: int) -> list[Any]:
        payloads = [self._dumps(o) for o in objs]
        sizes = [np.array([p.size], np.int64) for p in payloads]
        got = [np.zeros(1, np.int64) for _ in range(indegree)]
        self._exchange(opname, sizes, got)
        inedges = self.inoutedges[0]
        data = [np.empty(int(g[0]), np.uint8) for g in got]
        self._exchange(opname, payloads, data)
        return [self._loads(d) if src != PROC_NULL else None for d, src in zip(data, inedges)]

    def Ineighbor_allgather(self, sendbuf: Any, recvbuf: Any) -> Any:  # noqa: N802
        """Nonblocking Neighbor_allgather: the request completes once every neighbor's block is in."""
        return self._neighbor_call("Ineighbor_allgather", sendbuf, recvbuf, alltoall=False, vector=False, nonblocking=True)

    def Ineighbor_allgatherv(self, sendbuf: Any, recvbuf: Any) -> Any:  # noqa: N802
        return self._neighbor_call("Ineighbor_allgatherv", sendbuf, recvbuf, alltoall=False, vector=True, nonblocking=True)

    def Ineighbor_alltoall(self, sendbuf: Any, recvbuf: Any) -> Any:  # noqa: N802
        return self._neighbor_call("Ineighbor_alltoall", sendbuf, recvbuf, alltoall=True, vector=False, nonblocking=True)

    def Ineighbor_alltoallv(self, sendbuf: Any, recvbuf: Any) -> Any:  # noqa: N802
        return self._neighbor_call("Ineighbor_alltoallv", sendbuf, recvbuf, alltoall=True, vector=True, nonblocking=True)


def agreed_layout(parent: Comm, op: str, check: Callable[[], Any]) -> Any:
    """A new topology's layout, ``check()``ed on every rank and agreed among them (collective): every rank raises
    if any rank's arguments were bad or differ from the others'."""
    parent._live(op)
    parent._children += 1
    problem, layout = "", None
    try:
        layout = check()
    except InvalidArgumentError as exc:
        problem = exc.cause
    parent._agreed(op, layout, problem, same=True)
    assert layout is not None
    return layout
