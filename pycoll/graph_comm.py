"""Graph topology communicators (MPI.Graphcomm, and Distgraphcomm with its weights): ranks joined by edges that
the neighborhood collectives follow."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .comm import Comm
from .comm_management import COMM_NULL, _child_ctx, register_topologies
from .errors import InvalidArgumentError
from .status import UNDEFINED
from .topology_comm import DIST_GRAPH, GRAPH, Topocomm, agreed_layout, checked_index, int_list


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
    w = int_list(weights, what, opname)
    if len(w) != degree:
        raise InvalidArgumentError(f"{what} has {len(w)} entries for {degree} neighbors", op=opname)
    if any(x < 0 for x in w):
        raise InvalidArgumentError(f"{what} {w} has a negative weight", op=opname)
    return w


def graph_args(index: Any, edges: Any, opname: str) -> tuple[list[int], list[int]]:
    """Checked ``(index, edges)`` of Create_graph and Graph_map: index[i] is the end of node i's neighbors in
    edges. mpi4py also takes the conventional form with a leading 0, dropped here as there."""
    idx = int_list(index, "index", opname)
    e = int_list(edges, "edges", opname)
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
        r = checked_index(rank, "rank", "Get_neighbors")
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


def create_graph(parent: Comm, index: Any, edges: Any) -> Any:
    """``Comm.Create_graph``: collective; the first nnodes ranks form the graph (rank order kept), the others
    get COMM_NULL."""
    op = "Create_graph"

    def check() -> Any:
        spec = graph_args(index, edges, op)
        if len(spec[0]) > parent._size:
            raise InvalidArgumentError(f"the graph has {len(spec[0])} nodes; the communicator {parent._size} ranks", op=op)
        return spec

    idx, e = agreed_layout(parent, op, check)
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
        src = int_list(sources, "sources", op) if sources is not None else []
        dst = int_list(destinations, "destinations", op) if destinations is not None else []
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
        src = int_list(sources, "sources", op)
        deg = int_list(degrees, "degrees", op)
        if len(deg) != len(src) or any(d < 0 for d in deg):
            raise InvalidArgumentError(f"degrees {deg} must give a non-negative count for each of {len(src)} sources", op=op)
        dst = int_list(destinations, "destinations", op)
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


register_topologies(create_graph=create_graph, graph_map=graph_map, create_dist_graph_adjacent=create_dist_graph_adjacent,
                    create_dist_graph=create_dist_graph)
