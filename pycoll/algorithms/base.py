"""What every algorithm sees: the call it serves (Call) and the verbs it may use (Steps)."""

from __future__ import annotations

import functools

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Optional, Sequence

import numpy as np

from ..config import size_param
from ..memory import MemoryBackend
from ..ops import Op
from ..p2p import Engine
from ..p2p_protocol import SMALL_BYTES, Owner, Request, Sig, payload_bytes

CHUNK_SIZE = size_param(
    "PYCOLL_CHUNK_SIZE", 512 << 10, "Bytes per pipelined chunk: algorithms cut each block into chunks of at most this size."
)

# A schedule is a generator that yields the requests it must wait for before its next step.
Schedule = Generator[tuple, None, None]


@dataclass
class Call:
    """One collective call, resolved: flat arrays over user memory, counts in elements."""

    coll: str  # allreduce, reduce_scatter, allgather, broadcast, reduce, alltoall, gather, scatter, barrier
    dtype: np.dtype
    send: Optional[np.ndarray] = None  # this rank's input (for in-place calls: a view of the input inside recv)
    recv: Optional[np.ndarray] = None  # this rank's output (None where MPI says it is not significant)
    op: Optional[Op] = None
    root: int = 0
    counts: list[int] = field(default_factory=list)  # per-rank block sizes (vector collectives)
    displs: list[int] = field(default_factory=list)  # per-rank block offsets into recv (or send for scatter)
    send_counts: list[int] = field(default_factory=list)  # alltoall(v): per-destination counts in send
    send_displs: list[int] = field(default_factory=list)
    in_place: bool = False
    vector: bool = False  # a v-form (Gatherv, Scatterv, Alltoallv, ...): block sizes may differ by rank
    total: int = -1  # elements of the whole vector where every rank knows it (Gather, Scatter); -1: derive
    stream: Any = None  # the caller's CUDA stream, for algorithms that run on device buffers (None: no stream given)
    reproducible: bool = False  # the result must be the rank-order left fold, bit for bit (PYCOLL_REPRODUCIBLE)

    def without_buffers(self) -> "Call":
        """This call with no user buffer (a plan's template keeps no user memory alive): every other field as it
        is, without ``dataclasses.replace``'s field-by-field rebuild (a new call shape makes one per plan)."""
        template = object.__new__(type(self))
        template.__dict__.update(self.__dict__)
        template.send = template.recv = None
        return template

    @property
    def nbytes(self) -> int:
        """Bytes of the largest user buffer on this rank."""
        sizes = [a.nbytes for a in (self.send, self.recv) if a is not None]
        return max(sizes, default=0)

    @property
    def size_bytes(self) -> int:
        """The message size selection uses, the same on every rank: the whole vector (nccl-tests' size)."""
        if self.total >= 0:
            return self.total * self.dtype.itemsize
        if self.counts and self.coll in ("reduce_scatter", "allgather", "gather", "scatter"):
            return sum(self.counts) * self.dtype.itemsize
        if self.coll == "reduce" and self.send is not None:
            return self.send.nbytes
        if self.coll in ("allreduce", "broadcast") and self.recv is not None:
            return self.recv.nbytes
        return self.nbytes


def chunk_bytes() -> int:
    """The pipelining chunk in force (PYCOLL_CHUNK_SIZE, at least 64 bytes)."""
    return max(CHUNK_SIZE.get(), 64)


def num_chunks(largest_block_bytes: int, chunk: int) -> int:
    """How many chunks of at most ``chunk`` bytes every block is cut into, so that chunk k exists in every block."""
    return max(1, math.ceil(largest_block_bytes / chunk))


def even_counts(n: int, parts: int) -> list[int]:
    """Split ``n`` elements into ``parts`` blocks whose sizes differ by at most one."""
    q, rem = divmod(n, parts)
    return [q + (i < rem) for i in range(parts)]


