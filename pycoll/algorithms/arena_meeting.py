"""How the single-host algorithms meet on a communicator's host arena: its set-up (once, by the first arena call),
call numbers and turns, posting a call's signature, waiting for peers' flags with timeouts and liveness checks,
the check that every rank called the same thing, and the fallbacks where the arena cannot serve a call."""

from __future__ import annotations

import errno
import logging
import os
import time
from typing import Any, Callable, Generator, Optional

import numpy as np

from ..config import SHM_DIR, bool_param
from ..errors import MismatchError, PeerFailureError
from ..p2p_protocol import Sig
from ..transport.arena import (
    ARENA_STAGE,
    CONSUMED,
    DONE,
    POST,
    REDUCED,
    STAGED,
    ArenaUnavailable,
    HostArena,
    fold_seq,
    slot_bytes_for,
)
from ..transport.shm import SHM_DISABLE
from . import arena_jit
from .base import Call, Layout, Schedule, Steps

log = logging.getLogger("pycoll")


ARENA_DISABLE = bool_param("PYCOLL_ARENA_DISABLE", False, "Set to 1 to turn off the single-host arena algorithms (oneshot, cma).")
_LIVENESS_S = 0.25
PIPE_SPIN_S = 200e-6  # how long a pipelined copy spins for its partner before waiting as a schedule


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


def _words(*values: int) -> np.ndarray:
    """A set-up message: its words as int64."""
    return np.array(values, np.int64)


def _setup(st: Steps, state: ArenaState) -> Schedule:
    """Three messages: rank 0 creates the segment and says whether it could; the rest map it, try cross-memory
    attach to rank 0 and answer both; rank 0 unlinks it, tries attach to every rank, and tells all whether the
    arena is on and whether attach is. Attach is checked both ways between rank 0 and each rank, not between every
    pair (two messages fewer): the kernel's rules (same credentials, dumpable, ptrace scope, seccomp) that let both
    of those pass let two ranks of one job read each other, and a copy that fails later raises in its call."""
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
            yield tuple(st.send(q, _words(ok)) for q in others)
            answers = [_words(0, 0) for _ in others]  # (mapped, attach to rank 0 works)
            yield tuple(st.recv(q, a) for q, a in zip(others, answers))
            if arena is not None:
                arena.unlink()  # every rank has mapped it or given up: the name can go
            attached = int(ok and all(int(a[0]) for a in answers))
            cma = 0
            if attached:
                assert arena is not None
                state.cma_reason = arena.probe_peers(others)
                if state.cma_reason is None:
                    cma = int(all(int(a[1]) for a in answers))
            yield tuple(st.send(q, _words(attached, cma)) for q in others)
        else:
            created = _words(0)
            yield (st.recv(0, created),)
            ok = vote = 0
            if created[0]:
                try:
                    arena = HostArena(state.path, r, p, slot_bytes_for(p), create=False, stage_bytes=ARENA_STAGE.get())
                    ok = 1
                except ArenaUnavailable as exc:
                    state.reason = str(exc)
            if arena is not None:
                state.cma_reason = arena.probe_peers([0])  # rank 0 wrote its probe word when it created the segment
                vote = int(state.cma_reason is None)
            yield (st.send(0, _words(ok, vote)),)
            final = _words(0, 0)
            yield (st.recv(0, final),)
            attached, cma = int(final[0]), int(final[1])
        if attached:
            assert arena is not None
            arena.read_pids()
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
            # the call failed (a peer skipped it, or died): the next arena call sets the arena up afresh, as a rank
            # that skipped this one does
            state.status = "new"
            try:
                os.unlink(state.path)
            except OSError:
                pass


def arena_ready(st: Steps) -> Generator[tuple, None, Optional[HostArena]]:
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


def call_number(st: Steps) -> int:
    """This call's arena operation number, taken when the call starts, so calls are numbered in call order."""
    state: Optional[ArenaState] = st.arena
    if state is None:
        return 0
    state.ops += 1
    state.last = (st.seq, state.ops)
    return state.ops


def take_turn(st: Steps, arena: HostArena, op: int) -> Generator[tuple, None, int]:
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
        yield from meet_peers(st, arena, op - 2, others, "done")
        arena.lagging = False


class _LocalTurn:
    """Done once this rank finished arena operation ``op`` (an earlier nonblocking call)."""

    __slots__ = ("arena", "op", "peer", "error")

    def __init__(self, arena: HostArena, op: int) -> None:
        self.arena, self.op, self.peer, self.error = arena, op, -1, None

    @property
    def done(self) -> bool:
        return self.arena.finished >= self.op


def meet_peers(st: Steps, arena: HostArena, op: int, others: list[int], what: str = "post") -> Schedule:
    w = ArenaWait(st, arena, what, op, others)
    if not w.done:
        yield (w,)
    if w.error is not None:
        raise w.error


def check_posts(st: Steps, arena: HostArena, op: int, others: list[int], mine: tuple[int, int, int, int]) -> None:
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


def refuse_single_host(call: Call, lay: Layout) -> Optional[str]:
    if lay.size < 2:
        return "one rank needs no arena"
    if lay.hosts != 1:
        return "the ranks are on more than one host"
    if not arena_enabled():
        return "the arena is turned off (PYCOLL_ARENA_DISABLE, PYCOLL_SHM_DISABLE) or there is no shared-memory directory"
    return None


def post_call(arena: HostArena, op: int, sig: Sig) -> tuple[int, int, int, int]:
    """Post this rank's call signature for arena operation ``op``; returns the posted words."""
    mine = arena_jit.sig_words(sig)
    try:
        arena.post(op, mine)
    except BaseException:
        arena.set_done(op)
        raise
    return mine


def owner_fallback(coll: str) -> Callable[[Steps, Call], Schedule]:
    """The owner-fold algorithm of ``coll``: where a reproducible call falls back (pycoll.algorithms.owner registers
    after this module)."""
    from . import owner  # noqa: PLC0415

    return {"allreduce": owner.allreduce_owner, "reduce_scatter": owner.reduce_scatter_owner,
            "reduce": owner.reduce_owner}[coll]


def cma_or_none(st: Steps) -> Generator[tuple, None, tuple[Optional[HostArena], int]]:
    number = call_number(st)
    arena = yield from arena_ready(st)
    if arena is not None and not arena.cma_ok:  # this call takes its turn, then leaves the arena alone
        yield from take_turn(st, arena, number)
        arena.set_done(number)
        return None, number
    return arena, number


def transfer_error(st: Steps, exc: OSError, what: str, arena: Optional[HostArena] = None) -> PeerFailureError:
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


def compiled_loops(st: Steps) -> Any:
    """The kernel module for a pipelined call's chunk loop, or None (NumPy loops): as soon as Numba loads if the
    communicator has no gate, else once its gate opened (``PYCOLL_ARENA_JIT_AFTER`` arena calls), so that
    short jobs never pay Numba's import."""
    state: Optional[ArenaState] = st.arena
    gate = state.gate if state is not None else None
    if gate is None:
        return arena_jit.kernels() if arena_jit.unavailable() is None else None
    return gate.open()


def close_rounds(arena: HostArena, rounds: int) -> None:
    """End a staged operation: every round counter of this rank at ``rounds``, as the next one expects."""
    arena.rounds = rounds
    for index in (STAGED, REDUCED, CONSUMED):
        arena.words[arena.ctrl(arena.rank) + index] = rounds
    arena.bell.ring()
