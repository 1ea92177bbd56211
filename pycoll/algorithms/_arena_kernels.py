"""Numba kernels of the compiled arena path (see ``arena_jit``); importing this module needs Numba."""

from __future__ import annotations

import numpy as np
from numba import carray, njit, types
from numba.extending import overload

from .. import ops as _ops
from ..transport import arena as _arena
from ..transport.atomics import address_pointer as _address_pointer, byte_pointer as _byte_pointer
from ..transport.atomics import call_c0, cpu_relax, cross_copy as _cross_copy, load_acquire, store_seq_cst

_HEADER, _CTRL = _arena.HEADER_WORDS, _arena.CTRL_WORDS
_DONE_WORD, _SLEEPING_WORD = _arena.DONE, _arena.SLEEPING
_KIND, _SEND, _RECV, _NBYTES, _POST = _arena.KIND, _arena.SEND, _arena.RECV, _arena.NBYTES, _arena.POST
_STAGED, _CONSUMED = _arena.STAGED, _arena.CONSUMED
_BELL_WORD = _arena.BELL_BYTE // 8
_RING_ALWAYS_WORD = _arena.RING_ALWAYS
_SUM, _PROD, _MIN, _MAX, _AVG = _ops.SUM.code, _ops.PROD.code, _ops.MIN.code, _ops.MAX.code, _ops.AVG.code
_BAND, _BOR, _BXOR = _ops.BAND.code, _ops.BOR.code, _ops.BXOR.code
_LAND, _LOR = _ops.LAND.code, _ops.LOR.code
_DONE, _WAITING, _MISMATCH, _LEFT, _WAKE, _FAILED = 0, 1, 2, 3, 4, 8
_SEQ_WORD = _arena.SEQ
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # as ``arena.fold_seq``
_DEPTH = _arena.DEPTH  # slots and post lines in turn: call ``opno`` uses index ``opno % _DEPTH``


@njit(cache=True, nogil=True)
def copy_bytes(dst, dst_off, src, src_off, nbytes):
    """dst's bytes [dst_off, +nbytes) = src's [src_off, +nbytes), in a loop LLVM vectorizes.

    Not libc's memcpy: on this AMD VM its ``rep movsb`` path for 64 KiB copies ran 10x slower whenever
    (dst - src) mod 4096 was 16 (4K aliasing), which user buffers from the heap hit at random.
    """
    d = carray(_byte_pointer(dst, dst_off), nbytes)
    s = carray(_byte_pointer(src, src_off), nbytes)
    for i in range(nbytes):
        d[i] = s[i]


@njit(cache=True, nogil=True)
def copy_bytes_twice(dst, dst_off, dst2, dst2_off, src, src_off, nbytes):
    """``copy_bytes`` into two destinations in one pass: the source is read once."""
    d = carray(_byte_pointer(dst, dst_off), nbytes)
    e = carray(_byte_pointer(dst2, dst2_off), nbytes)
    s = carray(_byte_pointer(src, src_off), nbytes)
    for i in range(nbytes):
        x = s[i]
        d[i] = x
        e[i] = x


def _combine(op, a, b):  # pragma: no cover - replaced by the overload below in compiled code
    raise NotImplementedError


@overload(_combine, inline="always")
def _combine_impl(op, a, b):
    """op(a, b) with NumPy's ufunc meaning, typed per dtype so no invalid branch is compiled."""
    if isinstance(a, types.Boolean):
        def bools(op, a, b):
            if op == _BAND or op == _LAND:
                return a and b
            if op == _BOR or op == _LOR:
                return a or b
            return a != b
        return bools
    if isinstance(a, types.Integer):
        def ints(op, a, b):
            if op == _SUM:
                return a + b
            if op == _PROD:
                return a * b
            if op == _MIN:
                return a if a <= b else b
            if op == _MAX:
                return a if a >= b else b
            if op == _BAND:
                return a & b
            if op == _BOR:
                return a | b
            if op == _BXOR:
                return a ^ b
            if op == _LAND:
                return a != 0 and b != 0
            if op == _LOR:
                return a != 0 or b != 0
            return (a != 0) != (b != 0)
        return ints
    if isinstance(a, types.Float):
        def floats(op, a, b):
            if op == _PROD:
                return a * b
            # NaN wins, and of two equal values (-0.0 and 0.0) the second, bit for bit as np.minimum/np.maximum give
            # for float32 and float64 (float16 never reaches the kernels)
            if op == _MIN:
                return a if (a < b or a != a) else b
            if op == _MAX:
                return a if (a > b or a != a) else b
            return a + b  # SUM, AVG
        return floats
    if isinstance(a, types.Complex):
        def complexes(op, a, b):
            if op == _PROD:
                return a * b
            return a + b
        return complexes
    return None


def _mean(x, p):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(_mean, inline="always")
def _mean_impl(x, p):
    """x / p in x's own precision, as ``np.divide(out, dtype.type(p), out=out)``."""
    if isinstance(x, types.Float):
        ft = x
        return lambda x, p: x / ft(p)
    if isinstance(x, types.Complex):
        ft = x.underlying_float
        ct = x

        def complexes(x, p):  # NumPy's complex division by (p + 0j): scale by 1/p, zero cross terms kept
            scale = ft(1) / ft(p)
            zero = ft(0)
            return ct(complex((x.real + x.imag * zero) * scale, (x.imag - x.real * zero) * scale))
        return complexes
    return lambda x, p: x


