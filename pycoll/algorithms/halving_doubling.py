"""Recursive halving and doubling: Rabenseifner's allreduce, recursive-doubling allreduce for small messages,
halving reduce-scatter and doubling allgather, each for any number of ranks.

Non-powers of two are folded the standard way: with p = 2^q + rem, the first 2·rem ranks pair up, the
even rank of each pair hands its data to the odd one and sits out, and gets the result back at the end.
The 2^q active ranks are numbered v = 0 .. 2^q-1 ("virtual ranks").
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import numpy as np

from .base import Call, Layout, Schedule, Steps, blocks_of, even_counts, offsets, pieces_of, unfinished
from .cost import CostModel, log2ceil, pow2floor
from .registry import register

Region = Callable[[int, int], list[np.ndarray]]


class Fold:
    """Which ranks take part after folding p ranks onto the largest power of two below p."""

    def __init__(self, p: int) -> None:
        self.p2 = pow2floor(p)
        self.rem = p - self.p2

    def vrank(self, r: int) -> Optional[int]:
        """Virtual rank of ``r``, None if it sits out."""
        if r < 2 * self.rem:
            return r // 2 if r % 2 else None
        return r - self.rem

    def rank(self, v: int) -> int:
        """The rank that plays virtual rank ``v``."""
        return 2 * v + 1 if v < self.rem else v + self.rem

    def members(self, v: int) -> list[int]:
        """The ranks whose blocks virtual rank ``v`` owns (two for a folded pair)."""
        return [2 * v, 2 * v + 1] if v < self.rem else [v + self.rem]

    def sits_out(self, r: int) -> bool:
        return r < 2 * self.rem and r % 2 == 0


@functools.lru_cache(maxsize=32)
def _crossings(lay: Layout) -> tuple[tuple[int, ...], int, int]:
    """Where the folded recursive pattern leaves hosts: for each round (mask 1, 2, 4, ...) the most active ranks of one
    host whose partner is on another host; then, for the fold pairs, the most even ranks (which send in) and odd
    ranks (which send back) of one host whose partner is on another."""
    host, fold = lay.host_of, Fold(lay.size)
    rounds = []
    mask = 1
    while mask < fold.p2:
        out = [0] * lay.hosts
        for v in range(fold.p2):
            a = fold.rank(v)
            if host[a] != host[fold.rank(v ^ mask)]:
                out[host[a]] += 1
        rounds.append(max(out))
        mask <<= 1
    ins, outs = [0] * lay.hosts, [0] * lay.hosts
    for r in range(0, 2 * fold.rem, 2):
        if host[r] != host[r + 1]:
            ins[host[r]] += 1
            outs[host[r + 1]] += 1
    return tuple(rounds), max(ins), max(outs)


def _spread(lay: Layout, round_bytes: Sequence[float], fold_in: float = 0.0, fold_out: float = 0.0) -> tuple[float, float]:
    """(wire, local) for ``phase``: the bytes that leave the busiest host, and a rank's bytes in the steps that
    stay inside hosts, when round k (mask 2^k) moves ``round_bytes[k]`` per rank and the fold pairs move
    ``fold_in`` and ``fold_out``."""
    rounds, ins, outs = _crossings(lay)
    wire = ins * fold_in + outs * fold_out + sum(c * b for c, b in zip(rounds, round_bytes))
    local = sum(b for c, b in zip(rounds, round_bytes) if c == 0)
    if ins == 0 and outs == 0:
        local += fold_in + fold_out
    return wire, local


def _masks(p2: int) -> list[int]:
    """The partner masks of the recursive rounds: 1, 2, 4, ... p2/2 (halving runs them in reverse, moving the same bytes)."""
    return [1 << k for k in range(log2ceil(p2))]


def _across(lay: Layout, round_bytes: Sequence[float], fold_in: float, fold_out: float) -> dict[str, float]:
    """``phase``'s ``wire`` and ``local`` on several hosts (nothing on one host)."""
    if lay.hosts < 2:
        return {}
    wire, local = _spread(lay, round_bytes, fold_in, fold_out)
    return {"wire": wire, "local": local}


