"""Single-host algorithms on the host arena: one-shot through shared slots, and direct reads by cross-memory attach.

They meet through flags instead of messages. ``oneshot`` copies each rank's vector into its slot once and
lets every rank reduce all slots; the ``cma`` algorithms read peers' buffers in place with one kernel copy
(process_vm_readv), so a byte crosses memory once per hop and nobody waits for a neighbour mid-call.
Each rank writes only its own memory. Where the arena cannot be set up, or the kernel refuses cross-memory
attach, every rank learns it at set-up and runs the named stream algorithm instead.
"""

from __future__ import annotations

import math

import errno
import logging
import os
import time
from typing import Any, Callable, Generator, Optional

import numpy as np

from ..config import SHM_DIR, bool_param, size_param
from ..errors import MismatchError, PeerFailureError
from ..p2p import Sig
from ..transport.arena import ARENA_STAGE, CONSUMED, DONE, POST, REDUCED, STAGED, ArenaUnavailable, HostArena, fold_seq, slot_bytes_for
from ..transport.shm import SHM_DISABLE
from . import arena_jit
from .base import Call, Layout, Schedule, Steps, even_counts, offsets
from .chain import broadcast_chain
from .cost import CostModel
from .direct import barrier_dissemination
from .halving_doubling import allreduce_doubling
from .registry import register
from .ring import allreduce_ring, reduce_scatter_ring_algo

log = logging.getLogger("pycoll")

ARENA_DISABLE = bool_param("PYCOLL_ARENA_DISABLE", False, "Set to 1 to turn off the single-host arena algorithms (oneshot, cma).")
ARENA_CHUNK = size_param(
    "PYCOLL_ARENA_CHUNK", 256 << 10, "Bytes a cma reduction pulls from a peer per step: small enough to stay in cache."
)
ARENA_PIPE_CHUNK = size_param(
    "PYCOLL_ARENA_PIPE_CHUNK", 64 << 10, "Bytes per step (per block) of the staged algorithms: a chunk is copied in while the last one is copied out."
)

_LIVENESS_S = 0.25
_PIPE_SPIN_S = 200e-6  # how long a pipelined copy spins for its partner before waiting as a schedule


