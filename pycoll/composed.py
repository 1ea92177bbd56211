"""Small collectives across hosts composed from two smaller communicators, as MPICH's SMP-aware collectives are.

A communicator whose ranks span hosts, with more than one rank on some host, runs a small blocking call as calls
on each host's communicator, whose ranks share memory and so take the compiled arena path, and one among the
hosts' first ranks (the leaders), over the network. Allreduce: reduce to the leader, allreduce among the leaders,
broadcast from the leader. Barrier: the other ranks' arrivals gathered to each leader, a barrier among the leaders,
the leader's release broadcast (one-sided steps inside a host). Bcast: inside the root's host, then among the
leaders (a leader root sends to the other hosts first), then inside the other hosts. Reduce: reduce to each leader, reduce
among the leaders to the root's, which hands the result to the root. Allgather and Reduce_scatter_block, where
every host holds the same number of ranks, numbered host by host: gather to (reduce to) the leader, the
collective among the leaders over whole hosts' blocks, broadcast (scatter) from the leader (a larger Allgather
gathers the host's blocks to all its ranks first, and broadcasts only the other hosts' blocks); Alltoall likewise
gathers every rank's blocks to its leader, exchanges them among the leaders by destination host and scatters
them by destination rank. The network then
carries one message per host per step (between two hosts, one frame each way: ``pycoll.paired``), and the steps
inside a host cost a shared-memory meeting instead of a trip through the point-to-point engine.

A larger Reduce_scatter_block goes by rails instead, so that no rank reduces or sends the whole host's vector alone:
each host's run of blocks is reduce-scattered inside the host, then each rail (the ranks of one local index, one per
host, a communicator of its own) reduce-scatters those partial sums across the hosts (``_rails_reduce_scatter``).

Between two hosts whose link is far slower than their steps, a larger Allreduce, a Bcast from a host's leader or a
Reduce to one runs in segments: the leaders send each segment as soon as the host has it, and the host's step of one
segment runs while the next crosses (``segments``).

Every rank decides alike (the layout, the call's kind, size and op are the same everywhere), so every rank takes
the composed path or none does. ``PYCOLL_SMP_BYTES`` bounds the size; 0 turns it off. A larger Allreduce,
Allgather, Bcast, Reduce or Reduce_scatter_block (this one by rails, its host steps in pieces that fit a host arena's slot)
is composed where the cost model prices its steps one after another (each the cheapest algorithm for its
communicator: ``predict``) below every algorithm for the whole communicator, or, since a composition puts only the
fewest bytes on the links, below the other such algorithms and within PYCOLL_LINK_TOLERANCE of the cheapest.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import numpy as np

from . import ops as _ops
from .algorithms import cost as cost_model
from .algorithms.base import Call, Layout, offsets
from .algorithms.registry import LINK_MINIMAL, link_tolerance, preferred, ranked, ranked_cached
from .buffers import IN_PLACE
from .composed_failures import guarded
from .composed_segments import SegmentedSteps
from .config import int_param, size_param
from .transport.arena import shared_core_slot_bytes

SMP_BYTES = size_param(
    "PYCOLL_SMP_BYTES", 64 << 10,
    "Largest blocking Allreduce, Bcast, Reduce, Allgather, Reduce_scatter_block and Alltoall (and every Barrier) that a "
    "communicator spanning hosts, with several ranks on some host, runs as calls inside each host and one among the "
    "hosts' first ranks (the hosts' shared memory takes the compiled arena path); above it, an Allreduce, Allgather, "
    "Bcast, Reduce or Reduce_scatter_block (by rails) where "
    "the cost model prices that composition below the flat algorithms. 0: never.")

_KINDS = ("allreduce", "barrier", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall")
_REDUCING = ("allreduce", "reduce", "reduce_scatter")
# their parts take any length (``composed_plans``); the block collectives' read their block from their buffers
SPANNED = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter", "alltoall")
_BY_HOST = ("allgather", "reduce_scatter", "alltoall")  # blocks of whole hosts among the leaders: even, host-major layouts only
_RESULT_TAG = 1  # the root's host: its leader sends the result of a composed Reduce to the root
# Above PYCOLL_SMP_BYTES, where priced cheaper: each collective's steps as (collective, on the host or among the
# leaders (one rank per host, as a rail), its share of the call's bytes: the whole call, one host's part of it, that
# part once for each host, the other hosts' parts, or one rail's). A Reduce_scatter_block's host step goes in pieces
# that fit a host arena's slot (``rail_piece_elements``).
_WHOLE, _HOST_PART, _EACH_HOST_PART, _RAIL_PART = "whole", "host part", "each host's part", "rail part"
_OTHER_HOSTS = "the other hosts' parts"
_PRICED: dict[str, tuple[tuple[str, bool, str], ...]] = {
    "allreduce": (("reduce", True, _WHOLE), ("allreduce", False, _WHOLE), ("broadcast", True, _WHOLE)),
    # the host's blocks to all its ranks, the leaders' over whole hosts' runs, the other hosts' runs in the host
    "allgather": (("allgather", True, _HOST_PART), ("allgather", False, _WHOLE), ("broadcast", True, _OTHER_HOSTS)),
    "broadcast": (("broadcast", True, _WHOLE), ("broadcast", False, _WHOLE), ("broadcast", True, _WHOLE)),
    # a root that does not lead its host then gets the result from its leader (``_leader_reduce``; see ``_whole``)
    "reduce": (("reduce", True, _WHOLE), ("reduce", False, _WHOLE)),
    # by rails (``_rails_reduce_scatter``): one host call per host's run of blocks, then the rail's (one rank per host)
    "reduce_scatter": (("reduce_scatter", True, _EACH_HOST_PART), ("reduce_scatter", False, _RAIL_PART)),
}


# Where the leaders' step between the hosts brings a host at least this many bytes, the host's other ranks wait
# through it asleep rather than yield the core. 4 ranks on 2 namespace hosts, 2 cores, back to back on fresh arrays:
# with the ranks in one session (their yields hand the core over) the sleep cost more than it saved up to 4 MiB
# (Bcast 1 MiB 1.1-1.4 ms yielding against 1.1-3.0 asleep, 4 MiB 4.1-6.4 against 6.4-7.6; Allreduce 1 MiB 2.5-3.4
# against 3.4-4.5), and saved from 16 MiB (Bcast 18.6-21.8 ms asleep against 22.0-26.6).
SLEEP_FROM_BYTES = 8 << 20


# Between two hosts whose link takes far longer than the hosts' steps, a larger composed Allreduce, Bcast or Reduce
# runs in segments: the leaders send each segment over the link as soon as the host has it, and the host's step of
# one segment runs while the next crosses. The steps' fixed costs are paid once a segment, and a segment's own trip
# through the point-to-point engine costs more than the pair's one exchange in C, so this pays only where the link's
# time per segment is at least LINK_BOUND times the hosts' (4 ranks on 2 namespace hosts of 2 cores, Allreduce, the
# whole against 4 segments: 1 Gbit/s 1 MiB 8.94 -> 8.61 ms, 4 MiB 40.0-40.6 -> 37.5-38.7; at 10 Gbit/s 1 MiB 1.86
# -> 1.60 but 4 MiB 7.9-8.0 -> 8.3-8.5; unshaped 1 MiB 1.04 -> 1.42).
SEGMENTS = int_param(
    "PYCOLL_SMP_SEGMENTS", 4,
    "Segments of a composed Allreduce, Bcast or Reduce between two hosts where the cost model finds the link far "
    "slower than the hosts' steps (PYCOLL_SMP_BYTES); 1: never in segments.")
LINK_BOUND = 4.0
_SEGMENTED: dict[str, tuple[tuple[str, ...], str]] = {  # the host's steps of a segment, the leaders' step
    "allreduce": (("reduce", "broadcast"), "allreduce"),
    "broadcast": (("broadcast",), "broadcast"),
    "reduce": (("reduce",), "reduce"),
}


def rail_piece_elements(block: int, k: int, itemsize: int) -> int:
    """Elements of each of a host's ``k`` blocks (``block`` elements each) that one host step of a Reduce_scatter_block
    by rails takes: all of them while the host's run of blocks fits one slot of a host arena whose ranks share cores
    (``shared_core_slot_bytes``, from the layout alone, so every rank answers alike), the compiled slots path's limit;
    beyond, as many as fit, the run going in pieces. Whole, the staged path took a 2 MiB run in 1.3x the
    hierarchical algorithm's time (4 ranks on 2 namespace hosts, 2 and 4 MiB calls); within a slot the composition
    took 0.6-0.7x its time (2 MiB: 1.12-1.15 ms against 1.63-1.66; 1.59 against 2.58)."""
    fit = shared_core_slot_bytes(k) // max(k * itemsize, 1)
    return max(1, min(block, fit))


def segments(model: Any, coll: str, nbytes: int, lay: Layout, op: Any = None, root: int = 0) -> tuple[int, float]:
    """(segments, the model's time) of a composed ``coll`` of ``nbytes`` in segments between two hosts (``SEGMENTS``),
    where the link is bound to take LINK_BOUND times the hosts' steps a segment and the pipeline beats the whole
    call; (1, inf) otherwise. A pipeline: the first segment through every step, then the rest at the pace of the
    busier of the link and the host's cores, which also copy each segment through the sockets where they are
    shared."""
    count = SEGMENTS.get()
    if coll not in _SEGMENTED or count < 2 or lay.hosts != 2 or (coll != "allreduce" and not _leads(lay, root)):
        return 1, float("inf")
    steps, between = _SEGMENTED[coll]
    piece = nbytes // count
    host, leaders = Layout.flat(max(lay.local_sizes)), Layout(tuple(range(lay.hosts)))
    op = op if op is not None else _ops.SUM
    in_host = sum(_cheapest(model, step, piece, host, op) for step in steps)
    link = _cheapest(model, between, piece, leaders, op)
    cores = in_host + model.socket_copies(host, piece)
    # the segments stream back to back through one socket: after the first, the link takes the whole call's time
    # less the first segment's, its fixed costs paid once
    rest = _cheapest(model, between, nbytes, leaders, op) - link
    price = in_host + link + max((count - 1) * cores, rest)
    if link < LINK_BOUND * cores or price >= _whole(model, coll, nbytes, lay, op, root):
        return 1, float("inf")
    return count, price


def _regular(call: Call) -> bool:
    """Whether every rank's block has one size and the blocks follow each other in rank order (an Allgatherv,
    Reduce_scatter or Alltoallv may have any counts and displacements; the compositions by host take neither)."""
    for counts, displs in ((call.counts, call.displs), (call.send_counts, call.send_displs)):
        if counts and (any(c != counts[0] for c in counts) or (displs and list(displs) != offsets(counts))):
            return False
    return bool(call.counts)


def _cheapest(model: Any, coll: str, nbytes: int, lay: Layout, op: Any, shared: bool = True) -> float:
    """The model's time for the cheapest algorithm of ``coll`` on ``nbytes`` (the whole vector) over ``lay``
    (``shared``: through the selection's cache, which holds one model's answers; a derived model's are not kept)."""
    probe = Call(coll, np.dtype(np.uint8), op=op if coll in _REDUCING else None, total=nbytes,
                 counts=[nbytes // lay.size] * lay.size if coll in ("gather", "scatter", "allgather", "reduce_scatter")
                 else [])
    options = ranked_cached(coll, nbytes, lay, model, probe) if shared else ranked(probe, lay, model)
    return options[0][0] if options else float("inf")


def _leads(lay: Layout, root: int) -> bool:
    """Whether rank ``root`` is its host's first rank (its leader)."""
    return lay.groups[lay.host_of[root]][0] == root


def predict(model: Any, coll: str, nbytes: int, lay: Layout, op: Any = None, root: int = 0) -> float:
    """The model's time for a composed ``coll`` of ``nbytes`` on a communicator laid out as ``lay``: whole
    (``_whole``) or, where cheaper, in segments (``segments``); inf: not composed above PYCOLL_SMP_BYTES."""
    return min(_whole(model, coll, nbytes, lay, op, root), segments(model, coll, nbytes, lay, op, root)[1])


def _whole(model: Any, coll: str, nbytes: int, lay: Layout, op: Any = None, root: int = 0) -> float:
    """The model's time for a composed ``coll`` run whole: its steps one after another, on the largest host's
    communicator and the leaders' (inf: not composed whole above PYCOLL_SMP_BYTES). A Bcast whose ``root`` leads its
    host sends to the other hosts first, so its host's step overlaps theirs; a Reduce's root copies the result into
    its buffer, and one that does not lead its host first gets it from its leader, one more step inside the host."""
    steps = _PRICED.get(coll)
    if steps is None:
        return float("inf")
    if coll == "broadcast" and _leads(lay, root):
        steps = steps[1:]
    host, leaders = Layout.flat(max(lay.local_sizes)), Layout(tuple(range(lay.hosts)))
    op = op if op is not None else _ops.SUM
    total, rails = 0.0, max(lay.local_sizes)
    for step, on_host, share in steps:
        size = {_WHOLE: nbytes, _RAIL_PART: nbytes // rails,
                _OTHER_HOSTS: nbytes - nbytes // lay.hosts}.get(share, nbytes // lay.hosts)
        times = lay.hosts if share == _EACH_HOST_PART else 1
        # every rail crosses the links at once: each has its share of a host's link
        if share == _RAIL_PART:
            time = _cheapest(model.sharing_links(rails), step, size, leaders, op, shared=False)
        elif coll == "reduce_scatter":  # a host's run past the slot goes in pieces, each packed first (a copy of it)
            block = size // rails
            pieces = -(-block // rail_piece_elements(block, rails, 1)) if block else 1
            time = pieces * _cheapest(model, step, size // pieces, host, op)
            if pieces > 1:
                time += model.copy_s(size, 2 * size)
        else:
            time = _cheapest(model, step, size, host if on_host else leaders, op)
        total += times * time
    if coll == "reduce":  # the result is copied from scratch into the root's buffer once every step has succeeded
        total += model.copy_s(nbytes, 2 * nbytes)
        if not _leads(lay, root):  # after its leader hands it over inside the host
            total += _cheapest(model, "broadcast", nbytes, Layout.flat(2), op)
    return total


class HostComposition(SegmentedSteps):
    """The per-host and leaders' communicators of one parent communicator, made on its first composed call."""

    def __init__(self, comm: Any) -> None:
        lay = comm._layout
        self.comm = comm
        self.host = lay.host_of[comm._rank]
        self.groups = [sorted(g) for g in lay.groups]  # ranks of each host, in host order
        self.leader = self.groups[self.host][0] == comm._rank
        self.host_comm: Any = None
        self.leaders: Any = None
        self.column: Any = None  # the ranks of this rank's local index on every host (an even layout's rail)
        # the leaders' communicator: each host's first rank, in parent rank order; and each host's rank in it
        self.firsts = sorted(g[0] for g in self.groups)
        self.leader_rank = [self.firsts.index(g[0]) for g in self.groups]
        # every host the same number of ranks, numbered host by host: a host's blocks are one contiguous run
        size = len(self.groups[0])
        self.even = all(list(g) == list(range(g[0], g[0] + size)) for g in self.groups)
        self._hosts_last_mine = [h for h in range(len(self.groups)) if h != self.host] + [self.host]
        self._scratch_buf = np.zeros(0, np.uint8)  # reused between calls: fresh pages cost a fault each
        self.by_rails = 0  # Reduce_scatter_block calls composed by rails (for tests and debugging)
        self.rails_in_pieces = 0  # of those, the calls whose host steps went in pieces (likewise)
        self.in_segments = 0  # Allreduce, Bcast and Reduce calls composed in segments (likewise)
        self._token = np.zeros(len(self.groups[self.host]), np.uint8)  # a Barrier's arrivals (one per rank of the host)
        # the host's ranks take turns on shared cores: a rank whose post its leader waits for hands the core over
        self.shares_cores = bool(comm._engine.oversubscribed)
        self._priced: dict[tuple, bool] = {}  # (collective, bytes, op's kind, tolerance) -> composed when larger
        self._priced_by: Any = None  # the model those answers came from (compared by identity)

    @staticmethod
    def wanted(comm: Any) -> bool:
        """Whether ``comm``'s layout gains from composing: several hosts, and some host with several ranks."""
        lay = comm._layout
        return lay.hosts > 1 and max(lay.local_sizes) > 1 and SMP_BYTES.get() > 0

    def takes(self, call: Call) -> bool:
        """Whether this call is composed (the same answer on every rank for matching calls)."""
        limit = SMP_BYTES.get()
        if call.coll not in _KINDS or call.stream is not None or limit <= 0:
            return False
        if call.coll == "barrier":
            return True
        if call.dtype.kind not in "biufc" or call.vector:
            return False
        if call.coll in _BY_HOST and not (self.even and _regular(call)):
            return False
        if call.coll in _REDUCING and not (call.op is not None and call.op.commutative and not call.op.averages):
            return False
        return call.size_bytes <= limit or self._cheaper(call)

    def _cheaper(self, call: Call) -> bool:
        """Whether the composed call is the choice: priced below every algorithm for the whole communicator, or the
        cheapest of those that put the fewest bytes on the links (with the hierarchical one or the chain) and within
        PYCOLL_LINK_TOLERANCE of the cheapest (``registry.preferred``)."""
        if call.coll not in _PRICED and call.coll not in _SEGMENTED:
            return False
        model = cost_model.current()
        if self._priced_by is not model:
            self._priced.clear()
            self._priced_by = model
        lay = self.comm._layout
        tolerance = link_tolerance(call.coll, lay)
        leads = call.coll in ("broadcast", "reduce") and _leads(lay, call.root)
        key = (call.coll, call.size_bytes, call.op.order if call.op is not None else 0, tolerance, leads,
               SEGMENTS.get())
        known = self._priced.get(key)
        if known is None:
            priced = [(t, a.name) for t, a in ranked_cached(call.coll, call.size_bytes, lay, model, call)]
            priced.append((predict(model, call.coll, call.size_bytes, lay, call.op, call.root), "composed"))
            priced.sort(key=lambda p: p[0])
            lean = LINK_MINIMAL[call.coll] | {"composed"}  # these put only the fewest bytes on the links
            known = self._priced[key] = preferred(priced, lean, tolerance)[1] == "composed"
        return known

    def _segments(self, call: Call) -> int:
        """How many segments a composed Allreduce, Bcast or Reduce runs in (``segments``; 1: whole): only above
        PYCOLL_SMP_BYTES, where the cost model chose the composition."""
        if call.coll not in _SEGMENTED or call.size_bytes <= SMP_BYTES.get():
            return 1
        return segments(cost_model.current(), call.coll, call.size_bytes, self.comm._layout, call.op, call.root)[0]

    def part_of(self, call: Call) -> Optional[Callable[[Any, Any], None]]:
        """This rank's whole part of a composed Barrier, Bcast, Reduce or Allreduce as a function of its (send,
        recv) views, chosen for the rank's role (a host's leader, or another rank of it) and the call's op and
        root: ``run`` calls it, and a plan's closure binds it once (no call object or dispatch per call: the small
        calls' critical path runs through both roles on a host whose ranks share a core). None for the other
        collectives, which ``run`` dispatches by name."""
        if self.host_comm is None:
            return None
        coll, op, root, in_place, lead = call.coll, call.op, call.root, call.in_place, self.leader
        if coll == "barrier":
            barrier = self._leader_barrier if lead else self._member_barrier
            return lambda send, recv: barrier()
        pieces = self._segments(call)
        if pieces > 1:
            piecewise = getattr(self, f"_{'leader' if lead else 'member'}_{coll}_segments")

            def in_segments(send: Any, recv: Any) -> None:
                piecewise(send, recv, op, root, in_place, pieces)
                self.in_segments += 1
            return in_segments
        if coll == "reduce":
            reduce = self._leader_reduce if lead else self._member_reduce
            return lambda send, recv: reduce(send, recv, op, root)
        if coll == "broadcast":
            bcast = self._leader_bcast if lead else self._member_bcast
            return lambda send, recv: bcast(recv, root)
        if coll == "allreduce":
            allreduce = self._leader_allreduce if lead else self._member_allreduce
            return lambda send, recv: allreduce(send, recv, op, in_place)
        if coll not in _BY_HOST:
            return None
        p = self.comm._size  # below, a call's block is its buffers' length over the ranks': any length of its family
        if coll == "reduce_scatter" and not in_place:
            if call.size_bytes > SMP_BYTES.get():
                rails = self._rails_reduce_scatter
                return lambda send, recv: rails(send, recv, send.shape[0] // p, op, False)
            small = self._leader_reduce_scatter if lead else self._member_reduce_scatter
            return lambda send, recv: small(send, recv, send.shape[0] // p, op)
        if coll == "allgather":
            if call.size_bytes > SMP_BYTES.get():
                if in_place:
                    return None
                gather = self._host_first_allgather
                return lambda send, recv: gather(send, recv, recv.shape[0] // p, False)
            small_allgather = self._small_allgather
            return lambda send, recv: small_allgather(send, recv, recv.shape[0] // p, in_place)
        if coll == "alltoall":
            alltoall = self._alltoall_parts
            return lambda send, recv: alltoall(send, recv, recv.shape[0] // p)
        return None

    def _comms(self) -> None:
        if self.host_comm is None:  # every rank makes them in the same call, from the layout alone (no messages)
            c = self.comm
            self.host_comm = c._derived(self.groups[self.host], ("host", self.host), f"{c._name}.host")
            leaders = c._derived(self.firsts, ("leaders",), f"{c._name}.leaders")
            self.leaders = leaders if self.leader else None
            if self.even:  # the other rails (the leaders' is the first)
                me = self.groups[self.host].index(c._rank)
                self.column = self.leaders
                for j in range(1, len(self.groups[0])):
                    rail = c._derived([g[j] for g in self.groups], ("column", j), f"{c._name}.column{j}")
                    if j == me:
                        self.column = rail

    def run(self, call: Call, label: str) -> None:
        """``call``, the user's ``label`` call on the parent, as this rank's part of its composition."""
        self._comms()
        self.enter()
        part = self.part_of(call)
        guarded(self.comm, label, (self.host_comm, self.leaders, self.column),
                part or (lambda send, recv: getattr(self, "_" + call.coll)(call)), call.send, call.recv)

    def enter(self) -> None:
        """A call begins: the parent's next call number (its errors name it), and the parent's timeout inside."""
        c = self.comm
        c._seq += 1
        for sub in (self.host_comm, self.leaders, self.column):
            if sub is not None:
                sub.timeout = c.timeout

    def free(self) -> None:
        """Release the two communicators (with their arena), as the parent is freed."""
        for c in (self.host_comm, self.leaders, self.column if self.column is not self.leaders else None):
            if c is not None:
                c.free()
        self.host_comm = self.leaders = self.column = None

    def _host_bcast(self, buf: Any, root: int, incoming: int) -> None:
        """The host's Bcast from local rank ``root``; the ranks other than the leader wait asleep where the leaders'
        step brings the host ``incoming`` bytes, at least ``SLEEP_FROM_BYTES``: they wait through that step (or,
        in the root's host of a Bcast, through the copy of as large a buffer)."""
        if self.leader or incoming < SLEEP_FROM_BYTES:
            self.host_comm.Bcast(buf, root)
            return
        with self.host_comm._x.sleeping_waits():
            self.host_comm.Bcast(buf, root)

    # ---- the compositions ---------------------------------------------------------------------
    def _leader_barrier(self) -> None:
        # one-sided steps inside a host: the others' arrivals gathered to the leader (they post and go on), the
        # leaders' barrier, then the leader's release (it posts and goes on); two full host barriers made every
        # rank wait for every other twice
        token = self._token
        self.host_comm.Gather(IN_PLACE, token, 0)
        self.leaders.Barrier()
        self.host_comm.Bcast(token[:1], 0)

    def _member_barrier(self) -> None:
        token = self._token[:1]
        self.host_comm.Gather(token, None, 0)
        self.host_comm.Bcast(token, 0)

    def _leader_allreduce(self, send: Any, out: Any, op: Any, in_place: bool) -> None:
        # in place, the input stays in the user's buffer until the network step is done; out of place, the steps
        # write straight into the output, as the flat algorithms do
        partial = out.copy() if in_place else out
        self.host_comm.Reduce(IN_PLACE if in_place else send, partial, op, 0)
        self.leaders.Allreduce(IN_PLACE, partial, op)
        if partial is not out:
            out[...] = partial
        self._host_bcast(out, 0, out.nbytes)

    def _member_allreduce(self, send: Any, out: Any, op: Any, in_place: bool) -> None:
        self.host_comm.Reduce(out if in_place else send, None, op, 0)
        self._host_bcast(out, 0, out.nbytes)

    def _leader_bcast(self, buf: Any, root: int) -> None:
        root_host = self.comm._layout.host_of[root]
        if self.host == root_host:
            if self.comm._rank == root:  # the other hosts' longer way first
                self.leaders.Bcast(buf, self.leader_rank[root_host])
                self.host_comm.Bcast(buf, 0)
                return
            self._host_bcast(buf, self.groups[root_host].index(root), buf.nbytes)
            self.leaders.Bcast(buf, self.leader_rank[root_host])
        else:
            self.leaders.Bcast(buf, self.leader_rank[root_host])
            self._host_bcast(buf, 0, buf.nbytes)

    def _member_bcast(self, buf: Any, root: int) -> None:
        """A host's other rank: the host's Bcast, from the root where it is on this host, else from the leader."""
        group = self.groups[self.host]
        self._host_bcast(buf, group.index(root) if root in group else 0, buf.nbytes)

    def _leader_reduce(self, send: Any, recv: Any, op: Any, root: int) -> None:
        root_host = self.comm._layout.host_of[root]
        partial = self._scratch(send.dtype, send.size).reshape(send.shape)  # to the user's buffer once all succeeded
        self.host_comm.Reduce(send, partial, op, 0)
        if self.host == root_host:
            self.leaders.Reduce(IN_PLACE, partial, op, self.leader_rank[root_host])
            if self.comm._rank == root:
                recv[...] = partial
            else:
                self.host_comm.Send(partial, self.groups[root_host].index(root), _RESULT_TAG)
        else:
            self.leaders.Reduce(partial, None, op, self.leader_rank[root_host])

    def _member_reduce(self, send: Any, recv: Any, op: Any, root: int) -> None:
        self.host_comm.Reduce(send, None, op, 0)
        if self.comm._rank == root:  # the root's host leader hands it the result
            result = self._scratch(recv.dtype, recv.size).reshape(recv.shape)
            self.host_comm.Recv(result, 0, _RESULT_TAG)
            recv[...] = result
        elif self.shares_cores:
            # this rank's part is done; where its leader has entered the call, it waits for the vector just posted,
            # perhaps on this very core: hand the core over now rather than at this rank's next wait (8 B at 2 ranks
            # per host on 2 hosts: from a barrier 34-44 -> 28-29 us, back to back 16-19 -> 21-22; MPICH 16 and 11)
            state = self.host_comm._arena
            arena = state.arena if state is not None else None
            if arena is not None and arena.has_posted(0, arena.ops):
                os.sched_yield()

    def _scratch(self, dtype: np.dtype, count: int) -> np.ndarray:
        """``count`` elements of ``dtype`` from a buffer kept for the next call (fresh pages cost the first writer a
        fault each: at 1 MiB that was about a tenth of a composed Reduce_scatter_block)."""
        need = count * dtype.itemsize
        if self._scratch_buf.nbytes < need:
            self._scratch_buf = np.empty(need, np.uint8)
        return self._scratch_buf[:need].view(dtype)

    def _host_bounds(self, block: int) -> tuple[int, int]:
        """Where this host's contiguous run of ``block``-element blocks starts and ends (the layout is ``even``)."""
        group = self.groups[self.host]
        return group[0] * block, (group[-1] + 1) * block

    def _host_region(self, arr: np.ndarray, block: int) -> np.ndarray:
        """This host's run of ``block``-element blocks in ``arr``."""
        lo, hi = self._host_bounds(block)
        return arr[lo:hi]

    def _allgather(self, call: Call) -> None:
        recv, block, me = call.recv, call.counts[0], self.comm._rank
        assert recv is not None
        mine = recv[me * block: (me + 1) * block] if call.in_place else call.send
        self._host_first_allgather(mine, recv, block, call.in_place)  # a larger one (``part_of`` has the small)

    def _small_allgather(self, send: Any, recv: np.ndarray, block: int, in_place: bool) -> None:
        """A small Allgather: the host's blocks gathered to the leader, the leaders' over whole hosts' runs, then
        the other hosts' blocks broadcast in the host."""
        mine = recv[self.comm._rank * block:][:block] if in_place else send
        if self.leader:  # straight into the output, as the flat algorithms write it (the input stays as it was)
            self.host_comm.Gather(IN_PLACE if in_place else mine, self._host_region(recv, block), 0)
            self.leaders.Allgather(IN_PLACE, recv)
        else:
            self.host_comm.Gather(mine, None, 0)
        self._host_bcast(recv, 0, recv.nbytes - recv.nbytes // len(self.groups))  # the other hosts' blocks

    def _host_first_allgather(self, mine: np.ndarray, recv: np.ndarray, block: int, in_place: bool) -> None:
        """A larger Allgather: the host's blocks to all of its ranks first (an Allgather in the host, where every
        rank sends and reads alike), then the leaders' over whole hosts' runs, then only the other hosts' runs
        broadcast in the host. Through a Gather to the leader, its host-mates waited while it gathered their
        blocks, and the host's Bcast carried the whole vector."""
        lo, hi = self._host_bounds(block)
        self.host_comm.Allgather(IN_PLACE if in_place else mine, recv[lo:hi])
        if self.leader:
            self.leaders.Allgather(IN_PLACE, recv)
        incoming = (recv.size - (hi - lo)) * recv.itemsize
        for run in (recv[:lo], recv[hi:]):  # the other hosts' blocks
            if run.size:
                self._host_bcast(run, 0, incoming)

    def _reduce_scatter(self, call: Call) -> None:
        assert call.send is not None and call.recv is not None and call.op is not None
        if call.size_bytes > SMP_BYTES.get():
            self._rails_reduce_scatter(call.send, call.recv, call.counts[0], call.op, call.in_place)
            return
        small = self._leader_reduce_scatter if self.leader else self._member_reduce_scatter
        small(call.send, call.recv, call.counts[0], call.op)

    def _leader_reduce_scatter(self, send: np.ndarray, recv: np.ndarray, block: int, op: Any) -> None:
        """A small Reduce_scatter_block's leader: the host's sum, the leaders' Reduce_scatter_block of whole hosts'
        runs, then the host's run scattered (straight into the output: the input was read in the first step)."""
        k = len(self.groups[self.host])
        scratch = self._scratch(send.dtype, send.size + k * block)
        partial, host_result = scratch[:send.size], scratch[send.size:]
        self.host_comm.Reduce(send, partial, op, 0)
        self.leaders.Reduce_scatter_block(partial, host_result, op)
        self.host_comm.Scatter(host_result, recv[:block], 0)

    def _member_reduce_scatter(self, send: np.ndarray, recv: np.ndarray, block: int, op: Any) -> None:
        """A small Reduce_scatter_block's other ranks: post the vector to the leader's sum, then wait once."""
        self.host_comm.Reduce(send, None, op, 0)
        self.host_comm.Scatter(None, recv[:block], 0)

    def _rails_reduce_scatter(self, send: np.ndarray, recv: np.ndarray, block: int, op: Any, in_place: bool) -> None:
        """Reduce_scatter_block by rails: every rank works. The host reduce-scatters each host's run of blocks (the
        other hosts' first), which leaves each rank its host's sums of its rail's blocks (the blocks of its local
        index on every host); the rail's ranks then reduce-scatter those, one block each over the network (between
        two hosts, one frame each way: ``pycoll.paired``). The links carry the fewest bytes, as through the leaders,
        and no rank reduces or sends the whole host's vector alone."""
        self.by_rails += 1
        hosts, k = len(self.groups), len(self.groups[0])
        region = k * block
        width = rail_piece_elements(block, k, send.itemsize)
        pieced = width < block
        self.rails_in_pieces += pieced
        scratch = self._scratch(send.dtype, (hosts + in_place) * block + (k * width if pieced else 0))
        partial = scratch[:hosts * block]
        host_rs = self.host_comm.Reduce_scatter_block
        for h in self._hosts_last_mine:
            run = send[h * region:(h + 1) * region]
            if not pieced:
                host_rs(run, partial[h * block:(h + 1) * block], op)
                continue
            # a run past the slot goes in pieces that fit it: piece j holds part j of each of the host's k blocks
            packed, blocks = scratch[(hosts + in_place) * block:], run.reshape(k, block)
            for lo in range(0, block, width):
                hi = min(lo + width, block)
                piece = packed[:k * (hi - lo)]
                np.copyto(piece.reshape(k, hi - lo), blocks[:, lo:hi])
                host_rs(piece, partial[h * block + lo:h * block + hi], op)
        # in place, the input is in recv until the rail's step is done
        out = scratch[hosts * block:(hosts + 1) * block] if in_place else recv[:block]
        self.column.Reduce_scatter_block(partial, out, op)
        if in_place:
            recv[:block] = out

    def _alltoall_parts(self, send: np.ndarray, recv: np.ndarray, block: int) -> None:
        k, hosts = len(self.groups[self.host]), len(self.groups)
        p = k * hosts
        out = np.empty(p * block, recv.dtype)  # the user's buffer is written once all of it is here
        if self.leader:
            # [local source][destination host][its local rank][block] -> by destination host for the leaders
            gathered = np.empty((k, hosts, k, block), send.dtype)
            self.host_comm.Gather(send, gathered.reshape(-1), 0)
            outgoing = np.ascontiguousarray(gathered.transpose(1, 0, 2, 3))
            incoming = np.empty_like(outgoing)  # [source host][its local rank][local destination][block]
            self.leaders.Alltoall(outgoing.reshape(-1), incoming.reshape(-1))
            by_destination = np.ascontiguousarray(incoming.transpose(2, 0, 1, 3))
            self.host_comm.Scatter(by_destination.reshape(-1), out, 0)
        else:
            self.host_comm.Gather(send, None, 0)
            self.host_comm.Scatter(None, out, 0)
        recv[: p * block] = out
