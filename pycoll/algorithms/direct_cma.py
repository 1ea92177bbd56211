"""Gather, scatter, alltoall, broadcast and allgather on one host by cross-memory attach: each block crosses memory once.

Every rank posts its buffer's address in the arena; then each block crosses with one kernel copy straight between
two ranks' memories, and a rank whose memory others copy from or into stays in the call until they are done. Scatter,
Alltoall, Broadcast and Allgather receivers read their blocks from the owners' buffers (process_vm_readv); Gather
senders write theirs into the root's buffer (process_vm_writev) while the root copies its own. For large blocks the
root of a Gather, Scatter or Broadcast copies a share of each block itself meanwhile, so more cores copy at once.
In the vector forms the ranks do not all know the blocks' sizes and places (in a Gatherv or Scatterv only the root
does; in an Alltoallv no rank knows where its blocks lie in its peers' send buffers). There each rank writes a table
into its arena slot, (offset, bytes) of its block for each rank, with the blocks small enough beside it; a rank that
takes a block checks its size in the sender's table, then copies it from the sender's slot or reads it from the
sender's buffer at the table's offset. A communicator whose arena or cross-memory attach is unavailable runs the
stream algorithm instead.

What one rank does in a call shape is a ``cma_program.Program`` (posts, checks, copies, waits), built here and run by
the scheduled form here and by the executor's inline runner: one compiled kernel call (``_arena_kernels.cma_moves``)
while the peers keep up, the rest handed to ``cma_rest`` or ``cma_wait_rest`` (as a schedule, with timeouts and
reports) when they do not.

(Blocks passed through the arena's shared stage instead, two memory copies, measured slower here: a rank writing
stage lines that a peer's core has just read waits for their invalidation, 8-30 µs per 64 KiB on this VM against
9 µs for one process_vm_readv.)
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..errors import MismatchError
from ..memory import MemoryBackend
from ..transport.arena import RECV, SEND
from .arena_jit import sig_words
from .cma_program import Program, address, copy, local, post, table_block_bytes, table_mismatch, table_program
from .base import Call, Layout, Schedule, Steps
from .chain import broadcast_chain
from .direct import alltoall_pairwise, gather_linear, scatter_linear
from .registry import register
from .ring import allgather_ring_algo
from .arena_meeting import (check_posts, cma_or_none, lag_wait, meet_peers, refuse_single_host, take_turn,
                            transfer_error)
from .shared import cma_cost

_PAGE = 4096
# Gather and Scatter blocks from this size on are split between the root and the block's other rank, one kernel copy
# each at once: below it a second system call costs more than the overlap gains (a call costs about 5 µs here, plus
# 0.3 µs a page).
SPLIT_BYTES = 256 << 10
# The root's share of a 2-rank block, where both finished together when measured (the root also copies its own block,
# about 3.5x faster than a cross-memory copy; a Scatter root's writes ran slower than a Gather root's reads).
GATHER_ROOT_SHARE = 0.35
SCATTER_ROOT_SHARE = 0.2
BROADCAST_ROOT_SHARE = 0.45  # the Broadcast root has no block of its own to copy



def _refuse(call: Call, lay: Layout) -> Optional[str]:
    return refuse_single_host(call, lay)


def _block_bytes(call: Call, q: int) -> int:
    return call.counts[q] * call.dtype.itemsize


def root_share(nbytes: int, size: int, share: float) -> int:
    """Bytes of each ``nbytes`` Gather or Scatter block that the root copies itself by cross-memory attach (whole
    pages; none of a small block): the head of the Gather block it reads, the tail of the Scatter block it writes,
    while the block's other rank copies the rest. The same on every rank: it depends on the block size alone."""
    if nbytes < SPLIT_BYTES or size < 2:
        return 0
    return int(nbytes * share / (size - 1)) // _PAGE * _PAGE


class Moves:
    """One cma collective: its ``Program`` for a call shape on this rank (``program``), and where a call's buffers
    are (``buffers``: the in-place Alltoall posts a scratch copy of its input)."""

    coll = ""

    def program(self, r: int, p: int, call: Call, sub: int = 0) -> Program:
        """``sub``: the largest block a vector call keeps in the arena slot (``table_block_bytes``; 0: none)."""
        raise NotImplementedError

    def buffers(self, call: Call, mem: MemoryBackend) -> tuple[int, int, Optional[np.ndarray]]:
        """(send address, recv address, scratch to release after the call, or None)."""
        return address(call.send), address(call.recv), None

    def scratch(self, call: Call) -> bool:
        """Whether ``buffers`` makes a scratch copy for this call shape."""
        return False


