"""A blocking Alltoall across hosts whose blocks pass the small-frame size, as one function of its arguments (the
executor's fast path there): every block to and from every peer in one call into C, the other hosts' through their
sockets and this host's through their rings, without a schedule.

It sends what the pairwise algorithm sends, with the same context, tag and signature, so a peer that runs the call
through its schedule still matches it; whatever C leaves (a peer not there yet, a frame moved in part) is finished
through the engine, as the schedule's own exchange does (``Steps.exchange_now``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .algorithms.base import LANES
from .composed import SMP_BYTES
from .memory import HOST
from .p2p_protocol import SMALL_BYTES, payload_bytes
from .paired import choice_holds, wait_through_engine

if TYPE_CHECKING:  # pragma: no cover
    from .executor import Executor
    from .plans import Plan


def fast_path(x: "Executor", plan: "Plan", algo: Any) -> Any:
    """The plan's whole call (``Plan.fast``), or False where this path does not serve it: a pairwise Alltoall of
    more than two ranks (two: ``pycoll.paired``) with peers on other hosts, out of place on host arrays, whose
    every block passes the small-frame size and every peer of which can take part in the exchange in C. The function
    returns False, having done nothing, where anything it relies on changed (the environment's algorithm choice,
    checks or composition size, the cost model, a queued send, a broken communicator or a dead peer)."""
    c, t, engine = x.comm, plan.template, x.engine
    if (t.coll != "alltoall" or algo.name != "pairwise" or c._size < 3 or t.in_place or t.stream is not None
            or not t.counts or not t.send_counts):
        return False
    holds = choice_holds(c, SMP_BYTES)
    if holds is None:
        return False
    me, size, world = c._rank, t.dtype.itemsize, c._world
    peers = [(me + s) % c._size for s in range(1, c._size)]  # the order the algorithm posts them in
    if (min(t.send_counts[q] for q in peers) * size <= SMALL_BYTES
            or not all(engine.exchanges_with(world[q]) for q in peers)
            or not any(engine.swaps_with(world[q]) for q in peers)):
        return False
    # each peer's block of the send and receive buffers, in bytes
    places = [(world[q], t.send_displs[q] * size, (t.send_displs[q] + t.send_counts[q]) * size,
               t.displs[q] * size, (t.displs[q] + t.counts[q]) * size) for q in peers]
    # its own block, in elements of the flat views
    own = (t.send_displs[me], t.send_displs[me] + t.send_counts[me], t.displs[me], t.displs[me] + t.counts[me])
    ctx, sig, label, views, copy = c._ctx | 1, plan.sig, plan.label, plan.views, HOST.copy
    exchange, sendq, dead, broken, base = engine.exchange_or_post, engine._sendq, engine._dead, engine.broken_ctxs, c._ctx & ~1
    # the exchange made once for these blocks, each call its tag and buffers (None: the general one every call)
    steady = engine.frame_exchanger(places, ctx, sig)

    def fast(args: tuple) -> bool:
        bound = views(args) if holds() else None
        if bound is None:
            return False  # something it relies on changed, or the buffers overlap (the checks name it)
        send, recv = bound
        if (not send.flags.c_contiguous or not recv.flags.c_contiguous or c._freed or c._aborted is not None
                or (broken and base in broken) or dead or any(sendq.values())):
            return False
        seq = c._seq + 1
        c._seq = seq
        tag = seq * LANES
        a, b, d, e = own
        mine, result = send[a:b], recv[d:e]
        # the exchange copies the own block while its sockets wait (None: it did nothing, the copy neither)
        reqs = steady(tag, send, recv, lambda: owner_of(seq), (mine, result)) if steady is not None else None
        if reqs is None:
            sb, rb = payload_bytes(send), payload_bytes(recv)
            reqs = exchange([(w, sb[a:b], rb[d:e]) for w, a, b, d, e in places], ctx, tag, sig, owner_of(seq))
            copy(result, mine)
        if reqs:
            wait_through_engine(engine, c.timeout, reqs, reqs[0].owner)
        return True

    def owner_of(seq: int) -> Any:
        owner = c._owner(f"{label} #{seq}", ctx, seq)
        owner.sig = sig
        return owner

    return fast
