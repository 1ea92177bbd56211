"""Reductions in rank order: a pipelined chain from rank 0 to the last rank, then on to the root.

Every rank r folds its input onto what rank r-1 passes it, ``((x_0 op x_1) op ...) op x_r``, lower ranks on the
left: an associative op that does not commute gets MPI's result, and every op the left fold that reproducible mode
promises (docs/reproducibility.md). Other commutative calls have faster algorithms: these decline them.
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
    if call.op is None or (call.op.commutative and not call.reproducible):
        return "for non-commutative ops only, or reproducible calls (commutative ones have faster algorithms)"
    return None


def _chain_cost(m: CostModel, n: float, lay: Layout) -> float:
    return m.phase(lay, lay.size - 2 + m.messages(n), n, reduced=n, flows=1.0) if lay.size > 1 else 0.0


HOW = "a chain in rank order: rank r folds its input onto what rank r-1 passes it"


def chain_to_last(st: Steps, send: np.ndarray, acc: Optional[np.ndarray], op) -> Schedule:
    """Leave ``acc`` at rank p-1 = ((x_0 op x_1) op ...) op x_{p-1}, chunk by chunk along 0 -> 1 -> ... -> p-1.

    The last rank passes its ``acc`` (where the result goes; it must not overlap ``send``); the others need none.
    The incoming fold is always the left operand.
    """
    p, r = st.size, st.rank
    if p == 1:
        assert acc is not None
        st.mem.copy(acc, send)
        return
    k = st.num_chunks(send.nbytes)
    ins = split(send, k)
    if r == 0:  # the near end starts the chain with its own input
        yield tuple(st.send(1, piece) for piece in ins)
        return
    own = acc if r == p - 1 else st.mem.scratch(send.shape[0], send.dtype)
    assert own is not None
    outs = split(own, k)
    pending = deque(st.recv_fold(r - 1, ins[c], outs[c], op) for c in range(k))
    sends = []
    for c in range(k):
        yield (pending.popleft(),)
        if r < p - 1:
            sends.append(st.send(r + 1, outs[c]))
    if sends:
        yield tuple(sends)
    if r < p - 1:
        st.mem.release(own)


def _result(st: Steps, call: Call, n: int) -> np.ndarray:
    """Where the last rank gathers the whole reduction: scratch (released by the caller) unless recv may take it."""
    if call.recv is not None and not call.in_place and call.recv.shape[0] == n and call.coll != "reduce_scatter":
        return call.recv
    return st.mem.scratch(n, call.dtype)


@register(
    "reduce",
    "ordered",
    "A pipelined chain in rank order from rank 0 to the last rank, which passes the result to the root: "
    "non-commutative ops and reproducible calls.",
    steps="p-1 + chunks (+1 to a root other than p-1)",
    bytes="n (+n to the root)",
    refuse=_refuse,
    cost=lambda m, n, lay: _chain_cost(m, n, lay) + (m.phase(lay, m.messages(n), n) if lay.size > 1 else 0.0),
    ordered=True,
    reproducible=HOW,
)
def reduce_ordered(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.op is not None
    p, r, root = st.size, st.rank, call.root
    last = p - 1
    n = call.send.shape[0]
    acc = (_result(st, call, n) if root == last else st.mem.scratch(n, call.dtype)) if r == last else None
    yield from chain_to_last(st, call.send, acc, call.op)
    if r == last:
        assert acc is not None
        if call.op.averages:
            st.mem.scale(acc, p)
        if root == last:
            if acc is not call.recv:
                st.mem.copy(call.recv, acc)
        else:
            yield tuple(st.lane(1).send(root, piece) for piece in split(acc, st.num_chunks(acc.nbytes)))
        if acc is not call.recv:
            st.mem.release(acc)
    elif r == root:
        assert call.recv is not None
        yield tuple(st.lane(1).recv(last, piece) for piece in split(call.recv, st.num_chunks(call.recv.nbytes)))


@register(
    "allreduce",
    "ordered",
    "The rank-order chain to the last rank (as reduce:ordered), then a pipelined binary-tree broadcast: "
    "non-commutative ops and reproducible calls.",
    steps="p-1 + log2 p + chunks",
    bytes="2n",
    refuse=_refuse,
    cost=lambda m, n, lay: 2 * _chain_cost(m, n, lay),
    ordered=True,
    reproducible=HOW + ", then the last rank broadcasts it",
)
def allreduce_ordered(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    p, r = st.size, st.rank
    n = call.recv.shape[0]
    acc = _result(st, call, n) if r == p - 1 else None
    yield from chain_to_last(st, call.send, acc, call.op)
    if r == p - 1:
        assert acc is not None
        if call.op.averages:
            st.mem.scale(acc, p)
        if acc is not call.recv:
            st.mem.copy(call.recv, acc)
            st.mem.release(acc)
    if p > 1:
        yield from broadcast_down(st.lane(1), rooted_tree(p, p - 1), split(call.recv, st.num_chunks(call.recv.nbytes)))


@register(
    "reduce_scatter",
    "ordered",
    "The rank-order chain to the last rank over the whole vector, then it sends each rank its block: "
    "non-commutative ops and reproducible calls.",
    steps="p-1 + chunks, then 1",
    bytes="n, then (p-1)/p · n from the last rank",
    refuse=_refuse,
    cost=lambda m, n, lay: _chain_cost(m, n, lay) + (m.phase(lay, 1, n) if lay.size > 1 else 0.0),
    ordered=True,
    reproducible=HOW + ", then the last rank hands out the blocks",
)
def reduce_scatter_ordered(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    p, r = st.size, st.rank
    last = p - 1
    counts = list(call.counts)
    displs = offsets(counts)
    total = sum(counts)
    acc = st.mem.scratch(total, call.dtype) if r == last else None
    yield from chain_to_last(st, call.send[:total], acc, call.op)
    lane = st.lane(1)
    if r == last:
        assert acc is not None
        if call.op.averages:
            st.mem.scale(acc, p)
        sends = [lane.send(q, piece) for q in range(p) if q != last and counts[q]
                 for piece in split(acc[displs[q]:displs[q] + counts[q]], st.num_chunks(counts[q] * call.dtype.itemsize))]
        st.mem.copy(call.recv[:counts[last]], acc[displs[last]:displs[last] + counts[last]])
        if sends:
            yield tuple(sends)
        st.mem.release(acc)
    elif counts[r]:
        mine = call.recv[:counts[r]]
        yield tuple(lane.recv(last, piece) for piece in split(mine, st.num_chunks(mine.nbytes)))
