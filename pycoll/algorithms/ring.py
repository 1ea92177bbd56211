"""Ring algorithms: pipelined reduce-scatter, allgather, and allreduce as the one followed by the other.

They walk the layout's ring order (``Layout.ring``: hosts contiguous, fastest links first), not rank order:
``on_ring`` gives a view of the verbs in which rank i is ring position i, and per-rank block lists are
permuted to match, so each rank still ends with its own block.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np

from .base import Call, Layout, Schedule, Steps, blocks_of, even_counts, pieces_of, unfinished
from .cost import CostModel
from .registry import register


def on_ring(st: Steps) -> tuple[Steps, tuple[int, ...]]:
    """``st`` seen in ring order (rank i of the view is ring position i, so neighbours are i-1 and i+1), and the
    order itself (position i is rank ``order[i]``) to permute per-rank lists with; ``(st, ())`` for rank order."""
    order = st.layout.ring
    return (st.sub(order), order) if order else (st, ())


def reduce_scatter_ring(
    st: Steps,
    inputs: list[list[np.ndarray]],
    partial: Callable[[int], list[np.ndarray]],
    final: list[np.ndarray],
    op,
) -> Schedule:
    """Leave ``final`` = op over all ranks of block ``st.rank``. Blocks are lists of k pieces (k equal for all).

    ``inputs[b]`` is this rank's contribution to block b; ``partial(b)`` is where partial sums of block b
    may be kept (it may be ``inputs[b]`` itself for in-place calls). At step s a rank receives block
    (r-s-2) from its left, reduces it with its own contribution, and forwards it at step s+1; the
    pieces pipeline, so piece c of step s+1 leaves while piece c+1 of step s arrives. Positions on the
    layout's ring stand for ranks here (see ``on_ring``).
    """
    st, order = on_ring(st)
    if order:
        inputs, by_rank = [inputs[b] for b in order], partial
        partial = lambda b: by_rank(order[b])  # noqa: E731
    p, r = st.size, st.rank
    if p == 1:
        for dst, src in zip(final, inputs[0]):
            st.mem.copy(dst, src)
        return
    left, right = (r - 1) % p, (r + 1) % p
    k = len(final)

    def target(s: int) -> list[np.ndarray]:
        return final if s == p - 2 else partial((r - s - 2) % p)

    if st.now and k == 1 and p == 2:  # one step: a swap
        yield from st.swap_now(right, inputs[(r - 1) % p][0], final[0], inputs[r][0], op)
        return
    if st.now and k == 1:  # one message per step: straight through the sockets where it can go so
        later = unfinished(st.send_now(right, inputs[(r - 1) % p][0]))
        for s in range(p - 1):
            out = target(s)[0]
            got = unfinished(st.recv_reduce_now(left, inputs[(r - s - 2) % p][0], out, op))
            if got:
                yield got
            if s + 1 <= p - 2:
                later += unfinished(st.send_now(right, out))
        if later:
            yield later
        return

    sends = [st.send(right, piece) for piece in inputs[(r - 1) % p]]
    outs = {0: target(0)}
    pending = deque((0, c, st.recv_reduce(left, inputs[(r - 2) % p][c], outs[0][c], op)) for c in range(k))
    while pending:
        s, c, req = pending.popleft()
        yield (req,)
        if s + 1 <= p - 2:  # forward the piece just reduced, and expect the next step's piece
            sends.append(st.send(right, outs[s][c]))
            if s + 1 not in outs:
                outs[s + 1] = target(s + 1)
            b = (r - s - 3) % p
            pending.append((s + 1, c, st.recv_reduce(left, inputs[b][c], outs[s + 1][c], op)))
    yield tuple(sends)


def allgather_ring(st: Steps, blocks: list[list[np.ndarray]], mine: list[np.ndarray]) -> Schedule:
    """Fill ``blocks[b]`` (lists of k pieces) with rank b's block; this rank's comes from ``mine``, copied in last.
    The blocks travel along the layout's ring (see ``on_ring``)."""
    st, order = on_ring(st)
    if order:
        blocks = [blocks[b] for b in order]
    p, r = st.size, st.rank
    if p > 1:
        left, right = (r - 1) % p, (r + 1) % p
        k = len(mine)
        if st.now and k == 1:  # one message per step: straight through the sockets where it can go so
            if p == 2:  # one step: a swap
                yield from st.swap_now(right, mine[0], blocks[(r - 1) % p][0])
                for dst, src in zip(blocks[r], mine):
                    st.mem.copy(dst, src)
                return
            later = unfinished(st.send_now(right, mine[0]))
            for s in range(p - 1):
                got = unfinished(st.recv_now(left, blocks[(r - s - 1) % p][0]))
                if got:
                    yield got
                if s + 1 <= p - 2:
                    later += unfinished(st.send_now(right, blocks[(r - s - 1) % p][0]))
            if later:
                yield later
            for dst, src in zip(blocks[r], mine):
                st.mem.copy(dst, src)
            return
        sends = [st.send(right, piece) for piece in mine]
        pending = deque((0, c, st.recv(left, blocks[(r - 1) % p][c])) for c in range(k))
        while pending:
            s, c, req = pending.popleft()
            yield (req,)
            if s + 1 <= p - 2:
                sends.append(st.send(right, blocks[(r - s - 1) % p][c]))
                pending.append((s + 1, c, st.recv(left, blocks[(r - s - 2) % p][c])))
        yield tuple(sends)
    for dst, src in zip(blocks[r], mine):
        st.mem.copy(dst, src)


