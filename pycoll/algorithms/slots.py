"""Small collectives of one host through the arena slots: every rank copies its part in, meets, and reads what it needs.

One algorithm, ``slots``, serves broadcast, reduce, gather, scatter, allgather(v), reduce-scatter, alltoall, scan
and exscan below the slot size. A call is described once per plan as a small program: what this rank packs into its
slot (a table of block offsets first, where readers cannot know them), the contribution size each peer must post,
and what it then copies out of the peers' slots, or folds from them in rank order. The same program runs compiled
(one kernel call: pack, meet, unpack, finish) or, while the kernels load or when a peer is late, in NumPy after a
meeting that waits with timeouts. Slots alternate by call parity, and every call is a full meeting, so a slot is
never rewritten before all peers read it.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from ..errors import MismatchError
from ..memory import HOST
from ..p2p_protocol import Sig, counts_hash
from ..transport.arena import DEPTH, HostArena, slot_bytes_for
from . import arena_jit
from .base import Call, Layout, Schedule, Steps, offsets
from .chain import broadcast_chain, reduce_chain
from .cost import CostModel
from ..ops import ORDERED
from .direct import alltoall_pairwise, gather_linear, scatter_linear
from .ordered import reduce_ordered, reduce_scatter_ordered
from .registry import register
from .ring import allgather_ring_algo, reduce_scatter_ring_algo
from .scan import exscan_linear, scan_linear
from .arena_meeting import arena_ready, call_number, check_posts, lag_wait, meet_peers, refuse_single_host, take_turn

_REDUCING = ("reduce", "reduce_scatter", "scan", "exscan")
_TABLED = ("scatter", "alltoall")  # readers cannot know their block's place: the writer's slot starts with a table
_EMPTY_I64 = np.zeros((0, 4), np.int64)
_NO_HEAD, _NO_PACK = np.zeros(0, np.int64), np.zeros((0, 3), np.int64)


def _table_bytes(call: Call, p: int) -> int:
    return 16 * p if call.coll in _TABLED else 0


def _refuse(call: Call, lay: Layout) -> Optional[str]:
    if call.vector and call.coll in ("gather", "scatter", "alltoall"):
        return "a vector call's blocks differ by rank, and not every rank knows their sizes"
    n, p = call.size_bytes, lay.size
    need = n // max(p, 1) if call.coll == "gather" else n + _table_bytes(call, p)
    slot = slot_bytes_for(p)
    if need > slot:
        return f"{need} bytes per rank do not fit a {slot}-byte arena slot"
    return refuse_single_host(call, lay)


def _cost(m: CostModel, n: float, lay: Layout) -> float:
    p = lay.size
    footprint = 3 * p * n
    return (m.arena_sync_us * 1e-6 + 2 * m.copy_s(n, footprint)) * m.over(lay) + m.arena_handovers(lay, 1)


class Program:
    """What one rank does in a ``slots`` call, in bytes (or elements, for the folds)."""

    __slots__ = ("head", "pack", "nbytes", "expect", "unpack", "fold", "pack_from_recv", "typed", "reads", "one_sided",
                 "own")

    def __init__(self, call: Call, p: int, me: int) -> None:
        isz = call.dtype.itemsize
        coll = call.coll
        self.head = _NO_HEAD  # the empty tables are shared: a program's tables are never written after it is made
        self.pack = _NO_PACK
        self.unpack = _EMPTY_I64
        self.expect = [-1] * p  # per peer, the bytes it posts (-1: this rank reads nothing of it)
        self.fold = (0, 0, 0, 0, 0)  # (lo, hi, slot offset, recv offset, count), in elements
        self.own = False  # this rank's fold range stays out of its slot: it folds that row from its send buffer
        self.pack_from_recv = False
        self.typed = coll in _REDUCING
        nbytes = 0
        if coll == "broadcast":
            nb = call.recv.nbytes
            if me == call.root:
                self.pack, nbytes, self.pack_from_recv = np.array([[0, 0, nb]], np.int64), nb, True
            else:
                self.unpack = np.array([[call.root, 0, 0, nb]], np.int64)
                self.expect[call.root] = nb
        elif coll == "gather":
            if call.send is not None:
                nbytes = call.send.nbytes
                self.pack = np.array([[0, 0, nbytes]], np.int64)
            if me == call.root:
                rows = []
                for q, (c, d) in enumerate(zip(call.counts, call.displs)):
                    if q == me and call.in_place:
                        continue
                    rows.append([q, 0, d * isz, c * isz])
                    self.expect[q] = c * isz
                self.unpack = np.array(rows, np.int64).reshape(-1, 4)
        elif coll == "scatter":
            table = 16 * p
            if me == call.root:
                send = call.send
                self.head = np.array([[table + d * isz, c * isz] for c, d in zip(call.counts, call.displs)],
                                     np.int64).reshape(-1)
                self.pack = np.array([[0, table, send.nbytes]], np.int64)
                nbytes = table + send.nbytes
            if call.recv is not None:
                self.unpack = np.array([[call.root, -1, 0, call.recv.nbytes]], np.int64)
        elif coll == "allgather":
            me_count, me_displ = call.counts[me], call.displs[me]
            nbytes = me_count * isz
            if call.in_place:
                self.pack_from_recv = True
                self.pack = np.array([[me_displ * isz, 0, nbytes]], np.int64)
            else:
                self.pack = np.array([[0, 0, nbytes]], np.int64)
            rows = []
            for q, (c, d) in enumerate(zip(call.counts, call.displs)):
                self.expect[q] = c * isz
                if q == me and call.in_place:
                    continue
                rows.append([q, 0, d * isz, c * isz])
            self.unpack = np.array(rows, np.int64).reshape(-1, 4)
        elif coll == "alltoall":
            table, send = 16 * p, call.send
            self.head = np.array([[table + d * isz, c * isz] for c, d in zip(call.send_counts, call.send_displs)],
                                 np.int64).reshape(-1)
            self.pack = np.array([[0, table, send.nbytes]], np.int64)
            nbytes = table + send.nbytes
            self.unpack = np.array([[q, -1, d * isz, c * isz] for q, (c, d) in enumerate(zip(call.counts, call.displs))],
                                   np.int64).reshape(-1, 4)
        else:  # the folds: every rank copies its vector in; the rows it folds depend on the collective
            n = call.send.size
            nbytes = n * isz
            self.expect = [nbytes] * p
            if coll == "reduce":
                if me == call.root:
                    self.fold = (0, p, 0, 0, n)
            elif coll == "reduce_scatter":
                self.fold = (0, p, offsets(call.counts)[me], 0, call.counts[me])
            elif coll == "scan":
                self.fold = (0, me + 1, 0, 0, n)
            elif coll == "exscan":
                self.fold = (0, me, 0, 0, n)
            # a Reduce root's vector and a Reduce_scatter's own block are read by no peer (in place, the output
            # may overlap the row being folded)
            self.own = coll in ("reduce", "reduce_scatter") and self.fold[1] > self.fold[0] and not call.in_place
        self.nbytes = nbytes  # the bytes this rank's contribution takes in its slot
        # the peers whose slots this rank reads: the only ones it waits for (a Bcast root, a Gather or Reduce leaf
        # and Scan's rank 0 wait for nobody), and whose calls and sizes it checks
        lo, hi = self.fold[0], self.fold[1]
        peers = set(self.unpack[:, 0].tolist()) | set(range(lo, hi))
        peers.discard(me)
        self.reads = [0] * p
        for q in peers:
            self.reads[q] = 1
        self.one_sided = len(peers) < p - 1  # some peer may still be reading this call's slots when it returns


def _bytes(a: Optional[np.ndarray]) -> np.ndarray:
    return a.view(np.uint8) if a is not None and a.size else _NO_BYTES


def _meta(prog: Program, rank: int, size: int, bases: np.ndarray, code: int, words: tuple) -> np.ndarray:
    """The program as the kernels read it (``_arena_kernels.M_*``): scalars, then bases, expect, reads, head, pack,
    unpack."""
    lo, hi, s_off, d_off, n = prog.fold
    vhash = np.array([words[3]], np.uint64).view(np.int64)[0]  # the unfolded word, its bits as an int64
    head = [rank, 0, prog.nbytes, 0, code, lo, hi, s_off, d_off, n, size, prog.head.size, prog.pack.shape[0],
            prog.unpack.shape[0], 0, vhash, 0, 0, int(prog.own)]
    assert len(head) == _M_BASES
    scalars = np.array(head + bases.tolist() + prog.expect + prog.reads, np.int64)
    if not (prog.head.size or prog.pack.size or prog.unpack.size):
        return scalars
    return np.concatenate([scalars, prog.head, prog.pack.reshape(-1), prog.unpack.reshape(-1)], dtype=np.int64)


def _parities(meta: np.ndarray, bases: np.ndarray) -> list[np.ndarray]:
    """``meta`` (made with the first parity's bases) for every slot parity: rows of one array, each with its parity's
    post-line bases (``bases``: one row per parity)."""
    every = np.empty((DEPTH, meta.size), np.int64)
    every[:] = meta
    every[:, _M_BASES:_M_BASES + bases.shape[1]] = bases
    return list(every)


class Prepared:
    """One plan's kernel arguments on one arena: its program (``meta``, one per slot parity), signature words, slots,
    and the kernel for its dtype (``kernel``: checks the user buffers; ``raw``: trusts them)."""

    __slots__ = ("arena", "prog", "words", "sig", "metas", "slots", "ok", "polls", "dtype", "as_bytes", "empty",
                 "kernel", "raw")

    def __init__(self, arena: HostArena, call: Call, sig: Sig, rank: int, kern: Any = None,
                 signed: Optional[tuple[tuple, np.ndarray]] = None) -> None:
        p = arena.size
        self.arena = arena
        self.prog = Program(call, p, rank)
        # ``signed``: the signature's words and array where the caller has them (its runner made them for the plan)
        self.words, self.sig = signed if signed is not None else (w := arena_jit.sig_words(sig), arena_jit.sig_array(w))
        code = call.op.code if call.op is not None else 0
        bases = arena_jit.every_line_base(arena)
        self.metas = _parities(_meta(self.prog, rank, p, bases[0], code, self.words), bases)
        self.polls = -1  # the spin the metas carry (set at the first run)
        # a read-only input would need a signature of its own (compiled inside the call): those run in NumPy
        writable = call.send is None or call.send.flags.writeable
        self.ok = (self.prog.nbytes <= arena.slot_bytes and writable
                   and (not self.prog.typed or arena_jit.covers(call.op, call.dtype)))
        self.slots = arena_jit.slot_array(arena, call.dtype if self.prog.typed else np.dtype(np.uint8))
        # the kernels take the buffers in their own dtype where compiled for it, else (moves only) as bytes
        self.as_bytes = call.dtype not in arena_jit.DTYPES
        self.dtype = np.dtype(np.uint8) if self.as_bytes else call.dtype
        self.empty = np.zeros(0, self.dtype)  # stands for an absent buffer
        name = "slots_reduce" if self.prog.typed else "slots_move"
        self.kernel = self.raw = None
        if kern is not None and self.ok:
            self.kernel = arena_jit.pick(kern, name, self.dtype, checked=True)
            self.raw = arena_jit.pick(kern, name, self.dtype)

    def set_spin(self, gate: Any) -> None:
        """The gate's spin for every later call's kernel (polls, then yields; in meta, for every slot index)."""
        self.polls = gate.polls
        for m in self.metas:
            m[_M_POLLS], m[_M_YIELDS], m[_M_YIELD_FN] = gate.polls, gate.yields, gate.yield_fn


class Span:
    """A ``Prepared`` for every length of a resizable plan's family (``plans.Plan.scaled_call``) within one size span:
    the plan's program with the entries that grow with the call (bytes posted, the fold's count, the rows' sizes and
    offsets) patched for each call's scale, and the signature's count with them. The entries are found by making the
    program at twice and three times the plan's scale: each must move by the same step (linear in the scale), else
    there is no span. A scale at which an entry or the count would not be whole (an Alltoall's length that does not
    split into blocks) is declined: the checks take that call."""

    __slots__ = ("prep", "scale", "at", "idx", "base", "step", "count", "fits", "blocks", "kept", "whole", "unit",
                 "posted_at")

    def __init__(self, prep: Prepared, idx: np.ndarray, base: np.ndarray, step: np.ndarray, scale: int, count: int,
                 blocks: Optional[list[int]]) -> None:
        self.prep, self.idx, self.base, self.scale, self.count = prep, idx, base, scale, count
        self.blocks = blocks  # the call's block counts where its signature carries their hash (else None)
        self.at, self.fits = scale, prep.ok
        # every entry moves by step * (at - scale) / scale: whole where (at - scale) is a multiple of ``whole``; the
        # entries then move by (step / g) times (at - scale) * g / scale, g the steps' greatest common divisor
        g = math.gcd(*(int(v) for v in step)) if step.size else 1
        self.whole, self.unit, self.step = scale // math.gcd(scale, g), g, step // g
        nbytes = np.flatnonzero(idx == _M_NBYTES)  # where the bytes posted move with the scale
        self.posted_at = int(nbytes[0]) if nbytes.size else -1
        # scale -> (the moving entries' values, signature count, counts' hash and its signed word, fits), or None
        # (declined): a length that comes back (most do) is written in without working it out again
        self.kept: dict[int, Optional[tuple[np.ndarray, int, int, Any, bool]]] = {}

    @classmethod
    def of(cls, prep: Prepared, plan: Any, call: Call, scale: int, rank: int) -> Optional["Span"]:
        """The span program of ``prep``, the plan's for ``call`` at ``scale``; None where its program is not linear in
        the scale."""
        hashed = bool(plan.sig.vhash)  # the counts' hash: patched apart, it is not linear in the scale
        if call.vector or not prep.ok or (hashed and plan.sig.vhash != counts_hash(call.counts)):
            return None
        size, code = prep.arena.size, call.op.code if call.op is not None else 0
        bases = arena_jit.every_line_base(prep.arena)[0]
        rows, progs = [], []
        for at in (scale, 2 * scale, 3 * scale):
            grown = [None if a is None else np.empty(a.size // scale * at, a.dtype) for a in (call.send, call.recv)]
            probe = plan.scaled_call(grown[0], grown[1], at, scale)
            if probe is None:
                return None
            progs.append(Program(probe[0], size, rank))
            rows.append(_meta(progs[-1], rank, size, bases, code, prep.words))
        if len({r.size for r in rows}) != 1 or len({(p.own, p.one_sided, tuple(p.reads)) for p in progs}) != 1:
            return None
        if hashed:
            for r in rows:
                r[_M_VHASH] = 0
        step = rows[1] - rows[0]  # per ``scale`` more
        if not np.array_equal(rows[2] - rows[1], step):
            return None
        idx = np.flatnonzero(step)
        clone = object.__new__(Prepared)
        for name in Prepared.__slots__:
            setattr(clone, name, getattr(prep, name))
        clone.metas = [m.copy() for m in prep.metas]  # its own program and signature, patched call by call
        clone.sig = prep.sig.copy()
        return cls(clone, idx, rows[0][idx], step[idx], scale, plan.sig.count, list(call.counts) if hashed else None)

    def scaled(self, at: int) -> bool:
        """Patch the program for a call at scale ``at``; whether that call's entries are whole and its contribution
        fits the slot."""
        if at != self.at:
            self.at = at
            kept = self.kept.get(at, False)
            if kept is False:
                kept = self._entries(at)
                if len(self.kept) >= _KEPT_SCALES:
                    self.kept.clear()
                self.kept[at] = kept
            if kept is None:
                self.fits = False
                return False
            values, count, vhash, signed, self.fits = kept
            prep, idx = self.prep, self.idx
            for m in prep.metas:
                m[idx] = values
                if signed is not None:
                    m[_M_VHASH] = signed
            prep.sig[2] = count
            if signed is not None:
                prep.sig[3] = prep.sig[4] = vhash
            w = prep.words
            prep.words = (w[0], w[1], count, vhash)
        return self.fits

    def _entries(self, at: int) -> Optional[tuple[np.ndarray, int, int, Any, bool]]:
        """The moving entries' values, the signature's count, the counts' hash (with its word as the program holds
        it, where the signature carries one) and whether the contribution fits the slot, at scale ``at``; None where
        an entry or the count would not be whole there."""
        count, left = divmod(self.count * at, self.scale)
        if left or (at - self.scale) % self.whole:
            return None
        values, prep = self.base + self.step * ((at - self.scale) * self.unit // self.scale), self.prep
        vhash, signed = prep.words[3], None
        if self.blocks is not None:
            vhash = counts_hash([c * at // self.scale for c in self.blocks])
            signed = np.array([vhash], np.uint64).view(np.int64)[0]
        posted = int(values[self.posted_at] if self.posted_at >= 0 else prep.metas[0][_M_NBYTES])
        return values, count, vhash, signed, posted <= prep.arena.slot_bytes


_KEPT_SCALES = 32  # the scales a span keeps programs for (past it they are made again)
_M_NBYTES, _M_POLLS, _M_VHASH, _M_YIELDS, _M_YIELD_FN = 2, 3, 15, 16, 17  # as _arena_kernels.M_NBYTES, M_POLLS, ...
_M_BASES = 19  # where the post-line bases start, after the scalars


def run_kernel(kern: Any, st: Prepared, arena: HostArena, opno: int, send: Optional[np.ndarray], recv: Optional[np.ndarray],
               gate: Any) -> int:
    """One whole ``slots`` call as a kernel call (it posts the call number itself); the status as
    ``arena_jit.finished`` reads it."""
    if st.polls != gate.polls:
        st.set_spin(gate)
    fn = st.kernel if st.kernel is not None else getattr(kern, "slots_reduce" if st.prog.typed else "slots_move")
    if st.prog.pack_from_recv:
        send = recv
    if st.as_bytes:
        send, recv = _bytes(send), _bytes(recv)
    return fn(arena.u64, st.slots, send if send is not None else st.empty, recv if recv is not None else st.empty,
              st.metas[opno % DEPTH], st.sig, opno, arena.seq, arena.lagging)


_NO_BYTES = np.zeros(0, np.uint8)


# ---- the NumPy twin (first calls while the kernels load, late peers) ----------------------------------------------

def _pack_py(arena: HostArena, op: int, call: Call, prog: Program) -> None:
    slot = arena.slot(arena.rank, op)
    if prog.typed:
        src = _bytes(call.send)
        if prog.own:  # as the kernel: the rest of the vector
            isz, s_off, n = call.dtype.itemsize, prog.fold[2], prog.fold[4]
            HOST.copy(slot[:s_off * isz], src[:s_off * isz])
            HOST.copy(slot[(s_off + n) * isz:src.size], src[(s_off + n) * isz:])
        else:
            HOST.copy(slot[:src.size], src)
        return
    if prog.head.size:
        slot[: prog.head.size * 8] = prog.head.view(np.uint8)
    src = _bytes(call.recv if prog.pack_from_recv else call.send)
    for s_off, d_off, n in prog.pack:
        HOST.copy(slot[d_off:d_off + n], src[s_off:s_off + n])


def _table(arena: HostArena, op: int, rank: int, entry: int) -> tuple[int, int]:
    words = arena.slot(rank, op)[16 * entry:16 * entry + 16].view(np.int64)
    return int(words[0]), int(words[1])


def _unpack_py(st: Steps, arena: HostArena, op: int, call: Call, prog: Program) -> None:
    me = arena.rank
    if prog.typed:
        lo, hi, s_off, d_off, n = prog.fold
        if hi <= lo:
            return
        isz = call.dtype.itemsize
        views = [call.send[s_off:s_off + n] if prog.own and q == me else
                 arena.slot(q, op)[s_off * isz:(s_off + n) * isz].view(call.dtype) for q in range(lo, hi)]
        ufunc, acc = call.op.ufunc, views[0]
        for v in views[1:]:  # a new result each step: NumPy's complex product differs in its last bits with out= aliased
            acc = ufunc(acc, v)
        if call.op.averages:
            acc = np.divide(acc, acc.dtype.type(hi - lo))
        call.recv[d_off:d_off + n] = acc
        return
    recv = _bytes(call.recv)
    for q, s_off, d_off, n in prog.unpack:
        if s_off < 0:
            s_off, got = _table(arena, op, int(q), me)
            if got != n:
                raise st.owner.error(MismatchError, f"rank {q} has a {got}-byte block for this rank, which expects {n}",
                                     [st.world_rank(int(q))])
        HOST.copy(recv[d_off:d_off + n], arena.slot(int(q), op)[s_off:s_off + n])


def _check_sizes(st: Steps, arena: HostArena, op: int, prog: Program) -> None:
    for q, want in enumerate(prog.expect):
        if want >= 0:
            got = arena.peer_addrs(q, op)[2]
            if got != want:
                raise st.owner.error(MismatchError, f"rank {q} passed {got} bytes, this rank expects {int(want)}",
                                     [st.world_rank(q)])


def slots_rest(st: Steps, arena: HostArena, op: int, call: Call, mine: tuple[int, int, int, int]) -> Schedule:
    """After the post: meet the peers (with timeouts), compare their calls and sizes, copy or fold, finish."""
    others = [q for q in range(st.size) if q != st.rank]
    prog = Program(call, st.size, st.rank)
    try:
        yield from meet_peers(st, arena, op, others)
        check_posts(st, arena, op, others, mine)
        _check_sizes(st, arena, op, prog)
        _unpack_py(st, arena, op, call, prog)
    finally:
        arena.set_done(op)


_FALLBACK = {
    "broadcast": broadcast_chain, "reduce": reduce_chain, "gather": gather_linear, "scatter": scatter_linear,
    "allgather": allgather_ring_algo, "reduce_scatter": reduce_scatter_ring_algo, "alltoall": alltoall_pairwise,
    "scan": scan_linear, "exscan": exscan_linear,
}
# a non-commutative op, or a reproducible call, keeps the rank-order left fold in the fallback too
_ORDERED_FALLBACK = {**_FALLBACK, "reduce": reduce_ordered, "reduce_scatter": reduce_scatter_ordered}


def _slots(st: Steps, call: Call) -> Schedule:
    number = call_number(st)
    arena = yield from arena_ready(st)
    if arena is None:
        ordered = call.reproducible or (call.op is not None and call.op.order == ORDERED)
        yield from (_ORDERED_FALLBACK if ordered else _FALLBACK)[call.coll](st, call)
        return
    op = yield from take_turn(st, arena, number)
    yield from _slots_from_pack(st, arena, op, call)


def _slots_from_pack(st: Steps, arena: HostArena, op: int, call: Call) -> Schedule:
    """Pack and post in NumPy, then ``slots_rest``."""
    prog = Program(call, st.size, st.rank)
    mine = arena_jit.sig_words(st.sig)
    try:
        _pack_py(arena, op, call, prog)
        arena.post(op, mine, nbytes=prog.nbytes)
    except BaseException:
        arena.set_done(op)
        raise
    yield from slots_rest(st, arena, op, call, mine)


def slots_unposted(st: Steps, arena: HostArena, op: int, call: Call) -> Schedule:
    """An inline call whose kernel found the peers not done with the call two back (UNPOSTED): wait for them (with
    timeouts), then the whole call in NumPy."""
    yield from lag_wait(st, arena, op)
    yield from _slots_from_pack(st, arena, op, call)


def _register(coll: str, what: str) -> Any:
    def run(st: Steps, call: Call) -> Schedule:
        return _slots(st, call)

    run.__name__ = run.__qualname__ = f"{coll}_slots"
    register(coll, "slots", f"Each rank copies {what} into its arena slot, meets the others once, then reads what it needs "
             "from their slots. Small messages on one host.", steps="1 meeting", bytes="n copied in, n copied out",
             refuse=_refuse, cost=_cost, ordered=coll in _REDUCING,
             reproducible="each rank folds the slots it reads in rank order" if coll in _REDUCING else "")(run)
    return run


RUNS = tuple(_register(coll, what) for coll, what in (
    ("broadcast", "the root's buffer (the root only)"),
    ("reduce", "its vector"),
    ("gather", "its block"),
    ("scatter", "its blocks behind a table of their places (the root only)"),
    ("allgather", "its block"),
    ("reduce_scatter", "its vector"),
    ("alltoall", "its blocks behind a table of their places"),
    ("scan", "its vector"),
    ("exscan", "its vector"),
))
