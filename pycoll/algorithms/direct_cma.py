"""Gather, scatter and alltoall on one host by cross-memory attach: each block crosses memory once, in one kernel copy.

Every rank posts its buffer's address in the arena; then each block crosses with one kernel copy straight between
two ranks' memories, and a rank whose memory others copy from or into stays in the call until they are done. Scatter
and Alltoall receivers read their blocks from the owners' buffers (process_vm_readv); Gather senders write theirs
into the root's buffer (process_vm_writev) while the root copies its own, and the root reads the head of a large
block meanwhile, so more cores copy at once. The v-forms are refused (not every rank knows the others' block
sizes, so ranks could choose differently); a communicator whose arena or cross-memory attach is unavailable runs the
stream algorithm instead.

Each collective's posts, checks and copies are a ``Moves``, shared by the scheduled form here and the executor's
inline runner, which runs a repeated call without the progress engine while the peers keep up and hands the rest to
``cma_rest`` or ``cma_wait_rest`` (as a schedule, with timeouts and reports) when they do not.

(Blocks passed through the arena's shared stage instead, two memory copies, measured slower here: a rank writing
stage lines that a peer's core has just read waits for their invalidation, 8-30 µs per 64 KiB on this VM against
9 µs for one process_vm_readv.)
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional

import numpy as np

from ..errors import MismatchError
from ..memory import MemoryBackend
from ..transport.arena import COUNT, KIND, NBYTES, ROOT, SEQ, VHASH
from .base import Call, Layout, Schedule, Steps
from .direct import alltoall_pairwise, gather_linear, scatter_linear
from .registry import register
from .shared import _begin, _check_posts, _cma_cost, _cma_or_none, _meet, _refuse_single_host, _transfer_error, sig_words

_PAGE = 4096
# Gather and Scatter blocks from this size on are split between the root and the block's other rank, one kernel copy
# each at once: below it a second system call costs more than the overlap gains (a call costs about 5 µs here, plus
# 0.3 µs a page).
SPLIT_BYTES = 256 << 10
# The root's share of a 2-rank block, where both finished together when measured (the root also copies its own block,
# about 3.5x faster than a cross-memory copy; a Scatter root's writes ran slower than a Gather root's reads).
GATHER_ROOT_SHARE = 0.35
SCATTER_ROOT_SHARE = 0.2


def _refuse(call: Call, lay: Layout) -> Optional[str]:
    if call.vector:
        return "a vector call's blocks differ by rank, and not every rank knows their sizes"
    return _refuse_single_host(call, lay)


def address(arr: Optional[np.ndarray]) -> int:
    """Where ``arr``'s first byte is (0: no bytes); a quarter of ``arr.ctypes.data``'s cost for a writable array."""
    if arr is None or not arr.nbytes:
        return 0
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(arr))
    except (TypeError, ValueError):  # read-only, or a dtype the buffer protocol cannot name (bfloat16)
        return int(arr.ctypes.data)


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
    """One cma collective's steps on a posted arena operation, for the arena's rank (``arena.rank``, ``arena.size``).

    ``post`` publishes this rank's addresses; once the peers' posts match (``expect`` gives the byte counts they must
    post), ``copy`` moves bytes between this rank's memory and its peers', then this rank is "done", copies its own
    block (``local``) and waits for ``waits``, the ranks that copy from or into its memory. A call that goes on as a
    schedule may repeat ``copy``: the same bytes land in the same places.
    """

    coll = ""

    def post(self, arena: Any, op: int, call: Call, words: tuple, mem: MemoryBackend) -> Optional[np.ndarray]:
        """Post this rank's call and addresses for ``op``; returns the scratch copy the peers read (in place), or None."""
        raise NotImplementedError

    def expect(self, arena: Any, call: Call) -> list[tuple[int, int]]:
        """(peer, bytes) for each peer whose posted byte count this rank checks before copying."""
        raise NotImplementedError

    def copy(self, arena: Any, op: int, call: Call, scratch: Optional[np.ndarray]) -> None:
        """This rank's copies from or into its peers' memory; raises OSError where a cross-memory copy fails."""
        raise NotImplementedError

    def local(self, arena: Any, call: Call, scratch: Optional[np.ndarray]) -> None:
        """Copy this rank's own block, where it has one to copy."""

    def waits(self, arena: Any, op: int, call: Call) -> list[int]:
        """The ranks this rank waits for (their "done") before it leaves: they copy from or into its memory."""
        raise NotImplementedError

    def verb(self, arena: Any, call: Call) -> str:
        """What this rank's cross-memory copies do, in error reports."""
        return "read"