def exchange(st: Steps, peer: int, out: list[np.ndarray], into: list[np.ndarray], local: Optional[list[np.ndarray]] = None,
             op=None) -> Schedule:
    """Send the segments ``out`` to ``peer`` while receiving its segments into ``into`` (reduced with ``local``)."""
    k = st.num_chunks(max((s.nbytes for s in out + into), default=0))
    if st.now and k == 1 and len(out) <= 1 and len(into) <= 1:  # one frame each way at most
        yield from st.swap_now(peer, out[0] if out else None, into[0] if into else None,
                               local[0] if local else None, op)
        return
    if st.now and k == 1:  # one message per segment: straight through the sockets where they can go so
        pending = unfinished(*(st.send_now(peer, piece) for piece in out))
        if local is None:
            pending += unfinished(*(st.recv_now(peer, piece) for piece in into))
        else:
            pending += unfinished(*(st.recv_reduce_now(peer, a, b, op) for a, b in zip(local, into)))
        if pending:
            yield pending
        return
    sends = [st.send(peer, piece) for piece in pieces_of(out, k)]
    dst = pieces_of(into, k)
    if local is None:
        recvs = [st.recv(peer, piece) for piece in dst]
    else:
        recvs = [st.recv_reduce(peer, a, b, op) for a, b in zip(pieces_of(local, k), dst)]
    yield tuple(sends + recvs)


def transfer(st: Steps, peer: int, segments: list[np.ndarray], receive: bool) -> Schedule:
    """One-way: send ``segments`` to ``peer``, or receive them from it, pipelined."""
    if receive:
        yield from exchange(st, peer, [], segments)
    else:
        yield from exchange(st, peer, segments, [])


def halving(st: Steps, fold: Fold, v: int, src: Region, work: Region, op) -> Schedule:
    """Recursive halving among the active ranks: afterwards ``work(v, v+1)`` holds the full reduction of v's region."""
    lo, hi, mask = 0, fold.p2, fold.p2 >> 1
    region = src
    while mask:
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if v & mask else ((lo, mid), (mid, hi))
        yield from exchange(st, fold.rank(v ^ mask), region(*give), work(*keep), local=region(*keep), op=op)
        region, (lo, hi), mask = work, keep, mask >> 1


def doubling(st: Steps, fold: Fold, v: int, region: Region) -> Schedule:
    """Recursive doubling among the active ranks: from ``region(v, v+1)`` to all of ``region(0, p2)``."""
    lo, hi, mask = v, v + 1, 1
    while mask < fold.p2:
        width = hi - lo
        plo, phi = (lo - width, lo) if v & mask else (hi, hi + width)
        yield from exchange(st, fold.rank(v ^ mask), region(lo, hi), region(plo, phi))
        lo, hi, mask = min(lo, plo), max(hi, phi), mask << 1


def _slices(arr: np.ndarray, bounds: Sequence[int]) -> Region:
    return lambda lo, hi: [arr[bounds[lo] : bounds[hi]]]


def _fold_in(st: Steps, fold: Fold, send: np.ndarray, work: np.ndarray, op) -> Schedule:
    """Pairs of the first 2·rem ranks: the even one's vector is reduced into the odd one's ``work``."""
    r = st.rank
    if st.rank < 2 * fold.rem:
        if fold.sits_out(r):
            yield from transfer(st, r + 1, [send], receive=False)
        else:
            yield from exchange(st, r - 1, [], [work], local=[send], op=op)


# ---- allreduce ---------------------------------------------------------------------------------


def _halving_messages(m: CostModel, n: float, p2: int) -> int:
    """Pipelined messages of log2 p2 halving rounds (n/2, n/4, ... n/p2 bytes); doubling sends the same, reversed."""
    return sum(m.messages(n / (1 << k)) for k in range(1, log2ceil(p2) + 1))


def _rabenseifner_cost(m: CostModel, n: float, lay: Layout) -> float:
    p2 = pow2floor(lay.size)
    extra = 2 if p2 != lay.size else 0
    steps = 2 * log2ceil(p2) + extra
    msgs = 2 * _halving_messages(m, n, p2) + (2 * m.messages(n) if extra else 0)
    across = _across(lay, [2 * n * mask / p2 for mask in _masks(p2)], n if extra else 0.0, n if extra else 0.0)
    return m.phase(lay, steps, 2 * (p2 - 1) / p2 * n + extra * n, reduced=(p2 - 1) / p2 * n + (extra / 2) * n,
                   flows=m.flows(lay), messages=msgs, **across)