def _same(prog: Program, r: int, nbytes: int) -> None:
    """Every peer must post this rank's byte count (not a v-form: all blocks are alike). Every rank checks every peer,
    so a wrong size stops every rank before any copy: none writes into a rank that already left."""
    prog.expect[:] = nbytes
    prog.expect[r] = -1


class _Gather(Moves):
    """Each rank writes its block into the root's buffer (the root posts its address) while the root copies its own;
    the root reads the head of a large block meanwhile (``root_share``). Gatherv: a small block goes through the
    sender's slot (the root copies it out), a large one the sender writes where the root's table says."""

    coll = "gather"

    def program(self, r: int, p: int, call: Call, sub: int = 0) -> Program:
        root, isz = call.root, call.dtype.itemsize
        if call.vector:  # only the root knows the blocks' places: both sides table what the other must check
            table = [(0, 0)] * p
            if r != root:
                assert call.send is not None
                n = call.send.nbytes
                table[root] = (0, n)  # the root checks the size; a block of at most sub goes in the slot
                if n <= sub:
                    return table_program(p, table, [], [], [])
                # a larger one: written where the root's table says, but for the head the root reads meanwhile
                head = root_share(n, p, GATHER_ROOT_SHARE)
                return table_program(p, table, [(root, 1, head, n - head, 1, head)], [], [root] if head else [])
            rows, waits, heads = [], [], []
            for q in range(p):
                n = call.counts[q] * isz
                if q == r:
                    continue
                if n > sub:  # the sender writes it: its place in the root's table, the root checks the size only
                    table[q] = (call.displs[q] * isz, n)
                    rows.append((q, 0, 0, n, 0))
                    waits.append(q)
                    head = root_share(n, p, GATHER_ROOT_SHARE)
                    if head:  # ... and reads the head from the sender's buffer meanwhile
                        heads.append((q, SEND, 0, 2, call.displs[q] * isz, head, 0))
                else:
                    rows.append((q, 2, call.displs[q] * isz, n, 0))
            own = [] if call.in_place or not call.counts[r] else [(1, 0, 2, call.displs[r] * isz, call.counts[r] * isz)]
            return table_program(p, table, rows, own, waits, heads)
        if r != root:
            assert call.send is not None
            n = call.send.nbytes
            head = root_share(n, p, GATHER_ROOT_SHARE)
            prog = Program(p, n, (1, 0, 0, 0))
            _same(prog, r, n)
            if n > head:
                prog.rows.append((root, RECV, r * n + head, 1, head, n - head, 1))
            if head:
                prog.waits.append(root)  # the root reads the head
            return prog.done()
        mine = _block_bytes(call, r)
        prog = Program(p, mine, (0, 0, 2, 0))
        _same(prog, r, mine)
        for q in range(p):
            head = root_share(_block_bytes(call, q), p, GATHER_ROOT_SHARE)
            if q != r and head:
                prog.rows.append((q, SEND, 0, 2, call.displs[q] * isz, head, 0))
            if q != r and call.counts[q]:
                prog.waits.append(q)  # the owners write into its buffer
        if call.send is not None and not call.in_place and mine:
            prog.copies.append((1, 0, 2, call.displs[r] * isz, mine))
        return prog.done()