class ArenaState:
    """A communicator's arena: set up by its first arena call (on every rank alike), then reused."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.arena: Optional[HostArena] = None
        self.status = "new"  # new -> setting up -> ready | failed
        self.ops = 0  # arena calls started on this rank, numbered in call order (the same on every rank)
        self.last: tuple[int, int] = (0, 0)  # (call number, arena number) of the latest arena call
        self.reason = ""
        self.cma_reason: Optional[str] = None
        # the communicator's arena_jit.Gate: the compiled loops run once it opened (None: whenever Numba loads)
        self.gate: Optional[arena_jit.Gate] = None

    def give_back(self, seq: int) -> None:
        """Call ``seq`` took an arena number, but a peer rejected its arguments and took none: free the number,
        so the next call is numbered alike everywhere. Only the latest number can go back, and only before
        any round ran (the call was still waiting for the peer's post)."""
        number = self.last[1]
        if self.last[0] != seq or self.ops != number or number <= 0:
            return
        self.ops = number - 1
        self.last = (0, 0)
        arena = self.arena
        if arena is None:
            return
        arena.ops = min(arena.ops, number - 1)
        if arena.finished == number:
            arena.finished = number - 1
        w, me = arena.words, arena.ctrl(arena.rank)
        if w[me + DONE] == number:
            w[me + DONE] = number - 1
        w[arena.line(arena.rank, number) + POST] = 0  # withdraw the post: the next call posts this number afresh

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
            self.arena = None


_SHM_DIRS: dict[str, bool] = {}  # whether each shared-memory directory asked about exists (checked once)


def arena_enabled() -> bool:
    if ARENA_DISABLE.get() or SHM_DISABLE.get():
        return False
    where = SHM_DIR.get()
    found = _SHM_DIRS.get(where)
    if found is None:
        found = _SHM_DIRS[where] = os.path.isdir(where)
    return found


# ---- waiting on flags ----------------------------------------------------------------------------


class _Peer:
    __slots__ = ("peer", "done", "error")

    def __init__(self, peer: int) -> None:
        self.peer, self.done, self.error = peer, False, None


class ArenaWait:
    """A waitable the engine polls like a request: done once every rank in ``ranks`` reached ``what`` for ``op``."""

    __slots__ = ("st", "arena", "what", "op", "ranks", "error", "peer", "bell", "_done", "_next_check")

    def __init__(self, st: Steps, arena: HostArena, what: str, op: int, ranks: list[int]) -> None:
        self.st, self.arena, self.what, self.op, self.ranks = st, arena, what, op, ranks
        self.error: Optional[Exception] = None
        self.peer = -1
        self.bell = arena.bell
        self._done = False
        self._next_check = time.monotonic() + _LIVENESS_S

    @property
    def done(self) -> bool:
        if self._done:
            return True
        left = self.arena.waiting_for(self.what, self.op, self.ranks)
        if self.what == "post" and len(left) < len(self.ranks):  # a post of another call is not this one's
            stale = self.arena.posted_by_others(self.op, [r for r in self.ranks if r not in left])
            left += stale
        if not left:
            self._done = True
            return True
        self.ranks = left
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + _LIVENESS_S
            self._check(left)
        return self._done

    def _check(self, left: list[int]) -> None:
        """A waited-for rank that died, or that sent a stream message for this call (it chose differently)."""
        st = self.st
        dead = self.arena.dead(left) or [r for r in left if st.world_rank(r) in st.engine.dead_peers()]
        if dead:
            self.error = st.owner.error(PeerFailureError, f"rank {dead[0]} exited during the call", [st.world_rank(r) for r in dead])
            self._done = True
            return
        stray = st.stray_message()
        if stray is not None:
            src, sig = stray
            self.error = st.owner.error(
                MismatchError,
                f"rank {st.owner.to_comm(src)} called {st.owner.describe(sig)}, this rank called {st.owner.describe(st.sig)}",
                [src],
            )
            self._done = True

    @property
    def requests(self) -> list[_Peer]:
        """One pending item per rank still waited for (named in timeout errors)."""
        return [_Peer(self.st.world_rank(r)) for r in self.arena.waiting_for(self.what, self.op, self.ranks)]


def _describe_words(st: Steps, words: tuple[int, int, int, int]) -> str:
    kind, root, count, vhash = words
    return st.owner.describe(Sig(kind & 0xFF, (kind >> 8) & 0xFF, (kind >> 16) & 0xFF, root, count, vhash))


# ---- set-up --------------------------------------------------------------------------------------


def _flag(value: int) -> np.ndarray:
    return np.array([value], np.int64)


def _setup(st: Steps, state: ArenaState) -> Schedule:
    """Rank 0 creates the segment, the rest map it, rank 0 unlinks it; then all agree on cross-memory attach."""
    p, r = st.size, st.rank
    others = [q for q in range(p) if q != r]
    arena: Optional[HostArena] = None
    try:
        if r == 0:
            try:
                arena = HostArena(state.path, 0, p, slot_bytes_for(p), create=True, stage_bytes=ARENA_STAGE.get())
                ok = 1
            except ArenaUnavailable as exc:
                state.reason, ok = str(exc), 0
            yield tuple(st.send(q, _flag(ok)) for q in others)
            acks = [_flag(0) for _ in others]
            yield tuple(st.recv(q, a) for q, a in zip(others, acks))
            if arena is not None:
                arena.unlink()  # every rank has mapped it or given up: the name can go
            attached = ok and all(int(a[0]) for a in acks)
            yield tuple(st.send(q, _flag(int(attached))) for q in others)
            if attached:
                assert arena is not None
                state.cma_reason = arena.probe_peers()
                votes = [_flag(0) for _ in others]
                yield tuple(st.recv(q, v) for q, v in zip(others, votes))
                cma = state.cma_reason is None and all(int(v[0]) for v in votes)
                yield tuple(st.send(q, _flag(int(cma))) for q in others)
        else:
            created = _flag(0)
            yield (st.recv(0, created),)
            ok = 0
            if created[0]:
                try:
                    arena = HostArena(state.path, r, p, slot_bytes_for(p), create=False, stage_bytes=ARENA_STAGE.get())
                    ok = 1
                except ArenaUnavailable as exc:
                    state.reason = str(exc)
            yield (st.send(0, _flag(ok)),)
            go = _flag(0)
            yield (st.recv(0, go),)
            attached = int(go[0])
            if attached:
                assert arena is not None
                state.cma_reason = arena.probe_peers()
                yield (st.send(0, _flag(int(state.cma_reason is None))),)
                final = _flag(0)
                yield (st.recv(0, final),)
                cma = bool(final[0])
        if attached:
            assert arena is not None
            arena.cma_ok = bool(cma)
            if not cma and state.cma_reason is None:
                state.cma_reason = "another rank cannot use cross-memory attach"
            state.arena, state.status = arena, "ready"
            arena = None
            log.info("arena %s ready for %d ranks (cross-memory attach: %s)", state.path, p, state.cma_reason or "yes")
        else:
            state.status = "failed"
            state.reason = state.reason or "another rank could not map the arena"
            log.info("arena unavailable (%s): single-host calls use the stream algorithms", state.reason)
    finally:
        if arena is not None:  # set-up did not finish here
            arena.close()
        if state.status in ("new", "setting up"):  # set-up failed (rank 0 may have died before unlinking)
            try:
                os.unlink(state.path)
            except OSError:
                pass


def _ready(st: Steps) -> Generator[tuple, None, Optional[HostArena]]:
    """The communicator's arena once set up (the first arena call sets it up; later ones wait for it), or None."""
    state: Optional[ArenaState] = st.arena
    if state is None:
        return None
    if state.status == "new":
        state.status = "setting up"
        yield from _setup(st, state)
    elif state.status == "setting up":
        yield (_SetUp(state),)
    return state.arena


class _SetUp:
    """Done once the communicator's arena set-up has finished (either way)."""

    __slots__ = ("state", "peer", "error")

    def __init__(self, state: ArenaState) -> None:
        self.state, self.peer, self.error = state, -1, None

    @property
    def done(self) -> bool:
        return self.state.status not in ("new", "setting up")


def _number(st: Steps) -> int:
    """This call's arena operation number, taken when the call starts, so calls are numbered in call order."""
    state: Optional[ArenaState] = st.arena
    if state is None:
        return 0
    state.ops += 1
    state.last = (st.seq, state.ops)
    return state.ops


def _begin(st: Steps, arena: HostArena, op: int) -> Generator[tuple, None, int]:
    """Wait until this rank finished its previous arena operation (they run one at a time, in call order), and,
    after one that did not wait for every peer, until the peers finished the operation two back (``lag_wait``)."""
    arena.ops = max(arena.ops, op)
    while arena.finished < op - 1:
        yield (_LocalTurn(arena, op - 1),)
    yield from lag_wait(st, arena, op)
    arena.seq = st.seq  # its posts carry this call's number
    return op


def lag_wait(st: Steps, arena: HostArena, op: int) -> Schedule:
    """If the last operation returned without waiting for every peer (``HostArena.lagging``), wait for each to
    finish operation ``op - 2``, whose parity's slots and lines ``op`` reuses. Every operation of a schedule then
    meets all peers, so the next one needs no such wait."""
    if arena.lagging:
        others = [q for q in range(st.size) if q != st.rank]
        yield from _meet(st, arena, op - 2, others, "done")
        arena.lagging = False


class _LocalTurn:
    """Done once this rank finished arena operation ``op`` (an earlier nonblocking call)."""

    __slots__ = ("arena", "op", "peer", "error")

    def __init__(self, arena: HostArena, op: int) -> None:
        self.arena, self.op, self.peer, self.error = arena, op, -1, None

    @property
    def done(self) -> bool:
        return self.arena.finished >= self.op


def _meet(st: Steps, arena: HostArena, op: int, others: list[int], what: str = "post") -> Schedule:
    w = ArenaWait(st, arena, what, op, others)
    if not w.done:
        yield (w,)
    if w.error is not None:
        raise w.error


def _check_posts(st: Steps, arena: HostArena, op: int, others: list[int], mine: tuple[int, int, int, int]) -> None:
    posted = (mine[0], mine[1], mine[2], fold_seq(mine[3], arena.seq))
    for q in others:
        theirs = arena.peer_sig(q, op)
        if theirs != posted:
            theirs = (theirs[0], theirs[1], theirs[2], fold_seq(theirs[3], arena.seq))
            raise st.owner.error(
                MismatchError,
                f"rank {q} called {_describe_words(st, theirs)}, this rank called {_describe_words(st, mine)}",
                [st.world_rank(q)],
            )


def _finish(st: Steps, arena: HostArena, op: int, others: list[int], wait: bool = True) -> Schedule:
    """Mark this rank done; with ``wait``, stay until every peer is done too (they read this rank's memory)."""
    arena.set_done(op)
    if wait:
        yield from _meet(st, arena, op, others, "done")


def _addr(arr: Optional[np.ndarray]) -> int:
    return int(arr.ctypes.data) if arr is not None and arr.nbytes else 0


# ---- refusal and cost ----------------------------------------------------------------------------


def _refuse_single_host(call: Call, lay: Layout) -> Optional[str]:
    if lay.size < 2:
        return "one rank needs no arena"
    if lay.hosts != 1:
        return "the ranks are on more than one host"
    if not arena_enabled():
        return "the arena is turned off (PYCOLL_ARENA_DISABLE, PYCOLL_SHM_DISABLE) or there is no shared-memory directory"
    return None


def _refuse_oneshot(call: Call, lay: Layout) -> Optional[str]:
    slot = slot_bytes_for(lay.size)
    if call.size_bytes > slot:
        return f"{call.size_bytes} bytes do not fit a {slot}-byte arena slot"
    return _refuse_single_host(call, lay)


def _oneshot_cost(m: CostModel, n: float, lay: Layout) -> float:
    p = lay.size
    footprint = 3 * p * n  # input, result and slot of every rank
    work = m.arena_sync_us * 1e-6 + m.copy_s(n, footprint) + m.reduce_s((p - 1) * n, footprint)
    return work * m.over(lay) + m.handovers(lay, 1)


def _cma_cost(m: CostModel, n: float, lay: Layout, syncs: int, *, pulled: float = 0.0, copied: float = 0.0,
              local: float = 0.0, readers: Optional[int] = None, inline: bool = False) -> float:
    """A cma call of one rank: its meetings and chunk steps, then the slower of its own core's copying and the host's
    memory carrying what all ``readers`` ranks (default: every rank) move at once.

    ``pulled``: bytes read from peers in chunks into a scratch that stays in cache, each reduced into the result with
    one operand in cache (two of the reduction's three streams reach memory: 1.5x its rate, one copy's traffic);
    ``copied``: bytes read from peers straight into the result; ``local``: bytes this rank copies itself.
    """
    readers = lay.size if readers is None else readers
    chunks = max(1.0, pulled / m.arena_chunk)
    call = m.cma_inline_us if inline else m.cma_call_us + syncs * m.cma_sync_us
    fixed = (call + chunks * m.arena_step_us) * 1e-6
    hit = m.cached(2.0 * n * lay.size)  # every rank's input and result
    gain = lambda speedup: 1.0 - hit + hit / speedup  # noqa: E731 - time in cache / time from memory
    # In cache, a whole buffer read in one kernel copy gains cma_copy_cache_speedup; chunks pulled one system call
    # each, and their reductions, gain cma_cache_speedup.
    pull, copy, own_copy = gain(m.cma_cache_speedup), gain(m.cma_copy_cache_speedup), gain(m.cache_speedup)
    own = (copied / (m.cma_GBps * 1e9) * copy + pulled * (1 / (m.cma_GBps * 1e9) + 1 / (1.5 * m.reduce_GBps * 1e9)) * pull
           + local / (m.copy_GBps * 1e9) * own_copy)
    # in copies: a pulled byte is read once (half a copy), then reduced (a read and a write); the rest are copies
    host = readers * (1.5 * pulled * pull + copied * copy + local * own_copy) / (m.host_memory_GBps * 1e9)
    return fixed * m.over(lay) + max(own * m.over(lay), host) + m.handovers(lay, syncs)  # chunk copies wait on no one


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
    number = _number(st)
    arena = yield from _ready(st)
    if arena is None:
        yield from (_owner("allreduce") if call.reproducible else allreduce_doubling)(st, call)
        return
    op = yield from _begin(st, arena, number)
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


def post_call(arena: HostArena, op: int, sig: Sig) -> tuple[int, int, int, int]:
    """Post this rank's call signature for arena operation ``op``; returns the posted words."""
    mine = arena_jit.sig_words(sig)
    try:
        arena.post(op, mine)
    except BaseException:
        arena.set_done(op)
        raise
    return mine


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
        yield from _meet(st, arena, op, others)
        _check_posts(st, arena, op, others, mine)
        oneshot_reduce(arena, op, call)
    finally:
        arena.set_done(op)


@register(
    "barrier",
    "arena",
    "Every rank posts its call in the host arena and leaves once all have posted; one host.",
    steps="1 meeting",
    bytes="0",
    refuse=_refuse_single_host,
    cost=lambda m, n, lay: m.arena_sync_us * 1e-6 * m.over(lay),
)
def barrier_arena(st: Steps, call: Call) -> Schedule:
    number = _number(st)
    arena = yield from _ready(st)
    if arena is None:
        yield from barrier_dissemination(st, call)
        return
    op = yield from _begin(st, arena, number)
    yield from barrier_rest(st, arena, op, post_call(arena, op, st.sig))


def barrier_rest(st: Steps, arena: HostArena, op: int, mine: tuple[int, int, int, int]) -> Schedule:
    """After ``post_call``: meet the peers and compare their calls."""
    others = [q for q in range(st.size) if q != st.rank]
    try:
        yield from _meet(st, arena, op, others)
        _check_posts(st, arena, op, others, mine)
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


def _owner(coll: str) -> Callable[[Steps, Call], Schedule]:
    """The owner-fold algorithm of ``coll``: where a reproducible call falls back (pycoll.algorithms.owner registers
    after this module)."""
    from . import owner  # noqa: PLC0415

    return {"allreduce": owner.allreduce_owner, "reduce_scatter": owner.reduce_scatter_owner,
            "reduce": owner.reduce_owner}[coll]


def _cma_or_none(st: Steps) -> Generator[tuple, None, tuple[Optional[HostArena], int]]:
    number = _number(st)
    arena = yield from _ready(st)
    if arena is not None and not arena.cma_ok:  # this call takes its turn, then leaves the arena alone
        yield from _begin(st, arena, number)
        arena.set_done(number)
        return None, number
    return arena, number


def _transfer_error(st: Steps, exc: OSError, what: str, arena: Optional[HostArena] = None) -> PeerFailureError:
    """A failed cross-memory copy, naming the peers whose processes are gone (usually the cause)."""
    poll = getattr(st.engine, "poll_reports", None)  # a witness may already have named the rank that died first
    if poll is not None:
        poll()
    gone = st.engine.dead_peers()
    dead = [q for q in range(st.size) if q != st.rank and st.world_rank(q) in gone]
    if not dead and arena is not None:
        dead = arena.dead([q for q in range(st.size) if q != st.rank])
    pid = getattr(exc, "pid", None)
    if arena is not None and exc.errno == errno.ESRCH and pid in arena.pids and arena.pids.index(pid) not in dead:
        dead.append(arena.pids.index(pid))  # its memory is gone before /proc shows it exited
    if dead:
        cause = f"rank {', '.join(map(str, dead))} exited during the call (cross-memory {what}: {exc.strerror})"
    else:
        cause = f"cross-memory {what} failed ({exc.strerror}); a peer probably exited"
    return st.owner.error(PeerFailureError, cause, [st.world_rank(q) for q in dead])


@register(
    "allreduce",
    "cma",
    "Each rank reduces its 1/p block by reading peers' buffers with one kernel copy each (cross-memory attach), "
    "then reads the other reduced blocks; single host.",
    steps="3 meetings",
    bytes="2(p-1)/p · n read from peers",
    refuse=_refuse_single_host,
    cost=lambda m, n, lay: _cma_cost(m, n, lay, 3, pulled=(lay.size - 1) / lay.size * n, copied=(lay.size - 1) / lay.size * n),
    reproducible=_PULLED,
)
def allreduce_cma(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    arena, number = yield from _cma_or_none(st)
    if arena is None:
        yield from (_owner("allreduce") if call.reproducible else allreduce_ring)(st, call)
        return
    p, r = st.size, st.rank
    others = [q for q in range(p) if q != r]
    op = yield from _begin(st, arena, number)
    try:
        mine = arena_jit.sig_words(st.sig)
        arena.post(op, mine, _addr(call.send), _addr(call.recv), call.recv.nbytes)
        yield from _meet(st, arena, op, others)
        _check_posts(st, arena, op, others, mine)
        addrs = [arena.peer_addrs(q, op) for q in range(p)]
        counts = even_counts(call.recv.shape[0], p)
        displs = offsets(counts)
        lo, hi = displs[r], displs[r] + counts[r]
        try:
            _pull_reduce(st, arena, op, call.send[lo:hi], call.recv[lo:hi], lo, call.op.ufunc, arena.pids, [a[0] for a in addrs])
            if call.op.averages:
                st.mem.scale(call.recv[lo:hi], p)
            arena.set_ready(op)
            yield from _meet(st, arena, op, others, "ready")
            isz = call.dtype.itemsize
            for q in others:
                block = call.recv[displs[q] : displs[q] + counts[q]]
                arena.cma.read(arena.pids[q], block, addrs[q][1] + displs[q] * isz)
        except OSError as exc:
            raise _transfer_error(st, exc, "read", arena) from None
    finally:
        arena.set_done(op)
    yield from _meet(st, arena, op, others, "done")


@register(
    "reduce_scatter",
    "cma",
    "Each rank reduces its own block by reading it from every peer's buffer with one kernel copy (cross-memory attach); single host.",
    steps="2 meetings",
    bytes="(p-1)/p · n read from peers",
    refuse=_refuse_single_host,
    cost=lambda m, n, lay: _cma_cost(m, n, lay, 2, pulled=(lay.size - 1) / lay.size * n),
    reproducible=_PULLED,
)
def reduce_scatter_cma(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    arena, number = yield from _cma_or_none(st)
    if arena is None:
        yield from (_owner("reduce_scatter") if call.reproducible else reduce_scatter_ring_algo)(st, call)
        return
    p, r = st.size, st.rank
    others = [q for q in range(p) if q != r]
    op = yield from _begin(st, arena, number)
    displs = offsets(call.counts)
    lo, c = displs[r], call.counts[r]
    # In place the result goes to the start of the buffer, which peers still read: reduce into scratch first.
    out = st.mem.scratch(c, call.dtype) if call.in_place else call.recv[:c]
    try:
        mine = arena_jit.sig_words(st.sig)
        arena.post(op, mine, _addr(call.send), 0, call.send.nbytes)
        yield from _meet(st, arena, op, others)
        _check_posts(st, arena, op, others, mine)
        sends = [arena.peer_addrs(q, op)[0] for q in range(p)]
        try:
            _pull_reduce(st, arena, op, call.send[lo : lo + c], out, lo, call.op.ufunc, arena.pids, sends)
        except OSError as exc:
            raise _transfer_error(st, exc, "read", arena) from None
        if call.op.averages:
            st.mem.scale(out, p)
    finally:
        arena.set_done(op)
    yield from _meet(st, arena, op, others, "done")
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
    refuse=_refuse_single_host,
    cost=_pipe_cost,
)
def broadcast_staged(st: Steps, call: Call) -> Schedule:
    assert call.recv is not None
    number = _number(st)
    arena = yield from _ready(st)
    if arena is None or not arena.stage_bytes:
        yield from broadcast_chain(st, call)
        return
    op = yield from _begin(st, arena, number)
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
            yield from _meet(st, arena, op, others)
            _check_posts(st, arena, op, others, mine)
        buf = call.recv.view(np.uint8)
        chunk, nslots, nchunks = pipe_shape(arena, buf.nbytes)
        base, stage = arena.rounds, arena.stage(root)
        kern = compiled_loops(st)
        polls = arena_jit.polls_for(_PIPE_SPIN_S) if kern is not None else 0
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
                    yield from _meet(st, arena, base + j - nslots + 1, others, "consumed")
                else:
                    yield from _meet(st, arena, base + j + 1, [root], "staged")
        _close_rounds(arena, base + nchunks)
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


def compiled_loops(st: Steps) -> Any:
    """The kernel module for a pipelined call's chunk loop, or None (NumPy loops): as soon as Numba loads if the
    communicator has no gate, else once its gate opened (``PYCOLL_ARENA_JIT_AFTER`` arena calls), so that
    short jobs never pay Numba's import."""
    state: Optional[ArenaState] = st.arena
    gate = state.gate if state is not None else None
    if gate is None:
        return arena_jit.kernels() if arena_jit.unavailable() is None else None
    return gate.open()


def _close_rounds(arena: HostArena, rounds: int) -> None:
    """End a staged operation: every round counter of this rank at ``rounds``, as the next one expects."""
    arena.rounds = rounds
    for index in (STAGED, REDUCED, CONSUMED):
        arena.words[arena.ctrl(arena.rank) + index] = rounds
    arena.bell.ring()
