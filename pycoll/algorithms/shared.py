"""Single-host algorithms on the host arena: one-shot through shared slots, and direct reads by cross-memory attach.

They meet through flags instead of messages (``arena_meeting``). ``oneshot`` copies each rank's vector into its
slot once and lets every rank reduce all slots; the ``cma`` algorithms read peers' buffers in place with one kernel
copy (process_vm_readv), so a byte crosses memory once per hop and nobody waits for a neighbour mid-call.
Each rank writes only its own memory. Where the arena cannot be set up, or the kernel refuses cross-memory
attach, every rank learns it at set-up and runs the named stream algorithm instead.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..config import size_param
from ..p2p_protocol import Sig
from ..transport.arena import CONSUMED, STAGED, HostArena, slot_bytes_for
from . import arena_jit
from .arena_meeting import (
    PIPE_SPIN_S,
    arena_ready,
    call_number,
    check_posts,
    close_rounds,
    cma_or_none,
    compiled_loops,
    meet_peers,
    owner_fallback,
    post_call,
    refuse_single_host,
    take_turn,
    transfer_error,
)
from .base import Call, Layout, Schedule, Steps, even_counts, offsets
from .chain import broadcast_chain
from .cost import CostModel
from .direct import barrier_dissemination
from .halving_doubling import allreduce_doubling
from .registry import register
from .ring import allreduce_ring, reduce_scatter_ring_algo


ARENA_CHUNK = size_param(
    "PYCOLL_ARENA_CHUNK", 256 << 10, "Bytes a cma reduction pulls from a peer per step: small enough to stay in cache."
)
ARENA_PIPE_CHUNK = size_param(
    "PYCOLL_ARENA_PIPE_CHUNK", 64 << 10, "Bytes per step (per block) of the staged algorithms: a chunk is copied in while the last one is copied out."
)


def _addr(arr: Optional[np.ndarray]) -> int:
    return int(arr.ctypes.data) if arr is not None and arr.nbytes else 0


def _refuse_oneshot(call: Call, lay: Layout) -> Optional[str]:
    slot = slot_bytes_for(lay.size)
    if call.size_bytes > slot:
        return f"{call.size_bytes} bytes do not fit a {slot}-byte arena slot"
    return refuse_single_host(call, lay)


def _oneshot_cost(m: CostModel, n: float, lay: Layout) -> float:
    p = lay.size
    footprint = 3 * p * n  # input, result and slot of every rank
    work = m.arena_sync_us * 1e-6 + m.copy_s(n, footprint) + m.reduce_s((p - 1) * n, footprint)
    return work * m.over(lay) + m.arena_handovers(lay, 1)


def cma_cost(m: CostModel, n: float, lay: Layout, syncs: int, *, pulled: float = 0.0, copied: float = 0.0,
             local: float = 0.0, readers: Optional[int] = None, inline: bool = False,
             footprint: Optional[float] = None) -> float:
    """A cma call of one rank: its meetings and chunk steps, then the slower of its own core's copying and the host's
    memory carrying what all ``readers`` ranks (default: every rank) move at once.

    ``pulled``: bytes read from peers in chunks into a scratch that stays in cache, each reduced into the result with
    one operand in cache (two of the reduction's three streams reach memory: 1.5x its rate, one copy's traffic);
    ``copied``: bytes read from peers straight into the result; ``local``: bytes this rank copies itself.
    ``footprint``: the bytes the host's ranks touch in a call (default: every rank's input and result).
    """
    readers = lay.size if readers is None else readers
    chunks = max(1.0, pulled / m.arena_chunk)
    call = m.cma_inline_us if inline else m.cma_call_us + syncs * m.cma_sync_us
    fixed = (call + chunks * m.arena_step_us) * 1e-6
    hit = m.cached(2.0 * n * lay.size if footprint is None else footprint)
    gain = lambda speedup: 1.0 - hit + hit / speedup  # noqa: E731 - time in cache / time from memory
    # In cache, a whole buffer read in one kernel copy gains cma_copy_cache_speedup; chunks pulled one system call
    # each, and their reductions, gain cma_cache_speedup.
    pull, copy, own_copy = gain(m.cma_cache_speedup), gain(m.cma_copy_cache_speedup), gain(m.cache_speedup)
    own = (copied / (m.cma_GBps * 1e9) * copy + pulled * (1 / (m.cma_GBps * 1e9) + 1 / (1.5 * m.reduce_GBps * 1e9)) * pull
           + local / (m.copy_GBps * 1e9) * own_copy)
    # in copies: a pulled byte is read once (half a copy), then reduced (a read and a write); the rest are copies
    host = readers * (1.5 * pulled * pull + copied * copy + local * own_copy) / (m.host_memory_GBps * 1e9)
    return fixed * m.over(lay) + max(own * m.over(lay), host) + m.arena_handovers(lay, syncs)  # chunk copies wait on no one


# ---- algorithms ----------------------------------------------------------------------------------


@register(
    "allreduce",
    "oneshot",
    "Each rank copies its vector into its arena slot once; then every rank reduces all slots in rank order. Small messages.",
    steps="1 meeting",
    bytes="n copied in; (p-1) n reduced",
    refuse=_refuse_oneshot,
    cost=_oneshot_cost,
    reproducible="every rank folds all the slots in rank order",
)
def allreduce_oneshot(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    number = call_number(st)
    arena = yield from arena_ready(st)
    if arena is None:
        yield from (owner_fallback("allreduce") if call.reproducible else allreduce_doubling)(st, call)
        return
    op = yield from take_turn(st, arena, number)
    mine = oneshot_post(arena, op, call, st.sig)
    yield from oneshot_rest(st, arena, op, call, mine)


def oneshot_post(arena: HostArena, op: int, call: Call, sig: Sig) -> tuple[int, int, int, int]:
    """Copy this rank's vector into its slot and post the call; returns the posted signature words."""
    assert call.send is not None
    try:
        arena.slot_views(op, call.send.nbytes, call.dtype)[arena.rank][...] = call.send
    except BaseException:
        arena.set_done(op)
        raise
    return post_call(arena, op, sig)


