"""What one rank does in a cross-memory-attach call (``Program``), the vector forms' tables in the arena slots, and
the Python twin of the ``cma_moves`` kernel: post, copy, check (``direct_cma`` builds the programs and schedules
the calls; ``inline_runners`` runs them inline)."""

from __future__ import annotations

import ctypes
from typing import Any, Optional

import numpy as np

from ..memory import host_address
from ..transport.arena import COUNT, KIND, NBYTES, RECV, ROOT, SEND, SEQ, VHASH

TABLE_ROW = -1  # a row's posted word where the peer's table gives the block (as _arena_kernels.TABLE_ROW)


def address(arr: Optional[np.ndarray]) -> int:
    """Where ``arr``'s first byte is (0: None, or no bytes)."""
    if arr is None or not arr.nbytes:
        return 0
    return host_address(arr)


class Program:
    """What one rank does in one cma call shape (never a buffer address: those are passed per call, ``send`` and
    ``recv``): the addresses it posts, as (which, offset) for the SEND and RECV words (which: 0 none, 1 send, 2 recv);
    the byte count it posts and the counts it checks the peers posted (-1: unchecked); its copies between its memory
    and a peer's, as rows (peer, posted word of the peer, offset from it, which, offset, bytes, 1 to write or 0 to
    read); its own copies (which, offset, which, offset, bytes: source first); and the ranks it waits for (their
    "done") before it leaves, because they copy from or into its memory. The compiled kernel
    (``_arena_kernels.cma_moves``) and the Python path below run the same program. The kernel meets the ranks in
    ``meets`` (all, but in a vector call: the ranks it copies from or into); a call that meets fewer is
    ``one_sided`` (its peers may still read its slot when it returns: ``HostArena.lagging``)."""

    __slots__ = ("posted", "nbytes", "expect", "rows", "copies", "waits", "verb", "table", "meets", "one_sided")

    def __init__(self, size: int, nbytes: int, posted: tuple[int, int, int, int]) -> None:
        self.posted = np.array(posted, np.int64)
        self.nbytes = nbytes
        self.expect = np.full(size, -1, np.int64)
        self.rows: Any = []
        self.copies: Any = []
        self.waits: Any = []
        self.verb = "read"
        # (byte offset in the send buffer, bytes) of this rank's block for each rank, written into its arena slot for
        # the readers (an Alltoallv's), or None
        self.table: Optional[np.ndarray] = None
        self.meets = np.ones(size, np.int64)
        self.one_sided = False

    def done(self) -> "Program":
        """Freeze the lists into the arrays the kernel takes."""
        self.rows = np.array(self.rows, np.int64).reshape(-1, 7)
        self.copies = np.array(self.copies, np.int64).reshape(-1, 5)
        self.waits = np.array(self.waits, np.int64)
        if len(self.rows) and all(self.rows[:, 6]):
            self.verb = "write"
        return self

    def packed(self, rank: int, polls: int, readv: int, writev: int, bounce: bool, pids: list[int], arena: Any
               ) -> np.ndarray:
        """The program as the kernel takes it (``_arena_kernels.C_*``), with the spin length, libc's
        process_vm_readv and _writev, whether copies at the short distance bounce (``CrossMemory.bounces``), the
        ranks' process ids and where the arena's slots lie (for a table)."""
        size = len(self.expect)
        table = self.table is not None
        head = [rank, size, self.nbytes, polls, readv, writev, len(self.rows), len(self.copies), len(self.waits), 0,
                int(bounce), int(table), arena.slot_offset(0, 0), arena.slot_bytes,
                table_block_bytes(arena.slot_bytes, size) if table else 0]
        parts = [np.array(head, np.int64), self.posted, self.expect, np.array(pids, np.int64), self.meets,
                 self.rows.reshape(-1), self.copies.reshape(-1), self.waits]
        if table:
            parts.append(self.table.reshape(-1))
        return np.concatenate(parts).astype(np.int64)

    def expects(self) -> list[tuple[int, int]]:
        """(peer, bytes) for each peer whose posted byte count is checked."""
        return [(q, int(n)) for q, n in enumerate(self.expect) if n >= 0]


def table_head_bytes(size: int) -> int:
    """Bytes of a slot's table: (offset, bytes) per rank, to a whole line."""
    return (16 * size + 63) // 64 * 64


