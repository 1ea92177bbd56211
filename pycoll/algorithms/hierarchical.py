"""Hierarchical algorithms: shared memory inside each host, the network only between hosts.

Allreduce: an intra-host reduce-scatter leaves local rank j with part j of its host's sum; ranks with
the same local index then allreduce their part across hosts (one flow per local rank, all at once);
an intra-host allgather spreads the result. Hosts with fewer ranks are fine: the vector is cut into
as many parts as the smallest host has ranks, and extra local ranks hold empty parts.

Reduce-scatter and allgather split the vector into cells (host h, local index j) = the block of
host h's j-th rank, and need the same number of ranks on every host.
"""

from __future__ import annotations


import numpy as np

from .. import ops as _ops
from ..config import size_param

from .base import Call, Layout, Schedule, Steps, blocks_of, concurrently, even_counts, offsets
from .cost import CostModel
from .registry import ALGORITHMS, ranked, register
from .ring import allgather_ring, chunked, reduce_scatter_ring

_INTRA_RS, _INTER, _INTRA_AG = 1, 2, 3  # message lanes of the three phases
SEGMENT_BYTES = size_param(
    "PYCOLL_HIER_SEGMENT", 8 << 20,
    "A hierarchical allreduce or reduce-scatter of at least twice this many bytes runs as segments of at least this "
    "size (8 at most), each segment's steps inside the hosts beside another's transfer between them.")
MAX_SEGMENTS = 8


def _refuse_flat(call: Call, lay: Layout) -> str | None:
    if lay.hosts < 2:
        return "all ranks share one host"
    if lay.hosts == lay.size:
        return "every host holds a single rank"
    return None


def _refuse_grid(call: Call, lay: Layout) -> str | None:
    return _refuse_flat(call, lay) or (None if lay.uniform else "hosts hold different numbers of ranks")


def _column(lay: Layout, j: int) -> list[int]:
    """The ranks with local index ``j``, one per host that has such a rank."""
    return [g[j] for g in lay.groups if j < len(g)]


def _inner_allreduce(m: CostModel, n: float, hosts: int, flows: int) -> tuple[float, str]:
    """Cheapest flat allreduce among ``hosts`` ranks (one per host) for ``n`` bytes."""
    lay, shared = Layout.one_per_host(hosts), m.sharing_links(flows)
    options = [(a.predict(shared, n, lay), a.name) for a in ALGORITHMS["allreduce"].values()
               if a.name != "hierarchical" and a.refusal(_INNER_PROBE, lay) is None]
    return min(options) if options else (0.0, "ring")


_INNER_PROBE = Call("allreduce", np.dtype(np.uint8), recv=np.empty(0, np.uint8))  # what the refusals read: no buffer


def _through_pipeline(in_hosts: list[float], between: float, segments: int, between_cpu: float = 0.0) -> float:
    """Time of ``segments`` segments (``_pipelined``) whose stages inside the hosts take ``in_hosts`` each and whose
    stage between them takes ``between``: the first segment through every stage, then one segment per time of the
    busier resource (the stages inside a host share its memory and cores; the one between hosts, its link).

    Where a host's ranks outnumber its cores, the stage between hosts takes ``between_cpu`` of those cores too (its
    bytes copied into and out of the sockets), which the next segment's stages inside the host wait for: at 10
    Gbit/s the segments then nearly add up (4 ranks on 2 namespace hosts of 2 cores, a 16 MiB Reduce_scatter took
    17.7-18.3 ms in 2 segments, 18.2 in one); at 1 Gbit/s the link still hides them."""
    return sum(in_hosts) + between + (segments - 1) * max(sum(in_hosts) + between_cpu, between)


def _hier_allreduce_cost(m: CostModel, n: float, lay: Layout) -> float:
    parts = min(lay.local_sizes)
    local = max(lay.local_sizes)
    segments = _segments(int(n))
    piece = n / segments
    intra = Layout.flat(local)
    shm = m.ring(intra, local - 1, (local - 1) / local * piece, reduced=(local - 1) / local * piece) if local > 1 else 0.0
    inner, _ = _inner_allreduce(m, piece / parts, lay.hosts, parts)
    # each rank's share of a ring allreduce among the hosts: 2(H-1)/H of its part sent, as many received
    cpu = m.socket_copies(intra, 2 * (lay.hosts - 1) / lay.hosts * piece / parts)
    return _through_pipeline([shm, shm], inner, segments, cpu)