@njit(cache=True, nogil=True)
def _post(words, me, bases, sig, opno):
    base = bases[me]
    for k in range(4):
        words[base + _KIND + k] = sig[k]
    words[base + _SEND] = 0
    words[base + _RECV] = 0
    words[base + _NBYTES] = 0
    store_seq_cst(words, base + _POST, opno)


@njit(cache=True, nogil=True)
def _ring(words, me, size):
    """After a seq_cst store of what changed: if some peer sleeps on the doorbell, bump it and say WAKE. A sleeper
    raises its flag with a barrier before it checks for progress, so one of the two sees the other's store, and
    the doorbell's word, which every rank would write on every call, stays untouched while nobody sleeps; where
    ranks outnumber cores (RING_ALWAYS) it is bumped on every call, as sleepers there raise flags plainly."""
    always = words[_RING_ALWAYS_WORD] != 0
    if always:
        _bump_bell(words)
    for r in range(size):
        if r != me and load_acquire(words, _HEADER + r * _CTRL + _SLEEPING_WORD) != 0:
            if not always:
                _bump_bell(words)
            return _WAKE
    return 0


@njit(inline="always", cache=True, nogil=True)
def _bump_bell(words):
    store_seq_cst(words, _BELL_WORD, (load_acquire(words, _BELL_WORD) + np.uint64(1)) & np.uint64(0xFFFFFFFF))


@njit(inline="always", cache=True, nogil=True)
def _pause(i, polls, yields, yield_fn):
    """After the ``i``-th fruitless poll round (from 0): the spin hint for the first ``polls`` rounds, then, where
    ranks outnumber cores, ``yields`` rounds that give the core away (``yield_fn``: libc's sched_yield) so the peer
    being waited for can run; False once both are spent."""
    if i < polls:
        cpu_relax()
        return True
    if i < polls + yields:
        call_c0(yield_fn)
        return True
    return False


@njit(cache=True, nogil=True)
def spin(words, bases, opno, polls):
    """Poll until every rank in ``bases`` posted ``opno`` or ``polls`` rounds pass; how many have not."""
    left = len(bases)
    for _ in range(polls):
        left = 0
        for r in range(len(bases)):
            if load_acquire(words, bases[r] + _POST) != opno:
                left += 1
        if left == 0:
            return 0
        cpu_relax()
    return left


@njit(cache=True, nogil=True)
def _await_posts(words, me, bases, sig, opno, polls, yields, yield_fn):
    """After this rank posted: ring, spin for the peers (``_pause``), compare their calls: DONE, WAITING or MISMATCH,
    or'ed with WAKE."""
    return _await_some(words, me, bases, sig, opno, polls, yields, yield_fn, _NONE_SKIPPED, 0)


_NONE_SKIPPED = np.zeros(0, np.int64)


@njit(cache=True, nogil=True)
def _await_some(words, me, bases, sig, opno, polls, yields, yield_fn, meets, at):
    """``_await_posts`` for the ranks r with ``meets[at + r]`` nonzero (an empty ``meets``: every rank)."""
    wake = _ring(words, me, len(bases))
    every = len(meets) == 0
    i = 0
    while True:
        left = 0
        for r in range(len(bases)):
            if (every or meets[at + r] != 0) and load_acquire(words, bases[r] + _POST) != opno:
                left += 1
        if left == 0:
            break
        if not _pause(i, polls, yields, yield_fn):
            return _WAITING | wake
        i += 1
    for r in range(len(bases)):
        if every or meets[at + r] != 0:
            for k in range(4):
                if words[bases[r] + _KIND + k] != sig[k]:
                    return _MISMATCH | wake
    return _DONE | wake


@njit(cache=True, nogil=True)
def _meet(words, me, bases, sig, opno, polls, yields, yield_fn):
    """Post, spin for the peers, compare their calls (see ``_await_posts``)."""
    _post(words, me, bases, sig, opno)
    return _await_posts(words, me, bases, sig, opno, polls, yields, yield_fn)


@njit(cache=True, nogil=True)
def _finish(words, me, size, opno):
    store_seq_cst(words, _HEADER + me * _CTRL + _DONE_WORD, opno)
    return _ring(words, me, size)


@njit(cache=True, nogil=True)
def _fold(words, base, sig, seq):
    """For call number ``seq``: post word 3 is the unfolded word (kept in ``sig[4]``) mixed with it, as
    ``arena.fold_seq`` does, and the post line at ``base`` gets the number in clear (before the post flag); a
    negative ``seq`` leaves both as the caller wrote them."""
    if seq >= 0:
        sig[3] = sig[4] ^ (np.uint64(seq) * _GOLDEN)
        words[base + _SEQ_WORD] = seq


@njit(cache=True, nogil=True)
def barrier(words, me, bases, sig, opno, polls, seq, yields, yield_fn):
    """A whole arena barrier when every peer arrives within the spin (``_pause``); else it returns posted, not done."""
    _fold(words, bases[me], sig, seq)
    status = _meet(words, me, bases, sig, opno, polls, yields, yield_fn)
    if status & 3 != _DONE:
        return status
    return _finish(words, me, len(bases), opno) | (status & _WAKE)