class _Scatter(Moves):
    """Every rank reads its block straight from the root's buffer; the root writes the tail of a large block into its
    reader's buffer meanwhile (``root_share``; the readers post their addresses)."""

    coll = "scatter"

    def program(self, r: int, p: int, call: Call, sub: int = 0) -> Program:
        root, isz = call.root, call.dtype.itemsize
        if call.vector:  # only the root knows the blocks' places: its table gives each reader its block
            table = [(0, 0)] * p
            if r != root:
                assert call.recv is not None
                return table_program(p, table, [(root, 2, 0, call.recv.nbytes, 0)], [], [])
            for q in range(p):
                if q != r:
                    table[q] = (call.displs[q] * isz, call.counts[q] * isz)
            own = [] if call.in_place or not call.counts[r] else [(1, call.displs[r] * isz, 2, 0, call.counts[r] * isz)]
            return table_program(p, table, [], own, _readers(table, r, sub))
        if r != root:
            assert call.recv is not None
            n = call.recv.nbytes
            tail = root_share(n, p, SCATTER_ROOT_SHARE)
            prog = Program(p, n, (0, 0, 2, 0))
            _same(prog, r, n)
            if n > tail:
                prog.rows.append((root, SEND, r * n, 2, 0, n - tail, 0))
            if tail:
                prog.waits.append(root)  # the root writes the tail into its buffer
            return prog.done()
        mine = _block_bytes(call, r)
        prog = Program(p, mine, (1, 0, 0, 0))
        _same(prog, r, mine)
        for q in range(p):
            n = _block_bytes(call, q)
            tail = root_share(n, p, SCATTER_ROOT_SHARE)
            if q != r and tail:
                prog.rows.append((q, RECV, n - tail, 1, call.displs[q] * isz + n - tail, tail, 1))
            if q != r and n:
                prog.waits.append(q)  # the others read its buffer
        if call.recv is not None and not call.in_place and mine:
            prog.copies.append((1, call.displs[r] * isz, 2, 0, mine))
        prog.done()
        prog.verb = "write"
        return prog


class _Alltoall(Moves):
    """Every rank reads its block from each peer's send buffer (in place: from a copy the rank made first)."""

    coll = "alltoall"

    def program(self, r: int, p: int, call: Call, sub: int = 0) -> Program:
        assert call.send is not None
        isz = call.dtype.itemsize
        if call.vector:  # no rank knows where its blocks lie in the senders' buffers: their tables say
            own = [(1, call.send_displs[r] * isz, 2, call.displs[r] * isz, call.counts[r] * isz)] if call.counts[r] else []
            table = list(zip([d * isz for d in call.send_displs], [c * isz for c in call.send_counts]))
            return table_program(p, table, [(q, 2, call.displs[q] * isz, call.counts[q] * isz, 0)
                                             for q in range(p) if q != r], own, _readers(table, r, sub))
        prog = Program(p, call.send.nbytes, (1, 0, 0, 0))
        _same(prog, r, call.send.nbytes)
        for q in range(p):  # block r of q's send buffer, at q's displacement for r (uniform: r blocks in)
            if q != r and call.counts[q]:
                prog.rows.append((q, SEND, call.send_displs[r] * isz, 2, call.displs[q] * isz, call.counts[q] * isz, 0))
            if q != r and call.send_counts[q]:
                prog.waits.append(q)  # the peers read their blocks of this rank's buffer
        if call.counts[r]:
            prog.copies.append((1, call.send_displs[r] * isz, 2, call.displs[r] * isz, call.counts[r] * isz))
        return prog.done()

    def scratch(self, call: Call) -> bool:
        return call.in_place

    def buffers(self, call: Call, mem: MemoryBackend) -> tuple[int, int, Optional[np.ndarray]]:
        if not call.in_place:
            return address(call.send), address(call.recv), None
        assert call.send is not None  # peers read this rank's blocks while it overwrites them: they read a copy
        scratch = mem.scratch(call.send.shape[0], call.dtype)
        np.copyto(scratch, call.send)
        return address(scratch), address(call.recv), scratch


def _readers(table: list[tuple[int, int]], r: int, sub: int) -> list[int]:
    """The ranks that read their block from this rank's send buffer: those whose block does not fit the slot."""
    return [q for q, (_, n) in enumerate(table) if q != r and n > sub]


class _Broadcast(Moves):
    """Every rank reads the root's buffer; the root writes the tail of a large one into each reader meanwhile."""

    coll = "broadcast"

    def program(self, r: int, p: int, call: Call, sub: int = 0) -> Program:
        assert call.recv is not None
        root, n = call.root, call.recv.nbytes
        tail = root_share(n, p, BROADCAST_ROOT_SHARE)
        if r != root:
            prog = Program(p, n, (0, 0, 2, 0))
            _same(prog, r, n)
            if n > tail:
                prog.rows.append((root, SEND, 0, 2, 0, n - tail, 0))
            if tail:
                prog.waits.append(root)
            return prog.done()
        prog = Program(p, n, (2, 0, 0, 0))
        _same(prog, r, n)
        for q in range(p):
            if q != r and tail:
                prog.rows.append((q, RECV, n - tail, 2, n - tail, tail, 1))
            if q != r and n:
                prog.waits.append(q)
        prog.done()
        prog.verb = "write"
        return prog