def oneshot_reduce(arena: HostArena, op: int, call: Call) -> None:
    """``recv`` = op over every rank's slot, in rank order (so every rank gets the same bits)."""
    assert call.recv is not None and call.op is not None and call.send is not None
    p, nb = arena.size, call.send.nbytes
    views = arena.slot_views(op, nb, call.dtype)
    ufunc, acc = call.op.ufunc, views[0]
    for q in range(1, p):  # a new result each step: NumPy's complex product differs in its last bits with out= aliased
        acc = ufunc(acc, views[q])
    if call.op.averages:
        acc = np.divide(acc, acc.dtype.type(p))
    call.recv[...] = acc


def oneshot_rest(st: Steps, arena: HostArena, op: int, call: Call, mine: tuple[int, int, int, int]) -> Schedule:
    """After ``oneshot_post``: meet the peers, compare their calls, reduce."""
    others = [q for q in range(st.size) if q != st.rank]
    try:
        yield from meet_peers(st, arena, op, others)
        check_posts(st, arena, op, others, mine)
        oneshot_reduce(arena, op, call)
    finally:
        arena.set_done(op)


@register(
    "barrier",
    "arena",
    "Every rank posts its call in the host arena and leaves once all have posted; one host.",
    steps="1 meeting",
    bytes="0",
    refuse=refuse_single_host,
    cost=lambda m, n, lay: m.arena_sync_us * 1e-6 * m.over(lay),
)
def barrier_arena(st: Steps, call: Call) -> Schedule:
    number = call_number(st)
    arena = yield from arena_ready(st)
    if arena is None:
        yield from barrier_dissemination(st, call)
        return
    op = yield from take_turn(st, arena, number)
    yield from barrier_rest(st, arena, op, post_call(arena, op, st.sig))


