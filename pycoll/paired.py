"""Small blocking collectives of a two-rank communicator whose ranks are on different hosts: each call as its
one message each way straight through the pair's socket, without a schedule (the executor's fast path there).

Every form here sends what the algorithm the cost model chose for the call sends, with the same context, tag and
signature, so a peer that runs the same call through the schedule (it had a receive posted, say) still matches
it. Where a message cannot move at once, the rest of the call waits through the engine as a schedule's would.
"""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from .algorithms import cost as cost_model
from .algorithms.base import CHUNK_SIZE, LANES, chunk_bytes, even_counts, num_chunks, offsets, split
from .algorithms.check import CHECK_CALLS
from .algorithms.registry import ALGO, REPRODUCIBLE
from .config import _ENV_BYTES
from .errors import PycollError
from .memory import HOST
from .p2p_protocol import counts_hash, frame_head, payload_bytes
from .plans import one_block_size

if TYPE_CHECKING:  # pragma: no cover
    from .executor import Executor
    from .plans import Plan

_EMPTY = np.zeros(0, np.uint8)

# (collective, algorithm) -> its form here; each form handles the algorithm's two-rank case only
# the forms that take any size where the pair exchanges frames in C whatever their size: the Bcast chain's and the
# pairwise Alltoall's one frame, and the others' chunks one call each (``_swap_in_chunks``), as their schedules cut them
_ANY_SIZE = frozenset({("broadcast", "chain"), ("reduce", "chain"), ("allreduce", "ring"), ("allgather", "doubling"),
                       ("reduce_scatter", "ring"), ("alltoall", "pairwise")})
# the forms whose every call takes its buffers' lengths as they come (no count bound when the form is made); the
# block collectives' where every rank's block has one size (``plans.one_block_size``: its views' lengths give the block)
_SPANNED = frozenset({("broadcast", "chain"), ("reduce", "chain"), ("allreduce", "ring"), ("allreduce", "doubling"),
                      ("allgather", "doubling"), ("alltoall", "pairwise"), ("reduce_scatter", "ring")})
# the blocked forms' signature count: the whole vector (so the span's count must split into the two ranks' blocks)
_COUNTS_TOTAL = frozenset({"allgather", "reduce_scatter"})
_FORMS: dict[tuple[str, str], Callable[["_Pair", Any], Optional[Callable[[int, Any, Any], None]]]] = {}


def _form(coll: str, algo: str):
    def register(make):
        _FORMS[(coll, algo)] = make
        return make
    return register