class _Allgather(Moves):
    """Every rank reads each peer's block straight from the peer's buffer (its input, or in place its block of the
    result), then copies its own block, out of place."""

    coll = "allgather"

    def program(self, r: int, p: int, call: Call, sub: int = 0) -> Program:
        isz = call.dtype.itemsize
        mine = call.counts[r] * isz
        own = (2, call.displs[r] * isz) if call.in_place or call.send is None else (1, 0)
        prog = Program(p, mine, (*own, 0, 0))
        for q in range(p):
            if q != r:
                prog.expect[q] = call.counts[q] * isz
            if q != r and call.counts[q]:
                prog.rows.append((q, SEND, 0, 2, call.displs[q] * isz, call.counts[q] * isz, 0))
            if q != r and mine:
                prog.waits.append(q)
        if own[0] == 1 and mine:
            prog.copies.append((1, 0, 2, call.displs[r] * isz, mine))
        return prog.done()


GATHER, SCATTER, ALLTOALL, BROADCAST, ALLGATHER = _Gather(), _Scatter(), _Alltoall(), _Broadcast(), _Allgather()
MOVES = {m.coll: m for m in (GATHER, SCATTER, ALLTOALL, BROADCAST, ALLGATHER)}


def cma_rest(st: Steps, arena: Any, op: int, prog: Program, mine: tuple, send: int, recv: int,
             scratch: Optional[np.ndarray]) -> Schedule:
    """A posted cma call from its meeting on: meet the peers, check their calls, copy, then wait for the ranks that
    copy from or into this rank's memory."""
    others = [q for q in range(st.size) if q != st.rank]
    try:
        yield from meet_peers(st, arena, op, others)
        check_posts(st, arena, op, others, mine)
        for q, want in prog.expects():
            got = arena.peer_addrs(q, op)[2]
            if got != want:
                raise st.owner.error(MismatchError, f"rank {q} passed {got} bytes, this rank expects {want}", [st.world_rank(q)])
        wrong = table_mismatch(arena, op, prog) if prog.table is not None else None
        if wrong is not None:
            q, got, want = wrong
            exc = st.owner.error(MismatchError, f"rank {q} sends this rank {got} bytes, this rank expects {want}",
                                 [st.world_rank(q)])
            arena.set_done(op)  # the peers whose sizes agreed may be copying into its buffer: they finish first
            yield from meet_peers(st, arena, op, prog.waits.tolist(), "done")
            raise exc
        try:
            copy(arena, op, prog, send, recv)
        except OSError as exc:
            raise transfer_error(st, exc, prog.verb, arena) from None
    finally:
        arena.set_done(op)
    local(prog, send, recv)
    yield from cma_wait_rest(st, arena, op, prog.waits.tolist(), scratch)


def cma_unposted(st: Steps, arena: Any, op: int, prog: Program, mine: tuple, send: int, recv: int,
                 scratch: Optional[np.ndarray]) -> Schedule:
    """An inline call whose kernel found the peers not done with the call DEPTH back (UNPOSTED: after a one-sided
    call): wait for them (with timeouts), then post and go on as ``cma_rest``."""
    yield from lag_wait(st, arena, op)
    post(arena, op, prog, mine, send, recv)
    yield from cma_rest(st, arena, op, prog, mine, send, recv, scratch)


def cma_wait_rest(st: Steps, arena: Any, op: int, ranks: list[int], scratch: Optional[np.ndarray]) -> Schedule:
    """After this rank's copies (its "done" set): wait until ``ranks`` are done with its memory."""
    if ranks:
        yield from meet_peers(st, arena, op, ranks, "done")
    if scratch is not None:
        st.mem.release(scratch)