def offsets(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def split(arr: np.ndarray, parts: int) -> list[np.ndarray]:
    """``parts`` consecutive views of ``arr`` of near-equal size (some may be empty)."""
    return [arr[o : o + c] for o, c in zip(offsets(even_counts(arr.shape[0], parts)), even_counts(arr.shape[0], parts))]


@dataclass(frozen=True)
class Layout:
    """Where a communicator's ranks live: ``host_of[r]`` numbers rank r's host (0, 1, ... in order of first rank).

    ``ring`` is the order ring algorithms walk (a permutation of the ranks, from the topology: hosts
    contiguous, fastest links inside each); empty means rank order, and rank order is stored as empty, so
    equal rings compare equal."""

    host_of: tuple[int, ...]
    ring: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        ring = tuple(int(r) for r in self.ring)
        if ring and sorted(ring) != list(range(len(self.host_of))):
            raise ValueError(f"ring {ring} is not a permutation of {len(self.host_of)} ranks")
        object.__setattr__(self, "ring", () if ring == tuple(range(len(ring))) else ring)

    @staticmethod
    def from_ids(ids: Sequence[str], ring: Sequence[int] = ()) -> "Layout":
        first: dict[str, int] = {}
        return Layout(tuple(first.setdefault(i, len(first)) for i in ids), tuple(ring))

    @staticmethod
    def flat(size: int) -> "Layout":
        """``size`` ranks on one host (kept: the cost functions ask for a few in every ranking)."""
        return _flat_layout(size)

    @staticmethod
    def one_per_host(hosts: int) -> "Layout":
        """One rank on each of ``hosts`` hosts (kept, as ``flat``)."""
        return _one_per_host_layout(hosts)

    @property
    def size(self) -> int:
        return len(self.host_of)

    @functools.cached_property
    def hosts(self) -> int:
        return max(self.host_of, default=-1) + 1

    @functools.cached_property
    def groups(self) -> list[list[int]]:
        """Ranks of each host, in rank order."""
        out: list[list[int]] = [[] for _ in range(self.hosts)]
        for r, h in enumerate(self.host_of):
            out[h].append(r)
        return out

    @functools.cached_property
    def local_sizes(self) -> list[int]:
        return [len(g) for g in self.groups]

    @property
    def uniform(self) -> bool:
        """Every host holds the same number of ranks."""
        return len(set(self.local_sizes)) <= 1

    @property
    def order(self) -> tuple[int, ...]:
        """The ring order: ``ring``, or rank order."""
        return self.ring or tuple(range(self.size))

    def sub(self, members: Sequence[int]) -> "Layout":
        """The layout of ``members`` (member i is rank ``members[i]`` here); its ring keeps this ring's order."""
        ring: tuple[int, ...] = ()
        if self.ring:
            pos = {m: i for i, m in enumerate(members)}
            ring = tuple(pos[r] for r in self.ring if r in pos)
        return Layout.from_ids([str(self.host_of[m]) for m in members], ring)


@functools.lru_cache(maxsize=64)
def _flat_layout(size: int) -> Layout:
    return Layout((0,) * size)


@functools.lru_cache(maxsize=64)
def _one_per_host_layout(hosts: int) -> Layout:
    return Layout(tuple(range(hosts)))


# Message lanes within one call: a schedule that runs phases or trees side by side gives each its own
# lane, so their messages between the same two ranks can never be matched out of order. Lanes nest
# (a phase's lane can hold sub-lanes), up to LANE_DEPTH levels of LANE_FANOUT - 1 lanes each.
LANE_FANOUT = 4
LANE_DEPTH = 6
LANES = LANE_FANOUT**LANE_DEPTH  # tags per call


class Steps:
    """The verbs of one collective call. Peers are ranks of the communicator; the engine sees world ranks."""

    def __init__(
        self,
        engine: Engine,
        rank: int,
        size: int,
        world: Sequence[int],
        ctx: int,
        tag: int,
        sig: Sig,
        owner: Owner,
        mem: MemoryBackend,
        layout: Optional[Layout] = None,
        arena: Any = None,
        ipc: Any = None,
    ) -> None:
        self.engine = engine
        self.rank = rank
        self.size = size
        self._world = world
        self._ctx = ctx
        self._seq = tag
        self._lane = 0
        self._tag = tag * LANES
        self._sig = sig
        self._owner = owner
        self.mem = mem
        self.layout = layout or Layout.flat(size)
        self.chunk_bytes = chunk_bytes()
        self.arena = arena  # the communicator's ArenaState when all its ranks share a host (arena_meeting.py), else None
        self.ipc = ipc  # the communicator's IpcState for device buffers on one host (cuda_ipc.py), else None

    @property
    def owner(self) -> Owner:
        return self._owner

    @property
    def ctx(self) -> int:
        return self._ctx

    @property
    def seq(self) -> int:
        """The call's sequence number on its communicator."""
        return self._seq

    @property
    def sig(self) -> Sig:
        return self._sig

    def world_rank(self, peer: int) -> int:
        return self._world[peer]

    def stray_message(self) -> Optional[tuple[int, Sig]]:
        """(world rank, signature) of a stream message that arrived for this call and waits unmatched, if any."""
        return self.engine.unexpected_in(self._ctx, self._seq * LANES, (self._seq + 1) * LANES)

    def lane(self, index: int) -> "Steps":
        """The same verbs on sub-lane ``index`` (1 <= index < LANE_FANOUT) of this one."""
        if not 1 <= index < LANE_FANOUT:
            raise ValueError(f"lane {index} out of range 1..{LANE_FANOUT - 1}")
        lane = self._lane * LANE_FANOUT + index
        if lane >= LANES:
            raise ValueError(f"lanes nest deeper than {LANE_DEPTH} levels")
        other = copy.copy(self)
        other._lane, other._tag = lane, self._seq * LANES + lane
        return other

    def sub(self, members: Sequence[int], lane: Optional[int] = None) -> "Steps":
        """Verbs over a subgroup: peer i of the result is ``members[i]`` here; this rank must be a member."""
        other = self.lane(lane) if lane is not None else copy.copy(self)
        other.rank = list(members).index(self.rank)
        other.size = len(members)
        other._world = [self._world[m] for m in members]
        other.layout = self.layout.sub(members)
        other.arena = None  # the arena belongs to the whole communicator
        other.ipc = None
        return other

    # A blocking call's small messages to peers on other hosts may go straight through the sockets (the executor
    # sets this): the *_now verbs then return None for a message moved at once, else the engine's request
    # (``unfinished`` keeps those).
    now = False

    def send_now(self, peer: int, arr: np.ndarray) -> Optional[Request]:
        """``send``, in one system call where the call may: None once sent (the bytes are out of ``arr``)."""
        if self.now and type(arr) is np.ndarray and arr.flags.c_contiguous and self.engine.send_now(
                self._world[peer], arr.reshape(-1).view(np.uint8), self._ctx, self._tag, self._sig):
            return None
        return self.send(peer, arr)

    def recv_now(self, peer: int, arr: np.ndarray) -> Optional[Request]:
        """``recv``, taken straight from the socket where the call may: None once received."""
        if self.now and type(arr) is np.ndarray and arr.flags.c_contiguous and self.engine.recv_now(
                self._world[peer], arr.reshape(-1).view(np.uint8), self._ctx, self._tag, self._sig):
            return None
        return self.recv(peer, arr)

    def exchange_now(self, moves: Sequence[tuple[int, Optional[np.ndarray], Optional[np.ndarray]]]) -> list[Request]:
        """``send`` and ``recv`` of several (peer, outgoing, incoming) at once (either array None: nothing that
        way), the requests still to wait on. The call's frames to and from peers on other hosts move together in
        one call into C where the call may (``Engine.exchange_frames``), with this host's peers' frames through
        their rings; the other peers' sends are posted first, their receives last, and whatever did not start so
        goes through the engine."""
        engine, world = self.engine, self._world
        reqs: list[Request] = []
        direct, later = [], []
        # where a peer on another host takes part, this host's peers may join it through their rings
        joins = engine.exchanges_with if any(self.direct(m[0]) for m in moves) else None
        for peer, out, into in moves:
            flat_out, flat_in = _flat(out), _flat(into)
            if joins is not None and joins(world[peer]) and (out is None or flat_out is not None) \
                    and (into is None or flat_in is not None):
                direct.append((world[peer], flat_out, flat_in))
            else:
                if out is not None:
                    reqs.append(self.send(peer, out))
                if into is not None:
                    later.append((peer, into))
        if direct:
            reqs += engine.exchange_or_post(direct, self._ctx, self._tag, self._sig, self._owner)
        reqs += [self.recv(peer, into) for peer, into in later]
        return reqs

    def recv_reduce_now(self, peer: int, local: np.ndarray, out: np.ndarray, op: Op) -> Optional[Request]:
        """``recv_reduce``, taken straight from the socket where the call may: None once ``out`` is written."""
        if self.now and type(out) is np.ndarray and out.flags.c_contiguous:
            incoming = self.mem.scratch(out.size, out.dtype)
            try:
                if self.engine.recv_now(self._world[peer], incoming.view(np.uint8), self._ctx, self._tag, self._sig):
                    op.ufunc(local, incoming.reshape(out.shape), out=out)
                    return None
            finally:
                self.mem.release(incoming)
        return self.recv_reduce(peer, local, out, op)

    def direct(self, peer: int) -> bool:
        """Whether this call's frames with ``peer`` (on another host) may move in C (``swap_now``, ``exchange_now``)."""
        return self.now and self.engine.swaps_with(self._world[peer])

    def swap_now(self, peer: int, out: Optional[np.ndarray], into: Optional[np.ndarray], local: Optional[np.ndarray] = None,
                 op: Optional[Op] = None) -> Schedule:
        """One frame each way with ``peer`` (either array None: nothing that way), waited for; given ``local`` and
        ``op``, ``into = op(local, incoming)``. Where a frame passes the small-frame size and the peer is on another
        host, both move together in C (``exchange_now``), the incoming one read whole (into scratch where it is
        reduced once after); else as ``send_now`` and ``recv_now`` (or ``recv_reduce_now``)."""
        big = max(a.nbytes if a is not None else 0 for a in (out, into)) > SMALL_BYTES
        if big and self.direct(peer):  # an array that is not flat bytes goes through the engine there
            incoming = self.mem.scratch(into.size, into.dtype) if into is not None and op is not None else into
            try:
                pending = self.exchange_now([(peer, out, incoming)])
                if pending:
                    yield tuple(pending)
                if incoming is not into:
                    assert op is not None and into is not None
                    op.ufunc(local, incoming.reshape(into.shape), out=into)
            finally:
                if incoming is not into:
                    self.mem.release(incoming)
            return
        pending = unfinished(self.send_now(peer, out)) if out is not None else ()
        if into is not None:
            pending += unfinished(self.recv_now(peer, into) if op is None else self.recv_reduce_now(peer, local, into, op))
        if pending:
            yield pending

    def send(self, peer: int, arr: np.ndarray, sig: Optional[Sig] = None) -> Request:
        """Send ``arr`` to ``peer``; the request completes once the bytes are out of ``arr``."""
        return self.engine.isend(self._world[peer], arr, self._ctx, self._tag, sig or self._sig, self._owner)

    def recv(self, peer: int, arr: np.ndarray, sig: Optional[Sig] = None) -> Request:
        """Receive exactly ``arr.nbytes`` bytes from ``peer`` into ``arr``."""
        return self.engine.irecv(self._world[peer], arr, self._ctx, self._tag, sig or self._sig, self._owner)

    def recv_reduce(self, peer: int, local: np.ndarray, out: np.ndarray, op: Op) -> Request:
        """Receive from ``peer`` and write ``out = op(local, incoming)`` as bytes arrive (no staging array)."""
        return self.engine.irecv(
            self._world[peer], out, self._ctx, self._tag, self._sig, self._owner, local=local, ufunc=op.ufunc
        )

    def recv_fold(self, peer: int, local: np.ndarray, out: np.ndarray, op: Op) -> Request:
        """Receive from ``peer`` and write ``out = op(incoming, local)``: what a lower rank folded comes in on the left."""
        return self.engine.irecv(
            self._world[peer], out, self._ctx, self._tag, self._sig, self._owner, local=local,
            ufunc=_incoming_left(op.ufunc),
        )

    def num_chunks(self, largest_block_bytes: int) -> int:
        """How many chunks every block is cut into, so that chunk k exists in every block."""
        return num_chunks(largest_block_bytes, self.chunk_bytes)


@functools.lru_cache(maxsize=None)
def _incoming_left(ufunc: Any) -> Callable[..., Any]:
    """``ufunc`` with its operands swapped, as the engine calls a receive's reduction: ``(local, incoming, out=)``."""

    def fold(local: np.ndarray, incoming: np.ndarray, out: np.ndarray) -> Any:
        return ufunc(incoming, local, out=out)

    return fold


def _flat(arr: Optional[np.ndarray]) -> Any:
    """``arr`` as flat bytes for a frame, or None (None, or not one contiguous NumPy array: the engine's path)."""
    if arr is None or type(arr) is not np.ndarray or not arr.flags.c_contiguous:
        return None
    return payload_bytes(arr)


def unfinished(*reqs: Optional[Request]) -> tuple[Request, ...]:
    """The requests among ``reqs`` still to wait on (the *_now verbs give None for a message already moved)."""
    return tuple(q for q in reqs if q is not None)


def pieces_of(segments: Sequence[np.ndarray], k: int) -> list[np.ndarray]:
    """Cut each segment into ``k`` near-equal pieces: ``k * len(segments)`` pieces in order."""
    return [piece for seg in segments for piece in split(seg, k)]


def blocks_of(arr: np.ndarray, counts: Sequence[int], displs: Optional[Sequence[int]] = None) -> list[np.ndarray]:
    """Views of ``arr``: block i holds ``counts[i]`` elements from ``displs[i]`` (default: packed in order)."""
    displs = offsets(list(counts)) if displs is None else displs
    return [arr[d : d + c] for c, d in zip(counts, displs)]


def binary_tree(p: int) -> tuple[list[int], list[list[int]]]:
    """A binary tree over positions 0..p-1 whose odd positions are all leaves: (parent, children).

    Position 0 is the root. Position x > 0 with lowest set bit b has children x - b/2 and the
    largest x + b/2^i still below p; the root's one child is the largest power of two below p.
    """
    children: list[list[int]] = [[] for _ in range(p)]
    if p > 1:
        children[0].append(1 << ((p - 1).bit_length() - 1))
    for x in range(1, p):
        half = (x & -x) >> 1
        if half:
            children[x].append(x - half)
            while half and x + half >= p:
                half >>= 1
            if half:
                children[x].append(x + half)
    parent = [-1] * p
    for x, kids in enumerate(children):
        for c in kids:
            parent[c] = x
    return parent, children


class _FirstReady:
    """Waitable that is done once any one group of requests is all done (or any request failed)."""

    __slots__ = ("groups", "peer")

    def __init__(self, groups: list[tuple]) -> None:
        self.groups = groups
        self.peer = -1

    @property
    def requests(self) -> list:
        return [r for g in self.groups for r in g]

    @property
    def error(self):
        return next((r.error for g in self.groups for r in g if r.done and r.error is not None), None)

    @property
    def done(self) -> bool:
        return self.error is not None or any(all(r.done for r in g) for g in self.groups)


def concurrently(*schedules: Schedule) -> Schedule:
    """Run several schedules of one call side by side (they should use different lanes); done when all are."""
    live: list[tuple[Schedule, tuple]] = []
    for gen in schedules:
        try:
            live.append((gen, tuple(next(gen))))
        except StopIteration:
            pass
    while live:
        moved = False
        for i, (gen, waits) in enumerate(live):
            if waits is None or not all(r.done for r in waits):
                continue
            failed = next((r.error for r in waits if r.error is not None), None)
            if failed is not None:
                raise failed
            try:
                live[i] = (gen, tuple(gen.send(None)))
            except StopIteration:
                live[i] = (gen, None)  # type: ignore[assignment]
            moved = True
        live = [(g, w) for g, w in live if w is not None]
        if live and not moved:
            yield (_FirstReady([w for _, w in live]),)
