"""Direct algorithms, where every rank talks to its peers at once: gather, scatter, alltoall, barrier."""

from __future__ import annotations

import math

import numpy as np

from ..p2p_protocol import SMALL_BYTES
from .base import Call, Schedule, Steps, unfinished
from .registry import register


_EMPTY = np.empty(0, np.uint8)


def _direct_cost(steps_of, blocks_off_host):
    """The model's time for a direct algorithm: ``steps_of(p)`` message steps moving (p-1)/p of the vector; across
    hosts, ``blocks_off_host(layout)`` of its p blocks cross the busiest host's link each way."""

    def cost(m, n, lay):
        p = lay.size
        if p == 1:
            return 0.0
        wire = blocks_off_host(lay) * n / p if lay.hosts > 1 else None
        # the steps are posted at once: their messages cross together, one hop's latency for them all
        return m.phase(lay, steps_of(p), n * (p - 1) / p, wire=wire, depth=1)

    return cost


def _root_host_blocks(lay) -> int:
    """Gather and scatter: the blocks of ranks off the root's host (rank 0's, as the model knows no root), all
    through the root host's link."""
    return lay.size - lay.local_sizes[lay.host_of[0]]


def _alltoall_blocks(lay) -> int:
    """Alltoall: each of a host's k ranks sends a block to every rank off it, k (p - k) blocks."""
    return max(k * (lay.size - k) for k in lay.local_sizes)


@register("gather", "linear", "The root receives every rank's block directly.", steps="1", bytes="(p-1)/p · n at the root",
          cost=_direct_cost(lambda p: 1, _root_host_blocks))
def gather_linear(st: Steps, call: Call) -> Schedule:
    p, r = st.size, st.rank
    if r != call.root:
        assert call.send is not None
        yield (st.send(call.root, call.send),)
        return
    assert call.recv is not None
    blocks = [call.recv[d : d + c] for c, d in zip(call.counts, call.displs)]
    yield tuple(st.recv(i, blocks[i]) for i in range(p) if i != r)
    if not call.in_place:
        assert call.send is not None
        st.mem.copy(blocks[r], call.send)


@register("scatter", "linear", "The root sends every rank its block directly.", steps="1", bytes="(p-1)/p · n at the root",
          cost=_direct_cost(lambda p: 1, _root_host_blocks))
def scatter_linear(st: Steps, call: Call) -> Schedule:
    p, r = st.size, st.rank
    if r != call.root:
        assert call.recv is not None
        yield (st.recv(call.root, call.recv),)
        return
    assert call.send is not None
    blocks = [call.send[d : d + c] for c, d in zip(call.counts, call.displs)]
    yield tuple(st.send(i, blocks[i]) for i in range(p) if i != r)
    if not call.in_place:
        assert call.recv is not None
        st.mem.copy(call.recv, blocks[r])


@register(
    "alltoall",
    "pairwise",
    "At step s each rank sends to rank+s and receives from rank-s; all steps are posted at once.",
    steps="p-1",
    bytes="(p-1)/p · n",
    cost=_direct_cost(lambda p: p - 1, _alltoall_blocks),
)
def alltoall_pairwise(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None
    p, r = st.size, st.rank
    source = call.send
    if call.in_place:  # blocks are overwritten while they are still to be sent: send from a copy
        source = st.mem.scratch(call.send.shape[0], call.dtype)
        st.mem.copy(source, call.send)
    out = [call.recv[d : d + c] for c, d in zip(call.counts, call.displs)]
    inp = [source[d : d + c] for c, d in zip(call.send_counts, call.send_displs)]
    reqs: list = []
    if st.now and max(call.send_counts) * call.dtype.itemsize > SMALL_BYTES:  # every peer's frames at once, in C
        reqs += st.exchange_now([((r + s) % p, inp[(r + s) % p], out[(r + s) % p]) for s in range(1, p)])
    elif st.now:  # every send straight through the sockets where it can go so, then the receives in turn
        reqs += unfinished(*(st.send_now((r + s) % p, inp[(r + s) % p]) for s in range(1, p)))
        reqs += unfinished(*(st.recv_now((r - s) % p, out[(r - s) % p]) for s in range(1, p)))
    else:
        for s in range(1, p):
            reqs.append(st.recv((r - s) % p, out[(r - s) % p]))
            reqs.append(st.send((r + s) % p, inp[(r + s) % p]))
    try:
        yield tuple(reqs)
    except GeneratorExit:  # the call failed: in place, put the caller's input back
        if call.in_place:
            st.mem.copy(call.send, source)
        raise
    st.mem.copy(out[r], inp[r])
    if call.in_place:
        st.mem.release(source)


@register(
    "barrier",
    "dissemination",
    "Dissemination barrier: in round k each rank signals rank+2^k and waits for rank-2^k.",
    steps="ceil(log2 p)",
    bytes="0",
    cost=lambda m, n, lay: m.phase(lay, math.ceil(math.log2(lay.size)), 0.0) if lay.size > 1 else 0.0,
)
def barrier_dissemination(st: Steps, call: Call) -> Schedule:
    p, r = st.size, st.rank
    distance = 1
    while distance < p:  # messages carry no payload
        if st.now:
            pending = unfinished(st.send_now((r + distance) % p, _EMPTY), st.recv_now((r - distance) % p, _EMPTY))
            if pending:
                yield pending
        else:
            yield (st.send((r + distance) % p, _EMPTY), st.recv((r - distance) % p, _EMPTY))
        distance *= 2