def _others(arena: Any) -> list[int]:
    return [q for q in range(arena.size) if q != arena.rank]


def _same_bytes(arena: Any, mine: int) -> list[tuple[int, int]]:
    """Every peer must post this rank's block size (not a v-form: all blocks are alike). Every rank checks every
    peer, so a wrong size stops every rank before any copy: none writes into a rank that already left."""
    return [(q, mine) for q in _others(arena)]


class _Gather(Moves):
    """Each rank writes its block into the root's buffer (the root posts its address) while the root copies its own;
    the root reads the head of a large block meanwhile (``root_share``)."""

    coll = "gather"

    def post(self, arena: Any, op: int, call: Call, words: tuple, mem: MemoryBackend) -> Optional[np.ndarray]:
        if arena.rank == call.root:
            arena.post(op, words, 0, address(call.recv), _block_bytes(call, arena.rank))
        else:
            assert call.send is not None
            arena.post(op, words, address(call.send), 0, call.send.nbytes)
        return None

    def expect(self, arena: Any, call: Call) -> list[tuple[int, int]]:
        if arena.rank == call.root:
            return _same_bytes(arena, _block_bytes(call, arena.rank))
        assert call.send is not None
        return _same_bytes(arena, call.send.nbytes)

    def copy(self, arena: Any, op: int, call: Call, scratch: Optional[np.ndarray]) -> None:
        r, p, root = arena.rank, arena.size, call.root
        cma = arena.cma
        if r != root:
            assert call.send is not None
            n = call.send.nbytes
            head = root_share(n, p, GATHER_ROOT_SHARE)
            if n > head:
                recv_addr = arena.peer_addrs(root, op)[1]
                cma.write_addr(arena.pids[root], address(call.send) + head, recv_addr + r * n + head, n - head)
            return
        isz, base = call.dtype.itemsize, 0
        for q in range(p):
            head = root_share(_block_bytes(call, q), p, GATHER_ROOT_SHARE)
            if q != r and head:
                base = base or address(call.recv)
                cma.read_addr(arena.pids[q], base + call.displs[q] * isz, arena.peer_addrs(q, op)[0], head)

    def local(self, arena: Any, call: Call, scratch: Optional[np.ndarray]) -> None:
        if call.recv is not None and call.send is not None:  # the root, out of place
            r = arena.rank
            np.copyto(call.recv[call.displs[r]:call.displs[r] + call.counts[r]], call.send)

    def waits(self, arena: Any, op: int, call: Call) -> list[int]:
        r, p, root = arena.rank, arena.size, call.root
        if r == root:  # the owners write into its buffer
            return [q for q in range(p) if q != r and call.counts[q]]
        assert call.send is not None
        return [root] if root_share(call.send.nbytes, p, GATHER_ROOT_SHARE) else []  # the root reads its head

    def verb(self, arena: Any, call: Call) -> str:
        return "read" if arena.rank == call.root else "write"


