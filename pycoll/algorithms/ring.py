"""Ring algorithms: pipelined reduce-scatter, allgather, and allreduce as the one followed by the other."""

from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np

from .base import Call, Schedule, Steps, even_counts, offsets, split
from .registry import register


def reduce_scatter_ring(
    st: Steps, inputs: list[np.ndarray], partial: Callable[[int], np.ndarray], final: np.ndarray, op
) -> Schedule:
    """Leave ``final`` = op over all ranks of block ``st.rank``.

    ``inputs[b]`` is this rank's contribution to block b; ``partial(b)`` is where partial sums of block b
    may be kept (it may be ``inputs[b]`` itself for in-place calls). At step s a rank receives block
    (r-s-2) from its left, reduces it with its own contribution, and forwards it at step s+1.
    """
    p, r = st.size, st.rank
    if p == 1:
        st.mem.copy(final, inputs[0])
        return
    left, right = (r - 1) % p, (r + 1) % p
    k = st.num_chunks(max(a.nbytes for a in inputs))
    pieces = [split(a, k) for a in inputs]

    def target(s: int) -> list[np.ndarray]:
        return split(final, k) if s == p - 2 else split(partial((r - s - 2) % p), k)

    sends = [st.send(right, piece) for piece in pieces[(r - 1) % p]]
    out0 = target(0)
    pending = deque((0, c, st.recv_reduce(left, pieces[(r - 2) % p][c], out0[c], op)) for c in range(k))
    outs = {0: out0}
    while pending:
        s, c, req = pending.popleft()
        yield (req,)
        if s + 1 <= p - 2:  # forward the chunk just reduced, and expect the next step's chunk
            sends.append(st.send(right, outs[s][c]))
            if s + 1 not in outs:
                outs[s + 1] = target(s + 1)
            b = (r - s - 3) % p
            pending.append((s + 1, c, st.recv_reduce(left, pieces[b][c], outs[s + 1][c], op)))
    yield tuple(sends)


def allgather_ring(st: Steps, blocks: list[np.ndarray], mine: np.ndarray) -> Schedule:
    """Fill ``blocks[b]`` with rank b's block; this rank's comes from ``mine`` (copied in last)."""
    p, r = st.size, st.rank
    if p > 1:
        left, right = (r - 1) % p, (r + 1) % p
        k = st.num_chunks(max(max(b.nbytes for b in blocks), mine.nbytes))
        pieces = [split(b, k) for b in blocks]
        sends = [st.send(right, piece) for piece in split(mine, k)]
        pending = deque((0, c, st.recv(left, pieces[(r - 1) % p][c])) for c in range(k))
        while pending:
            s, c, req = pending.popleft()
            yield (req,)
            if s + 1 <= p - 2:
                sends.append(st.send(right, pieces[(r - s - 1) % p][c]))
                pending.append((s + 1, c, st.recv(left, pieces[(r - s - 2) % p][c])))
        yield tuple(sends)
    st.mem.copy(blocks[r], mine)


def blocks_of(arr: np.ndarray, counts: list[int], displs: list[int]) -> list[np.ndarray]:
    return [arr[d : d + c] for c, d in zip(counts, displs)]


@register(
    "allreduce",
    "ring",
    "Ring reduce-scatter then ring allgather, pipelined in chunks; bandwidth-optimal.",
    steps="2(p-1)",
    bytes="2(p-1)/p · n",
)
def allreduce_ring(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    p, r = st.size, st.rank
    counts = even_counts(call.recv.shape[0], p)
    displs = offsets(counts)
    # Partial sums live in scratch: user memory is written only once every rank's
    # call has been checked along the ring (a mismatch then leaves it untouched).
    scratch = st.mem.scratch(call.recv.shape[0], call.dtype)
    parts = blocks_of(scratch, counts, displs)
    ins = blocks_of(call.send, counts, displs)
    yield from reduce_scatter_ring(st, ins, lambda b: parts[b], parts[r], call.op)
    if call.op.averages:
        st.mem.scale(parts[r], p)
    yield from allgather_ring(st, blocks_of(call.recv, counts, displs), parts[r])
    st.mem.release(scratch)


@register(
    "reduce_scatter",
    "ring",
    "Ring reduce-scatter, pipelined in chunks; partial sums of other ranks' blocks live in scratch.",
    steps="p-1",
    bytes="(p-1)/p · n",
)
def reduce_scatter_ring_algo(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    p, r = st.size, st.rank
    ins = blocks_of(call.send, call.counts, offsets(call.counts))
    # Partial sums and the result stay in scratch until the end: in place, the result goes to the
    # start of the input buffer, which other blocks still need; and a mismatch leaves user memory alone.
    scratch = st.mem.scratch(call.send.shape[0], call.dtype)
    parts = blocks_of(scratch, call.counts, offsets(call.counts))
    yield from reduce_scatter_ring(st, ins, lambda b: parts[b], parts[r], call.op)
    if call.op.averages:
        st.mem.scale(parts[r], p)
    st.mem.copy(call.recv[: call.counts[r]], parts[r])
    st.mem.release(scratch)


@register(
    "allgather",
    "ring",
    "Ring allgather (also Allgatherv), pipelined in chunks; bandwidth-optimal.",
    steps="p-1",
    bytes="(p-1)/p · n",
)
def allgather_ring_algo(st: Steps, call: Call) -> Schedule:
    assert call.recv is not None
    blocks = blocks_of(call.recv, call.counts, call.displs)
    mine = blocks[st.rank] if call.in_place or call.send is None else call.send
    yield from allgather_ring(st, blocks, mine)