def table_block_bytes(slot_bytes: int, size: int) -> int:
    """The largest block a rank keeps in its slot beside its table for each peer (whole lines; 0: none)."""
    return max((slot_bytes - table_head_bytes(size)) // size // 64 * 64, 0)


def _table_of(arena: Any, rank: int, op: int) -> np.ndarray:
    return arena.slot(rank, op)[: 16 * arena.size].view(np.int64)


def write_table(arena: Any, op: int, prog: Program, send: int) -> None:
    """This rank's table, and its blocks small enough, into its slot for ``op`` (before its post)."""
    if prog.table is None:
        return
    size, sub = arena.size, table_block_bytes(arena.slot_bytes, arena.size)
    slot = arena.slot(arena.rank, op)
    _table_of(arena, arena.rank, op)[:] = prog.table.reshape(-1)
    head = table_head_bytes(size)
    for q, (off, n) in enumerate(prog.table.tolist()):
        if q != arena.rank and 0 < n <= sub:
            ctypes.memmove(address(slot[head + q * sub: head + q * sub + n]), send + off, n)


def table_mismatch(arena: Any, op: int, prog: Program) -> Optional[tuple[int, int, int]]:
    """(peer, bytes its table gives this rank, bytes this rank expects) for the first table row whose sizes differ;
    the peers' posts must be in."""
    for q, word, skip, _, _, n, _ in prog.rows.tolist():
        if word == TABLE_ROW:
            got = int(_table_of(arena, q, op)[2 * arena.rank + 1])
            if got != skip + n:
                return q, got, skip + n
    return None


def _at(send: int, recv: int, which: int, offset: int) -> int:
    return (send if which == 1 else recv) + offset


def table_program(p: int, table: list[tuple[int, int]], rows: list[tuple[int, ...]],
                   own: list[tuple[int, int, int, int, int]], waits: list[int],
                   plain: Optional[list[tuple[int, int, int, int, int, int, int]]] = None) -> Program:
    """A vector call's program, where the ranks do not all know the blocks' sizes and places. ``table`` gives
    (byte offset, bytes) for each rank: of its block in this rank's send buffer (the kernel writes the table into the
    rank's slot, with the blocks of at most ``table_block_bytes`` beside it), or, a Gatherv root's, of the place in
    its receive buffer where a sender writes a larger block. ``rows`` (peer, which, offset, bytes, 1 to write) are
    the blocks this rank copies, each after checking its size in the peer's table: read from the peer's slot or
    send buffer into ``which`` (2: this rank's receive buffer), or written from it into the peer's receive buffer;
    ``which`` 0 checks the size only. ``own``: its local copies; ``waits``: the ranks that copy from or into its
    buffers. A row may end with a skip: the bytes at the block's start that another rank copies (its size check
    counts them). ``plain``: rows as ``Program``'s (a Gatherv root reading a large block's head). It meets only the
    ranks it copies from or into: a Gatherv sender whose block lies in its slot, or a Scatterv root whose blocks all
    do, posts and leaves (the others check its post)."""
    prog = Program(p, 0, (1, 0, 2, 0))
    prog.table = np.array(table, np.int64).reshape(p, 2)
    prog.rows = [(q, TABLE_ROW, skip[0] if skip else 0, which, at, n, write) for q, which, at, n, write, *skip in rows]
    prog.rows += list(plain or [])
    prog.copies = list(own)
    prog.waits = list(waits)
    prog.meets[:] = 0
    prog.meets[[q for q, *_ in rows]] = 1
    prog.one_sided = int(prog.meets.sum()) < p - 1
    return prog.done()


def post(arena: Any, op: int, prog: Program, words: tuple, send: int, recv: int) -> None:
    """Post this rank's call, addresses and byte count for ``op``; if posting fails, its arena operation ends."""
    try:
        write_table(arena, op, prog, send)
        s_which, s_off, r_which, r_off = (int(v) for v in prog.posted)
        arena.post(op, words, _at(send, recv, s_which, s_off) if s_which else 0,
                   _at(send, recv, r_which, r_off) if r_which else 0, prog.nbytes)
    except BaseException:
        arena.set_done(op)
        raise


def copy(arena: Any, op: int, prog: Program, send: int, recv: int) -> None:
    """The program's copies between this rank's memory and its peers'; raises OSError where one fails. A call that goes
    on as a schedule may repeat them: the same bytes land in the same places."""
    cma, w = arena.cma, arena.words
    sub, head = table_block_bytes(arena.slot_bytes, arena.size), table_head_bytes(arena.size)
    for q, word, off, which, local_off, n, write in prog.rows.tolist():
        if word == TABLE_ROW:
            if not n or not which:  # nothing, or a size check only
                continue
            if not write and n <= sub:  # in the sender's slot
                at = head + arena.rank * sub
                ctypes.memmove(_at(send, recv, which, local_off), address(arena.slot(q, op)[at: at + n]), n)
                continue
            at = int(_table_of(arena, q, op)[2 * arena.rank]) + off  # off: the head another rank copies
            remote = int(w[arena.line(q, op) + (RECV if write else SEND)]) + at
        else:
            remote = int(w[arena.line(q, op) + word]) + off
        (cma.write_addr if write else cma.read_addr)(arena.pids[q], _at(send, recv, which, local_off), remote, n)


def local(prog: Program, send: int, recv: int) -> None:
    """The program's copies within this rank's memory."""
    for s_which, s_off, d_which, d_off, n in prog.copies.tolist():
        ctypes.memmove(_at(send, recv, d_which, d_off), _at(send, recv, s_which, s_off), n)


def posts_agree(arena: Any, op: int, others: list[int], posted: tuple, expect: list[tuple[int, int]]) -> bool:
    """Whether every rank in ``others`` posted ``op`` for this call (``posted``: the signature words as posted, the
    call number folded in) and each peer in ``expect`` the byte count given there; the peers' posts must be in."""
    w, seq = arena.words, arena.seq
    for q in others:
        b = arena.line(q, op)
        if (w[b + KIND], w[b + ROOT], w[b + COUNT], w[b + VHASH]) != posted or w[b + SEQ] != seq:
            return False
    return all(w[arena.line(q, op) + NBYTES] == n for q, n in expect)


def tables_agree(arena: Any, op: int, prog: Program) -> bool:
    return prog.table is None or table_mismatch(arena, op, prog) is None