class _Scatter(Moves):
    """Every rank reads its block straight from the root's buffer; the root writes the tail of a large block into its
    reader's buffer meanwhile (``root_share``; the readers post their addresses)."""

    coll = "scatter"

    def post(self, arena: Any, op: int, call: Call, words: tuple, mem: MemoryBackend) -> Optional[np.ndarray]:
        if arena.rank == call.root:
            arena.post(op, words, address(call.send), 0, _block_bytes(call, arena.rank))
        else:
            recv = call.recv
            assert recv is not None
            arena.post(op, words, 0, address(recv) if root_share(recv.nbytes, arena.size, SCATTER_ROOT_SHARE) else 0, recv.nbytes)
        return None

    def expect(self, arena: Any, call: Call) -> list[tuple[int, int]]:
        if arena.rank == call.root:
            return _same_bytes(arena, _block_bytes(call, arena.rank))
        assert call.recv is not None
        return _same_bytes(arena, call.recv.nbytes)

    def copy(self, arena: Any, op: int, call: Call, scratch: Optional[np.ndarray]) -> None:
        r, p, root, cma = arena.rank, arena.size, call.root, arena.cma
        if r != root:
            assert call.recv is not None
            n = call.recv.nbytes
            head = n - root_share(n, p, SCATTER_ROOT_SHARE)
            if head:
                cma.read_addr(arena.pids[root], address(call.recv), arena.peer_addrs(root, op)[0] + r * n, head)
            return
        isz, base = call.dtype.itemsize, 0
        for q in range(p):
            n = _block_bytes(call, q)
            tail = root_share(n, p, SCATTER_ROOT_SHARE)
            if q != r and tail:
                base = base or address(call.send)
                cma.write_addr(arena.pids[q], base + call.displs[q] * isz + n - tail, arena.peer_addrs(q, op)[1] + n - tail, tail)

    def local(self, arena: Any, call: Call, scratch: Optional[np.ndarray]) -> None:
        if call.send is not None and call.recv is not None:  # the root, out of place
            r = arena.rank
            np.copyto(call.recv, call.send[call.displs[r]:call.displs[r] + call.counts[r]])

    def waits(self, arena: Any, op: int, call: Call) -> list[int]:
        if arena.rank == call.root:  # the others read its buffer
            return [q for q in _others(arena) if call.counts[q]]
        assert call.recv is not None
        return [call.root] if root_share(call.recv.nbytes, arena.size, SCATTER_ROOT_SHARE) else []  # the root writes into its buffer

    def verb(self, arena: Any, call: Call) -> str:
        return "write" if arena.rank == call.root else "read"


class _Alltoall(Moves):
    """Every rank reads its block from each peer's send buffer (in place: from a copy the peer made first)."""

    coll = "alltoall"

    def post(self, arena: Any, op: int, call: Call, words: tuple, mem: MemoryBackend) -> Optional[np.ndarray]:
        assert call.send is not None
        source, scratch = call.send, None
        if call.in_place:  # peers read this rank's blocks while it overwrites them: they read a copy
            source = scratch = mem.scratch(call.send.shape[0], call.dtype)
            np.copyto(scratch, call.send)
        arena.post(op, words, address(source), 0, source.nbytes)
        return scratch

    def expect(self, arena: Any, call: Call) -> list[tuple[int, int]]:
        assert call.send is not None
        return [(q, call.send.nbytes) for q in _others(arena)]

    def copy(self, arena: Any, op: int, call: Call, scratch: Optional[np.ndarray]) -> None:
        r, cma = arena.rank, arena.cma
        isz, base = call.dtype.itemsize, 0
        for q in range(arena.size):  # block r of q's send buffer, at q's displacement for r (uniform: r blocks in)
            if q != r and call.counts[q]:
                base = base or address(call.recv)
                cma.read_addr(arena.pids[q], base + call.displs[q] * isz, arena.peer_addrs(q, op)[0] + call.send_displs[r] * isz,
                              call.counts[q] * isz)

    def local(self, arena: Any, call: Call, scratch: Optional[np.ndarray]) -> None:
        assert call.send is not None and call.recv is not None
        r, source = arena.rank, call.send if scratch is None else scratch
        np.copyto(call.recv[call.displs[r]:call.displs[r] + call.counts[r]],
                  source[call.send_displs[r]:call.send_displs[r] + call.send_counts[r]])

    def waits(self, arena: Any, op: int, call: Call) -> list[int]:
        return [q for q in _others(arena) if call.send_counts[q]]  # the peers read their blocks of this rank's buffer


