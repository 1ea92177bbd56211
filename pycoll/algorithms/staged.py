"""Pipelined staged allreduce, reduce-scatter and allgather on the host arena: chunk rings in shared memory, a flag per step.

Each rank's stage is a ring of slots; a slot holds one chunk of every block (a sub-slot per rank). Per
chunk a rank stages what it contributes, reduces its own block from every rank's sub-slot (reductions)
and copies the others' results out (allreduce, allgather), raising its STAGED, REDUCED and CONSUMED
counters as it goes, so a peer waits on a flag of one chunk, never on a whole round. The chunk loop runs
in one compiled call (``_arena_kernels.pipe_blocks``) when Numba is present and covers the dtype, else in
NumPy (``_pipe_py``); both speak the same protocol. A repeated call whose plan chose these algorithms runs
inline as one kernel call (``Comm``'s fast paths), falling back to ``pipe_rest`` as a schedule when a peer
is late.
"""

from __future__ import annotations

import math

from typing import Optional

import numpy as np

from .. import machine
from ..transport.arena import CONSUMED, REDUCED, STAGED, HostArena
from . import arena_jit
from .base import Call, Layout, Schedule, Steps, even_counts, offsets
from .cost import CostModel
from .registry import register
from .chain import reduce_chain
from .ring import allgather_ring_algo, allreduce_ring, reduce_scatter_ring_algo
from .scan import exscan_linear, scan_linear
from .arena_meeting import (
    PIPE_SPIN_S,
    arena_ready,
    call_number,
    check_posts,
    close_rounds,
    compiled_loops,
    meet_peers,
    owner_fallback,
    post_call,
    refuse_single_host,
    take_turn,
)
from .shared import ARENA_PIPE_CHUNK

ALLREDUCE, REDUCE_SCATTER, ALLGATHER, REDUCE_ROOT, REDUCE_LEAF, SCAN, EXSCAN = 0, 1, 2, 3, 4, 5, 6  # as in _arena_kernels
_OVERSUBSCRIBED_SPIN_S = 2e-6
_MODES = {"allreduce": ALLREDUCE, "reduce_scatter": REDUCE_SCATTER, "allgather": ALLGATHER, "scan": SCAN, "exscan": EXSCAN}
_REDUCING = (ALLREDUCE, REDUCE_SCATTER, REDUCE_ROOT, REDUCE_LEAF)  # a block per rank, reduced by its owner
_SCANS = (SCAN, EXSCAN)
# The peers' counter a late call waits on, by the phase ``pipe_blocks`` stopped in (its WAIT_* codes).
_WAITS = ("consumed", "staged", "reduced")


def oversubscribed(size: int) -> bool:
    """More ranks than cores on this machine (pycoll.machine): partners cannot spin side by side, so the pipe takes
    big steps."""
    return machine.oversubscribed(size)