@register(
    "allreduce",
    "rabenseifner",
    "Recursive-halving reduce-scatter then recursive-doubling allgather (Rabenseifner); any p by folding.",
    steps="2 log2 p (+2 if p is not a power of two)",
    bytes="2(p-1)/p · n (+2n on folded ranks)",
    cost=lambda m, n, lay: _rabenseifner_cost(m, n, lay) if lay.size > 1 else 0.0,
)
def allreduce_rabenseifner(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    p, r, n = st.size, st.rank, call.recv.shape[0]
    if p == 1:
        st.mem.copy(call.recv, call.send)
        return
    fold = Fold(p)
    if fold.sits_out(r):
        yield from transfer(st, r + 1, [call.send], receive=False)
        yield from transfer(st, r + 1, [call.recv], receive=True)
        return
    work = st.mem.scratch(n, call.dtype)
    yield from _fold_in(st, fold, call.send, work, call.op)
    v = fold.vrank(r)
    assert v is not None
    bounds = offsets(even_counts(n, fold.p2)) + [n]
    src = call.send if r >= 2 * fold.rem else work
    yield from halving(st, fold, v, _slices(src, bounds), _slices(work, bounds), call.op)
    mine = work[bounds[v] : bounds[v + 1]]
    if call.op.averages:
        st.mem.scale(mine, p)
    st.mem.copy(call.recv[bounds[v] : bounds[v + 1]], mine)
    yield from doubling(st, fold, v, _slices(call.recv, bounds))
    if r < 2 * fold.rem:
        yield from transfer(st, r - 1, [call.recv], receive=False)
    st.mem.release(work)


def _doubling_cost(m: CostModel, n: float, lay: Layout) -> float:
    p2 = pow2floor(lay.size)
    extra = 2 if p2 != lay.size else 0
    rounds = log2ceil(p2)
    across = _across(lay, [n] * rounds, n if extra else 0.0, n if extra else 0.0)
    return m.phase(lay, rounds + extra, (rounds + extra) * n, reduced=(rounds + extra / 2) * n, flows=m.flows(lay), **across)


@register(
    "allreduce",
    "doubling",
    "Recursive doubling: log2 p rounds of exchanging and reducing the whole vector; for small messages.",
    steps="log2 p (+2 if p is not a power of two)",
    bytes="n · log2 p",
    cost=lambda m, n, lay: _doubling_cost(m, n, lay) if lay.size > 1 else 0.0,
)
def allreduce_doubling(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    p, r, n = st.size, st.rank, call.recv.shape[0]
    if p == 1:
        st.mem.copy(call.recv, call.send)
        return
    fold = Fold(p)
    if fold.sits_out(r):
        yield from transfer(st, r + 1, [call.send], receive=False)
        yield from transfer(st, r + 1, [call.recv], receive=True)
        return
    pair = st.mem.scratch(2 * n, call.dtype)
    bufs = [pair[:n], pair[n:]]
    yield from _fold_in(st, fold, call.send, bufs[1], call.op)
    cur = call.send if r >= 2 * fold.rem else bufs[1]
    v = fold.vrank(r)
    assert v is not None
    mask, turn = 1, 0
    while mask < fold.p2:
        nxt = bufs[turn]
        yield from exchange(st, fold.rank(v ^ mask), [cur], [nxt], local=[cur], op=call.op)
        cur, turn, mask = nxt, 1 - turn, mask << 1
    if call.op.averages:
        st.mem.scale(cur, p)
    st.mem.copy(call.recv, cur)
    if r < 2 * fold.rem:
        yield from transfer(st, r - 1, [call.recv], receive=False)
    st.mem.release(pair)


# ---- reduce-scatter and allgather ----------------------------------------------------------------


def _halving_cost(m: CostModel, n: float, lay: Layout) -> float:
    p2 = pow2floor(lay.size)
    extra = 2 if p2 != lay.size else 0
    across = _across(lay, [n * mask / p2 for mask in _masks(p2)], n if extra else 0.0, n / lay.size if extra else 0.0)
    return m.phase(lay, log2ceil(p2) + extra, (p2 - 1) / p2 * n + (n if extra else 0),
                   reduced=(p2 - 1) / p2 * n + (n if extra else 0), flows=m.flows(lay),
                   messages=_halving_messages(m, n, p2) + (m.messages(n) + 1 if extra else 0), **across)


@register(
    "reduce_scatter",
    "halving",
    "Recursive halving: log2 p rounds, each exchanging half of what is left; any p by folding.",
    steps="log2 p (+2 if p is not a power of two)",
    bytes="(p-1)/p · n (+n on folded ranks)",
    cost=lambda m, n, lay: _halving_cost(m, n, lay) if lay.size > 1 else 0.0,
)
def reduce_scatter_halving(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    p, r = st.size, st.rank
    counts = call.counts
    mine_out = call.recv[: counts[r]]
    if p == 1:
        st.mem.copy(mine_out, call.send[: counts[0]])
        if call.op.averages:
            st.mem.scale(mine_out, p)
        return
    fold = Fold(p)
    if fold.sits_out(r):
        yield from transfer(st, r + 1, [call.send], receive=False)
        yield from transfer(st, r + 1, [mine_out], receive=True)
        return
    total = call.send.shape[0]
    work = st.mem.scratch(total, call.dtype)
    yield from _fold_in(st, fold, call.send, work, call.op)
    v = fold.vrank(r)
    assert v is not None
    displs = offsets(counts) + [total]
    bounds = [displs[fold.members(u)[0]] for u in range(fold.p2)] + [total]
    src = call.send if r >= 2 * fold.rem else work
    yield from halving(st, fold, v, _slices(src, bounds), _slices(work, bounds), call.op)
    blocks = blocks_of(work, counts)
    if call.op.averages:
        for b in fold.members(v):
            st.mem.scale(blocks[b], p)
    if r < 2 * fold.rem:
        yield from transfer(st, r - 1, [blocks[r - 1]], receive=False)
    st.mem.copy(mine_out, blocks[r])
    st.mem.release(work)


def _allgather_doubling_cost(m: CostModel, n: float, lay: Layout) -> float:
    """The rank's own block copied into the result (out of place, before the rounds, as the ring's), then log2 p
    rounds (+2 where ranks fold)."""
    p2 = pow2floor(lay.size)
    extra = 2 if p2 != lay.size else 0
    across = _across(lay, [n * mask / p2 for mask in _masks(p2)], n / lay.size if extra else 0.0, n if extra else 0.0)
    own = m.copy_s(n / lay.size, (1.0 + 1.0 / lay.size) * n * lay.size)  # the ring's footprint
    return own + m.phase(lay, log2ceil(p2) + extra, (lay.size - 1) / lay.size * n + (n if extra else 0),
                         flows=m.flows(lay), messages=_halving_messages(m, n, p2) + (m.messages(n) + 1 if extra else 0),
                         **across)


@register(
    "allgather",
    "doubling",
    "Recursive doubling: log2 p rounds, each doubling what a rank holds; any p by folding.",
    steps="log2 p (+2 if p is not a power of two)",
    bytes="(p-1)/p · n (+n on folded ranks)",
    cost=lambda m, n, lay: _allgather_doubling_cost(m, n, lay) if lay.size > 1 else 0.0,
)
def allgather_doubling(st: Steps, call: Call) -> Schedule:
    assert call.recv is not None
    p, r = st.size, st.rank
    blocks = blocks_of(call.recv, call.counts, call.displs)
    mine = blocks[r] if call.in_place or call.send is None else call.send
    fold = Fold(p)
    others = [blocks[b] for b in range(p) if b != r]
    if fold.sits_out(r):
        yield from transfer(st, r + 1, [mine], receive=False)
        yield from transfer(st, r + 1, others, receive=True)
        st.mem.copy(blocks[r], mine)
        return
    st.mem.copy(blocks[r], mine)
    if r < 2 * fold.rem:
        yield from transfer(st, r - 1, [blocks[r - 1]], receive=True)
    v = fold.vrank(r)
    assert v is not None

    def region(lo: int, hi: int) -> list[np.ndarray]:
        return [blocks[b] for u in range(lo, hi) for b in fold.members(u)]

    yield from doubling(st, fold, v, region)
    if r < 2 * fold.rem:
        yield from transfer(st, r - 1, [blocks[b] for b in range(p) if b != r - 1], receive=False)
