"""Reductions in rank order, for non-commutative ops: a pipelined chain from the last rank to rank 0, then on to the root.

Every rank r combines its input with what rank r+1 passes it, ``x_r op (x_{r+1} op (... op x_{p-1}))``, lower ranks
on the left, so an associative op that does not commute gets MPI's result. Commutative ops have faster algorithms:
these decline them.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import numpy as np

from .base import Call, Layout, Schedule, Steps, offsets, split
from .cost import CostModel
from .registry import register
from .tree import broadcast_down, rooted_tree


def _refuse(call: Call, lay: Layout) -> Optional[str]:
    if call.op is None or call.op.commutative:
        return "for non-commutative ops only (commutative ones have faster algorithms)"
    return None


def _chain_cost(m: CostModel, n: float, lay: Layout) -> float:
    return m.phase(lay, lay.size - 2 + m.messages(n), n, reduced=n, flows=1.0) if lay.size > 1 else 0.0


def chain_to_zero(st: Steps, send: np.ndarray, acc: Optional[np.ndarray], op) -> Schedule:
    """Leave ``acc`` at rank 0 = x_0 op (x_1 op (... op x_{p-1})), chunk by chunk along p-1 -> ... -> 1 -> 0.

    Rank 0 passes its ``acc`` (where the result goes; it must not be ``send``); the others need none.
    """
    p, r = st.size, st.rank
    if p == 1:
        assert acc is not None
        st.mem.copy(acc, send)
        return
    k = st.num_chunks(send.nbytes)
    ins = split(send, k)
    if r == p - 1:  # the far end starts the chain with its own input
        yield tuple(st.send(r - 1, piece) for piece in ins)
        return
    own = acc if r == 0 else st.mem.scratch(send.shape[0], send.dtype)
    assert own is not None
    outs = split(own, k)
    pending = deque(st.recv_reduce(r + 1, ins[c], outs[c], op) for c in range(k))
    sends = []
    for c in range(k):
        yield (pending.popleft(),)
        if r > 0:
            sends.append(st.send(r - 1, outs[c]))
    if sends:
        yield tuple(sends)
    if r > 0:
        st.mem.release(own)


def _result(st: Steps, call: Call, n: int) -> np.ndarray:
    """Where rank 0 gathers the whole reduction: scratch (released by the caller) unless recv may take it directly."""
    if call.recv is not None and not call.in_place and call.recv.shape[0] == n and call.coll != "reduce_scatter":
        return call.recv
    return st.mem.scratch(n, call.dtype)


@register(
    "reduce",
    "ordered",
    "Non-commutative ops: a pipelined chain in rank order from the last rank to rank 0, which passes the result to the root.",
    steps="p-1 + chunks (+1 to a root other than 0)",
    bytes="n (+n to the root)",
    refuse=_refuse,
    cost=lambda m, n, lay: _chain_cost(m, n, lay) + (m.phase(lay, m.messages(n), n) if lay.size > 1 else 0.0),
    ordered=True,
)
def reduce_ordered(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.op is not None
    p, r, root = st.size, st.rank, call.root
    n = call.send.shape[0]
    acc = _result(st, call, n) if r == 0 and root == 0 else (st.mem.scratch(n, call.dtype) if r == 0 else None)
    yield from chain_to_zero(st, call.send, acc, call.op)
    if r == 0:
        assert acc is not None
        if call.op.averages:
            st.mem.scale(acc, p)
        if root == 0:
            if acc is not call.recv:
                st.mem.copy(call.recv, acc)
        else:
            yield tuple(st.lane(1).send(root, piece) for piece in split(acc, st.num_chunks(acc.nbytes)))
        if acc is not call.recv:
            st.mem.release(acc)
    elif r == root:
        assert call.recv is not None
        yield tuple(st.lane(1).recv(0, piece) for piece in split(call.recv, st.num_chunks(call.recv.nbytes)))


@register(
    "allreduce",
    "ordered",
    "Non-commutative ops: the rank-order chain to rank 0 (as reduce:ordered), then a pipelined binary-tree broadcast.",
    steps="p-1 + log2 p + chunks",
    bytes="2n",
    refuse=_refuse,
    cost=lambda m, n, lay: 2 * _chain_cost(m, n, lay),
    ordered=True,
)
def allreduce_ordered(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    p, r = st.size, st.rank
    n = call.recv.shape[0]
    acc = _result(st, call, n) if r == 0 else None
    yield from chain_to_zero(st, call.send, acc, call.op)
    if r == 0:
        assert acc is not None
        if call.op.averages:
            st.mem.scale(acc, p)
        if acc is not call.recv:
            st.mem.copy(call.recv, acc)
            st.mem.release(acc)
    if p > 1:
        yield from broadcast_down(st.lane(1), rooted_tree(p, 0), split(call.recv, st.num_chunks(call.recv.nbytes)))


@register(
    "reduce_scatter",
    "ordered",
    "Non-commutative ops: the rank-order chain to rank 0 over the whole vector, then rank 0 sends each rank its block.",
    steps="p-1 + chunks, then 1",
    bytes="n, then (p-1)/p · n from rank 0",
    refuse=_refuse,
    cost=lambda m, n, lay: _chain_cost(m, n, lay) + (m.phase(lay, 1, n) if lay.size > 1 else 0.0),
    ordered=True,
)
def reduce_scatter_ordered(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    p, r = st.size, st.rank
    counts = list(call.counts)
    displs = offsets(counts)
    total = sum(counts)
    acc = st.mem.scratch(total, call.dtype) if r == 0 else None
    yield from chain_to_zero(st, call.send[:total], acc, call.op)
    lane = st.lane(1)
    if r == 0:
        assert acc is not None
        if call.op.averages:
            st.mem.scale(acc, p)
        sends = [lane.send(q, piece) for q in range(1, p) if counts[q]
                 for piece in split(acc[displs[q]:displs[q] + counts[q]], st.num_chunks(counts[q] * call.dtype.itemsize))]
        st.mem.copy(call.recv[:counts[0]], acc[:counts[0]])
        if sends:
            yield tuple(sends)
        st.mem.release(acc)
    elif counts[r]:
        mine = call.recv[:counts[r]]
        yield tuple(lane.recv(0, piece) for piece in split(mine, st.num_chunks(mine.nbytes)))