class Pipe:
    """One call's geometry on one arena: blocks, chunking, the typed stage rows and whether the kernel runs it.

    It keeps no user array: ``send`` and ``recv`` views are passed per call (``views``), so a plan that
    holds a Pipe never keeps a user's buffer alive.
    """

    __slots__ = ("rank", "mode", "dtype", "stages", "sd", "rd", "counts", "op", "code", "local", "c", "nslots", "nchunks",
                 "covered", "kernel", "polls")

    def __init__(self, arena: HostArena, call: Call, rank: int, compiled: bool = True) -> None:
        p = arena.size
        self.rank = rank
        if call.coll == "reduce":
            self.mode = REDUCE_ROOT if rank == call.root else REDUCE_LEAF
        else:
            self.mode = _MODES[call.coll]
        self.op = call.op
        self.code = call.op.code if call.op is not None else 0
        if self.mode == ALLGATHER:  # plain bytes: any dtype
            isz = call.dtype.itemsize
            self.dtype = np.dtype(np.uint8)
            self.counts = np.array(call.counts, np.int64) * isz
            self.rd = np.array(call.displs, np.int64) * isz
            self.sd = np.zeros(p, np.int64)
            self.local = not call.in_place
        else:
            self.dtype = call.dtype
            if self.mode in _SCANS:  # the whole vector is every rank's block
                assert call.send is not None
                counts = [call.send.shape[0]] * p
                self.sd = self.rd = np.zeros(p, np.int64)
            elif self.mode != REDUCE_SCATTER:
                n = call.send.shape[0] if call.send is not None else call.recv.shape[0]  # type: ignore[union-attr]
                counts = even_counts(n, p)
                self.sd = self.rd = np.array(offsets(counts), np.int64)
            else:
                counts = list(call.counts)
                self.sd, self.rd = np.array(offsets(counts), np.int64), np.zeros(p, np.int64)
            self.counts = np.array(counts, np.int64)
            self.local = False
        isz = self.dtype.itemsize
        chunk = arena.stage_bytes // (2 * p)  # at least two slots, so staging the next chunk overlaps the last
        if not oversubscribed(p):  # ranks sharing cores take big steps: fewer hand-overs; others pipeline finely
            chunk = min(ARENA_PIPE_CHUNK.get(), chunk)
        self.c = max(64, chunk // 64 * 64) // isz
        self.nslots = max(1, arena.stage_bytes // (p * self.c * isz))
        self.nchunks = -(-int(self.counts.max(initial=0)) // self.c)
        # C-contiguous rows (each rank's stage follows the last), so compiled loops over a row vectorize
        self.stages = np.ndarray((p, arena.stage_bytes // isz), self.dtype, buffer=arena.mapping, offset=arena.stage_offset(0))
        # whether the compiled loop gives NumPy's bits here; it runs if ``compiled`` and Numba loads
        self.covered = self.mode == ALLGATHER or (self.op is not None and arena_jit.covers(self.op, self.dtype))
        self.kernel = self.covered and compiled and arena_jit.unavailable() is None
        # a late partner is spun for briefly; with ranks sharing cores hardly at all (it may need this core)
        self.polls = arena_jit.polls_for(_OVERSUBSCRIBED_SPIN_S if oversubscribed(p) else PIPE_SPIN_S) if self.kernel else 0

    def views(self, call: Call) -> tuple[np.ndarray, np.ndarray]:
        """(send, recv) as the kernel takes them: flat, and bytes for allgather (in place, send is recv's own block); a
        reduce's other ranks have no recv and pass their send (never written)."""
        if self.mode != ALLGATHER:
            assert call.send is not None
            return call.send, call.recv if call.recv is not None else call.send
        assert call.recv is not None
        recv = call.recv.view(np.uint8)
        if call.in_place:
            lo = int(self.rd[self.rank])
            return recv[lo : lo + int(self.counts[self.rank])], recv
        assert call.send is not None
        return call.send.view(np.uint8), recv

    def run(self, arena: HostArena, send: np.ndarray, recv: np.ndarray, base: int, j: int) -> tuple[int, int]:
        """Chunks ``j``.. as far as the peers allow: (next chunk, phase waited in or -1), waking sleepers as asked."""
        if not self.kernel:
            return _pipe_py(self, arena, send, recv, base, j)
        polls = self.polls
        k = arena_jit.kernels()
        while True:
            j, phase, wake = k.pipe_blocks(arena.u64, self.stages, send, recv, self.sd, self.rd, self.counts, self.rank, self.mode,
                                           self.code, self.local, base, self.c, self.nslots, j, polls)
            if wake:
                arena.bell.wake()
            if phase >= 0 or j >= self.nchunks:
                return j, phase


def _pipe_py(pipe: Pipe, arena: HostArena, send: np.ndarray, recv: np.ndarray, base: int, j: int) -> tuple[int, int]:
    """``pipe_blocks`` in NumPy, without spinning: (the chunk it could not finish, the phase it waits in) or (nchunks, -1)."""
    w, me, p, c = arena.words, pipe.rank, arena.size, pipe.c
    counts, sd, rd, rows, mode = pipe.counts, pipe.sd, pipe.rd, pipe.stages, pipe.mode
    others = [q for q in range(p) if q != me]
    mine = arena.ctrl(me)
    while j < pipe.nchunks:
        done = base + j + 1
        slot = ((base + j) % pipe.nslots) * p * c
        lo = j * c
        size = [max(0, min(c, int(counts[q]) - lo)) for q in range(p)]
        if w[mine + STAGED] < done:
            if any(w[arena.ctrl(q) + CONSUMED] < done - pipe.nslots for q in others):
                return j, 0
            if mode == ALLGATHER or mode in _SCANS:
                m = size[me]
                rows[me, slot + me * c : slot + me * c + m] = send[sd[me] + lo : sd[me] + lo + m]
                if pipe.local:
                    recv[rd[me] + lo : rd[me] + lo + m] = send[sd[me] + lo : sd[me] + lo + m]
                if mode == ALLGATHER:
                    w[mine + REDUCED] = done
            else:
                for q in others:
                    rows[me, slot + q * c : slot + q * c + size[q]] = send[sd[q] + lo : sd[q] + lo + size[q]]
            w[mine + STAGED] = done
            arena.bell.ring()
        if mode != ALLGATHER and w[mine + REDUCED] < done:
            if any(w[arena.ctrl(q) + STAGED] < done for q in others):
                return j, 1
            assert pipe.op is not None
            if mode in _SCANS:
                _fold_scan_py(pipe, recv, rd[me] + lo, size[me], slot, me + 1 if mode == SCAN else me)
            else:
                m, own = size[me], slot + me * c
                out = rows[me, own : own + m] if mode == REDUCE_LEAF else recv[rd[me] + lo : rd[me] + lo + m]
                # the left fold in rank order, a new array each step (NumPy's complex product rounds differently
                # in place), all read before ``out`` (in place: this rank's input) is written
                acc = send[sd[me] + lo : sd[me] + lo + m] if me == 0 else rows[0, own : own + m]
                for q in range(1, p):
                    acc = pipe.op.ufunc(acc, send[sd[me] + lo : sd[me] + lo + m] if q == me else rows[q, own : own + m])
                if pipe.op.averages and m:
                    acc = np.divide(acc, acc.dtype.type(p))
                out[...] = acc
                if mode == ALLREDUCE:
                    rows[me, own : own + m] = out
            w[mine + REDUCED] = done
            arena.bell.ring()
        if mode in (ALLREDUCE, ALLGATHER, REDUCE_ROOT):
            if any(w[arena.ctrl(q) + REDUCED] < done for q in others):
                return j, 2
            for q in others:
                recv[rd[q] + lo : rd[q] + lo + size[q]] = rows[q, slot + q * c : slot + q * c + size[q]]
        w[mine + CONSUMED] = done
        arena.bell.ring()
        j += 1
    return j, -1


def _fold_scan_py(pipe: Pipe, recv: np.ndarray, dst: int, m: int, slot: int, hi: int) -> None:
    """``_arena_kernels._fold_scan`` in NumPy: ranks 0..hi-1's staged sub-slots folded in rank order into ``recv``. No
    ufunc call writes over one of its operands (NumPy's complex multiply rounds differently when it does): the
    partial results alternate between ``recv`` and a scratch, the last landing in ``recv``."""
    if hi <= 0 or m <= 0:
        return
    assert pipe.op is not None
    rows, c, out = pipe.stages, pipe.c, recv[dst : dst + m]
    part = [rows[q, slot + q * c : slot + q * c + m] for q in range(hi)]
    if hi == 1:
        out[...] = part[0]
    else:
        spare = np.empty_like(out) if hi > 2 else out
        acc = part[0]
        for q in range(1, hi):
            target = out if (hi - 1 - q) % 2 == 0 else spare
            pipe.op.ufunc(acc, part[q], out=target)
            acc = target
    if pipe.op.averages:
        np.divide(out, out.dtype.type(hi), out=out)


def pipe_rest(st: Steps, arena: HostArena, op: int, mine: tuple[int, int, int, int], pipe: Pipe, call: Call,
              met: bool, j: int) -> Schedule:
    """A posted pipelined call from where it stands: the meeting (unless ``met``), then chunks ``j``..; a late
    peer is waited for as a schedule (timeouts, liveness checks, error reports)."""
    others = [q for q in range(st.size) if q != st.rank]
    try:
        if not met:
            yield from meet_peers(st, arena, op, others)
            check_posts(st, arena, op, others, mine)
        send, recv = pipe.views(call)
        base = arena.rounds
        while j < pipe.nchunks:
            j, phase = pipe.run(arena, send, recv, base, j)
            if phase >= 0:
                target = base + j + 1 - (pipe.nslots if phase == 0 else 0)
                yield from meet_peers(st, arena, target, others, _WAITS[phase])
        close_rounds(arena, base + pipe.nchunks)
    finally:
        arena.set_done(op)


def _pipelined(st: Steps, call: Call, fallback) -> Schedule:
    """The schedule of every algorithm here: set up or wait for the arena, meet, run the pipe."""
    number = call_number(st)
    arena = yield from arena_ready(st)
    if arena is None or not arena.stage_bytes:
        if call.reproducible and call.coll in ("allreduce", "reduce_scatter", "reduce"):
            fallback = owner_fallback(call.coll)  # the flat fallbacks do not keep the fold
        yield from fallback(st, call)
        return
    op = yield from take_turn(st, arena, number)
    pipe = Pipe(arena, call, st.rank, compiled_loops(st) is not None)
    yield from pipe_rest(st, arena, op, post_call(arena, op, st.sig), pipe, call, False, 0)


def _pipe_cost(m: CostModel, n: float, lay: Layout, copied: float, reduced: float, touched: float, phases: int,
               fused: float = 0.0) -> float:
    """Two meetings, the pipe's fill, then the copies and reductions of one rank.

    ``touched`` is what one rank's buffers hold in units of n (its stage adds up to ``arena_stage``): the host's
    calls stay in its cache while they fit. ``fused`` is a second write the reduction pass makes: free while
    memory-bound, a copy's work in cache. When ranks outnumber cores the pipe takes two big steps, and
    partners wait on descheduled ranks: a hand-over per chunk and phase (``phases`` flags per chunk).
    """
    p = lay.size
    chunk = min(float(ARENA_PIPE_CHUNK.get()) * p, max(n, 1.0))
    footprint = p * (touched * n + min(float(m.arena_stage), n))
    work = 2 * m.arena_sync_us * 1e-6 + m.copy_s(copied * n + chunk, footprint) + m.reduce_s(reduced * n, footprint)
    work += m.cached(footprint) * fused * n / (m.copy_GBps * m.cache_speedup * 1e9)
    steps = math.ceil(2 * n / max(float(m.arena_stage), 1.0))  # oversubscribed: a chunk of every block fills half the stage
    return work * m.over(lay) + m.handovers(lay, 2 + steps * phases)


_FOLD = "each rank folds its block of every chunk in rank order from its input and the peers' stages"


@register(
    "allreduce",
    "staged",
    "Pipelined through the arena's chunk rings: each rank stages the parts peers reduce, reduces its own block "
    "from every rank's stage into its result and its stage, and copies the others' results out, chunk by chunk "
    "with a flag per step; compiled when Numba is present; single host.",
    steps="1 meeting, then flags per chunk",
    bytes="(p-1)/p · n copied in, (p-1)/p · n reduced, (p-1)/p · n copied out",
    refuse=refuse_single_host,
    cost=lambda m, n, lay: _pipe_cost(m, n, lay, 2 * (lay.size - 1) / lay.size, (lay.size - 1) / lay.size, 2.0, 3,
                                      (lay.size - 1) / lay.size),
    reproducible=_FOLD + ", then copies the others' blocks out",
)
def allreduce_staged(st: Steps, call: Call) -> Schedule:
    yield from _pipelined(st, call, allreduce_ring)


@register(
    "reduce_scatter",
    "staged",
    "Pipelined through the arena's chunk rings: each rank stages the parts of peers' blocks, then reduces its "
    "own block from every rank's stage straight into its result, chunk by chunk; compiled when Numba is present; "
    "single host.",
    steps="1 meeting, then flags per chunk",
    bytes="(p-1)/p · n copied in, (p-1)/p · n reduced",
    refuse=refuse_single_host,
    cost=lambda m, n, lay: _pipe_cost(m, n, lay, (lay.size - 1) / lay.size, (lay.size - 1) / lay.size, 1.0 + 1.0 / lay.size, 2),
    reproducible=_FOLD,
)
def reduce_scatter_staged(st: Steps, call: Call) -> Schedule:
    # In place the result overwrites the front of the input: safe, because chunk j of every block is staged
    # before chunk j of the result is written, and chunk j writes only offsets below any later chunk's input.
    yield from _pipelined(st, call, reduce_scatter_ring_algo)


@register(
    "allgather",
    "staged",
    "Pipelined through the arena's chunk rings: each rank copies its block into its stage chunk by chunk while "
    "the others copy earlier chunks out; compiled when Numba is present; single host.",
    steps="1 meeting, then flags per chunk",
    bytes="n/p copied in by each rank (read once, written to its stage and, out of place, its own result), "
          "(p-1)/p · n copied out",
    refuse=refuse_single_host,
    # A copy that writes twice moves 1.5 copies' bytes (one read, two writes): 1 + 0.5/p copies in all.
    cost=lambda m, n, lay: _pipe_cost(m, n, lay, 1.0 + 0.5 / lay.size, 0.0, 1.0 + 1.0 / lay.size, 2),
)
def allgather_staged(st: Steps, call: Call) -> Schedule:
    yield from _pipelined(st, call, allgather_ring_algo)


@register(
    "reduce",
    "staged",
    "Pipelined through the arena's chunk rings as the staged allreduce, but only the root copies the reduced blocks "
    "out: the other ranks reduce their block into their stage; single host.",
    steps="1 meeting, then flags per chunk",
    bytes="(p-1)/p · n copied in, (p-1)/p · n reduced, (p-1)/p · n copied out by the root",
    refuse=refuse_single_host,
    cost=lambda m, n, lay: _pipe_cost(m, n, lay, 2 * (lay.size - 1) / lay.size, (lay.size - 1) / lay.size, 2.0, 3),
    reproducible=_FOLD + ", and the root copies the blocks out",
)
def reduce_staged(st: Steps, call: Call) -> Schedule:
    yield from _pipelined(st, call, reduce_chain)


def _scan_cost(m: CostModel, n: float, lay: Layout) -> float:
    """The last rank's work: its input staged, then the p inputs folded (p-1 passes)."""
    return _pipe_cost(m, n, lay, 1.0, lay.size - 1.0, 2.0, 2)


@register(
    "scan",
    "staged",
    "Pipelined through the arena's chunk rings: each rank stages its input chunk by chunk and folds the staged chunks "
    "of ranks 0..r in rank order into its result; single host.",
    steps="1 meeting, then flags per chunk",
    bytes="n copied in, r · n reduced by rank r",
    refuse=refuse_single_host,
    cost=_scan_cost,
    ordered=True,
    reproducible="every rank folds the staged chunks of the ranks before it strictly left to right",
)
def scan_staged(st: Steps, call: Call) -> Schedule:
    yield from _pipelined(st, call, scan_linear)


@register(
    "exscan",
    "staged",
    "As the staged scan, folding the staged chunks of ranks 0..r-1; rank 0's result is left untouched; single host.",
    steps="1 meeting, then flags per chunk",
    bytes="n copied in, (r-1) · n reduced by rank r",
    refuse=refuse_single_host,
    cost=_scan_cost,
    ordered=True,
    reproducible="every rank folds the staged chunks of the ranks before it strictly left to right",
)
def exscan_staged(st: Steps, call: Call) -> Schedule:
    yield from _pipelined(st, call, exscan_linear)


def pipe_for(arena: Optional[HostArena], call: Call, rank: int) -> Optional[Pipe]:
    """A Pipe for ``call`` on ``arena``, or None without an arena stage."""
    if arena is None or not arena.stage_bytes:
        return None
    return Pipe(arena, call, rank)
