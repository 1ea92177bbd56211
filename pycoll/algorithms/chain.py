"""Pipelined chain algorithms rooted at one rank: broadcast flows down the chain, reduce flows up it.

The chain follows the layout's ring order from the root (as the cost model's ``ring`` counts it).
"""

from __future__ import annotations

from collections import deque

from .base import Call, Schedule, Steps, split
from .registry import register
from .ring import on_ring


@register(
    "broadcast",
    "chain",
    "Pipelined chain from the root: each rank forwards chunk k while chunk k+1 arrives (two ranks: one message).",
    steps="p-1 + chunks",
    bytes="n",
    cost=lambda m, n, lay: (m.ring(lay, lay.size - 2 + m.messages(n), n, depth=lay.size - 1) if lay.size > 2
                            else m.ring(lay, 1, n, depth=1, messages=1) if lay.size == 2 else 0.0),
)
def broadcast_chain(st: Steps, call: Call) -> Schedule:
    assert call.recv is not None
    st, order = on_ring(st)
    root = order.index(call.root) if order else call.root
    p, r = st.size, st.rank
    if p == 1:
        return
    pos = (r - root) % p
    prev, nxt = (r - 1) % p, (r + 1) % p
    # chunks pipeline the forwarding; with one hop there is none, and the buffer goes as one message
    pieces = split(call.recv, st.num_chunks(call.recv.nbytes) if p > 2 else 1)
    if st.now and len(pieces) == 1:  # one message: straight through the sockets where it can go so
        got = st.recv_now(prev, pieces[0]) if pos else None
        if got is not None:
            yield (got,)
        sent = st.send_now(nxt, pieces[0]) if pos < p - 1 else None
        if sent is not None:
            yield (sent,)
        return
    if pos == 0:
        yield tuple(st.send(nxt, piece) for piece in pieces)
        return
    sends = []
    for req, piece in [(st.recv(prev, piece), piece) for piece in pieces]:
        yield (req,)
        if pos < p - 1:
            sends.append(st.send(nxt, piece))
    yield tuple(sends)


@register(
    "reduce",
    "chain",
    "Pipelined chain towards the root: each rank reduces chunk k into its running sum and passes it on.",
    steps="p-1 + chunks",
    bytes="n",
    cost=lambda m, n, lay: m.ring(lay, lay.size - 2 + m.messages(n), n, reduced=n, depth=lay.size - 1) if lay.size > 1 else 0.0,
)
def reduce_chain(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.op is not None
    st, order = on_ring(st)
    root = order.index(call.root) if order else call.root
    p, r = st.size, st.rank
    pos = (r - root) % p
    at_root = pos == 0
    acc = call.recv if at_root else st.mem.scratch(call.send.shape[0], call.dtype)
    assert acc is not None
    if p > 1:
        toward_root, away = (r - 1) % p, (r + 1) % p
        k = st.num_chunks(call.send.nbytes)
        ins = split(call.send, k)
        if st.now and k == 1:  # one message per link: straight through the sockets where it can go so
            if pos == p - 1:
                result = ins[0]
            else:
                got = st.recv_reduce_now(away, ins[0], acc, call.op)
                if got is not None:
                    yield (got,)
                result = acc
            sent = st.send_now(toward_root, result) if not at_root else None
            if sent is not None:
                yield (sent,)
            if not at_root:
                if pos != p - 1:
                    st.mem.release(acc)
                return
            if call.op.averages:
                st.mem.scale(acc, p)
            return
        if pos == p - 1:  # the far end starts the chain with its own data
            yield tuple(st.send(toward_root, piece) for piece in ins)
            return
        outs = split(acc, k)
        pending = deque(st.recv_reduce(away, ins[c], outs[c], call.op) for c in range(k))
        sends = []
        for c in range(k):
            yield (pending.popleft(),)
            if not at_root:
                sends.append(st.send(toward_root, outs[c]))
        yield tuple(sends)
    else:
        st.mem.copy(acc, call.send)
    if at_root and call.op.averages:
        st.mem.scale(acc, p)
    if not at_root:
        st.mem.release(acc)
