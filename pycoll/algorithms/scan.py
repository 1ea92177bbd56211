"""Prefix reductions (MPI Scan and Exscan): a pipelined chain in rank order, and recursive doubling.

Both combine strictly left to right, ``op(op(op(x0, x1), x2), ...)`` with the lower ranks' value as the left
operand, so every algorithm gives the bits of ``functools.reduce(ufunc, [x0, ..., xr])``. AVG divides the prefix
sum by the number of ranks in the prefix (r+1 for Scan, r for Exscan). Exscan leaves rank 0's recvbuf untouched.
"""

from __future__ import annotations

from typing import Optional

from .base import Call, Layout, Schedule, Steps, split
from .cost import CostModel, log2ceil
from .registry import register


def _chain_flows(lay: Layout) -> float:
    """Flows on the busiest host link of a chain in rank order: the hops r -> r+1 that leave each host."""
    leaving = [0] * max(lay.hosts, 1)
    for r in range(lay.size - 1):
        if lay.host_of[r] != lay.host_of[r + 1]:
            leaving[lay.host_of[r]] += 1
    return float(max(leaving + [1]))


def _linear_cost(m: CostModel, n: float, lay: Layout) -> float:
    if lay.size < 2:
        return 0.0
    # p-1 hops, pipelined: the last chunk leaves rank 0 after chunks-1 steps; every rank but the first reduces n
    return m.phase(lay, lay.size - 2 + m.messages(n), n, reduced=n, flows=_chain_flows(lay))


def _doubling_rounds(p: int) -> list[int]:
    """Blocks the busiest rank (p-1) receives in each round: min(2^k, p - 2^k)."""
    return [min(1 << k, p - (1 << k)) for k in range(log2ceil(p))]


def _doubling_cost(m: CostModel, n: float, lay: Layout) -> float:
    if lay.size < 2:
        return 0.0
    blocks = _doubling_rounds(lay.size)
    moved = sum(blocks) * n  # p-1 input vectors reach the last rank, which then folds them all
    msgs = sum(m.messages(b * n) for b in blocks)
    return m.phase(lay, len(blocks), moved, reduced=moved, flows=m.flows(lay), messages=msgs)


# Doubling leaves the last rank holding every rank's input: p·n bytes of scratch. Past this it declines, and
# selection falls back to the chain (which holds n).
_HELD_LIMIT = 1 << 30


def _doubling_refuse(call: Call, lay: Layout) -> Optional[str]:
    held = lay.size * call.size_bytes
    if held > _HELD_LIMIT:
        return f"the last rank would hold {lay.size} inputs ({held >> 20} MiB), over {_HELD_LIMIT >> 20} MiB"
    return None


def _scale(st: Steps, call: Call, ranks: int) -> None:
    """AVG: divide the prefix sum by the number of ranks it covers."""
    assert call.op is not None and call.recv is not None
    if call.op.averages and ranks > 1:
        st.mem.scale(call.recv, ranks)


def _linear(st: Steps, call: Call, exclusive: bool) -> Schedule:
    """Rank r receives the prefix of ranks 0..r-1 from r-1 chunk by chunk and forwards its own prefix to r+1.

    No reduction writes over one of its operands: NumPy's complex multiply rounds differently when it does.
    """
    assert call.send is not None and call.recv is not None and call.op is not None
    p, r, op = st.size, st.rank, call.op
    n = call.send.shape[0]
    k = st.num_chunks(call.send.nbytes)
    if r == 0:  # starts the chain with its own input
        sends = tuple(st.send(1, piece) for piece in split(call.send, k)) if p > 1 else ()
        if not exclusive:
            st.mem.copy(call.recv, call.send)
        if sends:
            yield sends
        return
    last = r == p - 1
    # scratch: the incoming prefix (Scan) or the forwarded one (Exscan), then a copy of x_r when it lives in recvbuf
    need = not (exclusive and last)  # the last rank of an Exscan only receives
    keep = need and call.in_place
    scratch = st.mem.scratch(n * (1 + keep), call.dtype) if need else None
    mine = call.send
    if keep:
        assert scratch is not None
        mine = scratch[n:]
        st.mem.copy(mine, call.send)  # the incoming prefix (Exscan) or the result (Scan) overwrites recvbuf
    outs, ins = split(call.recv, k), split(mine, k)
    if exclusive:  # the incoming prefix goes straight into recvbuf; prefix op x_r into scratch, then on
        fwds = split(scratch[:n], k) if scratch is not None else []
        pending = [st.recv(r - 1, piece) for piece in outs]
    else:  # the incoming prefix into scratch; prefix op x_r into recvbuf, then on
        assert scratch is not None
        incs = split(scratch[:n], k)
        pending = [st.recv(r - 1, piece) for piece in incs]
    sends = []
    for c in range(k):
        yield (pending[c],)
        if exclusive:
            if not last:
                st.mem.reduce(op, outs[c], ins[c], fwds[c])  # lower ranks on the left
                sends.append(st.send(r + 1, fwds[c]))
        else:
            st.mem.reduce(op, incs[c], ins[c], outs[c])
            if not last:
                sends.append(st.send(r + 1, outs[c]))
    if sends:
        yield tuple(sends)  # the sum leaves before AVG scales it
    if scratch is not None:
        st.mem.release(scratch)
    _scale(st, call, r if exclusive else r + 1)