def chunked(st: Steps, blocks: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
    """Blocks given as lists of segments, cut so every block has the same number of pipelined pieces."""
    largest = max((seg.nbytes for segs in blocks for seg in segs), default=0)
    k = st.num_chunks(largest)
    return [pieces_of(segs, k) for segs in blocks]


def ring_allreduce(st: Steps, send: np.ndarray, recv: np.ndarray, op) -> Schedule:
    """Allreduce of ``send`` into ``recv`` (they may be the same array) over the ranks of ``st``, along its ring:
    ring position i reduces part i of the vector."""
    st, _ = on_ring(st)
    p, r = st.size, st.rank
    counts = even_counts(recv.shape[0], p)
    # Partial sums live in scratch: user memory is written only once every rank's
    # call has been checked along the ring (a mismatch then leaves it untouched).
    scratch = st.mem.scratch(recv.shape[0], recv.dtype)
    parts = chunked(st, [[b] for b in blocks_of(scratch, counts)])
    ins = chunked(st, [[b] for b in blocks_of(send, counts)])
    yield from reduce_scatter_ring(st, ins, parts.__getitem__, parts[r], op)
    if op.averages:
        for piece in parts[r]:
            st.mem.scale(piece, p)
    yield from allgather_ring(st, chunked(st, [[b] for b in blocks_of(recv, counts)]), parts[r])
    st.mem.release(scratch)


@register(
    "allreduce",
    "ring",
    "Ring reduce-scatter then ring allgather, pipelined in chunks; bandwidth-optimal.",
    steps="2(p-1)",
    bytes="2(p-1)/p · n",
    cost=lambda m, n, lay: m.ring(lay, 2 * (lay.size - 1), 2 * (lay.size - 1) / lay.size * n, reduced=(lay.size - 1) / lay.size * n,
                                  footprint=3.0 * n * lay.size),  # send, scratch, recv
)
def allreduce_ring(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    yield from ring_allreduce(st, call.send, call.recv, call.op)


@register(
    "reduce_scatter",
    "ring",
    "Ring reduce-scatter, pipelined in chunks; partial sums of other ranks' blocks live in scratch.",
    steps="p-1",
    bytes="(p-1)/p · n",
    cost=lambda m, n, lay: m.ring(lay, lay.size - 1, (lay.size - 1) / lay.size * n, reduced=(lay.size - 1) / lay.size * n,
                                  footprint=(2.0 + 1.0 / lay.size) * n * lay.size),  # send, scratch, recv
)
def reduce_scatter_ring_algo(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    p, r = st.size, st.rank
    # Partial sums and the result stay in scratch until the end: in place, the result goes to the
    # start of the input buffer, which other blocks still need; and a mismatch leaves user memory alone.
    scratch = st.mem.scratch(call.send.shape[0], call.dtype)
    parts = chunked(st, [[b] for b in blocks_of(scratch, call.counts)])
    ins = chunked(st, [[b] for b in blocks_of(call.send, call.counts)])
    yield from reduce_scatter_ring(st, ins, parts.__getitem__, parts[r], call.op)
    mine = blocks_of(scratch, call.counts)[r]
    if call.op.averages:
        st.mem.scale(mine, p)
    st.mem.copy(call.recv[: call.counts[r]], mine)
    st.mem.release(scratch)


def _allgather_ring_cost(m: CostModel, n: float, lay: Layout) -> float:
    """p-1 steps of n/p bytes, then the rank's own block copied into the result (out of place)."""
    footprint = (1.0 + 1.0 / lay.size) * n * lay.size
    return m.ring(lay, lay.size - 1, (lay.size - 1) / lay.size * n, footprint=footprint) + m.copy_s(n / lay.size, footprint)


@register(
    "allgather",
    "ring",
    "Ring allgather (also Allgatherv), pipelined in chunks; bandwidth-optimal.",
    steps="p-1",
    bytes="(p-1)/p · n",
    cost=lambda m, n, lay: _allgather_ring_cost(m, n, lay),
)
def allgather_ring_algo(st: Steps, call: Call) -> Schedule:
    assert call.recv is not None
    blocks = blocks_of(call.recv, call.counts, call.displs)
    mine = blocks[st.rank] if call.in_place or call.send is None else call.send
    *pieces, own = chunked(st, [[b] for b in blocks] + [[mine]])
    yield from allgather_ring(st, pieces, own)
