"""Owner-fold reductions: each rank owns one block and folds every rank's part of it in rank order, left to right.

Every element of the result is ``((x_0 op x_1) op x_2) ... op x_{p-1}`` in the buffer's dtype, whatever the chunk
size, the transport or where the ranks sit: the promise of reproducible mode (docs/reproducibility.md). The lower
ranks' fold is always the left operand, so non-commutative ops get MPI's result too. A rank sends each peer that
peer's block at once and takes the blocks in rank order, so the bytes are a ring's ((p-1)/p · n each way for the
reduce-scatter, as much again for an allreduce's allgather); the p-1 receipts are sequential, not pipelined.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import Call, Layout, Schedule, Steps, blocks_of, even_counts, offsets, split
from .cost import CostModel
from .ordered import folds_only
from .registry import register
from .ring import allgather_ring, chunked

HOW = "the owner of each block folds the ranks' parts of it in rank order, as they arrive"


def owner_fold(st: Steps, send: np.ndarray, counts: list[int], op: Any, dest: np.ndarray) -> Schedule:
    """Leave in ``dest`` (``counts[r]`` elements, not overlapping ``send``) the left fold in rank order of every
    rank's block r of ``send`` (blocks packed in rank order), and send every peer its block of ours.

    The partial folds alternate between ``dest`` and a scratch so that no ufunc writes over one of its operands
    (NumPy's complex multiply rounds differently when it does); the last lands in ``dest``."""
    p, r = st.size, st.rank
    blocks = blocks_of(send, counts)
    mine = blocks[r]
    if p == 1:
        st.mem.copy(dest, mine)
        return
    k = st.num_chunks(max(counts) * send.itemsize)
    sends = tuple(st.send(q, piece) for q in range(p) if q != r for piece in split(blocks[q], k))
    spare = st.mem.scratch(counts[r], send.dtype)

    def target(j: int) -> np.ndarray:  # where the fold of ranks 0..j goes: the last one (j = p-1) into dest
        return dest if (p - 1 - j) % 2 == 0 else spare

    acc = mine
    if r != 0:
        acc = spare if target(1) is dest else dest
        yield tuple(st.recv(0, piece) for piece in split(acc, k))
    for j in range(1, p):
        out = target(j)
        if j == r:
            st.mem.reduce(op, acc, mine, out)
        else:
            yield tuple(st.recv_reduce(j, a, o, op) for a, o in zip(split(acc, k), split(out, k)))
        acc = out
    yield sends
    st.mem.release(spare)


def _rs_cost(m: CostModel, n: float, lay: Layout) -> float:
    p = lay.size
    return m.phase(lay, p - 1, (p - 1) / p * n, reduced=(p - 1) / p * n, flows=m.flows(lay)) if p > 1 else 0.0


def _ag_cost(m: CostModel, n: float, lay: Layout) -> float:
    return m.ring(lay, lay.size - 1, (lay.size - 1) / lay.size * n) if lay.size > 1 else 0.0


@register(
    "reduce_scatter",
    "owner",
    "Each rank sends every peer its block and folds its own block from every rank's part in rank order (left fold).",
    steps="p-1 (receipts in rank order)",
    bytes="(p-1)/p · n",
    refuse=folds_only,
    cost=_rs_cost,
    ordered=True,
    reproducible=HOW,
)
def reduce_scatter_owner(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    r, m = st.rank, call.counts[st.rank]
    # The fold lives in scratch: in place, the result goes to the start of the input, which peers' blocks still need.
    folded = st.mem.scratch(m, call.dtype)
    yield from owner_fold(st, call.send, list(call.counts), call.op, folded)
    if call.op.averages:
        st.mem.scale(folded, st.size)
    st.mem.copy(call.recv[:m], folded)
    st.mem.release(folded)


@register(
    "allreduce",
    "owner",
    "The owner reduce-scatter (each block folded in rank order by its owner), then a ring allgather (left fold).",
    steps="p-1 (receipts in rank order) + p-1",
    bytes="2(p-1)/p · n",
    refuse=folds_only,
    cost=lambda m, n, lay: _rs_cost(m, n, lay) + _ag_cost(m, n, lay),
    ordered=True,
    reproducible=HOW + ", then the blocks are copied out",
)
def allreduce_owner(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    p, r = st.size, st.rank
    counts = even_counts(call.recv.shape[0], p)
    folded = st.mem.scratch(counts[r], call.dtype)
    yield from owner_fold(st, call.send, counts, call.op, folded)  # waits for our sends: in place, recv is free now
    if call.op.averages:
        st.mem.scale(folded, p)
    *pieces, own = chunked(st, [[b] for b in blocks_of(call.recv, counts)] + [[folded]])
    yield from allgather_ring(st, pieces, own)
    st.mem.release(folded)


@register(
    "reduce",
    "owner",
    "The owner reduce-scatter (each block folded in rank order by its owner), then every owner sends its block to "
    "the root (left fold).",
    steps="p-1 (receipts in rank order) + 1",
    bytes="(p-1)/p · n, and (p-1)/p · n into the root",
    refuse=folds_only,
    cost=lambda m, n, lay: _rs_cost(m, n, lay) + (m.phase(lay, 1, (lay.size - 1) / lay.size * n) if lay.size > 1 else 0.0),
    ordered=True,
    reproducible=HOW + ", then sends it to the root",
)
def reduce_owner(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.op is not None
    p, r, root = st.size, st.rank, call.root
    counts = even_counts(call.send.shape[0], p)
    folded = st.mem.scratch(counts[r], call.dtype)
    yield from owner_fold(st, call.send, counts, call.op, folded)
    if call.op.averages:
        st.mem.scale(folded, p)
    if r != root:
        yield tuple(st.send(root, piece) for piece in split(folded, st.num_chunks(max(counts) * call.dtype.itemsize)))
    else:
        assert call.recv is not None
        targets = blocks_of(call.recv, counts, offsets(counts))
        k = st.num_chunks(max(counts) * call.dtype.itemsize)
        gets = tuple(st.recv(q, piece) for q in range(p) if q != r for piece in split(targets[q], k))
        st.mem.copy(targets[r], folded)
        if gets:
            yield gets
    st.mem.release(folded)