def _doubling(st: Steps, call: Call, exclusive: bool) -> Schedule:
    """Round k: send the inputs of ranks r-2^k+1..r to r+2^k, receive r-2^(k+1)+1..r-2^k from r-2^k.

    After ceil(log2 p) rounds rank r holds the inputs of ranks 0..r and folds them in rank order. The raw
    inputs travel (not partial sums), so the fold has the same association as the chain's.
    """
    assert call.send is not None and call.recv is not None and call.op is not None
    p, r, op = st.size, st.rank, call.op
    n = call.send.shape[0]
    held = st.mem.scratch((r + 1) * n, call.dtype)  # block i (input of rank i) at [i*n, (i+1)*n)
    st.mem.copy(held[r * n :], call.send)
    d = 1
    while d < p:
        reqs = []
        if r + d < p:
            out = held[max(0, r - d + 1) * n :]
            reqs += [st.send(r + d, piece) for piece in split(out, st.num_chunks(out.nbytes))]
        if r - d >= 0:
            into = held[max(0, r - 2 * d + 1) * n : (r - d + 1) * n]
            reqs += [st.recv(r - d, piece) for piece in split(into, st.num_chunks(into.nbytes))]
        if reqs:
            yield tuple(reqs)
        d *= 2
    upto = r if exclusive else r + 1  # blocks folded into recvbuf
    if upto == 1:
        st.mem.copy(call.recv, held[:n])
    elif upto > 1:
        # fold into recvbuf and a spare in turn, never writing over an operand, ending in recvbuf
        spare = st.mem.scratch(n, call.dtype)
        acc = held[:n]
        for i in range(1, upto):
            dst = call.recv if (upto - 1 - i) % 2 == 0 else spare
            st.mem.reduce(op, acc, held[i * n : (i + 1) * n], dst)
            acc = dst
        st.mem.release(spare)
    _scale(st, call, upto)
    st.mem.release(held)


_LINEAR = "Pipelined chain in rank order: rank r combines the prefix from r-1 with its input chunk by chunk and forwards it."
_DOUBLING = ("Recursive doubling of the inputs: in round k rank r passes the inputs it holds to r+2^k; after log2 p "
             "rounds it holds ranks 0..r and folds them in rank order. For small messages.")


_FOLDS = "every rank folds the prefix strictly left to right"


@register("scan", "linear", _LINEAR, steps="p-1 + chunks", bytes="n", cost=_linear_cost, ordered=True,
          reproducible=_FOLDS)
def scan_linear(st: Steps, call: Call) -> Schedule:
    return _linear(st, call, exclusive=False)


@register("scan", "doubling", _DOUBLING, steps="ceil(log2 p)", bytes="up to (p-1) · n", cost=_doubling_cost,
          refuse=_doubling_refuse, ordered=True, reproducible=_FOLDS)
def scan_doubling(st: Steps, call: Call) -> Schedule:
    return _doubling(st, call, exclusive=False)


@register("exscan", "linear", _LINEAR, steps="p-1 + chunks", bytes="n", cost=_linear_cost, ordered=True,
          reproducible=_FOLDS)
def exscan_linear(st: Steps, call: Call) -> Schedule:
    return _linear(st, call, exclusive=True)


@register("exscan", "doubling", _DOUBLING, steps="ceil(log2 p)", bytes="up to (p-1) · n", cost=_doubling_cost,
          refuse=_doubling_refuse, ordered=True, reproducible=_FOLDS)
def exscan_doubling(st: Steps, call: Call) -> Schedule:
    return _doubling(st, call, exclusive=True)

