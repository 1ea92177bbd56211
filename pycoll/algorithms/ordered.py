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


def folds_only(call: Call, lay: Layout) -> Optional[str]:
    """The refusal of algorithms that fold in rank order: other commutative calls have faster algorithms."""
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
    refuse=folds_only,
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


def _there_and_back_cost(m: CostModel, n: float, lay: Layout) -> float:
    # the fold goes up the chain while the results come back down it: both directions of every link busy at once
    return m.phase(lay, 2 * (lay.size - 1) - 1 + m.messages(n), n, reduced=n, flows=1.0) if lay.size > 1 else 0.0


@register(
    "allreduce",
    "ordered",
    "The rank-order chain to the last rank (as reduce:ordered), whose results go back down the chain chunk by "
    "chunk while later chunks still go up: non-commutative ops and reproducible calls.",
    steps="2(p-1) + chunks",
    bytes="2n (n each way on every link, at once)",
    refuse=folds_only,
    cost=_there_and_back_cost,
    ordered=True,
    reproducible=HOW + "; the last rank's results go back down the chain",
)
def allreduce_ordered(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    p, r, op = st.size, st.rank, call.op
    if p == 1:
        st.mem.copy(call.recv, call.send)
        return
    # at least 16 chunks of 64 KiB or more where the vector allows: the way back only overlaps the way up in chunks
    k = max(st.num_chunks(call.send.nbytes), min(16, call.send.nbytes // (64 << 10)))
    ins, outs = split(call.send, k), split(call.recv, k)
    back = st.lane(1)  # results travel on their own lane, against the chain
    if r == 0:  # starts the chain; in place its input chunk is read before its result can arrive
        sends = [st.send(1, piece) for piece in ins]
        for c in range(k):
            yield (back.recv(1, outs[c]),)
        yield tuple(sends)
        return
    acc = st.mem.scratch(call.send.shape[0], call.dtype)  # the fold so far (never the user's memory: it may be send)
    accs = split(acc, k)
    folds = [st.recv_fold(r - 1, ins[c], accs[c], op) for c in range(k)]
    last = r == p - 1
    results = [] if last else [back.recv(r + 1, outs[c]) for c in range(k)]
    sends = []

    def pass_back(c: int) -> Schedule:
        if last:
            if op.averages:
                st.mem.scale(accs[c], p)
            st.mem.copy(outs[c], accs[c])
        else:
            yield (results[c],)
        sends.append(back.send(r - 1, outs[c]))

    # Results come back with a lag: rank r+1 passes result c back once its fold c + 2(p-2-r) is done, so rank r waits
    # for result c - 2(p-1-r) after sending fold c on, two chunks' slack, and never for the chunk it just sent.
    lag = 2 * (p - 1 - r)
    for c in range(k):
        yield (folds[c],)
        if not last:
            sends.append(st.send(r + 1, accs[c]))
        if c >= lag:
            yield from pass_back(c - lag)
    for c in range(max(k - lag, 0), k):
        yield from pass_back(c)
    yield tuple(sends)
    st.mem.release(acc)


@register(
    "reduce_scatter",
    "ordered",
    "The rank-order chain to the last rank over the whole vector, then it sends each rank its block: "
    "non-commutative ops and reproducible calls.",
    steps="p-1 + chunks, then 1",
    bytes="n, then (p-1)/p · n from the last rank",
    refuse=folds_only,
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
