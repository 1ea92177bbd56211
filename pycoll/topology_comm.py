"""Topology communicators (MPI.Cartcomm, Graphcomm, Distgraphcomm): ranks on a grid or a graph, with coordinates,
shifts, sub-grids and the neighborhood collectives."""

from __future__ import annotations

import sys
from math import prod
from typing import Any, Callable, Optional, Sequence

import numpy as np

from . import buffers
from .buffers import IN_PLACE
from .comm import Comm
from .comm_management import COMM_NULL, _child_ctx, register_topologies
from .errors import InvalidArgumentError
from .not_provided import refuse
from .p2p import PROC_NULL
from .request import UNDEFINED

# Comm.Get_topology() results (MPICH's values); a communicator without a topology answers UNDEFINED
GRAPH, CART, DIST_GRAPH = 1, 2, 3


def _index(value: Any, what: str, opname: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidArgumentError(f"{what} {value!r} is not an integer", op=opname)
    return value.__index__()


def _int_list(values: Any, what: str, opname: str) -> list[int]:
    try:
        items = list(values)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be a sequence of integers, got {values!r}", op=opname) from None
    return [_index(v, f"{what} entry", opname) for v in items]


# ---- Compute_dims ------------------------------------------------------------------------------
def _divisors(m: int) -> list[int]:
    small = [d for d in range(1, int(m**0.5) + 1) if m % d == 0]
    return sorted(set(small + [m // d for d in small]), reverse=True)


def _balanced(m: int, k: int) -> list[int]:
    """The factorization of m into k factors, largest first, with the least spread (largest - smallest), then the
    least sum: the grid MPICH's MPI_Dims_create picks (checked for every m <= 256, k <= 5)."""
    divisors = _divisors(m)
    best: Optional[tuple[tuple[int, int], list[int]]] = None

    def walk(rest: int, left: int, cap: int, acc: list[int]) -> None:
        nonlocal best
        if left == 1:
            if rest <= cap:
                f = acc + [rest]
                score = (f[0] - f[-1], sum(f))
                if best is None or score < best[0]:
                    best = (score, f)
            return
        for d in divisors:
            if d > cap or rest % d:
                continue
            if d**left < rest:  # d is the largest factor still to come: too small, and so is every later one
                break
            walk(rest // d, left - 1, d, acc + [d])

    walk(m, k, m, [])
    assert best is not None
    return best[1]


def compute_dims(nnodes: int, dims: Any) -> list[int]:
    """``MPI.Compute_dims``: fill the zero entries of ``dims`` (or ``dims`` zeros, for an integer) with a grid of
    ``nnodes`` processes that is as square as it can be, in non-increasing order; nonzero entries stay."""
    op = "Compute_dims"
    n = _index(nnodes, "nnodes", op)
    if n < 0:
        raise InvalidArgumentError(f"nnodes must be non-negative, got {n}", op=op)
    if hasattr(dims, "__index__") and not isinstance(dims, bool):
        out = [0] * dims.__index__()
    else:
        out = _int_list(dims, "dims", op)
    if any(d < 0 for d in out):
        raise InvalidArgumentError(f"dims {out} has a negative entry", op=op)
    free = [i for i, d in enumerate(out) if d == 0]
    fixed = prod(d for d in out if d)
    if n == 0:
        return out
    if n % fixed or (not free and fixed != n):
        raise InvalidArgumentError(f"cannot lay {n} processes out on a grid with dims {out}", op=op)
    if free:
        for i, d in zip(free, _balanced(n // fixed, len(free))):
            out[i] = d
    return out


def cart_args(dims: Any, periods: Any, opname: str) -> tuple[list[int], list[int]]:
    """Checked ``(dims, periods)`` of Create_cart and Cart_map: positive extents, one period flag (0/1) per
    dimension; ``periods`` may be None (none periodic) or one bool for all, as in mpi4py."""
    d = _int_list(dims, "dims", opname)
    if any(x <= 0 for x in d):
        raise InvalidArgumentError(f"dims {d} must all be positive", op=opname)
    if periods is None:
        periods = False
    if isinstance(periods, bool):
        periods = [periods] * len(d)
    try:
        flags = list(periods)
    except TypeError:
        raise InvalidArgumentError(f"periods must be a bool or a sequence of bools, got {periods!r}", op=opname) from None
    if len(flags) != len(d):
        raise InvalidArgumentError(f"periods has {len(flags)} entries for {len(d)} dimensions", op=opname)
    return d, [1 if p else 0 for p in flags]


def coords_of(rank: int, dims: Sequence[int]) -> list[int]:
    """Row-major coordinates of ``rank`` on a grid of ``dims`` (the last dimension varies fastest)."""
    out = []
    for extent in reversed(dims):
        rank, c = divmod(rank, extent)
        out.append(c)
    return out[::-1]


def rank_of(coords: Sequence[int], dims: Sequence[int]) -> int:
    rank = 0
    for c, extent in zip(coords, dims):
        rank = rank * extent + c
    return rank


# ---- communicators -----------------------------------------------------------------------------
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
        for req in pending:
            req.Wait()

    def _blocks(self, spec: Any, what: str, opname: str, count: int, vector: bool, writable: bool) -> Any:
        """``count`` blocks of a neighborhood buffer: even blocks, or ``[buf, counts, displs]`` with ``vector``."""
        if spec is IN_PLACE:
            raise InvalidArgumentError(f"MPI.IN_PLACE is not allowed as {what} of a neighborhood collective", op=opname, rank=self._rank)
        if vector:
            v = buffers.parse_vector(spec, what, opname, count, writable=writable)
            return v, [v.part(i) for i in range(count)]
        b = buffers.parse(spec, what, opname, writable=writable, blocks=max(count, 1))
        each = b.count // count if count else 0
        return b, [b.array[i * each:(i + 1) * each] for i in range(count)]

    def _neighbor_call(self, opname: str, sendbuf: Any, recvbuf: Any, alltoall: bool, vector: bool) -> None:
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
        self._exchange(opname, sblocks, rblocks)
        if isinstance(recv, buffers.Buf):
            recv.finish()

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

    def _nonblocking(self, name: str) -> Any:
        refuse(f"nonblocking neighborhood collectives ({name}); the blocking ones are provided", name)

    def Ineighbor_allgather(self, *args: Any) -> Any:  # noqa: N802
        self._nonblocking("Ineighbor_allgather")

    def Ineighbor_allgatherv(self, *args: Any) -> Any:  # noqa: N802
        self._nonblocking("Ineighbor_allgatherv")

    def Ineighbor_alltoall(self, *args: Any) -> Any:  # noqa: N802
        self._nonblocking("Ineighbor_alltoall")

    def Ineighbor_alltoallv(self, *args: Any) -> Any:  # noqa: N802
        self._nonblocking("Ineighbor_alltoallv")


class Cartcomm(Topocomm):
    """A Cartesian grid of ranks (row-major: the last dimension varies fastest), periodic or not per dimension.
    Every collective and point-to-point call works on it as on any communicator."""

    _dims: tuple[int, ...] = ()
    _periods: tuple[int, ...] = ()
    _coords: tuple[int, ...] = ()

    @classmethod
    def _build(cls, parent: Comm, world: list[int], ctx: int, name: str, dims: Sequence[int], periods: Sequence[int]) -> "Cartcomm":
        cart = cls._made(parent, world, ctx, name)
        cart._dims, cart._periods = tuple(dims), tuple(periods)
        cart._coords = tuple(coords_of(cart._rank, cart._dims))
        return cart

    def _copy(self, ctx: int, name: str) -> "Cartcomm":  # Dup keeps the grid
        return Cartcomm._build(self, list(self._world), ctx, name, self._dims, self._periods)

    def __repr__(self) -> str:
        return f"<pycoll.Cartcomm {self._name} rank {self._rank}/{self._size} dims {list(self._dims)} coords {list(self._coords)}>"

    # ---- inquiry ---------------------------------------------------------------------------
    def Get_topology(self) -> int:  # noqa: N802
        return CART

    def Get_dim(self) -> int:  # noqa: N802
        return len(self._dims)

    @property
    def dim(self) -> int:
        return len(self._dims)

    @property
    def ndim(self) -> int:
        return len(self._dims)

    def Get_topo(self) -> tuple[list[int], list[int], list[int]]:  # noqa: N802
        """``(dims, periods, coords)`` of this rank, as new lists (periods as 0/1, as MPI gives them)."""
        return list(self._dims), list(self._periods), list(self._coords)

    @property
    def topo(self) -> tuple[list[int], list[int], list[int]]:
        return self.Get_topo()

    @property
    def dims(self) -> list[int]:
        return list(self._dims)

    @property
    def periods(self) -> list[int]:
        return list(self._periods)

    @property
    def coords(self) -> list[int]:
        return list(self._coords)

    # ---- translation -----------------------------------------------------------------------
    def Get_cart_rank(self, coords: Sequence[int]) -> int:  # noqa: N802
        """The rank at ``coords``; a coordinate outside a periodic dimension wraps around, outside a
        non-periodic one is an error."""
        op = "Get_cart_rank"
        c = _int_list(coords, "coords", op)
        if len(c) != len(self._dims):
            raise InvalidArgumentError(f"coords {c} has {len(c)} entries for a {len(self._dims)}-dimensional grid", op=op, rank=self._rank)
        for i, (x, extent, periodic) in enumerate(zip(c, self._dims, self._periods)):
            if periodic:
                c[i] = x % extent
            elif not 0 <= x < extent:
                raise InvalidArgumentError(
                    f"coordinate {x} is outside non-periodic dimension {i} (extent {extent})", op=op, rank=self._rank
                )
        return rank_of(c, self._dims)

    def Get_coords(self, rank: int) -> list[int]:  # noqa: N802
        r = _index(rank, "rank", "Get_coords")
        if not 0 <= r < self._size:
            raise InvalidArgumentError(f"rank {r} is not in this {self._size}-rank grid", op="Get_coords", rank=self._rank)
        return coords_of(r, self._dims)

    def Shift(self, direction: int, disp: int) -> tuple[int, int]:  # noqa: N802
        """``(source, dest)``: the ranks ``disp`` steps back and forward along ``direction``; PROC_NULL past
        the edge of a non-periodic dimension."""
        op = "Shift"
        axis, step = _index(direction, "direction", op), _index(disp, "disp", op)
        if not 0 <= axis < len(self._dims):
            raise InvalidArgumentError(f"direction {axis} is not a dimension of this {len(self._dims)}-dimensional grid", op=op, rank=self._rank)
        extent, periodic = self._dims[axis], self._periods[axis]

        def moved(delta: int) -> int:
            c = list(self._coords)
            x = c[axis] + delta
            if periodic:
                x %= extent
            elif not 0 <= x < extent:
                return PROC_NULL
            c[axis] = x
            return rank_of(c, self._dims)

        return moved(-step), moved(step)

    @property
    def inoutedges(self) -> tuple[list[int], list[int]]:
        """For each dimension, the ranks one step back and one step forward (PROC_NULL past an edge)."""
        neighbors: list[int] = []
        for axis in range(len(self._dims)):
            neighbors.extend(self.Shift(axis, 1))
        return neighbors, list(neighbors)

    def _tags(self) -> tuple[list[int], list[int]]:
        # neighbor 2d is one step back along dimension d, 2d+1 one step forward: what goes forward arrives from
        # behind. Tagging by the receiver's slot keeps periodic dimensions of 1 or 2 ranks apart (MPI-4's rule).
        slots = list(range(2 * len(self._dims)))
        return slots, [j ^ 1 for j in slots]

    # ---- partition -------------------------------------------------------------------------
    def Sub(self, remain_dims: Sequence[bool]) -> "Cartcomm":  # noqa: N802
        """Collective: the sub-grid through this rank that keeps the dimensions ``remain_dims`` marks true (one
        communicator per combination of the dropped coordinates; none kept gives a 0-dimensional grid of one)."""
        op = "Sub"
        self._live(op)
        self._children += 1
        problem, keep = "", None
        try:
            flags = list(remain_dims)
            if len(flags) != len(self._dims):
                raise InvalidArgumentError(f"remain_dims has {len(flags)} entries for {len(self._dims)} dimensions", op=op)
            keep = tuple(bool(f) for f in flags)
        except (TypeError, InvalidArgumentError) as exc:
            problem = exc.cause if isinstance(exc, InvalidArgumentError) else f"remain_dims must be a sequence of bools, got {remain_dims!r}"
        self._agreed(op, keep, problem, same=True)
        assert keep is not None
        dropped = [i for i, k in enumerate(keep) if not k]
        mine = [self._coords[i] for i in dropped]
        members = [r for r in range(self._size) if [coords_of(r, self._dims)[i] for i in dropped] == mine]
        ctx = _child_ctx(self._ctx, self._children, ("sub", keep, tuple(mine)))
        kept = [i for i, k in enumerate(keep) if k]
        return Cartcomm._build(
            self, [self._world[r] for r in members], ctx, f"{self._name}.sub({''.join('1' if k else '0' for k in keep)})",
            [self._dims[i] for i in kept], [self._periods[i] for i in kept],
        )


# ---- graph topologies --------------------------------------------------------------------------
class _WeightsMarker:
    """``MPI.UNWEIGHTED`` and ``MPI.WEIGHTS_EMPTY``: the markers the distributed graph constructors take for weights."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return f"MPI.{self._name}"

    def __reduce__(self) -> str:
        return self._name


UNWEIGHTED = _WeightsMarker("UNWEIGHTED")
WEIGHTS_EMPTY = _WeightsMarker("WEIGHTS_EMPTY")


def _ranks_in(ranks: list[int], size: int, what: str, opname: str) -> None:
    bad = [r for r in ranks if not 0 <= r < size]
    if bad:
        raise InvalidArgumentError(f"{what} {bad} are not ranks of a {size}-rank communicator", op=opname)


def _weights(weights: Any, degree: int, what: str, opname: str) -> Optional[list[int]]:
    """None for an unweighted side, else one non-negative weight per neighbor."""
    if weights is None or weights is UNWEIGHTED:
        return None
    if weights is WEIGHTS_EMPTY:
        if degree:
            raise InvalidArgumentError(f"{what} is MPI.WEIGHTS_EMPTY but there are {degree} neighbors", op=opname)
        return []
    w = _int_list(weights, what, opname)
    if len(w) != degree:
        raise InvalidArgumentError(f"{what} has {len(w)} entries for {degree} neighbors", op=opname)
    if any(x < 0 for x in w):
        raise InvalidArgumentError(f"{what} {w} has a negative weight", op=opname)
    return w


def graph_args(index: Any, edges: Any, opname: str) -> tuple[list[int], list[int]]:
    """Checked ``(index, edges)`` of Create_graph and Graph_map: index[i] is the end of node i's neighbors in
    edges. mpi4py also takes the conventional form with a leading 0, dropped here as there."""
    idx = _int_list(index, "index", opname)
    e = _int_list(edges, "edges", opname)
    if idx and idx[0] == 0 and idx[-1] == len(e):
        idx = idx[1:]
    if any(b < a for a, b in zip([0] + idx, idx)) or (idx and idx[-1] != len(e)):
        raise InvalidArgumentError(f"index {idx} must rise to len(edges) = {len(e)}", op=opname)
    _ranks_in(e, len(idx), "edges", opname)
    return idx, e


class Graphcomm(Topocomm):
    """A graph of ranks (``Comm.Create_graph``): node i's neighbors are edges[index[i-1]:index[i]]."""

    _index: tuple[int, ...] = ()
    _edges: tuple[int, ...] = ()

    def _copy(self, ctx: int, name: str) -> "Graphcomm":  # Dup keeps the graph
        return _graph(self, list(self._world), ctx, name, self._index, self._edges)

    def Get_topology(self) -> int:  # noqa: N802
        return GRAPH

    def Get_dims(self) -> tuple[int, int]:  # noqa: N802
        """``(nnodes, nedges)``."""
        return len(self._index), len(self._edges)

    @property
    def dims(self) -> tuple[int, int]:
        return self.Get_dims()

    @property
    def nnodes(self) -> int:
        return len(self._index)

    @property
    def nedges(self) -> int:
        return len(self._edges)

    def Get_topo(self) -> tuple[list[int], list[int]]:  # noqa: N802
        return list(self._index), list(self._edges)

    @property
    def topo(self) -> tuple[list[int], list[int]]:
        return self.Get_topo()

    @property
    def index(self) -> list[int]:
        return list(self._index)

    @property
    def edges(self) -> list[int]:
        return list(self._edges)

    def Get_neighbors(self, rank: int) -> list[int]:  # noqa: N802
        r = _index(rank, "rank", "Get_neighbors")
        if not 0 <= r < len(self._index):
            raise InvalidArgumentError(f"rank {r} is not a node of this {len(self._index)}-node graph", op="Get_neighbors", rank=self._rank)
        return list(self._edges[self._index[r - 1] if r else 0:self._index[r]])

    def Get_neighbors_count(self, rank: int) -> int:  # noqa: N802
        return len(self.Get_neighbors(rank))

    @property
    def neighbors(self) -> list[int]:
        return self.Get_neighbors(self._rank)

    @property
    def nneighbors(self) -> int:
        return len(self.neighbors)

    @property
    def inoutedges(self) -> tuple[list[int], list[int]]:
        return self.neighbors, self.neighbors


def _graph(parent: Comm, world: list[int], ctx: int, name: str, index: Sequence[int], edges: Sequence[int]) -> Graphcomm:
    graph = Graphcomm._made(parent, world, ctx, name)
    graph._index, graph._edges = tuple(index), tuple(edges)
    return graph


def _agreed_layout(parent: Comm, op: str, check: Callable[[], Any]) -> Any:
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


def create_cart(parent: Comm, dims: Any, periods: Any) -> Any:
    """``Comm.Create_cart``: collective; the first prod(dims) ranks form the grid (rank order kept), the others
    get COMM_NULL."""
    op = "Create_cart"

    def check() -> Any:
        grid = cart_args(dims, periods, op)
        if prod(grid[0]) > parent._size:
            raise InvalidArgumentError(f"dims {grid[0]} need {prod(grid[0])} ranks; the communicator has {parent._size}", op=op)
        return grid

    grid = _agreed_layout(parent, op, check)
    if parent._rank >= prod(grid[0]):
        return COMM_NULL
    ctx = _child_ctx(parent._ctx, parent._children, ("cart", tuple(grid[0]), tuple(grid[1])))
    name = f"{parent._name}.cart({'x'.join(map(str, grid[0]))})"
    return Cartcomm._build(parent, parent._world[: prod(grid[0])], ctx, name, grid[0], grid[1])


def cart_map(parent: Comm, dims: Any, periods: Any) -> int:
    """``Comm.Cart_map``: this rank in the grid pycoll would make (its own), or UNDEFINED past it."""
    d, _ = cart_args(dims, periods, "Cart_map")
    if prod(d) > parent._size:
        raise InvalidArgumentError(f"dims {d} need {prod(d)} ranks; the communicator has {parent._size}", op="Cart_map", rank=parent._rank)
    return parent._rank if parent._rank < prod(d) else UNDEFINED


def create_graph(parent: Comm, index: Any, edges: Any) -> Any:
    """``Comm.Create_graph``: collective; the first nnodes ranks form the graph (rank order kept), the others
    get COMM_NULL."""
    op = "Create_graph"

    def check() -> Any:
        spec = graph_args(index, edges, op)
        if len(spec[0]) > parent._size:
            raise InvalidArgumentError(f"the graph has {len(spec[0])} nodes; the communicator {parent._size} ranks", op=op)
        return spec

    idx, e = _agreed_layout(parent, op, check)
    if parent._rank >= len(idx):
        return COMM_NULL
    ctx = _child_ctx(parent._ctx, parent._children, ("graph", tuple(idx), tuple(e)))
    return _graph(parent, parent._world[: len(idx)], ctx, f"{parent._name}.graph", idx, e)


def graph_map(parent: Comm, index: Any, edges: Any) -> int:
    """``Comm.Graph_map``: this rank in the graph pycoll would make (its own), or UNDEFINED past its nodes."""
    idx, _ = graph_args(index, edges, "Graph_map")
    if len(idx) > parent._size:
        raise InvalidArgumentError(f"the graph has {len(idx)} nodes; the communicator {parent._size} ranks", op="Graph_map", rank=parent._rank)
    return parent._rank if parent._rank < len(idx) else UNDEFINED


class Distgraphcomm(Topocomm):
    """A distributed graph (``Comm.Create_dist_graph`` and ``Create_dist_graph_adjacent``): each rank knows its
    own incoming and outgoing neighbors, optionally weighted."""

    _sources: tuple[int, ...] = ()
    _destinations: tuple[int, ...] = ()
    _weights: Optional[tuple[list[int], list[int]]] = None

    def _copy(self, ctx: int, name: str) -> "Distgraphcomm":  # Dup keeps the graph
        return _dist_graph(self, list(self._world), ctx, name, self._sources, self._destinations, self._weights)

    def Get_topology(self) -> int:  # noqa: N802
        return DIST_GRAPH

    def Get_dist_neighbors_count(self) -> tuple[int, int, bool]:  # noqa: N802
        """``(indegree, outdegree, weighted)``."""
        return len(self._sources), len(self._destinations), self._weights is not None

    def Get_dist_neighbors(self) -> tuple[list[int], list[int], Optional[tuple[list[int], list[int]]]]:  # noqa: N802
        """``(sources, destinations, (sourceweights, destweights) or None)``."""
        w = self._weights
        return list(self._sources), list(self._destinations), (list(w[0]), list(w[1])) if w is not None else None

    @property
    def inoutedges(self) -> tuple[list[int], list[int]]:
        return list(self._sources), list(self._destinations)


def _dist_graph(parent: Comm, world: list[int], ctx: int, name: str, sources: Sequence[int], destinations: Sequence[int],
                weights: Optional[tuple[list[int], list[int]]]) -> Distgraphcomm:
    graph = Distgraphcomm._made(parent, world, ctx, name)
    graph._sources, graph._destinations, graph._weights = tuple(sources), tuple(destinations), weights
    return graph


def create_dist_graph_adjacent(parent: Comm, sources: Any, destinations: Any, sourceweights: Any, destweights: Any) -> Distgraphcomm:
    """``Comm.Create_dist_graph_adjacent``: collective; each rank names its own neighbors (None: none)."""
    op = "Create_dist_graph_adjacent"
    parent._live(op)
    parent._children += 1
    problem, mine = "", None
    try:
        src = _int_list(sources, "sources", op) if sources is not None else []
        dst = _int_list(destinations, "destinations", op) if destinations is not None else []
        _ranks_in(src + dst, parent._size, "neighbors", op)
        sw = _weights(sourceweights, len(src), "sourceweights", op)
        dw = _weights(destweights, len(dst), "destweights", op)
        if (sw is None) != (dw is None) and (src if sw is None else dst):
            raise InvalidArgumentError("weights were given for one direction only", op=op)
        weights = (sw or [], dw or []) if sw is not None or dw is not None else None
        mine = (src, dst, weights)
    except InvalidArgumentError as exc:
        problem = exc.cause
    parent._agreed(op, None, problem)
    assert mine is not None
    ctx = _child_ctx(parent._ctx, parent._children, "dist_graph_adjacent")
    return _dist_graph(parent, list(parent._world), ctx, f"{parent._name}.dist_graph", *mine)


def create_dist_graph(parent: Comm, sources: Any, degrees: Any, destinations: Any, weights: Any) -> Distgraphcomm:
    """``Comm.Create_dist_graph``: collective; each rank contributes edges (sources[i] to its degrees[i] next
    destinations), and learns its own neighbors from every rank's edges (ordered by contributing rank)."""
    op = "Create_dist_graph"
    parent._live(op)
    parent._children += 1
    problem, mine = "", None
    try:
        src = _int_list(sources, "sources", op)
        deg = _int_list(degrees, "degrees", op)
        if len(deg) != len(src) or any(d < 0 for d in deg):
            raise InvalidArgumentError(f"degrees {deg} must give a non-negative count for each of {len(src)} sources", op=op)
        dst = _int_list(destinations, "destinations", op)
        if len(dst) != sum(deg):
            raise InvalidArgumentError(f"destinations has {len(dst)} entries; degrees add up to {sum(deg)}", op=op)
        _ranks_in(src + dst, parent._size, "ranks", op)
        w = _weights(weights, len(dst), "weights", op)
        starts = [s for s, d in zip(src, deg) for _ in range(d)]
        mine = ([(s, d, w[k] if w is not None else 1) for k, (s, d) in enumerate(zip(starts, dst))], w is not None)
    except InvalidArgumentError as exc:
        problem = exc.cause
    table = parent._agreed(op, mine, problem)
    every = [edge for edges, _ in table for edge in edges]
    me = parent._rank
    ins = [(s, w) for s, d, w in every if d == me]
    outs = [(d, w) for s, d, w in every if s == me]
    weighted = any(flag for _, flag in table)
    both = ([w for _, w in ins], [w for _, w in outs]) if weighted else None
    ctx = _child_ctx(parent._ctx, parent._children, "dist_graph")
    return _dist_graph(parent, list(parent._world), ctx, f"{parent._name}.dist_graph", [s for s, _ in ins], [d for d, _ in outs], both)


register_topologies(sys.modules[__name__])