@njit(cache=True, nogil=True)
def allreduce(words, slots, send, recv, me, bases, sig, opno, op, polls, seq, yields, yield_fn):
    """A whole one-shot Allreduce when every peer arrives within the spin; else it returns posted, not done.

    ``slots`` is every rank's slots as one C-contiguous (ranks, DEPTH, slot) array of the dtype (so each row is
    contiguous and the loops vectorize); the call uses slot ``opno % DEPTH``. ``recv`` gets the ranks' slots combined in
    rank order and rounded to the dtype after each step, as chained ufunc calls do.
    """
    size = len(bases)
    n = len(send)
    par = opno % _DEPTH
    mine = slots[me, par]
    for i in range(n):
        mine[i] = send[i]
    _fold(words, bases[me], sig, seq)
    status = _meet(words, me, bases, sig, opno, polls, yields, yield_fn)
    if status & 3 != _DONE:
        return status
    first = slots[0, par]
    for i in range(n):
        recv[i] = first[i]
    for q in range(1, size):
        row = slots[q, par]
        for i in range(n):
            recv[i] = _combine(op, recv[i], row[i])
    if op == _AVG:
        for i in range(n):
            recv[i] = _mean(recv[i], size)
    return _finish(words, me, size, opno) | (status & _WAKE)


@njit(cache=True, nogil=True)
def _counter(words, rank, which):
    return np.int64(load_acquire(words, _HEADER + rank * _CTRL + which))


@njit(cache=True, nogil=True)
def pipe_broadcast(words, stage, buf, me, root, size, base, chunk, nslots, start, polls):
    """Chunks ``start``.. of a broadcast through the root's stage ring, as far as ``polls`` spins allow.

    Chunks are numbered over the arena's life from ``base``. The root copies chunk j of ``buf`` into ring
    slot (base + j) % nslots once every reader has consumed the chunk that used that slot before, then raises its STAGED counter to base + j + 1; a reader waits for that,
    copies the slot into ``buf`` and raises its CONSUMED counter. Each wait may spin ``polls`` rounds.
    Returns (next chunk, WAKE or 0): the caller wakes sleepers when asked and waits with timeouts before
    calling again.
    """
    n = len(buf)
    nchunks = (n + chunk - 1) // chunk
    j = start
    while j < nchunks:
        budget = polls
        lo = j * chunk
        m = min(n - lo, chunk)
        slot = ((base + j) % nslots) * chunk
        if me == root:
            need = base + j - nslots + 1
            for r in range(size):
                if r != root:
                    while _counter(words, r, _CONSUMED) < need:
                        budget -= 1
                        if budget <= 0:
                            return j, 0
                        cpu_relax()
            copy_bytes(stage, slot, buf, lo, m)
            store_seq_cst(words, _HEADER + me * _CTRL + _STAGED, base + j + 1)
        else:
            while _counter(words, root, _STAGED) < base + j + 1:
                budget -= 1
                if budget <= 0:
                    return j, 0
                cpu_relax()
            copy_bytes(buf, lo, stage, slot, m)
            store_seq_cst(words, _HEADER + me * _CTRL + _CONSUMED, base + j + 1)
        j += 1
        if _ring(words, me, size):
            return j, _WAKE
    return j, 0


@njit(cache=True, nogil=True)
def broadcast(words, stage, buf, me, bases, sig, opno, root, base, chunk, nslots, polls):
    """A whole staged broadcast when the peers keep up: meet, pipe every chunk, close the rounds, finish.

    Returns (status, next chunk, met): DONE when finished; otherwise the call is posted and ``met`` says
    whether the meeting completed, so the caller's schedule resumes at chunk ``next`` (or at the meeting).
    """
    size = len(bases)
    status = _meet(words, me, bases, sig, opno, polls, 0, 0)
    if status & 3 != _DONE:
        return status, 0, False
    wake = status & _WAKE
    j, more = pipe_broadcast(words, stage, buf, me, root, size, base, chunk, nslots, 0, polls)
    wake |= more
    if j * chunk < len(buf):
        return _WAITING | wake, j, True
    rounds = base + j
    mine = _HEADER + me * _CTRL
    store_seq_cst(words, mine + _STAGED, rounds)
    store_seq_cst(words, mine + _arena.REDUCED, rounds)
    store_seq_cst(words, mine + _CONSUMED, rounds)
    return _finish(words, me, size, opno) | wake, j, True


@njit(cache=True, nogil=True)
def _wait_counter(words, me, size, which, target, budget):
    """Spin until every rank but ``me`` has counter ``which`` at ``target``; the budget left (<= 0: gave up)."""
    for r in range(size):
        if r != me:
            while _counter(words, r, which) < target:
                budget -= 1
                if budget <= 0:
                    return 0
                cpu_relax()
    return budget


# Modes of ``pipe_blocks``, and the phases it reports when a peer is late.
ALLREDUCE, REDUCE_SCATTER, ALLGATHER, REDUCE_ROOT, REDUCE_LEAF, SCAN, EXSCAN = 0, 1, 2, 3, 4, 5, 6
WAIT_SLOT, WAIT_STAGED, WAIT_REDUCED = 0, 1, 2