@register(
    "allreduce",
    "hierarchical",
    "Intra-host ring reduce-scatter, inter-host allreduce per local index, intra-host ring allgather.",
    steps="2(L-1) + inter-host allreduce of n/L on H ranks",
    bytes="2(L-1)/L · n in the host + 2(H-1)/H · n/L across hosts",
    refuse=_refuse_flat,
    cost=_hier_allreduce_cost,
)
def allreduce_hierarchical(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    lay = st.layout
    host = lay.groups[lay.host_of[st.rank]]
    j = host.index(st.rank)
    parts = min(lay.local_sizes)
    n = call.recv.shape[0]
    scratch = st.mem.scratch(n, call.dtype)
    intra, intra_ag = st.sub(host, lane=_INTRA_RS), st.sub(host, lane=_INTRA_AG)
    column = st.sub(_column(lay, j), lane=_INTER) if j < parts else None
    segments = _segments(call.recv.nbytes)

    def blocks(arr: np.ndarray, k: int) -> list[np.ndarray]:  # segment k of ``arr``, cut into the host's parts
        piece = _segment(arr, k, segments)
        return blocks_of(piece, even_counts(piece.shape[0], parts) + [0] * (len(host) - parts))

    def reduce_in_host(k: int) -> Schedule:  # 1. local rank j ends with part j of the segment's host sum
        ins = chunked(intra, [[b] for b in blocks(call.send, k)])
        work = chunked(intra, [[b] for b in blocks(scratch, k)])
        yield from reduce_scatter_ring(intra, ins, work.__getitem__, work[j], call.op)

    def across_hosts(k: int) -> Schedule:  # 2. that part, allreduced with the same local index on other hosts
        part = blocks(scratch, k)[j]
        if column is not None:
            from . import cost as cost_model  # the model in force, as selection uses it

            _, name = _inner_allreduce(cost_model.current(), part.nbytes, column.size, parts)
            summing = _ops.SUM if call.op.averages else call.op  # average once, over all ranks, below
            inner = Call("allreduce", call.dtype, send=part, recv=part, op=summing, in_place=True)
            yield from ALGORITHMS["allreduce"][name].run(column, inner)
        if call.op.averages:
            st.mem.scale(part, st.size)

    def gather_in_host(k: int) -> Schedule:  # 3. the segment's parts to every rank of the host
        out = chunked(intra, [[b] for b in blocks(call.recv, k)])
        own = chunked(intra, [[b] for b in blocks(scratch, k)])[j]
        yield from allgather_ring(intra_ag, out, own)

    yield from _pipelined((reduce_in_host, across_hosts, gather_in_host), segments)
    st.mem.release(scratch)


def _pipelined(stages: tuple, segments: int) -> Schedule:
    """Every segment through every stage, in a pipeline: at step t segment t - i runs stage i, the stages of one
    step side by side. Each stage keeps its own lane and one segment at a time runs each stage, so every rank
    matches messages in one order."""
    for t in range(segments + len(stages) - 1):
        now = [stage(t - i) for i, stage in enumerate(stages) if 0 <= t - i < segments]
        yield from (now[0] if len(now) == 1 else concurrently(*now))


def _segments(nbytes: int) -> int:
    """How many pipelined segments a hierarchical allreduce of ``nbytes`` runs in (one below twice
    PYCOLL_HIER_SEGMENT)."""
    return max(1, min(MAX_SEGMENTS, nbytes // max(1, SEGMENT_BYTES.get())))


def _cells(arr: np.ndarray, counts: list[int], displs: list[int] | None = None) -> list[np.ndarray]:
    return blocks_of(arr, counts, displs)


def _hier_grid_cost(m: CostModel, n: float, lay: Layout, reduced: bool) -> float:
    """Reduce-scatter (``reduced``, in pipelined segments) or allgather (whole): a ring in the host, one between them."""
    local, hosts = max(lay.local_sizes), lay.hosts
    segments = _segments(int(n)) if reduced else 1
    piece = n / segments
    shm = m.ring(Layout.flat(local), local - 1, (local - 1) / local * piece,
                 reduced=((local - 1) / local * piece) if reduced else 0)
    net_model = m.sharing_links(local)
    chunk = piece / local
    net = net_model.ring(Layout.one_per_host(hosts), hosts - 1, (hosts - 1) / hosts * chunk,
                         reduced=((hosts - 1) / hosts * chunk) if reduced else 0)
    cpu = m.socket_copies(Layout.flat(local), (hosts - 1) / hosts * chunk)
    return _through_pipeline([shm], net, segments, cpu)


@register(
    "reduce_scatter",
    "hierarchical",
    "Intra-host ring reduce-scatter by local index, then inter-host ring reduce-scatter per local index.",
    steps="(L-1) + (H-1)",
    bytes="(L-1)/L · n in the host + (H-1)/H · n/L across hosts",
    refuse=_refuse_grid,
    cost=lambda m, n, lay: _hier_grid_cost(m, n, lay, True),
)
def reduce_scatter_hierarchical(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    lay = st.layout
    groups = lay.groups
    host = groups[lay.host_of[st.rank]]
    j = host.index(st.rank)
    total = call.send.shape[0]
    scratch = st.mem.scratch(total, call.dtype)
    send_cells, work_cells = _cells(call.send, call.counts), _cells(scratch, call.counts)
    intra = st.sub(host, lane=_INTRA_RS)
    column = st.sub(_column(lay, j), lane=_INTER)
    mine = call.recv[: call.counts[st.rank]]
    segments = _segments(call.send.nbytes)

    def column_of(cells: list[np.ndarray], jj: int) -> list[np.ndarray]:
        return [cells[g[jj]] for g in groups]

    def piece(cells: list[np.ndarray], k: int) -> list[np.ndarray]:  # segment k of every cell
        return [_segment(c, k, segments) for c in cells]

    def reduce_in_host(k: int) -> Schedule:  # 1. local rank j sums column j (every host's j-th rank's block)
        sends, works = piece(send_cells, k), piece(work_cells, k)
        ins = chunked(intra, [column_of(sends, jj) for jj in range(len(host))])
        work = chunked(intra, [column_of(works, jj) for jj in range(len(host))])
        yield from reduce_scatter_ring(intra, ins, work.__getitem__, work[j], call.op)

    def across_hosts(k: int) -> Schedule:  # 2. the column's ranks reduce-scatter it: each keeps its own block
        cells = chunked(column, [[c] for c in column_of(piece(work_cells, k), j)] + [[_segment(mine, k, segments)]])
        *parts, final = cells
        yield from reduce_scatter_ring(column, parts, parts.__getitem__, final, call.op)

    yield from _pipelined((reduce_in_host, across_hosts), segments)
    if call.op.averages:
        st.mem.scale(mine, st.size)
    st.mem.release(scratch)


def _segment(block: np.ndarray, k: int, segments: int) -> np.ndarray:
    """Segment ``k`` of ``segments`` nearly equal ones of ``block``."""
    bounds = offsets(even_counts(block.shape[0], segments)) + [block.shape[0]]
    return block[bounds[k] : bounds[k + 1]]


@register(
    "allgather",
    "hierarchical",
    "Inter-host ring allgather per local index, then intra-host ring allgather of the gathered columns.",
    steps="(H-1) + (L-1)",
    bytes="(H-1)/H · n/L across hosts + (L-1)/L · n in the host",
    refuse=_refuse_grid,
    cost=lambda m, n, lay: _hier_grid_cost(m, n, lay, False),
)
def allgather_hierarchical(st: Steps, call: Call) -> Schedule:
    assert call.recv is not None
    lay = st.layout
    groups = lay.groups
    host = groups[lay.host_of[st.rank]]
    j = host.index(st.rank)
    cells = _cells(call.recv, call.counts, call.displs)
    mine = cells[st.rank] if call.in_place or call.send is None else call.send

    def column_of(jj: int) -> list[np.ndarray]:
        return [cells[g[jj]] for g in groups]

    # 1. across hosts: gather column j
    column = st.sub(_column(lay, j), lane=_INTER)
    *pieces, own = chunked(column, [[c] for c in column_of(j)] + [[mine]])
    yield from allgather_ring(column, pieces, own)

    # 2. inside the host: every local rank contributes its column
    intra = st.sub(host, lane=_INTRA_AG)
    blocks = chunked(intra, [column_of(jj) for jj in range(len(host))])
    yield from allgather_ring(intra, blocks, blocks[j])


__all__ = ["allreduce_hierarchical", "reduce_scatter_hierarchical", "allgather_hierarchical", "ranked"]