class _Pair:
    """What every call of one plan shares: the peer, the call's context and signature, the engine's verbs."""

    def __init__(self, x: "Executor", plan: "Plan") -> None:
        c = x.comm
        self.comm, self.engine, self.label, self.sig = c, x.engine, plan.label, plan.sig
        self.template = plan.template
        self.me, self.peer = c._rank, 1 - c._rank
        self.world_peer = c._world[self.peer]
        self.ctx = c._ctx | 1
        # one message each way, taken whole from the socket: within a chunk and the receiver's staging area
        self.chunk = chunk = chunk_bytes()  # the fast path watches PYCOLL_CHUNK_SIZE (``choice_holds``)
        self.limit = min(chunk, self.engine.frame_room(self.world_peer))
        # the largest message a call sends as one (the algorithm's chunk): past ``limit``, one exchange in C straight
        # into place (``Engine.frame_exchanger``) where it is built
        self.most = chunk if self.engine.exchanges_blocks_with(self.world_peer) else self.limit
        self._heads: dict[int, bytes] = {}  # payload bytes -> the frame header, tag 0 (of the call's count now)
        # count -> (the call's signature at that count, its frames' headers)
        self._counted: dict[int, tuple[Any, dict[int, bytes]]] = {plan.sig.count: (plan.sig, self._heads)}
        # (count, out bytes, into bytes) -> its exchanger, or None
        self._exchangers: dict[tuple[int, int, int], Any] = {}
        self.swap = self._swapper()

    def head(self, nbytes: int) -> bytes:
        """The header of this plan's frames of ``nbytes`` with tag 0 (each call puts its own tag in, in C)."""
        head = self._heads.get(nbytes)
        if head is None:
            head = self._heads[nbytes] = frame_head(self.ctx, 0, nbytes, self.sig)
        return head

    def count(self, count: int) -> None:
        """The call's element count from now on, as its frames' headers and its errors name it: a plan's own calls
        have its count; a call of another length in its size span (``fast_path``'s ``spanning``) has its own (a
        Reduce_scatter_block's signature also carries its blocks' hash: two blocks of half the count)."""
        if count != self.sig.count:
            known = self._counted.get(count)
            if known is None:
                if len(self._counted) > 64:
                    self._counted.clear()
                vhash = counts_hash([count // 2] * 2) if self.sig.vhash else 0
                known = self._counted[count] = (self.sig._replace(count=count, vhash=vhash), {})
            self.sig, self._heads = known

    def _swapper(self) -> Callable[[int, Optional[np.ndarray], Optional[np.ndarray]], None]:
        """``swap(seq, out, into[, local])``: send ``out`` to the peer and receive ``into`` from it (contiguous
        arrays; None: no message that way), as the call numbered ``seq``; ``into`` is written only once its message is
        whole. ``local`` (source, target): a copy of the rank's own block into its result, made while the link
        carries a large exchange, or after a small one."""
        # the pair keeps its swap: bound methods in it would tie the two in a cycle, which only the cyclic collector
        # frees once a plan is dropped (its tens of objects in every new shape's plan)
        me = weakref.proxy(self)
        ctx, limit = self.ctx, self.limit
        frames = self.engine.frame_swapper(self.world_peer)

        def swap(seq: int, out: Optional[np.ndarray], into: Optional[np.ndarray],
                 local: Optional[tuple[np.ndarray, np.ndarray]] = None) -> None:
            if (out is not None and out.nbytes > limit) or (into is not None and into.nbytes > limit):
                me._swap_large(seq, out, into, local)
                return
            heads = me._heads
            head_out = None if out is None else heads.get(out.nbytes) or me.head(out.nbytes)
            head_in = None if into is None else heads.get(into.nbytes) or me.head(into.nbytes)
            sent, got = frames(ctx, seq * LANES, head_out, out, head_in, into, limit)
            if not (sent and got):
                me._through_engine(seq, None if sent else payload_bytes(out), None if got else payload_bytes(into))  # type: ignore[arg-type]
            if local is not None:
                HOST.copy(local[1], local[0])

        return swap

    def _swap_large(self, seq: int, out: Optional[np.ndarray], into: Optional[np.ndarray],
                    local: Optional[tuple[np.ndarray, np.ndarray]] = None) -> None:
        """``swap`` of a message past the socket's staging area (up to ``most``): both ways in one call into C that
        reads the incoming frame straight into place (an exchanger made once per pair of sizes) and makes the
        ``local`` copy (source, target) while the sockets wait; a message one way only, or an engine that is not
        quiet, through the engine's exchange, the copy made here. What C leaves, the engine finishes."""
        engine, tag = self.engine, seq * LANES
        reqs = None
        if out is not None and into is not None:
            key = (self.sig.count, out.nbytes, into.nbytes)
            if key not in self._exchangers:
                if len(self._exchangers) > 64:
                    self._exchangers.clear()
                self._exchangers[key] = engine.frame_exchanger([(self.world_peer, 0, key[1], 0, key[2])], self.ctx,
                                                               self.sig)
            run = self._exchangers[key]
            if run is not None:
                reqs = run(tag, out, into, lambda: self._owner(seq), local)
                if reqs is not None:  # it made the copy (where it did nothing, None, the copy is left here)
                    local = None
        if local is not None:
            HOST.copy(local[1], local[0])
        if reqs is None:
            reqs = engine.exchange_or_post([(self.world_peer, None if out is None else payload_bytes(out),
                                             None if into is None else payload_bytes(into))],
                                           self.ctx, tag, self.sig, self._owner(seq))
        if reqs:
            wait_through_engine(engine, self.comm.timeout, reqs, reqs[0].owner)

    def _owner(self, seq: int) -> Any:
        owner = self.comm._owner(f"{self.label} #{seq}", self.ctx, seq)
        owner.sig = self.sig
        return owner

    def _through_engine(self, seq: int, out: Optional[np.ndarray], into: Optional[np.ndarray]) -> None:
        """The messages that could not move at once, posted to the engine and waited for as a schedule's are; a
        failure is reported to the peer (as the executor does for a failed schedule) and raised."""
        c, engine, tag = self.comm, self.engine, seq * LANES
        owner = self._owner(seq)
        reqs = []
        if out is not None:
            reqs.append(engine.isend(self.world_peer, out, self.ctx, tag, self.sig, owner))
        if into is not None:
            reqs.append(engine.irecv(self.world_peer, into, self.ctx, tag, self.sig, owner))
        wait_through_engine(engine, c.timeout, reqs, owner)


def wait_through_engine(engine: Any, timeout: float, reqs: list, owner: Any) -> None:
    """A fast path's messages that could not move at once, waited for through the engine as a schedule's are; a
    failure is reported to the peers (as the executor does for a failed schedule) and raised."""
    try:
        engine.wait_requests(reqs, timeout, owner)
        failed = next((q.error for q in reqs if q.error is not None), None)
        if failed is not None:  # a request fails (a mismatch, a dead peer) without raising
            raise engine.witnessed(failed, owner)
    except PycollError as err:
        engine.abort(owner, err)
        raise


def fast_path(x: "Executor", plan: "Plan", algo: Any) -> Any:
    """The plan's whole call as one function of its arguments (``Plan.fast``), or False where this module has no
    form for it: a two-rank communicator across hosts without an arena, a call of one message each way, an
    algorithm with a form here. The function returns False, having done nothing, where anything it relies on
    changed (the environment's algorithm choice or checks, the cost model, a pending send, a broken communicator)."""
    c, t = x.comm, plan.template
    if (c._size != 2 or c._arena is not None or t.stream is not None or t.vector
            or (t.op is not None and t.op.averages)):
        return False
    make = _FORMS.get((t.coll, algo.name))
    engine, peer = x.engine, c._world[1 - c._rank]
    if make is None or peer not in engine._tcp_socks:
        return False
    pair = _Pair(x, plan)
    body = make(pair, t)
    holds = choice_holds(c, CHUNK_SIZE)  # the plan's chunking and its frame limits are the chunk's in force now
    if body is None or holds is None:
        return False
    limit, views = pair.most, plan.views
    if pair.most > pair.limit and (t.coll, algo.name) in _ANY_SIZE:
        limit = sys.maxsize  # the chain and the Alltoall send their block whole, the others a chunk at a time: any size
    largest = _largest_message(t, pair.me, pair.peer)
    if largest is not None and largest > limit:
        return False
    sendq, dead, broken, base = engine._sendq[peer], engine._dead, engine.broken_ctxs, c._ctx & ~1
    own = plan.sig.count

    def fast(args: tuple, count: int = own) -> bool:
        bound = views(args) if holds() else None
        if bound is None:
            return False  # something it relies on changed, or the buffers overlap (the checks name it)
        send, recv = bound
        if largest is None and ((send is not None and send.nbytes > limit) or (recv is not None and recv.nbytes > limit)):
            return False
        if c._freed or c._aborted is not None or (broken and base in broken) or sendq or peer in dead:
            return False
        if count != pair.sig.count:
            pair.count(count)
        seq = c._seq + 1
        c._seq = seq
        body(seq, send, recv)
        return True

    if (t.coll, algo.name) in _SPANNED and (largest is None or (t.counts and one_block_size(t))):
        fast.spanning = _spanning(fast, own, largest, limit, t.coll in _COUNTS_TOTAL)  # type: ignore[attr-defined]
    return fast


def _spanning(fast: Callable[..., bool], own: int, largest: Optional[int], limit: int, halves: bool
              ) -> Callable[[Any, int], Optional[Callable[[tuple, int], bool]]]:
    """Every length of a call's size span (``span_runners.keep``) on the fast path ``fast`` made for the plan's
    count ``own``: the forms take their buffers' lengths as they come, and the frames carry each call's own count.
    A call at scale ``at`` (the plan's at ``scale``) whose count is not whole, or whose two blocks (``halves``: the
    count is the whole vector) are not, takes the checks; one whose largest message would pass ``limit`` declines."""
    ref = weakref.ref(fast)  # the closure holds this function: a strong reference would make a cycle

    def spanning(call: Any, scale: int) -> Optional[Callable[[tuple, int], bool]]:
        run = ref()
        if run is None:
            return None

        def at_scale(args: tuple, at: int) -> bool:
            count, rest = divmod(own * at, scale)
            if rest or (halves and count % 2) or (largest is not None and largest * at > limit * scale):
                return False
            return run(args, count)

        return at_scale

    return spanning


def choice_holds(c: Any, *knobs: Any) -> Optional[Callable[[], bool]]:
    """For a fast path made now on ``c``: a check that the algorithm choice it was made for still holds (the
    environment's PYCOLL_ALGO, PYCOLL_CHECK_CALLS, PYCOLL_REPRODUCIBLE and ``knobs`` as they are now, the
    communicator's reproducible mode, the cost model). None where no fast path may be made: the environment cannot be
    watched, or every call is checked."""
    env = _ENV_BYTES
    if env is None or CHECK_CALLS.get():
        return None
    keys = (ALGO.env_key, CHECK_CALLS.env_key, REPRODUCIBLE.env_key, *(k.env_key for k in knobs))
    read = env.get
    values, mine, model = tuple(map(read, keys)), c._reproducible, cost_model.current()

    def holds() -> bool:
        return c._reproducible is mine and cost_model._current is model and tuple(map(read, keys)) == values

    return holds


def _largest_message(t: Any, me: int, peer: int) -> Optional[int]:
    """The larger of the call's two messages, in bytes, where only a block of its buffers crosses (an Allgather,
    Reduce_scatter or Alltoall sends and receives one rank's block: its whole buffers may exceed the socket's
    staging area while each message fits); None where a message is a whole buffer (checked call by call)."""
    size = t.dtype.itemsize
    if t.coll in ("allgather", "reduce_scatter") and t.counts:
        return max(t.counts[me], t.counts[peer]) * size
    if t.coll == "alltoall" and t.counts and t.send_counts:
        return max(t.counts[peer], t.send_counts[peer]) * size
    return None


class _Scratch:
    """A plan's incoming vector, kept between its calls (one shape and dtype per plan, but sized on first use)."""

    __slots__ = ("array",)

    def __init__(self) -> None:
        self.array = _EMPTY

    def like(self, a: np.ndarray) -> np.ndarray:
        return self.sized(a.size, a.dtype)

    def sized(self, n: int, dtype: np.dtype) -> np.ndarray:
        have = self.array
        if have.size != n or have.dtype != dtype:
            have = self.array = np.empty(n, dtype)
        return have


@_form("allreduce", "doubling")
def _allreduce(pair: _Pair, t: Any) -> Callable[[int, Any, Any], None]:
    ufunc, scratch = t.op.ufunc, _Scratch()

    def body(seq: int, send: np.ndarray, recv: np.ndarray) -> None:
        incoming = scratch.like(recv)
        pair.swap(seq, send, incoming)
        ufunc(send, incoming, out=recv)  # as the algorithm's round: own values on the left

    return body


def chunks(nbytes: int) -> int:
    """Into how many pieces the schedules cut a message (or a block) of ``nbytes``: their ``Steps.num_chunks``."""
    return num_chunks(nbytes, chunk_bytes())


def _swap_in_chunks(swap: Callable[..., None], seq: int, k: int, out: Optional[np.ndarray], into: Optional[np.ndarray],
                    own: Optional[np.ndarray] = None, ufunc: Any = None, result: Optional[np.ndarray] = None,
                    copy_to: Optional[np.ndarray] = None) -> None:
    """``swap`` of ``out`` for ``into`` (None: nothing that way) in ``k`` chunks each way, one call each, as the
    schedules cut their blocks; with ``ufunc``, each chunk that came in folded at once as
    ``result = ufunc(own, incoming)`` (the rank's own values on the left, as the schedules fold); with ``copy_to``,
    each chunk of ``out`` also copied there during its swap."""
    if k == 1:  # one message each way: no cutting on the small calls' path
        swap(seq, out, into, None if copy_to is None else (out, copy_to))
        if ufunc is not None:
            ufunc(own, into, out=result)
        return
    outs = (None,) * k if out is None else split(out, k)
    ins = (None,) * k if into is None else split(into, k)
    if copy_to is not None:
        for piece_out, piece_in, piece_copy in zip(outs, ins, split(copy_to, k)):
            swap(seq, piece_out, piece_in, (piece_out, piece_copy))
        return
    if ufunc is None:
        for piece_out, piece_in in zip(outs, ins):
            swap(seq, piece_out, piece_in)
        return
    for piece_out, piece_in, piece_own, piece_result in zip(outs, ins, split(own, k), split(result, k)):
        swap(seq, piece_out, piece_in)
        ufunc(piece_own, piece_in, out=piece_result)


@_form("allreduce", "ring")
def _allreduce_ring(pair: _Pair, t: Any) -> Callable[[int, Any, Any], None]:
    """The two-rank ring's messages, each chunk both ways in one call into C: each rank's half of the vector, its own
    values on the left and the peer's chunk of that half on the right, then the reduced halves swapped, in the ring's
    order of frames (its blocks cut into equal numbers of chunks), so a peer that runs the ring's schedule matches."""
    me, peer, ufunc, scratch = pair.me, pair.peer, t.op.ufunc, _Scratch()

    def body(seq: int, send: Optional[np.ndarray], recv: np.ndarray) -> None:
        src = recv if send is None else send
        counts = even_counts(recv.shape[0], 2)
        starts = offsets(counts)
        k = chunks(max(counts) * recv.itemsize)
        mine, theirs = (slice(starts[i], starts[i] + counts[i]) for i in (me, peer))
        _swap_in_chunks(pair.swap, seq, k, src[theirs], scratch.like(recv[mine]), src[mine], ufunc, recv[mine])
        _swap_in_chunks(pair.swap, seq, k, recv[mine], recv[theirs])

    return body


@_form("broadcast", "chain")
def _broadcast(pair: _Pair, t: Any) -> Callable[[int, Any, Any], None]:
    at_root = pair.me == t.root

    def body(seq: int, send: Any, recv: np.ndarray) -> None:
        if at_root:
            pair.swap(seq, recv, None)
        else:
            pair.swap(seq, None, recv)

    return body


@_form("reduce", "chain")
def _reduce(pair: _Pair, t: Any) -> Callable[[int, Any, Any], None]:
    """The two-rank chain's chunks one way, as its schedule cuts them: the root folds each as it comes in (its own
    values on the left, as the chain's last link) while the next crosses."""
    at_root, ufunc, scratch, chunk = pair.me == t.root, t.op.ufunc, _Scratch(), pair.chunk

    def body(seq: int, send: np.ndarray, recv: Optional[np.ndarray]) -> None:
        k = 1 if send.nbytes <= chunk else chunks(send.nbytes)  # one message without working the count out
        if at_root:
            _swap_in_chunks(pair.swap, seq, k, None, scratch.like(send), send, ufunc, recv)
        else:
            _swap_in_chunks(pair.swap, seq, k, send, None)

    return body


class _Blocks:
    """A blocked form's two blocks in a flat vector of ``n`` elements: (this rank's, the peer's, chunks a block is cut
    into), fixed for the plan's own length and worked out (two equal blocks) for another length of its span."""

    __slots__ = ("me", "peer", "item", "n", "fixed", "others")

    def __init__(self, pair: _Pair, t: Any, counts: list[int], displs: Optional[list[int]]) -> None:
        me, peer = pair.me, pair.peer
        starts = offsets(list(counts)) if not displs else displs
        self.me, self.peer, self.item = me, peer, t.dtype.itemsize
        self.n = sum(counts) if one_block_size(t) else -1  # -1: every call has the plan's blocks
        self.fixed = (slice(starts[me], starts[me] + counts[me]), slice(starts[peer], starts[peer] + counts[peer]),
                      chunks(max(counts[me], counts[peer]) * t.dtype.itemsize))  # as the schedules cut a block
        self.others: dict[int, tuple[slice, slice, int]] = {}  # n -> its blocks, for the lengths of a span

    def of(self, n: int) -> tuple[slice, slice, int]:
        if n == self.n or self.n < 0:
            return self.fixed
        known = self.others.get(n)
        if known is None:
            if len(self.others) > 64:
                self.others.clear()
            b = n // 2
            known = self.others[n] = (slice(self.me * b, self.me * b + b), slice(self.peer * b, self.peer * b + b),
                                      chunks(b * self.item))
        return known


@_form("allgather", "doubling")
def _allgather(pair: _Pair, t: Any) -> Callable[[int, Any, Any], None]:
    if not t.counts:
        return None
    blocks, in_place = _Blocks(pair, t, t.counts, t.displs or None), t.in_place
    large = pair.limit  # a block past it goes through the exchange in C, which can make the own copy meanwhile

    def body(seq: int, send: Optional[np.ndarray], recv: np.ndarray) -> None:
        mine, theirs, k = blocks.of(recv.shape[0])
        block = recv[mine]
        if in_place or send is None:
            _swap_in_chunks(pair.swap, seq, k, block, recv[theirs])
        elif (block.nbytes > large and send.dtype == block.dtype and send.size == block.size
              and send.flags.c_contiguous):
            # past the staging area: the own block sent from the input and copied into the result in the exchange
            _swap_in_chunks(pair.swap, seq, k, send.reshape(block.shape), recv[theirs], copy_to=block)
        else:  # as the schedule: the block (converted) into the result first, and sent from there
            block[...] = send
            _swap_in_chunks(pair.swap, seq, k, block, recv[theirs])

    return body


@_form("alltoall", "pairwise")
def _alltoall(pair: _Pair, t: Any) -> Callable[[int, Any, Any], None]:
    if not (t.counts and t.displs and t.send_counts and t.send_displs):
        return None
    ins, outs = _Blocks(pair, t, t.counts, t.displs), _Blocks(pair, t, t.send_counts, t.send_displs)
    in_place = t.in_place
    large = pair.limit  # a frame past it goes through the exchange in C, which can make the own copy meanwhile

    def body(seq: int, send: np.ndarray, recv: np.ndarray) -> None:
        mine_out, theirs_in, _ = ins.of(recv.shape[0])
        mine_in, theirs_out, _ = outs.of(send.shape[0])
        source = send.copy() if in_place else send  # in place, the blocks still to send are overwritten
        out, into = source[theirs_out], recv[theirs_in]
        # one frame each way, as the pairwise schedule sends each block whole
        if out.nbytes > large or into.nbytes > large:
            pair.swap(seq, out, into, (source[mine_in], recv[mine_out]))  # the own block copied during the exchange
        else:
            pair.swap(seq, out, into)
            recv[mine_out] = source[mine_in]

    return body


@_form("reduce_scatter", "ring")
def _reduce_scatter(pair: _Pair, t: Any) -> Callable[[int, Any, Any], None]:
    if not t.counts:
        return None
    blocks, ufunc, in_place, scratch = _Blocks(pair, t, t.counts, None), t.op.ufunc, t.in_place, _Scratch()

    def body(seq: int, send: np.ndarray, recv: np.ndarray) -> None:
        mine, theirs, k = blocks.of(send.shape[0])
        incoming = scratch.sized(mine.stop - mine.start, send.dtype)
        # in place, the result's place overlaps the inputs still to send: the sums kept apart until the end
        result = incoming if in_place else recv[:incoming.shape[0]]
        _swap_in_chunks(pair.swap, seq, k, send[theirs], incoming, send[mine], ufunc, result)
        if in_place:
            recv[:incoming.shape[0]] = incoming

    return body


@_form("barrier", "dissemination")
def _barrier(pair: _Pair, t: Any) -> Callable[[int, Any, Any], None]:
    def body(seq: int, send: Any, recv: Any) -> None:
        pair.swap(seq, _EMPTY, _EMPTY)

    return body