GATHER, SCATTER, ALLTOALL = _Gather(), _Scatter(), _Alltoall()
MOVES = {m.coll: m for m in (GATHER, SCATTER, ALLTOALL)}


def cma_post(arena: Any, op: int, call: Call, moves: Moves, words: tuple, mem: MemoryBackend) -> Optional[np.ndarray]:
    """``moves.post``; if posting fails, this rank's arena operation ends with it."""
    try:
        return moves.post(arena, op, call, words, mem)
    except BaseException:
        arena.set_done(op)
        raise


def posts_agree(arena: Any, op: int, others: list[int], posted: tuple, expect: list[tuple[int, int]]) -> bool:
    """Whether every rank in ``others`` posted ``op`` for this call (``posted``: the signature words as posted, the
    call number folded in) and each peer in ``expect`` the byte count given there; the peers' posts must be in."""
    w, seq = arena.words, arena.seq
    for q in others:
        b = arena.line(q, op)
        if (w[b + KIND], w[b + ROOT], w[b + COUNT], w[b + VHASH]) != posted or w[b + SEQ] != seq:
            return False
    return all(w[arena.line(q, op) + NBYTES] == n for q, n in expect)


def cma_rest(st: Steps, arena: Any, op: int, call: Call, moves: Moves, mine: tuple,
             scratch: Optional[np.ndarray]) -> Schedule:
    """A posted cma call from its meeting on: meet the peers, check their calls, copy, then wait for the ranks that
    copy from or into this rank's memory."""
    others = [q for q in range(st.size) if q != st.rank]
    try:
        yield from _meet(st, arena, op, others)
        _check_posts(st, arena, op, others, mine)
        for q, want in moves.expect(arena, call):
            got = arena.peer_addrs(q, op)[2]
            if got != want:
                raise st.owner.error(MismatchError, f"rank {q} passed {got} bytes, this rank expects {want}", [st.world_rank(q)])
        try:
            moves.copy(arena, op, call, scratch)
        except OSError as exc:
            raise _transfer_error(st, exc, moves.verb(arena, call), arena) from None
    finally:
        arena.set_done(op)
    moves.local(arena, call, scratch)
    yield from cma_wait_rest(st, arena, op, moves.waits(arena, op, call), scratch)


def cma_wait_rest(st: Steps, arena: Any, op: int, ranks: list[int], scratch: Optional[np.ndarray]) -> Schedule:
    """After this rank's copies (its "done" set): wait until ``ranks`` are done with its memory."""
    if ranks:
        yield from _meet(st, arena, op, ranks, "done")
    if scratch is not None:
        st.mem.release(scratch)


def cma_copy_failed(st: Steps, arena: Any, exc: OSError, verb: str) -> Schedule:
    """An inline copy failed (this rank's "done" set): report it as the schedule does."""
    raise _transfer_error(st, exc, verb, arena)
    yield  # a schedule: its first step raises


def _cma(st: Steps, call: Call, moves: Moves, fallback) -> Schedule:
    arena, number = yield from _cma_or_none(st)
    if arena is None:
        yield from fallback(st, call)
        return
    op = yield from _begin(st, arena, number)
    mine = sig_words(st.sig)
    scratch = cma_post(arena, op, call, moves, mine, st.mem)
    yield from cma_rest(st, arena, op, call, moves, mine, scratch)


@register(
    "gather",
    "cma",
    "Every rank writes its block straight into the root's buffer with one kernel copy (cross-memory attach) while the "
    "root copies its own, and the root reads the head of a large block meanwhile; single host.",
    steps="2 meetings",
    bytes="(p-1)/p · n written into the root (large blocks: a third read by the root)",
    refuse=_refuse,
    cost=lambda m, n, lay: _cma_cost(m, n, lay, 2, copied=(lay.size - 1) / lay.size * n, local=n / lay.size, readers=1),
)
def gather_cma(st: Steps, call: Call) -> Schedule:
    yield from _cma(st, call, GATHER, gather_linear)


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
    yield from _cma(st, call, SCATTER, scatter_linear)


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
    yield from _cma(st, call, ALLTOALL, alltoall_pairwise)