def barrier_rest(st: Steps, arena: HostArena, op: int, mine: tuple[int, int, int, int]) -> Schedule:
    """After ``post_call``: meet the peers and compare their calls."""
    others = [q for q in range(st.size) if q != st.rank]
    try:
        yield from meet_peers(st, arena, op, others)
        check_posts(st, arena, op, others, mine)
    finally:
        arena.set_done(op)


def _pull_reduce(st: Steps, arena: HostArena, op: int, send: np.ndarray, out: np.ndarray, first: int,
                 ufunc, pids: list[int], remote_send: list[int]) -> None:
    """``out`` = the left fold in rank order of elements [first, first + len(out)) of every rank's send buffer, pulled
    in chunks: ``((x0 op x1) op x2) ...``, the lower ranks' fold on the left, so the bits are ``functools.reduce``'s.
    The fold stays in ``out``, except for complex products, whose steps alternate between ``out`` and a scratch
    (NumPy's complex product rounds differently when it writes over an operand)."""
    p, r = st.size, st.rank
    isz = out.dtype.itemsize
    step = max(1, ARENA_CHUNK.get() // isz)
    n = min(step, max(out.shape[0], 1))
    tmp = st.mem.scratch(n, out.dtype)
    spare = st.mem.scratch(n, out.dtype) if ufunc is np.multiply and out.dtype.kind == "c" else None
    # in place, this rank's input is the result's memory, written before the fold reaches it: keep it apart
    own = st.mem.scratch(n, out.dtype) if np.shares_memory(send, out) else None
    # where fold q goes (alternating only with a spare), so that the last lands in out
    in_out = [spare is None or (p - 1 - q) % 2 == 0 for q in range(p)]
    read = arena.cma.read_addr
    try:
        for a in range(0, out.shape[0], step):
            b = min(a + step, out.shape[0])
            m = b - a
            dst, mine, got = out[a:b], send[a:b], tmp[:m]
            other = spare[:m] if spare is not None else dst
            if own is not None:
                own[:m] = mine
                mine = own[:m]
            offset = (first + a) * isz
            if r == 0:
                acc = mine
            else:
                acc = other if p > 1 and in_out[1] else dst  # x0 where fold 1 does not write (with a spare)
                read(pids[0], acc.ctypes.data, remote_send[0] + offset, m * isz)
            for q in range(1, p):
                if q == r:
                    x = mine
                else:
                    read(pids[q], got.ctypes.data, remote_send[q] + offset, m * isz)
                    x = got
                target = dst if in_out[q] else other
                ufunc(acc, x, out=target)
                acc = target
            if acc is not dst:
                dst[...] = acc  # one rank: its own input
    finally:
        for buf in (tmp, spare, own):
            if buf is not None:
                st.mem.release(buf)


_PULLED = "each rank folds its block in rank order from the parts it pulls, then the blocks are read out"


@register(
    "allreduce",
    "cma",
    "Each rank reduces its 1/p block by reading peers' buffers with one kernel copy each (cross-memory attach), "
    "then reads the other reduced blocks; single host.",
    steps="3 meetings",
    bytes="2(p-1)/p · n read from peers",
    refuse=refuse_single_host,
    cost=lambda m, n, lay: cma_cost(m, n, lay, 3, pulled=(lay.size - 1) / lay.size * n, copied=(lay.size - 1) / lay.size * n),
    reproducible=_PULLED,
)
def allreduce_cma(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    arena, number = yield from cma_or_none(st)
    if arena is None:
        yield from (owner_fallback("allreduce") if call.reproducible else allreduce_ring)(st, call)
        return
    p, r = st.size, st.rank
    others = [q for q in range(p) if q != r]
    op = yield from take_turn(st, arena, number)
    try:
        mine = arena_jit.sig_words(st.sig)
        arena.post(op, mine, _addr(call.send), _addr(call.recv), call.recv.nbytes)
        yield from meet_peers(st, arena, op, others)
        check_posts(st, arena, op, others, mine)
        addrs = [arena.peer_addrs(q, op) for q in range(p)]
        counts = even_counts(call.recv.shape[0], p)
        displs = offsets(counts)
        lo, hi = displs[r], displs[r] + counts[r]
        try:
            _pull_reduce(st, arena, op, call.send[lo:hi], call.recv[lo:hi], lo, call.op.ufunc, arena.pids, [a[0] for a in addrs])
            if call.op.averages:
                st.mem.scale(call.recv[lo:hi], p)
            arena.set_ready(op)
            yield from meet_peers(st, arena, op, others, "ready")
            isz = call.dtype.itemsize
            for q in others:
                block = call.recv[displs[q] : displs[q] + counts[q]]
                arena.cma.read(arena.pids[q], block, addrs[q][1] + displs[q] * isz)
        except OSError as exc:
            raise transfer_error(st, exc, "read", arena) from None
    finally:
        arena.set_done(op)
    yield from meet_peers(st, arena, op, others, "done")


@register(
    "reduce_scatter",
    "cma",
    "Each rank reduces its own block by reading it from every peer's buffer with one kernel copy (cross-memory attach); single host.",
    steps="2 meetings",
    bytes="(p-1)/p · n read from peers",
    refuse=refuse_single_host,
    cost=lambda m, n, lay: cma_cost(m, n, lay, 2, pulled=(lay.size - 1) / lay.size * n),
    reproducible=_PULLED,
)
def reduce_scatter_cma(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    arena, number = yield from cma_or_none(st)
    if arena is None:
        yield from (owner_fallback("reduce_scatter") if call.reproducible else reduce_scatter_ring_algo)(st, call)
        return
    p, r = st.size, st.rank
    others = [q for q in range(p) if q != r]
    op = yield from take_turn(st, arena, number)
    displs = offsets(call.counts)
    lo, c = displs[r], call.counts[r]
    # In place the result goes to the start of the buffer, which peers still read: reduce into scratch first.
    out = st.mem.scratch(c, call.dtype) if call.in_place else call.recv[:c]
    try:
        mine = arena_jit.sig_words(st.sig)
        arena.post(op, mine, _addr(call.send), 0, call.send.nbytes)
        yield from meet_peers(st, arena, op, others)
        check_posts(st, arena, op, others, mine)
        sends = [arena.peer_addrs(q, op)[0] for q in range(p)]
        try:
            _pull_reduce(st, arena, op, call.send[lo : lo + c], out, lo, call.op.ufunc, arena.pids, sends)
        except OSError as exc:
            raise transfer_error(st, exc, "read", arena) from None
        if call.op.averages:
            st.mem.scale(out, p)
    finally:
        arena.set_done(op)
    yield from meet_peers(st, arena, op, others, "done")
    if call.in_place:
        st.mem.copy(call.recv[:c], out)
        st.mem.release(out)


def _pipe_cost(m: CostModel, n: float, lay: Layout) -> float:
    """A meeting, the pipeline's fill, then one copy's time: the root's and the readers' copies overlap.

    When ranks outnumber cores they cannot overlap, and partners wait on descheduled ranks: hand-overs at the
    meetings and as the ring of chunks turns over.
    """
    chunk = min(float(ARENA_PIPE_CHUNK.get()), max(n, 1.0))
    # The root's and the readers' copies overlap chunk by chunk, each chunk still in cache for the reader.
    # (Before the compiled copy stopped using libc's memcpy, 4K-aliased copies made it lose to cma past
    # 32 MiB; measured since: 11.3 against 8.7 GB/s at 64 MiB, 11.4 against 9.0 at 256 MiB on 2 ranks.)
    footprint = lay.size * n + min(float(m.arena_stage), n)
    work = 2 * m.arena_sync_us * 1e-6 + m.copy_s(n + chunk, footprint)
    return work * m.over(lay) + m.handovers(lay, 2 + math.ceil(2 * n / max(float(m.arena_stage), 1.0)))


@register(
    "broadcast",
    "staged",
    "The root copies chunks into its arena stage ring while the others copy earlier chunks out: two copies "
    "that overlap, in compiled loops when Numba is present; single host.",
    steps="1 meeting, then flags per chunk",
    bytes="n copied in by the root, n copied out by each other rank",
    refuse=refuse_single_host,
    cost=_pipe_cost,
)
def broadcast_staged(st: Steps, call: Call) -> Schedule:
    assert call.recv is not None
    number = call_number(st)
    arena = yield from arena_ready(st)
    if arena is None or not arena.stage_bytes:
        yield from broadcast_chain(st, call)
        return
    op = yield from take_turn(st, arena, number)
    yield from broadcast_staged_rest(st, arena, op, post_call(arena, op, st.sig), call, False, 0)


def pipe_shape(arena: HostArena, nbytes: int) -> tuple[int, int, int]:
    """(chunk bytes, ring slots, chunks) of a staged broadcast of ``nbytes`` on this arena."""
    chunk = max(64, min(ARENA_PIPE_CHUNK.get(), arena.stage_bytes) // 64 * 64)
    return chunk, arena.stage_bytes // chunk, -(-nbytes // chunk)


def broadcast_staged_rest(st: Steps, arena: HostArena, op: int, mine: tuple[int, int, int, int], call: Call,
                          met: bool, j: int) -> Schedule:
    """A posted staged broadcast from where it stands: the meeting (unless ``met``), then chunks ``j``.."""
    assert call.recv is not None
    p, r, root = st.size, st.rank, call.root
    others = [q for q in range(p) if q != r]
    try:
        if not met:
            yield from meet_peers(st, arena, op, others)
            check_posts(st, arena, op, others, mine)
        buf = call.recv.view(np.uint8)
        chunk, nslots, nchunks = pipe_shape(arena, buf.nbytes)
        base, stage = arena.rounds, arena.stage(root)
        kern = compiled_loops(st)
        polls = arena_jit.polls_for(PIPE_SPIN_S) if kern is not None else 0
        while j < nchunks:
            if kern is not None:
                j, wake = kern.pipe_broadcast(arena.u64, stage, buf, r, root, p, base, chunk, nslots, j, polls)
                if wake:
                    arena.bell.wake()
                    continue
            else:
                j = _pipe_broadcast_py(arena, stage, buf, root, base, chunk, nslots, j)
            if j < nchunks:  # the partner is late: wait as a schedule, with timeouts
                if r == root:
                    yield from meet_peers(st, arena, base + j - nslots + 1, others, "consumed")
                else:
                    yield from meet_peers(st, arena, base + j + 1, [root], "staged")
        close_rounds(arena, base + nchunks)
    finally:
        arena.set_done(op)


def _pipe_broadcast_py(arena: HostArena, stage: np.ndarray, buf: np.ndarray, root: int, base: int, chunk: int,
                       nslots: int, j: int) -> int:
    """The kernel ``pipe_broadcast`` in NumPy, without spinning: the next chunk it could not do yet."""
    w, me, n = arena.words, arena.rank, buf.nbytes
    while j * chunk < n:
        lo, slot = j * chunk, ((base + j) % nslots) * chunk
        m = min(n - lo, chunk)
        if me == root:
            need = base + j - nslots + 1
            if any(w[arena.ctrl(q) + CONSUMED] < need for q in range(arena.size) if q != root):
                return j
            stage[slot : slot + m] = buf[lo : lo + m]
            arena.set_counter("staged", base + j + 1)
        else:
            if w[arena.ctrl(root) + STAGED] < base + j + 1:
                return j
            buf[lo : lo + m] = stage[slot : slot + m]
            arena.set_counter("consumed", base + j + 1)
        j += 1
    return j
