"""Gather, scatter and alltoall on one host by cross-memory attach: each block crosses memory once, read by its receiver.

Every rank posts its buffer's address in the arena; a rank that receives reads its blocks straight from the owners'
memory with one kernel copy each (process_vm_readv), and an owner keeps its buffer untouched until its readers are
done. The v-forms are refused (not every rank knows the others' block sizes, so ranks could choose differently); a
communicator whose arena or cross-memory attach is unavailable runs the stream algorithm instead.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import MismatchError
from .base import Call, Layout, Schedule, Steps
from .direct import alltoall_pairwise, gather_linear, scatter_linear
from .registry import register
from .shared import (
    _addr, _begin, _check_posts, _cma_cost, _cma_or_none, _meet, _refuse_single_host, _transfer_error, sig_words,
)


def _refuse(call: Call, lay: Layout) -> Optional[str]:
    if call.vector:
        return "a vector call's blocks differ by rank, and not every rank knows their sizes"
    return _refuse_single_host(call, lay)


def _read(st: Steps, arena, q: int, into: np.ndarray, addr: int) -> None:
    if not into.nbytes:
        return
    try:
        arena.cma.read(arena.pids[q], into, addr)
    except OSError as exc:
        raise _transfer_error(st, exc, "read", arena) from None


def _check_size(st: Steps, arena, op: int, q: int, want: int) -> None:
    got = arena.peer_addrs(q, op)[2]
    if got != want:
        raise st.owner.error(MismatchError, f"rank {q} passed {got} bytes, this rank expects {want}", [st.world_rank(q)])


@register(
    "gather",
    "cma",
    "The root reads every rank's block straight from that rank's buffer with one kernel copy (cross-memory attach); "
    "single host.",
    steps="2 meetings",
    bytes="(p-1)/p · n read by the root",
    refuse=_refuse,
    cost=lambda m, n, lay: _cma_cost(m, n, lay, 2, copied=(lay.size - 1) / lay.size * n, local=n / lay.size, readers=1),
)
def gather_cma(st: Steps, call: Call) -> Schedule:
    arena, number = yield from _cma_or_none(st)
    if arena is None:
        yield from gather_linear(st, call)
        return
    p, r, root = st.size, st.rank, call.root
    others = [q for q in range(p) if q != r]
    op = yield from _begin(st, arena, number)
    own = call.send
    try:
        mine = sig_words(st.sig)
        arena.post(op, mine, _addr(own), 0, own.nbytes if own is not None else 0)
        yield from _meet(st, arena, op, others)
        _check_posts(st, arena, op, others, mine)
        if r == root:
            blocks = [call.recv[d:d + c] for c, d in zip(call.counts, call.displs)]
            for q in others:
                _check_size(st, arena, op, q, blocks[q].nbytes)
                _read(st, arena, q, blocks[q], arena.peer_addrs(q, op)[0])
            if own is not None:
                st.mem.copy(blocks[r], own)
    finally:
        arena.set_done(op)
    if r != root:  # the root reads this rank's buffer: it stays untouched until the root is done
        yield from _meet(st, arena, op, [root], "done")


@register(
    "scatter",
    "cma",
    "Every rank reads its block straight from the root's buffer with one kernel copy (cross-memory attach); single host.",
    steps="2 meetings",
    bytes="n/p read by each rank from the root",
    refuse=_refuse,
    cost=lambda m, n, lay: _cma_cost(m, n, lay, 2, copied=n / lay.size, readers=lay.size - 1),
)
def scatter_cma(st: Steps, call: Call) -> Schedule:
    arena, number = yield from _cma_or_none(st)
    if arena is None:
        yield from scatter_linear(st, call)
        return
    p, r, root = st.size, st.rank, call.root
    others = [q for q in range(p) if q != r]
    op = yield from _begin(st, arena, number)
    try:
        mine = sig_words(st.sig)
        if r == root:
            arena.post(op, mine, _addr(call.send), 0, call.send.nbytes)
        else:
            arena.post(op, mine, 0, 0, call.recv.nbytes)
        yield from _meet(st, arena, op, others)
        _check_posts(st, arena, op, others, mine)
        if r == root:
            for q in others:  # every rank's block has the root's block size (not a v-form)
                _check_size(st, arena, op, q, call.counts[q] * call.dtype.itemsize)
            if call.recv is not None:
                st.mem.copy(call.recv, call.send[call.displs[r]:call.displs[r] + call.counts[r]])
        else:
            block = call.recv.nbytes
            _read(st, arena, root, call.recv, arena.peer_addrs(root, op)[0] + r * block)
    finally:
        arena.set_done(op)
    if r == root:  # the others read the root's buffer: it stays untouched until they are done
        yield from _meet(st, arena, op, others, "done")


@register(
    "alltoall",
    "cma",
    "Every rank reads its block from each peer's send buffer with one kernel copy (cross-memory attach); single host.",
    steps="2 meetings",
    bytes="(p-1)/p · n read from peers",
    refuse=_refuse,
    cost=lambda m, n, lay: _cma_cost(m, n, lay, 2, copied=(lay.size - 1) / lay.size * n, local=n / lay.size),
)
def alltoall_cma(st: Steps, call: Call) -> Schedule:
    arena, number = yield from _cma_or_none(st)
    if arena is None:
        yield from alltoall_pairwise(st, call)
        return
    p, r = st.size, st.rank
    others = [q for q in range(p) if q != r]
    op = yield from _begin(st, arena, number)
    source = call.send
    if call.in_place:  # peers read this rank's blocks while it overwrites them: they read a copy
        source = st.mem.scratch(call.send.shape[0], call.dtype)
        st.mem.copy(source, call.send)
    try:
        mine = sig_words(st.sig)
        arena.post(op, mine, _addr(source), 0, source.nbytes)
        yield from _meet(st, arena, op, others)
        _check_posts(st, arena, op, others, mine)
        isz = call.dtype.itemsize
        for q in others:  # block r of q's send buffer, at q's displacement for r (uniform: r blocks in)
            block = call.recv[call.displs[q]:call.displs[q] + call.counts[q]]
            _check_size(st, arena, op, q, source.nbytes)
            _read(st, arena, q, block, arena.peer_addrs(q, op)[0] + call.send_displs[r] * isz)
        st.mem.copy(call.recv[call.displs[r]:call.displs[r] + call.counts[r]],
                    source[call.send_displs[r]:call.send_displs[r] + call.send_counts[r]])
    finally:
        arena.set_done(op)
    yield from _meet(st, arena, op, others, "done")  # the peers read this rank's buffer
    if source is not call.send:
        st.mem.release(source)