@njit(cache=True, nogil=True)
def pipe_blocks(words, stages, send, recv, sd, rd, counts, me, mode, op, local, base, c, nslots, start, polls):
    """Chunks ``start``.. of a pipelined staged allreduce, reduce-scatter, allgather, reduce or (ex)scan (``mode``).

    The vector is ``size`` blocks (``counts``; block q sits at ``sd[q]`` in ``send``, ``rd[q]`` in
    ``recv``); chunk j is elements [j*c, j*c + c) of every block. Ring slot (base + j) % nslots of each
    rank's stage row holds ``size`` sub-slots of c elements. Per chunk, rank ``me``:
      1. once every peer consumed the chunk that used the slot before, stages the parts it contributes
         (its send's block q into sub-slot q for each peer q; in allgather and the scans its own block into
         sub-slot ``me``, and in allgather into ``recv`` if ``local``) and raises STAGED (allgather: and REDUCED);
      2. (reductions) once every peer staged, combines its own block of ``send`` with every peer's
         sub-slot ``me`` (own first, then the peers in rank order) into ``recv`` (allreduce: and into its
         own sub-slot ``me``; a reduce's other ranks: into that sub-slot only), raises REDUCED; the scans fold
         the sub-slots of ranks 0..me (exscan: 0..me-1), in rank order, into ``recv``;
      3. (allreduce, allgather, a reduce's root) once every peer reduced, copies the peers' sub-slots into
         their blocks of ``recv``; then raises CONSUMED.
    Every step is skipped if this rank's counter shows it done, so a call resumes where it stopped. After
    each raised counter it rings the doorbell, and returns at once if a peer sleeps on it.
    Returns (next chunk, the phase it waits in or -1, WAKE or 0).
    """
    size = stages.shape[0]
    isz = send.itemsize
    nchunks = 0
    for q in range(size):
        nchunks = max(nchunks, (counts[q] + c - 1) // c)
    mine = _HEADER + me * _CTRL
    width = size * c
    scan = mode == SCAN or mode == EXSCAN
    j = start
    while j < nchunks:
        budget = polls
        done = base + j + 1
        slot = ((base + j) % nslots) * width
        lo = j * c
        if _counter(words, me, _STAGED) < done:
            budget = _wait_counter(words, me, size, _CONSUMED, done - nslots, budget)
            if budget <= 0:
                return j, WAIT_SLOT, 0
            row = stages[me]
            if mode == ALLGATHER or scan:
                m = min(c, counts[me] - lo)
                if m > 0 and local:  # the own block into the stage and into recv, reading it once
                    copy_bytes_twice(row, (slot + me * c) * isz, recv, (rd[me] + lo) * isz, send, (sd[me] + lo) * isz, m * isz)
                elif m > 0:
                    copy_bytes(row, (slot + me * c) * isz, send, (sd[me] + lo) * isz, m * isz)
                store_seq_cst(words, mine + _STAGED, done)
                if mode == ALLGATHER:
                    store_seq_cst(words, mine + _arena.REDUCED, done)
            else:
                for q in range(size):
                    m = min(c, counts[q] - lo)
                    if q != me and m > 0:
                        copy_bytes(row, (slot + q * c) * isz, send, (sd[q] + lo) * isz, m * isz)
                store_seq_cst(words, mine + _STAGED, done)
            if _ring(words, me, size):  # a peer sleeps on this flag: the caller wakes it, then calls again
                return j, -1, _WAKE
        if mode != ALLGATHER and _counter(words, me, _arena.REDUCED) < done:
            budget = _wait_counter(words, me, size, _STAGED, done, budget)
            if budget <= 0:
                return j, WAIT_STAGED, 0
            if scan:
                _fold_scan(stages, recv, rd[me] + lo, min(c, counts[me] - lo), slot, c, me + 1 if mode == SCAN else me, op)
            else:
                _reduce_block(stages, send, recv, sd, rd, counts, me, mode, op, slot, c, lo)
            store_seq_cst(words, mine + _arena.REDUCED, done)
            if _ring(words, me, size):
                return j, -1, _WAKE
        if mode == ALLREDUCE or mode == ALLGATHER or mode == REDUCE_ROOT:
            budget = _wait_counter(words, me, size, _arena.REDUCED, done, budget)
            if budget <= 0:
                return j, WAIT_REDUCED, 0
            for q in range(size):
                m = min(c, counts[q] - lo)
                if q != me and m > 0:
                    copy_bytes(recv, (rd[q] + lo) * isz, stages[q], (slot + q * c) * isz, m * isz)
        store_seq_cst(words, mine + _CONSUMED, done)
        j += 1
        if _ring(words, me, size):
            return j, -1, _WAKE
    return j, -1, 0


@njit(cache=True, nogil=True)
def _reduce_block(stages, send, recv, sd, rd, counts, me, mode, op, slot, c, lo):
    """Step 2 of ``pipe_blocks`` for the reductions: this rank's block of chunk ``lo``, the left fold in rank order of
    the ranks' parts (its own input at its place, the peers' sub-slots ``me``), into ``recv`` or its own sub-slot."""
    size = stages.shape[0]
    isz = send.itemsize
    m = min(c, counts[me] - lo)
    own = slot + me * c
    src, dst = sd[me] + lo, rd[me] + lo
    mine_out = stages[me][own : own + m]
    # slices, not offset indexing: loops over them vectorize; a reduce's other ranks reduce into their stage
    out = mine_out if mode == REDUCE_LEAF else recv[dst : dst + m]
    both = mode == ALLREDUCE and op != _AVG  # the last pass writes the stage too (one pass fewer)
    ours = send[src : src + m]
    if me >= 2 and mode != REDUCE_LEAF:
        # in place the first pass writes over this rank's input before the fold reaches it: keep it in the stage
        for i in range(m):
            mine_out[i] = ours[i]
        ours = mine_out
    acc = ours if me == 0 else stages[0][own : own + m]
    for q in range(1, size):
        theirs = ours if q == me else stages[q][own : own + m]
        if both and q == size - 1:
            for i in range(m):
                x = _combine(op, acc[i], theirs[i])
                out[i] = x
                mine_out[i] = x
        else:
            for i in range(m):
                out[i] = _combine(op, acc[i], theirs[i])
        acc = out
    if op == _AVG:
        for i in range(m):
            out[i] = _mean(out[i], size)
    if mode == ALLREDUCE and not both and m > 0:
        copy_bytes(stages[me], own * isz, recv, dst * isz, m * isz)


@njit(cache=True, nogil=True)
def _fold_scan(stages, recv, dst, m, slot, c, hi, op):
    """``recv[dst:dst + m]`` = op over ranks 0..hi-1 of their staged sub-slots (rank q's is sub-slot q), in rank order
    (each rank's own input is read from its stage too, so an in-place call reads it before writing)."""
    if hi <= 0 or m <= 0:
        return
    out = recv[dst : dst + m]
    first = stages[0][slot : slot + m]
    if hi == 1:
        for i in range(m):
            out[i] = first[i]
    else:
        second = stages[1][slot + c : slot + c + m]
        for i in range(m):
            out[i] = _combine(op, first[i], second[i])
    for q in range(2, hi):
        row = stages[q][slot + q * c : slot + q * c + m]
        for i in range(m):
            out[i] = _combine(op, out[i], row[i])
    if op == _AVG:
        for i in range(m):
            out[i] = _mean(out[i], hi)


@njit(cache=True, nogil=True)
def close_rounds(words, me, rounds):
    mine = _HEADER + me * _CTRL
    store_seq_cst(words, mine + _STAGED, rounds)
    store_seq_cst(words, mine + _arena.REDUCED, rounds)
    store_seq_cst(words, mine + _CONSUMED, rounds)


@njit(cache=True, nogil=True)
def blocks(words, stages, send, recv, sd, rd, counts, me, bases, sig, opno, mode, op, local, base, c, nslots, polls):
    """A whole ``pipe_blocks`` call when the peers keep up: meet, pipe every chunk, close the rounds, finish.

    Returns (status, next chunk, met), as ``broadcast`` does.
    """
    size = len(bases)
    status = _meet(words, me, bases, sig, opno, polls, 0, 0)
    if status & 3 != _DONE:
        return status, 0, False
    wake = status & _WAKE
    nchunks = 0
    for q in range(size):
        nchunks = max(nchunks, (counts[q] + c - 1) // c)
    j, _, more = pipe_blocks(words, stages, send, recv, sd, rd, counts, me, mode, op, local, base, c, nslots, 0, polls)
    wake |= more
    if j < nchunks:
        return _WAITING | wake, j, True
    close_rounds(words, me, base + nchunks)
    return _finish(words, me, size, opno) | wake, j, True


# ---- slots: every small collective through the ranks' arena slots (see ``slots``) ----------------------------
# ``slots`` is every rank's slots as one C-contiguous (ranks, DEPTH, slot) array (bytes, or elements of the call's dtype);
# ``meta`` is the call's program, laid out as ``slots.Program.meta`` writes it (the M_* offsets below).

_NBYTES_WORD = _arena.NBYTES
(M_ME, M_OPNO, M_NBYTES, M_POLLS, M_OP, M_LO, M_HI, M_SOFF, M_DOFF, M_N, M_SIZE, M_NHEAD, M_NPACK, M_NUNPACK, M_SEQ,
 M_VHASH, M_YIELDS, M_YIELD_FN, M_OWN) = range(19)
# M_OWN: 1 where no peer reads this rank's own fold range (a Reduce_scatter's block, a Reduce root's vector): the rank
# copies the rest of its vector in and folds its own row from its send buffer
M_BASES = 19  # then: bases[size], expect[size], reads[size], head[nhead], pack[npack][3], unpack[nunpack][4]
_UNPOSTED = 16  # or'ed into WAITING: nothing was packed or posted (peers had not finished the call two back)


@njit(cache=True, nogil=True)
def _post_n(words, base, sig, opno, nbytes, seq):
    for k in range(4):
        words[base + _KIND + k] = sig[k]
    words[base + _SEND] = 0
    words[base + _RECV] = 0
    words[base + _NBYTES] = nbytes
    words[base + _SEQ_WORD] = seq
    store_seq_cst(words, base + _POST, opno)


@njit(cache=True, nogil=True)
def _all_done(words, me, size, target, polls, yields, yield_fn):
    """Spin (``_pause``) until every peer finished arena call ``target`` (its DONE word); False if the spin ends
    first."""
    i = 0
    while True:
        left = 0
        for r in range(size):
            if r != me and np.int64(load_acquire(words, _HEADER + r * _CTRL + _DONE_WORD)) < target:
                left += 1
        if left == 0:
            return True
        if not _pause(i, polls, yields, yield_fn):
            return False
        i += 1


@njit(cache=True, nogil=True)
def _peers_done(words, meta, target):
    """``_all_done`` with the spin in ``meta``."""
    return _all_done(words, meta[M_ME], meta[M_SIZE], target, meta[M_POLLS], meta[M_YIELDS], meta[M_YIELD_FN])


@njit(cache=True, nogil=True)
def _meet_slots(words, meta, sig):
    """Post (with this rank's contribution size and call number), spin for the peers whose slots this rank reads
    (``reads``; none: it returns at once), compare their calls and contribution sizes. The posted vhash word is the
    call's, folded with its number (``arena.fold_seq``)."""
    me, opno, size, polls = meta[M_ME], meta[M_OPNO], meta[M_SIZE], meta[M_POLLS]
    seq = np.uint64(meta[M_SEQ])
    sig[3] = np.uint64(meta[M_VHASH]) ^ (seq * _GOLDEN)
    bases = meta[M_BASES:M_BASES + size]
    expect = meta[M_BASES + size:M_BASES + 2 * size]
    reads = meta[M_BASES + 2 * size:M_BASES + 3 * size]
    _post_n(words, bases[me], sig, opno, meta[M_NBYTES], seq)
    wake = _ring(words, me, size)
    i = 0
    while True:
        left = 0
        for r in range(size):
            if reads[r] and load_acquire(words, bases[r] + _POST) != opno:
                left += 1
        if left == 0:
            break
        if not _pause(i, polls, meta[M_YIELDS], meta[M_YIELD_FN]):
            return _WAITING | wake
        i += 1
    for r in range(size):
        if reads[r]:
            for k in range(4):
                if words[bases[r] + _KIND + k] != sig[k]:
                    return _MISMATCH | wake
            if expect[r] >= 0 and np.int64(words[bases[r] + _NBYTES_WORD]) != expect[r]:
                return _MISMATCH | wake
    return _DONE | wake


@njit(cache=True, nogil=True)
def slots_pack(slots, send, meta):
    """Write this rank's contribution into its slot: the head words (a table), then the pack rows."""
    me, size, par = meta[M_ME], meta[M_SIZE], meta[M_OPNO] % _DEPTH
    nhead, npack = meta[M_NHEAD], meta[M_NPACK]
    mine = slots[me, par]
    at = M_BASES + 3 * size
    for i in range(nhead):
        v = meta[at + i]
        for b in range(8):
            mine[i * 8 + b] = np.uint8((v >> np.int64(8 * b)) & np.int64(0xFF))
    at += nhead
    for k in range(npack):
        copy_bytes(mine, meta[at + 3 * k + 1], send, meta[at + 3 * k], meta[at + 3 * k + 2])


@njit(cache=True, nogil=True)
def _table_entry(row, entry):
    """(offset, bytes) of entry ``entry`` of the table at the start of a slot (int64 pairs, little-endian)."""
    off = np.int64(0)
    n = np.int64(0)
    for b in range(8):
        off |= np.int64(row[16 * entry + b]) << np.int64(8 * b)
        n |= np.int64(row[16 * entry + 8 + b]) << np.int64(8 * b)
    return off, n


@njit(cache=True, nogil=True)
def slots_unpack(slots, recv, meta):
    """Copy the unpack rows (rank, slot offset, offset in ``recv``, bytes) out of the slots; a slot offset of -1 reads
    (offset, bytes) from that rank's table entry for this rank. False if a table entry disagrees."""
    me, size, par = meta[M_ME], meta[M_SIZE], meta[M_OPNO] % _DEPTH
    at = M_BASES + 3 * size + meta[M_NHEAD] + 3 * meta[M_NPACK]
    for k in range(meta[M_NUNPACK]):
        r, s_off, d_off, n = meta[at + 4 * k], meta[at + 4 * k + 1], meta[at + 4 * k + 2], meta[at + 4 * k + 3]
        row = slots[r, par]
        if s_off < 0:
            s_off, got = _table_entry(row, me)
            if got != n:
                return False
        copy_bytes(recv, d_off, row, s_off, n)
    return True


@njit(cache=True, nogil=True)
def slots_move(words, slots, send, recv, meta, sig, opno, seq, lag):
    """A whole data-movement collective through the slots, call ``opno`` numbered ``seq`` (``send`` and ``recv``
    of any one dtype, moved as bytes): pack, meet, unpack, finish; else posted, not done. With ``lag`` (the last call
    did not wait for every peer) it first waits for the peers to finish call ``opno - DEPTH``, whose slots it reuses;
    if they do not within the spin, it returns WAITING | UNPOSTED, having done nothing."""
    meta[M_OPNO] = opno
    meta[M_SEQ] = seq
    if lag and not _peers_done(words, meta, opno - _DEPTH):
        return _WAITING | _UNPOSTED
    send = send.view(np.uint8)
    recv = recv.view(np.uint8)
    slots_pack(slots, send, meta)
    status = _meet_slots(words, meta, sig)
    if status & 3 != _DONE:
        return status
    if not slots_unpack(slots, recv, meta):
        return _MISMATCH | (status & _WAKE)
    return _finish(words, meta[M_ME], meta[M_SIZE], meta[M_OPNO]) | (status & _WAKE)


@njit(cache=True, nogil=True)
def _fold_row(out, row, op, first):
    if first:
        for i in range(len(out)):
            out[i] = row[i]
    else:
        for i in range(len(out)):
            out[i] = _combine(op, out[i], row[i])


@njit(cache=True, nogil=True)
def _fold_pair(out, a, b, op):
    for i in range(len(out)):
        out[i] = _combine(op, a[i], b[i])


@njit(cache=True, nogil=True)
def _fold_source(slots, send, meta, q):
    """Rank ``q``'s row of the fold: its slot's elements, or this rank's send buffer where ``M_OWN``."""
    s_off, n = meta[M_SOFF], meta[M_N]
    if meta[M_OWN] != 0 and q == meta[M_ME]:
        return send[s_off:s_off + n]
    return slots[q, meta[M_OPNO] % _DEPTH, s_off:s_off + n]


@njit(cache=True, nogil=True)
def slots_fold(slots, send, recv, meta):
    """recv[d_off:+n] = op over ranks lo..hi-1 of their slots' elements [s_off, +n), in rank order (this rank's own
    row from ``send`` where ``M_OWN``)."""
    op, lo, hi, d_off, n = meta[M_OP], meta[M_LO], meta[M_HI], meta[M_DOFF], meta[M_N]
    if hi <= lo:
        return
    out = recv[d_off:d_off + n]
    start = lo
    if hi - lo >= 2:  # the first two rows in one pass
        _fold_pair(out, _fold_source(slots, send, meta, lo), _fold_source(slots, send, meta, lo + 1), op)
        start = lo + 2
    for q in range(start, hi):
        _fold_row(out, _fold_source(slots, send, meta, q), op, q == lo)
    if op == _AVG:
        for i in range(n):
            out[i] = _mean(out[i], hi - lo)


@njit(cache=True, nogil=True)
def slots_reduce(words, slots, send, recv, meta, sig, opno, seq, lag):
    """A whole reduction collective through the slots (elements of one dtype), call ``opno`` numbered ``seq``:
    copy in, meet, fold, finish (``lag``: as ``slots_move``)."""
    meta[M_OPNO] = opno
    meta[M_SEQ] = seq
    if lag and not _peers_done(words, meta, opno - _DEPTH):
        return _WAITING | _UNPOSTED
    mine = slots[meta[M_ME], meta[M_OPNO] % _DEPTH]
    skip_lo, skip_hi = len(send), len(send)
    if meta[M_OWN]:  # the range only this rank reads stays out of its slot
        skip_lo, skip_hi = meta[M_SOFF], meta[M_SOFF] + meta[M_N]
    for i in range(skip_lo):
        mine[i] = send[i]
    rest, into = send[skip_hi:], mine[skip_hi:len(send)]  # views: indices from 0 keep the loop vectorised
    for i in range(len(rest)):
        into[i] = rest[i]
    status = _meet_slots(words, meta, sig)
    if status & 3 != _DONE:
        return status
    slots_fold(slots, send, recv, meta)
    return _finish(words, meta[M_ME], meta[M_SIZE], meta[M_OPNO]) | (status & _WAKE)


# ---- cross-memory attach: Gather, Scatter, Alltoall, Broadcast, Allgather (see ``direct_cma``) ---------------------
# A call's program is one int64 array (``cma_program.Program.packed``): the C_* scalars, then the two posted addresses
# as (which, offset) pairs (which: 0 none, 1 send, 2 recv), the byte count expected from each rank (-1: unchecked), each
# rank's process id, whether this rank meets each rank (waits for its post and checks it), rows (peer, posted word of
# the peer, offset from it, which, offset, bytes, 1 to write into the peer or 0 to read from it), own copies (which,
# offset, which, offset, bytes: source first), and the ranks waited for. A program with a table (``C_TABLE``: the vector
# forms, whose ranks do not all know the blocks' sizes and places) ends with it: (byte offset, bytes) for each peer's
# block. The kernel writes it into the rank's arena slot for the call (``C_SLOT0`` and ``C_SLOTB``: where slot 0 of rank
# 0 lies in the mapping and how long a slot is), with each block of at most ``C_SUB`` bytes after it; a row whose posted
# word is ``TABLE_ROW`` reads the peer's table and checks the block's size (the row's offset, bytes skipped at the
# block's start, plus its bytes), then reads the block from the peer's slot (at most ``C_SUB``) or its send buffer, or
# writes it into the peer's receive buffer at the table's offset (a Gatherv sender's large block, less the head the root
# reads), or copies nothing (``which`` 0: the peer writes it).
C_ME, C_SIZE, C_NBYTES, C_POLLS, C_READV, C_WRITEV, C_NROWS, C_NCOPIES, C_NWAITS, C_COPIED, C_BOUNCE = range(11)
C_TABLE, C_SLOT0, C_SLOTB, C_SUB = range(11, 15)
C_POSTED = 15
TABLE_ROW = -1


@njit(cache=True, nogil=True)
def table_slot(prog, rank, opno):
    """Byte offset in the mapping of ``rank``'s slot for call ``opno``, where its table lies."""
    return prog[C_SLOT0] + (rank * _DEPTH + opno % _DEPTH) * prog[C_SLOTB]


@njit(cache=True, nogil=True)
def table_block(prog, size, rank, opno, peer):
    """Byte offset in the mapping of the block ``rank`` keeps in its slot for ``peer`` (a block of at most C_SUB)."""
    return table_slot(prog, rank, opno) + (16 * size + 63) // 64 * 64 + peer * prog[C_SUB]


@njit(cache=True, nogil=True)
def _local(send, recv, which, offset):
    return (send if which == 1 else recv) + offset


@njit(cache=True, nogil=True)
def cma_moves(words, bases, sig, prog, opno, seq, send, recv, lag):
    """A whole cross-memory-attach call when the peers keep up: post this rank's addresses (``send``, ``recv``: 0 for
    none) and byte count, make its own copies (they depend on no peer; once per call: ``prog[C_COPIED]`` keeps the
    call's number), meet, check the peers' calls and byte counts, copy every row with one system call, mark this rank
    done, then spin until the ranks waited for are done with its memory.

    It meets only the ranks its program names (a Gatherv sender whose block lies in its slot meets nobody: the
    others check its post); such a call may return before the peers have read its slot, and the next call is made
    with ``lag``: it first waits for the peers to finish call ``opno - DEPTH``, whose slot and line it reuses.

    ``sig`` is ``arena_jit.sig_array``'s: the kernel folds the call number ``seq`` into word 3 (``_fold``). Returns
    DONE; WAITING (posted, nothing
    copied from or to a peer: call again, or go on as a schedule; with UNPOSTED: the lag wait ran out, nothing was
    posted), MISMATCH, FAILED (a copy failed, nothing marked) or LEFT (done here, some ranks waited for are not),
    or'ed with WAKE.
    """
    me, size, polls = prog[C_ME], prog[C_SIZE], prog[C_POLLS]
    if lag and not _all_done(words, me, size, opno - _DEPTH, polls, 0, 0):
        return _WAITING | _UNPOSTED
    expect = C_POSTED + 4
    pids = expect + size
    meets = pids + size
    rows = meets + size
    copies = rows + 7 * prog[C_NROWS]
    waits = copies + 5 * prog[C_NCOPIES]
    table = waits + prog[C_NWAITS]
    base = bases[me]
    if prog[C_TABLE]:  # the table and the small blocks into this rank's slot, before the post shows them
        at = table_slot(prog, me, opno) // 8  # slots start on whole lines
        for q in range(size):
            off, n = prog[table + 2 * q], prog[table + 2 * q + 1]
            words[at + 2 * q] = off
            words[at + 2 * q + 1] = n
            if q != me and 0 < n <= prog[C_SUB]:
                src = carray(_address_pointer(send + off), n)
                dst = carray(_byte_pointer(words, table_block(prog, size, me, opno, q)), n)
                for i in range(n):
                    dst[i] = src[i]
    _fold(words, base, sig, seq)  # word 3 and the number in clear, before the words are posted
    for k in range(4):
        words[base + _KIND + k] = sig[k]
    at = C_POSTED
    words[base + _SEND] = _local(send, recv, prog[at], prog[at + 1]) if prog[at] else 0
    words[base + _RECV] = _local(send, recv, prog[at + 2], prog[at + 3]) if prog[at + 2] else 0
    words[base + _NBYTES] = prog[C_NBYTES]
    store_seq_cst(words, base + _POST, opno)
    if prog[C_COPIED] != opno:
        for k in range(prog[C_NCOPIES]):
            row = copies + 5 * k
            n = prog[row + 4]
            src = carray(_address_pointer(_local(send, recv, prog[row], prog[row + 1])), n)
            dst = carray(_address_pointer(_local(send, recv, prog[row + 2], prog[row + 3])), n)
            for i in range(n):
                dst[i] = src[i]
        prog[C_COPIED] = opno
    status = _await_some(words, me, bases, sig, opno, polls, 0, 0, prog, meets)
    if status & 3 != _DONE:
        return status
    wake = status & _WAKE
    for r in range(size):
        if prog[expect + r] >= 0 and np.int64(words[bases[r] + _NBYTES_WORD]) != prog[expect + r]:
            return _MISMATCH | wake
    for k in range(prog[C_NROWS]):  # every table row's size first: a mismatch copies nothing
        row = rows + 7 * k
        if prog[row + 1] == TABLE_ROW:
            if np.int64(words[table_slot(prog, prog[row], opno) // 8 + 2 * me + 1]) != prog[row + 2] + prog[row + 5]:
                return _MISMATCH | wake
    for k in range(prog[C_NROWS]):
        row = rows + 7 * k
        q = prog[row]
        local = _local(send, recv, prog[row + 3], prog[row + 4])
        writing = prog[row + 6] != 0
        if prog[row + 1] == TABLE_ROW:
            n = prog[row + 5]
            if prog[row + 3] == 0:  # a size check only: the peer copies this block itself
                continue
            if not writing and n <= prog[C_SUB]:  # in the peer's slot
                src = carray(_byte_pointer(words, table_block(prog, size, q, opno, me)), n)
                dst = carray(_address_pointer(local), n)
                for i in range(n):
                    dst[i] = src[i]
                continue
            remote = (np.int64(words[bases[q] + (_RECV if writing else _SEND)])
                      + np.int64(words[table_slot(prog, q, opno) // 8 + 2 * me]) + prog[row + 2])
        else:
            remote = np.int64(words[bases[q] + prog[row + 1]]) + prog[row + 2]
        fn = prog[C_WRITEV] if writing else prog[C_READV]
        if not _cross_copy(fn, prog[pids + q], local, remote, prog[row + 5], not writing, prog[C_BOUNCE] != 0):
            return _FAILED | wake
    wake |= _finish(words, me, size, opno)
    budget = polls
    for k in range(prog[C_NWAITS]):
        q = prog[waits + k]
        while np.int64(load_acquire(words, _HEADER + q * _CTRL + _DONE_WORD)) < opno:
            budget -= 1
            if budget <= 0:
                return _LEFT | wake
            cpu_relax()
    return _DONE | wake