def cma_copy_failed(st: Steps, arena: Any, exc: OSError, verb: str) -> Schedule:
    """An inline copy failed (this rank's "done" set): report it as the schedule does."""
    raise transfer_error(st, exc, verb, arena)
    yield  # a schedule: its first step raises


def _cma(st: Steps, call: Call, moves: Moves, fallback) -> Schedule:
    arena, number = yield from cma_or_none(st)
    if arena is None:
        yield from fallback(st, call)
        return
    op = yield from take_turn(st, arena, number)
    mine = sig_words(st.sig)
    prog = moves.program(st.rank, st.size, call, table_block_bytes(arena.slot_bytes, arena.size))
    try:
        send, recv, scratch = moves.buffers(call, st.mem)
    except BaseException:
        arena.set_done(op)
        raise
    post(arena, op, prog, mine, send, recv)
    yield from cma_rest(st, arena, op, prog, mine, send, recv, scratch)


@register(
    "gather",
    "cma",
    "Every rank writes its block straight into the root's buffer with one kernel copy (cross-memory attach) while the "
    "root copies its own, and the root reads the head of a large block meanwhile (Gatherv: the root takes every "
    "block through its sender's table); single host.",
    steps="2 meetings",
    bytes="(p-1)/p · n written into the root (large blocks: a third read by the root)",
    refuse=_refuse,
    cost=lambda m, n, lay: cma_cost(m, n, lay, 2, copied=(lay.size - 1) / lay.size * n, local=n / lay.size, readers=1,
                                    inline=True, footprint=2.0 * n),  # the root's buffer and every rank's block
)
def gather_cma(st: Steps, call: Call) -> Schedule:
    yield from _cma(st, call, GATHER, gather_linear)


@register(
    "scatter",
    "cma",
    "Every rank reads its block straight from the root's buffer with one kernel copy (cross-memory attach; Scatterv: "
    "where the root's table says); single host.",
    steps="2 meetings",
    bytes="n/p read by each rank from the root",
    refuse=_refuse,
    cost=lambda m, n, lay: cma_cost(m, n, lay, 2, copied=n / lay.size, readers=lay.size - 1, inline=True,
                                    footprint=2.0 * n),  # the root's buffer and every rank's block
)
def scatter_cma(st: Steps, call: Call) -> Schedule:
    yield from _cma(st, call, SCATTER, scatter_linear)


@register(
    "alltoall",
    "cma",
    "Every rank reads its block from each peer's send buffer with one kernel copy (cross-memory attach; Alltoallv: "
    "where the peer's table says, small blocks from its slot); single host.",
    steps="2 meetings",
    bytes="(p-1)/p · n read from peers",
    refuse=_refuse,
    cost=lambda m, n, lay: cma_cost(m, n, lay, 2, copied=(lay.size - 1) / lay.size * n, local=n / lay.size,
                                    inline=True),
)
def alltoall_cma(st: Steps, call: Call) -> Schedule:
    yield from _cma(st, call, ALLTOALL, alltoall_pairwise)


@register(
    "broadcast",
    "cma",
    "Every rank reads the root's buffer straight from the root's memory with one kernel copy (cross-memory attach) "
    "while the root writes the tail of a large buffer into each reader; single host.",
    steps="2 meetings",
    bytes="n read from the root (large buffers: the root writes a share)",
    refuse=refuse_single_host,
    cost=lambda m, n, lay: cma_cost(m, n, lay, 2, copied=n, readers=lay.size - 1, inline=True,
                                    footprint=n * lay.size),  # one buffer a rank
)
def broadcast_cma(st: Steps, call: Call) -> Schedule:
    yield from _cma(st, call, BROADCAST, broadcast_chain)


@register(
    "allgather",
    "cma",
    "Each rank reads every peer's block straight from the peer's buffer with one kernel copy (cross-memory attach); "
    "single host.",
    steps="2 meetings",
    bytes="(p-1)/p · n read from peers",
    refuse=refuse_single_host,
    cost=lambda m, n, lay: cma_cost(m, n, lay, 2, copied=(lay.size - 1) / lay.size * n, local=n / lay.size,
                                    inline=True, footprint=(lay.size + 1.0) * n),  # every rank's result and block
)
def allgather_cma(st: Steps, call: Call) -> Schedule:
    yield from _cma(st, call, ALLGATHER, allgather_ring_algo)
